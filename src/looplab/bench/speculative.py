"""Self-speculative decoding measured (issue 27, table 11; not a timed test): tokens/s of plain greedy
decoding against speculative greedy decoding (models/speculative.py) of the same prompts.

    python -m looplab.bench.speculative [CKPT_OR_SWEEP_DIR ...] [--k 1 2 3] [--gamma 2 3 4 5 6 7 8]
                                        [--batch 1 8] [--prompt 32] [--new 64] [--repeats 3]
                                        [--threads 1] [--out bench/speculation.json]

Without a path: a random-init llama 1⊗4 at d 64 (its loops disagree, so little is accepted). Paths
are checkpoints or sweep folders (every run with an ok results.json, as bench/exit_grid.py reads
them). Prompts are the first --prompt tokens of the checkpoint's test sequences (a language model's
held-out windows, a task's test sequences), one per row, all of one length (no padding). For each
checkpoint and batch size every configuration decodes the same prompts, timed round-robin (repeat i
of every configuration before repeat i+1 of any, odd rounds reversed), so load hits all alike; the
figure is the median tokens/s over repeats, wall time from the call to `generate` to its return
(prefill included, the same for both). Every speculative run is checked to give plain greedy
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

from looplab.bench.common import time_side_by_side
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.generation import generate

GAMMAS = (2, 3, 4, 5, 6, 7, 8)
TARGET_SPEEDUP = 1.5  # issue 27: ≥ 1.5× tokens/s at identical output, batch 1, on some trained model


def _random_model(seed: int = 0) -> LoopedLM:
    torch.manual_seed(seed)
    return LoopedLM(LoopedLMConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=1, n_loops=4, max_seq_len=512)).eval()


def _prompts(model, meta: dict | None, batch: int, prompt_len: int, seed: int = 0) -> torch.Tensor:
    dataset = (meta or {}).get("dataset") or {}
    if dataset:
        from looplab.bench.exit_decode import _test_examples

        rows = [ex["input_ids"][:prompt_len] for ex in _test_examples(meta, batch, every_token=True)]
        if len(rows) < batch or any(len(r) < prompt_len for r in rows):
            raise ValueError(f"the test split has fewer than {batch} sequences of {prompt_len} tokens")
        return torch.stack(rows)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g)


@torch.no_grad()
def measure(model, ids: torch.Tensor, ks, gammas, new_tokens: int = 64, repeats: int = 3) -> dict[str, Any]:
    """One model, one batch of prompts: plain and every (k, γ), round-robin → tokens/s, speed-up, acceptance."""
    configs: dict[str, dict] = {"plain": {}}
    for k in ks:
        for g in gammas:
            configs[f"k={k} gamma={g}"] = {"speculative_loops": k, "draft_tokens": g}
    reference = generate(model, ids, new_tokens)
    stats: dict[str, Any] = {}
    for name, kw in configs.items():  # untimed: exactness, acceptance (the same every call: greedy, same prompts)
        out = generate(model, ids, new_tokens, return_logits=True, **kw)
        if not torch.equal(out.sequences, reference):
            raise AssertionError(f"{name} decoded other tokens than plain greedy decoding")
        if out.speculation is not None:
            s = out.speculation
            stats[name] = {"acceptance": s.acceptance_rate, "rounds": s.rounds,
                           "row_acceptance_min": float(s.row_acceptance.min()),
                           "mean_draft": statistics.fmean(s.draft_sizes) if s.draft_sizes else 0.0}
    fns = {name: (lambda kw=kw: generate(model, ids, new_tokens, **kw)) for name, kw in configs.items()}
    for k in ks:  # plain decoding at depth k: what one draft token costs, against the full depth
        fns[f"depth {k}"] = lambda k=k: generate(model, ids, new_tokens, n_loops=k)
    times = time_side_by_side(fns, warmup=0, repeats=repeats)
    n = ids.shape[0] * new_tokens
    plain = n / statistics.median(times["plain"])
    draft_cost = {k: statistics.median(times[f"depth {k}"]) / statistics.median(times["plain"]) for k in ks}
    cells = []
    for name, kw in configs.items():
        if name == "plain":
            continue
        tps = n / statistics.median(times[name])
        cells.append({"k": kw["speculative_loops"], "gamma": kw["draft_tokens"], "tokens_per_s": round(tps, 2),
                      "draft_cost": round(draft_cost[kw["speculative_loops"]], 4),
                      "speedup": round(tps / plain, 4), **{k: round(v, 4) if isinstance(v, float) else v
                                                          for k, v in stats[name].items()}})
    return {"plain_tokens_per_s": round(plain, 2), "cells": cells}


def run_checkpoint(path: str | Path | None, ks=None, gammas=GAMMAS, batches=(1,), prompt_len: int = 32,
                   new_tokens: int = 64, repeats: int = 3) -> dict[str, Any]:
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
        from looplab.bench.exit_grid import _results, _run_seed, body_training

        res = _results(path)
        out.update(seed=_run_seed(path), training=body_training(path), perplexity=res.get("perplexity"),
                   accuracy=res.get("accuracy"), init_from=(res.get("config") or {}).get("init_from"))
    for b in batches:
        ids = _prompts(model, meta, b, prompt_len)
        out["batches"][str(b)] = measure(model, ids, ks, gammas, new_tokens, repeats)
    return out


def best_cell(runs: list[dict[str, Any]], batch: int = 1) -> dict[str, Any] | None:
    best = None
    for run in runs:
        for cell in run["batches"].get(str(batch), {}).get("cells", []):
            if best is None or cell["speedup"] > best["speedup"]:
                best = {**cell, "checkpoint": run["checkpoint"], "backbone": run["backbone"],
                        "state_mode": run["state_mode"], "d_model": run["d_model"], "training": run.get("training")}
    return best


def run(paths=(), ks=None, gammas=GAMMAS, batches=(1,), prompt_len: int = 32, new_tokens: int = 64,
        repeats: int = 3, threads: int | None = 1) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    if paths:
        from looplab.bench.exit_grid import checkpoints_in

        ckpts = checkpoints_in(paths)
        if not ckpts:
            raise SystemExit(f"no trained checkpoint in {', '.join(map(str, paths))}")
    else:
        ckpts = [None]
    runs = [run_checkpoint(c, ks, gammas, batches, prompt_len, new_tokens, repeats) for c in ckpts]
    best = best_cell(runs, 1)
    return {"threads": torch.get_num_threads(), "prompt": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
            "gammas": list(gammas), "batches": list(batches), "target_speedup": TARGET_SPEEDUP,
            "best_batch1": best, "target_met": bool(best and best["speedup"] >= TARGET_SPEEDUP), "runs": runs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", help="checkpoints or sweep folders (none: a random-init model)")
    p.add_argument("--k", type=int, nargs="*")
    p.add_argument("--gamma", nargs="*", default=[str(g) for g in GAMMAS], help="draft sizes (ints or auto)")
    p.add_argument("--batch", type=int, nargs="*", default=[1])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write the JSON here too")
    a = p.parse_args(argv)
    gammas = [g if g == "auto" else int(g) for g in a.gamma]
    res = run(a.paths, a.k, gammas, a.batch, a.prompt, a.new, a.repeats, a.threads)
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
