"""Self-speculative decoding measured (table 11; not a timed test): tokens/s of plain greedy
decoding against speculative greedy decoding (`generate(speculation=Speculation(k, γ))`) of the same prompts.

    python -m looplab.bench.speculative [CKPT_OR_SWEEP_DIR ...] [--k 1 2 3] [--gamma 2 3 4 5 6 7 8]
                                        [--batch 1 8] [--prompt 32] [--new 64] [--repeats 3]
                                        [--threads 1] [--out bench/speculation.json]

Without a path: a random-init llama 1⊗4 at d 64 (its loops disagree, so little is accepted). Paths
are checkpoints or sweep folders (every run with an ok results.json: bench/trained_runs.py). Prompts
are the first --prompt tokens of the checkpoint's test sequences (a language model's held-out
windows, a task's test sequences), one per row, all of one length (no padding). For each checkpoint
and batch size every configuration decodes the same prompts, timed round-robin (repeat i of every
configuration before repeat i+1 of any, odd rounds reversed: common.time_round_robin), so load hits
all alike; the figure is the median tokens/s over repeats, wall time from the call to `generate` to
its return (prefill included, the same for both). Every speculative run is checked to give plain greedy
decoding's tokens (an AssertionError otherwise): the speed-ups are at identical output. Timed with
them: plain decoding at depth k (`n_loops=k`), whose time over plain's is each cell's `draft_cost`,
what one draft token costs against one full-depth token. A round that keeps every draft emits γ+1
tokens for γ+1 draft steps and one verify call, so (verify aside) a cell cannot beat 1 / draft_cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from looplab.bench.common import device_of, time_round_robin
from looplab.bench.trained_runs import held_out_prompts
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.generation import Speculation, generate
from looplab.targets import SPECULATION_SPEEDUP_TARGET as TARGET_SPEEDUP

GAMMAS = (2, 3, 4, 5, 6, 7, 8)


def _random_model(seed: int = 0) -> LoopedLM:
    torch.manual_seed(seed)
    return LoopedLM(LoopedLMConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=1, n_loops=4, max_seq_len=512)).eval()


@torch.no_grad()
def measure(model, ids: torch.Tensor, ks, gammas, new_tokens: int = 64, repeats: int = 5) -> dict[str, Any]:
    """One model, one batch of prompts: plain and every (k, γ), round-robin → tokens/s, speed-up, acceptance.

    Every call is timed (odd rounds in reverse order) and checked against plain greedy decoding's tokens; a
    cell's speed-up is the median over rounds of plain's time / the cell's time in the same round (paired, so
    a slow moment of the machine hits both), with the range over rounds."""
    configs: dict[str, dict] = {"plain": {}}
    for k in ks:
        configs[f"depth {k}"] = {"n_loops": k}  # plain decoding at depth k: what one draft token costs
        for g in gammas:
            configs[f"k={k} gamma={g}"] = {"speculation": Speculation(k, g)}
    reference = generate(model, ids, new_tokens)
    generate(model, ids, new_tokens, speculation=Speculation(ks[0], gammas[0]))  # warm-up of the round code
    stats: dict[str, Any] = {}

    def check(name: str, out) -> None:
        """Untimed, after every call: the tokens are plain greedy decoding's; the speculation statistics."""
        if "n_loops" in configs[name]:
            return
        if not torch.equal(out.sequences, reference):
            raise AssertionError(f"{name} decoded other tokens than plain greedy decoding")
        if out.speculation is not None and name not in stats:  # greedy, same prompts: the same every call
            s = out.speculation
            stats[name] = {"acceptance": s.acceptance_rate, "rounds": s.rounds,
                           "row_acceptance_min": float(s.row_acceptance.min()),
                           "mean_draft": statistics.fmean(s.draft_sizes) if s.draft_sizes else 0.0}

    calls = {name: (lambda kw=kw: generate(model, ids, new_tokens, return_logits=True, **kw))
             for name, kw in configs.items()}
    timings = time_round_robin(calls, repeats, warmup=0, reference="plain", device=device_of(model), after=check)
    times = timings.wall
    n = ids.shape[0] * new_tokens
    cells = []
    for name, kw in configs.items():
        if "speculation" not in kw:
            continue
        k = kw["speculation"].loops
        speedup = timings.ratio("plain", name)  # plain's time / the cell's, round by round
        cells.append({"k": k, "gamma": kw["speculation"].draft_tokens, "tokens_per_s": round(n / statistics.median(times[name]), 2),
                      "speedup": round(speedup.median, 4),
                      "speedup_range": [round(speedup.low, 4), round(speedup.high, 4)],
                      "draft_cost": round(1 / timings.ratio("plain", f"depth {k}").median, 4),
                      **{key: round(v, 4) if isinstance(v, float) else v for key, v in stats[name].items()}})
    return {"plain_tokens_per_s": round(n / statistics.median(times["plain"]), 2), "repeats": repeats, "cells": cells}


