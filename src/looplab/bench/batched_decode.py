"""Batched decoding against plain decoding (`make bench`'s `batched` part; docs/performance.md#decoding).

What a batch saves once its rows no longer need the same work, at batch 8 and batch 1, 64 greedy tokens after a
32-token prompt (quick: batch 8, 16 tokens), fp32, every arm of a model timed round-robin against plain decoding of
the same weights and prompts (`common.time_round_robin`; a speed-up is the median of per-round paired ratios):

    speculation  Speculation(loops=k, draft_tokens=γ) for k in 1..R−1, γ in (2, 4): each row keeps its own agreeing
                 prefix; checked to decode plain greedy decoding's tokens
    skip         an exit gate's ExitPolicy(threshold=0.5, skip=kv_copy | ssm_skip) against the same gated model with
                 every loop run: later loops run only the rows still going
    routed       an expert-choice depth router's decoding against the same weights at the fixed depth R
    static       the static-shape step (`allocate_cache(static=True)`) uncompiled, and compiled (`compile=True`, full
                 runs only: the first call compiles, its seconds reported) against eager plain decoding

Without checkpoints the models are random-init llama 2⊗4 at d 256 (vocab 4096), made to behave like trained looped
models in the one way each arm depends on: the shared block's residual writes are scaled down (×0.1), so a shallow
loop's argmax mostly agrees with the full depth's (speculation has something to accept), the gate's and router's
weights are scaled up so tokens spread over depths. `--checkpoints` (or `run(checkpoints=...)`) measures trained
ones instead — table 11's exit-aware lm_tiny models, table 12's MoR model — on their held-out prompts.

    python -m looplab.bench.batched_decode [--checkpoints CKPT_OR_SWEEP ...] [--batch 1 8] [--repeats 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from looplab.bench.common import device_of, machine_info, set_threads, time_round_robin
from looplab.bench.decode_overhead import static_eager
from looplab.bench.trained_runs import checkpoints_in, held_out_prompts
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exit_compute import has_ssm
from looplab.models.exits import ExitPolicy
from looplab.models.generation import Speculation, compile_unsupported, generate

DIMS = dict(d_model=256, n_heads=4, n_kv_heads=4, ffn_hidden=688, n_layers=2, n_loops=4, vocab_size=4096,
            max_seq_len=256)
PROMPT, NEW = 32, 64
GAMMAS = (2, 4)
EXIT_Q = 0.5


def _scale_residual_writes(model: LoopedLM, factor: float) -> None:
    """Scale what the shared block adds to the residual stream (attention out- and MLP down-projections)."""
    with torch.no_grad():
        for name, p in model.block.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight", "wo.weight", "w2.weight")):
                p.mul_(factor)


def random_models(seed: int = 0) -> dict[str, LoopedLM]:
    """{plain, gated, routed}: one set of shared weights; the gated model adds an exit gate, the routed one an
    expert-choice router (both with their own weights scaled up, so that tokens spread over depths)."""
    torch.manual_seed(seed)
    plain = LoopedLM(LoopedLMConfig(**DIMS)).eval()
    _scale_residual_writes(plain, 0.1)
    out = {"plain": plain}
    for name, extra in (("gated", dict(exit_gate="ouro")), ("routed", dict(depth_router="expert_choice"))):
        torch.manual_seed(seed)
        m = LoopedLM(LoopedLMConfig(**DIMS, **extra)).eval()
        m.load_state_dict(plain.state_dict(), strict=False)
        with torch.no_grad():
            for p in (m.exit_gate or m.router).parameters():
                p.mul_(8.0)
        out[name] = m
    return out


def _cell(timings, name: str, reference: str, n_tokens: int) -> dict[str, Any]:
    r = timings.ratio(reference, name)  # the reference's time / this arm's: a speed-up, round by round
    return {"tokens_per_s": round(n_tokens / statistics.median(timings.wall[name]), 1),
            "speedup": round(r.median, 3), "speedup_range": [round(r.low, 3), round(r.high, 3)]}


@torch.no_grad()
def measure_speculation(model, ids: torch.Tensor, new: int, repeats: int) -> dict[str, Any]:
    R = model.config.n_loops
    ref = generate(model, ids, new)
    arms = {"plain": {}}
    arms.update({f"k={k} gamma={g}": {"speculation": Speculation(k, g)} for k in range(1, R) for g in GAMMAS})
    stats: dict[str, float] = {}

    def check(name, out):
        if name == "plain":
            return
        if not torch.equal(out.sequences, ref):
            raise AssertionError(f"speculation {name} decoded other tokens than plain greedy decoding")
        stats[name] = out.speculation.acceptance_rate

    calls = {n: (lambda kw=kw: generate(model, ids, new, return_logits=True, **kw)) for n, kw in arms.items()}
    t = time_round_robin(calls, repeats, warmup=1, reference="plain", device=device_of(model), after=check)
    n = ids.shape[0] * new
    cells = {name: {**_cell(t, name, "plain", n), "acceptance": round(stats[name], 3)} for name in arms if name != "plain"}
    best = max(cells, key=lambda c: cells[c]["speedup"])
    return {"plain_tokens_per_s": round(n / statistics.median(t.wall["plain"]), 1), "cells": cells,
            "best": best, "best_speedup": cells[best]["speedup"]}


@torch.no_grad()
def measure_skip(gated, ids: torch.Tensor, new: int, repeats: int) -> dict[str, Any]:
    handling = "ssm_skip" if has_ssm(gated.config) else "kv_copy"
    policy = ExitPolicy(threshold=EXIT_Q, skip=handling)
    out = generate(gated, ids, new, exits=policy, return_logits=True)
    calls = {"all_loops": lambda: generate(gated, ids, new), "skip": lambda: generate(gated, ids, new, exits=policy)}
    t = time_round_robin(calls, repeats, warmup=1, reference="all_loops", device=device_of(gated))
    n = ids.shape[0] * new
    return {"handling": handling, "q": EXIT_Q, "mean_exit_step": round(float(out.exit_steps.float().mean()), 3),
            "all_loops_tokens_per_s": round(n / statistics.median(t.wall["all_loops"]), 1), **_cell(t, "skip", "all_loops", n)}


@torch.no_grad()
def measure_routed(routed, fixed, ids: torch.Tensor, new: int, repeats: int) -> dict[str, Any]:
    depth = []
    cache = routed.allocate_cache(ids.shape[0], ids.shape[1] + new)
    o = routed(ids, cache=cache)
    tok = o.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(new - 1):  # the depths decoding takes, once, untimed
        o = routed(tok, cache=cache)
        depth.append(o.routing.depth.float().mean())
        tok = o.logits[:, -1].argmax(-1, keepdim=True)
    calls = {"fixed_depth": lambda: generate(fixed, ids, new), "routed": lambda: generate(routed, ids, new)}
    t = time_round_robin(calls, repeats, warmup=1, reference="fixed_depth", device=device_of(routed))
    n = ids.shape[0] * new
    return {"router": routed.config.depth_router.name, "mean_depth": round(float(torch.stack(depth).mean()), 3),
            "fixed_tokens_per_s": round(n / statistics.median(t.wall["fixed_depth"]), 1),
            **_cell(t, "routed", "fixed_depth", n)}


@torch.no_grad()
def measure_static(model, ids: torch.Tensor, new: int, repeats: int, compile: bool) -> dict[str, Any]:
    ref = generate(model, ids, new)
    if not torch.equal(static_eager(model, ids, new), ref):
        raise AssertionError("the static-shape step decoded other tokens than plain decoding")
    calls = {"eager": lambda: generate(model, ids, new), "static_eager": lambda: static_eager(model, ids, new)}
    res: dict[str, Any] = {}
    if compile and compile_unsupported(model.config) is None:
        t0 = time.perf_counter()
        if not torch.equal(generate(model, ids, new, compile=True), ref):
            raise AssertionError("the compiled step decoded other tokens than plain decoding")
        res["first_compiled_call_s"] = round(time.perf_counter() - t0, 1)
        calls["compiled"] = lambda: generate(model, ids, new, compile=True)
    t = time_round_robin(calls, repeats, warmup=1, reference="eager", device=device_of(model))
    n = ids.shape[0] * new
    res["eager_tokens_per_s"] = round(n / statistics.median(t.wall["eager"]), 1)
    for name in calls:
        if name != "eager":
            res[name] = _cell(t, name, "eager", n)
    return res


def measure_random(batch: int, new: int, repeats: int, compile: bool) -> dict[str, Any]:
    m = random_models()
    ids = held_out_prompts(m["plain"], None, batch, PROMPT, seed=batch)
    return {"speculation": measure_speculation(m["plain"], ids, new, repeats),
            "skip": measure_skip(m["gated"], ids, new, repeats),
            "routed": measure_routed(m["routed"], m["plain"], ids, new, repeats),
            "static": measure_static(m["plain"], ids, new, repeats, compile)}


def measure_checkpoint(path: Path, batch: int, new: int, repeats: int) -> dict[str, Any]:
    """A trained model: its own decoders — speculation on every model without a router, skip with its gate,
    routed against the same weights without the router."""
    from looplab.checkpoint import load_model

    model, meta = load_model(path, map_location="cpu")
    model.eval()
    ids = held_out_prompts(model, meta, batch, PROMPT)
    cfg = model.config
    res: dict[str, Any] = {"checkpoint": str(path), "backbone": cfg.backbone, "n_layers": cfg.n_layers, "n_loops": cfg.n_loops}
    if model.router is not None:
        fixed = LoopedLM(dataclasses.replace(cfg, depth_router="none")).eval()
        fixed.load_state_dict(model.state_dict(), strict=False)
        res["routed"] = measure_routed(model, fixed, ids, new, repeats)
        return res
    res["speculation"] = measure_speculation(model, ids, new, repeats)
    if model.exit_gate is not None:
        res["skip"] = measure_skip(model, ids, new, repeats)
    return res


def run(threads: int, quick: bool = False, repeats: int | None = None, batches=None, checkpoints=(),
        compile: bool | None = None) -> dict[str, Any]:
    set_threads(threads)
    batches = tuple(batches or ((8,) if quick else (1, 8)))
    repeats = repeats or (2 if quick else 5)
    new = 16 if quick else NEW
    compile = (not quick) if compile is None else compile
    res: dict[str, Any] = {"dims": {**DIMS, "prompt": PROMPT, "new_tokens": new}, "repeats": repeats,
                           "random": {str(b): measure_random(b, new, repeats, compile) for b in batches}}
    if checkpoints:
        res["trained"] = {str(b): [measure_checkpoint(p, b, new, repeats) for p in checkpoints_in(checkpoints)]
                          for b in batches}
    top = res["random"][str(max(batches))]
    res.update({f"batch{max(batches)}_speculation_speedup": top["speculation"]["best_speedup"],
                f"batch{max(batches)}_skip_speedup": top["skip"]["speedup"],
                f"batch{max(batches)}_routed_speedup": top["routed"]["speedup"],
                "static_eager_speedup": top["static"]["static_eager"]["speedup"]})
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", nargs="*", default=())
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/batched.json"))
    a = ap.parse_args(argv)
    res = {"machine": machine_info(a.threads),
           **run(a.threads, a.quick, a.repeats, a.batch, a.checkpoints, compile=False if a.no_compile else None)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("random", "trained", "machine")}, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