def run_checkpoint(path: str | Path | None, ks=None, gammas=GAMMAS, batches=(1,), prompt_len: int = 32,
                   new_tokens: int = 64, repeats: int = 5, batch_gammas=None) -> dict[str, Any]:
    meta = None
    if path:
        from looplab.checkpoint import load_model

        model, meta = load_model(path, map_location="cpu")
        model.eval()
    else:
        model = _random_model()
    cfg = model.config
    R = cfg.n_loops
    ks = [k for k in (ks or range(1, R)) if 1 <= k < R]
    out: dict[str, Any] = {"checkpoint": str(path) if path else "random llama 1x4 d64", "backbone": cfg.backbone,
                           "state_mode": cfg.state_mode, "n_layers": cfg.n_layers, "n_loops": R,
                           "d_model": cfg.d_model, "prelude_layers": cfg.prelude_layers, "coda_layers": cfg.coda_layers,
                           "vocab_size": cfg.vocab_size, "batches": {}}
    if path:
        from looplab.bench.trained_runs import body_training, run_results, run_seed

        res = run_results(path)
        out.update(seed=run_seed(path), training=body_training(path), perplexity=res.get("perplexity"),
                   accuracy=res.get("accuracy"), init_from=(res.get("config") or {}).get("init_from"))
    for b in batches:
        ids = held_out_prompts(model, meta, b, prompt_len)
        gs = gammas if b == 1 or not batch_gammas else batch_gammas
        out["batches"][str(b)] = measure(model, ids, ks, gs, new_tokens, repeats)
    return out


def _run_one(args) -> dict[str, Any]:
    path, threads, kw = args
    torch.set_num_threads(threads)
    return run_checkpoint(path, **kw)


def best_cell(runs: list[dict[str, Any]], batch: int = 1) -> dict[str, Any] | None:
    best = None
    for run in runs:
        for cell in run["batches"].get(str(batch), {}).get("cells", []):
            if best is None or cell["speedup"] > best["speedup"]:
                best = {**cell, "checkpoint": run["checkpoint"], "backbone": run["backbone"],
                        "state_mode": run["state_mode"], "d_model": run["d_model"], "training": run.get("training")}
    return best


def run(paths=(), ks=None, gammas=GAMMAS, batches=(1,), prompt_len: int = 32, new_tokens: int = 64,
        repeats: int = 5, threads: int | None = 1, jobs: int = 1, batch_gammas=None) -> dict[str, Any]:
    """jobs > 1: that many checkpoints at once, each in its own process (every cell is still timed against
    plain decoding round-robin inside one process, so the other process's load hits both alike)."""
    if threads:
        torch.set_num_threads(threads)
    if paths:
        from looplab.bench.trained_runs import checkpoints_in

        ckpts = checkpoints_in(paths)
        if not ckpts:
            raise SystemExit(f"no trained checkpoint in {', '.join(map(str, paths))}")
    else:
        ckpts = [None]
    kw = dict(ks=ks, gammas=gammas, batches=batches, prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats,
              batch_gammas=batch_gammas)
    work = [(c, threads or torch.get_num_threads(), kw) for c in ckpts]
    if jobs > 1 and len(work) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(jobs, len(work)), mp_context=mp.get_context("spawn")) as pool:
            runs = list(pool.map(_run_one, work))
    else:
        runs = [_run_one(w) for w in work]
    best = best_cell(runs, 1)
    return {"threads": threads or torch.get_num_threads(), "jobs": jobs, "prompt": prompt_len, "new_tokens": new_tokens,
            "repeats": repeats, "gammas": list(gammas), "batch_gammas": list(batch_gammas or gammas),
            "batches": list(batches), "target_speedup": TARGET_SPEEDUP,
            "best_batch1": best, "target_met": bool(best and best["speedup"] >= TARGET_SPEEDUP), "runs": runs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", help="checkpoints or sweep folders (none: a random-init model)")
    p.add_argument("--k", type=int, nargs="*")
    p.add_argument("--gamma", nargs="*", default=[str(g) for g in GAMMAS], help="draft sizes (ints or auto)")
    p.add_argument("--batch", type=int, nargs="*", default=[1])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="checkpoints measured at once, one process each")
    p.add_argument("--batch-gamma", nargs="*", help="draft sizes at batch > 1 (default: --gamma)")
    p.add_argument("--out", help="write the JSON here too")
    a = p.parse_args(argv)
    gammas = [g if g == "auto" else int(g) for g in a.gamma]
    bg = [g if g == "auto" else int(g) for g in a.batch_gamma] if a.batch_gamma else None
    res = run(a.paths, a.k, gammas, a.batch, a.prompt, a.new, a.repeats, a.threads, a.jobs, bg)
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    b = res["best_batch1"]
    print(text if not a.out else f"wrote {a.out}")
    if b:
        print(f"best at batch 1: {b['backbone']} d {b['d_model']} ({b['training']}) k={b['k']} γ={b['gamma']}: "
              f"{b['speedup']:.2f}× plain, acceptance {b['acceptance']:.2f}")


if __name__ == "__main__":
    main()
