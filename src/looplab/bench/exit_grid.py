"""Exit rules × thresholds × state handlings on trained models: quality against measured speed (issue 16, table 10).

`python -m looplab.bench.exit_grid CKPT_OR_SWEEP_DIR ... --out bench/exits.json`

For each trained looped checkpoint (R > 1; N⊗1 ones are skipped: nothing to exit) — a task model
(p-hop or Mano: answer accuracy at the answer positions) or a language model (`lm_tiny`: perplexity
of every next token of the first `lm_sequences` test windows) — and each configuration (exit rule, threshold, and — for `skip` — the state handling
of models/exit_compute.py; attention-only models: kv_copy, models with Mamba-2 layers or a
Mamba-2 state mixer: ssm_skip and ssm_propagate), three decoders are compared:

  all_loops   every loop, the prediction of loop R (the fixed-depth model)
  exact_exit  every loop computed, each token read out at the rule's exit (forward(exit_rule=...))
  skip        skip_compute: loops after a token's exit do not run; its deeper-loop cache entries
              come from the handling

Quality: answer accuracy and mean exit step over `n_quality` test sequences, in batched forward
passes (skip: `forward_with_exits` with the rule deciding online, which equals token-by-token skip
decoding — tests/test_exit_compute.py). Speed: median ms per token of cached decoding of
`n_time` test sequences, one token at a time, the three decoders round-robin (so load on the machine
hits them alike); the speed-up is all_loops / skip and exact_exit / skip.
Gate rules need a gated checkpoint (table 8's stage-2 runs); the zero-shot rules run on any.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from looplab.models.exit_compute import forward_with_exits, has_ssm
from looplab.models.exits import ExitPolicy
from looplab.models.generation import decode_step
from looplab.targets import EXIT_LOSS_TARGET as TARGET_LOSS, EXIT_SPEEDUP_TARGET as TARGET_SPEEDUP, EXIT_TARGET_TASK as TARGET_TASK

# thresholds per rule (exit_rules.py): the gate's CDF level q, nats for entropy and KL, a relative
# hidden change, loops without an argmax change
GRID: dict[str, tuple[float, ...]] = {
    "gate": (0.5, 0.7, 0.9),
    "entropy": (0.05, 0.2, 0.5),
    "kl": (0.001, 0.01, 0.1),
    "hidden_delta": (0.05, 0.1, 0.2),
    "argmax_stable": (1, 2),
}
# language models: a next-token distribution has entropy of nats, not hundredths of a nat, so the entropy
# thresholds that fire on a task's confident answers never fire there (the table's mean exit step shows it)
GRID_LM: dict[str, tuple[float, ...]] = {
    "entropy": (1.0, 2.0, 3.0),
    "kl": (0.01, 0.05, 0.2),
    "hidden_delta": (0.05, 0.1, 0.2),
    "argmax_stable": (1, 2),
}


def handlings_for(config) -> tuple[str, ...]:
    return ("ssm_skip", "ssm_propagate") if has_ssm(config) else ("kv_copy",)


def _batches(examples: list[dict[str, torch.Tensor]], size: int):
    for i in range(0, len(examples), size):
        chunk = examples[i:i + size]
        yield {k: torch.stack([e[k] for e in chunk]) for k in chunk[0]}


@torch.no_grad()
def quality(model, examples, rule: str, threshold: float, handling: str, batch_size: int = 64) -> dict[str, Any]:
    """Answer accuracy, mean loss (nats) and exit steps of exact_exit and skip (and all_loops) over the examples'
    scored positions, batched."""
    R = model.config.n_loops
    correct = {"all_loops": 0, "exact_exit": 0, "skip": 0}
    nll = {"all_loops": 0.0, "exact_exit": 0.0, "skip": 0.0}
    steps_sum = {"exact_exit": 0.0, "skip": 0.0}
    hist = [0] * R
    answers = 0
    for b in _batches(examples, batch_size):
        ids, targets, answer = b["input_ids"], b["targets"], b["answer_mask"]
        full = model(ids, exits=ExitPolicy(threshold=threshold, rule=rule), return_all_loops=True)
        skip = forward_with_exits(model, ids, None, handling, rule=rule, threshold=threshold)
        logits = {"all_loops": full.loop_logits[-1], "exact_exit": full.logits, "skip": skip.logits}
        for k, lg in logits.items():
            correct[k] += int((lg.argmax(-1) == targets)[answer].sum())
            nll[k] += float(F.cross_entropy(lg[answer].float(), targets[answer], reduction="sum"))
        steps_sum["exact_exit"] += float(full.exit_steps[answer].float().sum())
        steps_sum["skip"] += float(skip.exit_steps[answer].float().sum())
        for s in skip.exit_steps[answer].tolist():
            hist[s - 1] += 1
        answers += int(answer.sum())
    n = max(answers, 1)
    return {"answers": answers, "accuracy": {k: v / n for k, v in correct.items()},
            "loss": {k: v / n for k, v in nll.items()}, "perplexity": {k: math.exp(v / n) for k, v in nll.items()},
            "mean_exit_step": {k: v / n for k, v in steps_sum.items()}, "exit_histogram_skip": hist}


@torch.no_grad()
def speed(model, examples, rule: str, threshold: float, handling: str, warmup: int = 4) -> dict[str, float]:
    """Median ms per token of the three cached decoders, round-robin over the examples' tokens."""
    options = {"all_loops": {}, "exact_exit": {"exit_threshold": threshold, "exit_rule": rule},
               "skip": {"exit_threshold": threshold, "exit_rule": rule, "skip_compute": handling}}
    times: dict[str, list[float]] = {k: [] for k in options}
    seen = 0
    for ex in examples:
        ids = ex["input_ids"]
        caches = {k: model.allocate_cache(1, ids.shape[0]) for k in options}
        for t in range(ids.shape[0]):
            tok = ids[t].view(1, 1)
            for k, kw in options.items():
                t0 = time.perf_counter()
                decode_step(model, tok, caches[k], **kw)
                if seen >= warmup:
                    times[k].append(time.perf_counter() - t0)
            seen += 1
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def grid_for(model, lm: bool = False) -> list[tuple[str, float]]:
    grid = GRID_LM if lm else GRID
    rules = [r for r in grid if r != "gate" or model.exit_gate is not None]
    return [(r, th) for r in rules for th in grid[r]]


def run_checkpoint(path: str | Path, n_quality: int = 512, n_time: int = 4, grid: list[tuple[str, float]] | None = None,
                   handlings: Sequence[str] | None = None, lm_sequences: int = 64) -> dict[str, Any] | None:
    """One checkpoint's rows; None for an N⊗1 model (one loop: no exit to take)."""
    from looplab.bench.exit_decode import _test_examples
    from looplab.checkpoint import load_model

    model, meta = load_model(path)
    model.eval()
    if model.config.n_loops < 2:
        return None
    lm = not meta["dataset"].get("task")
    if lm:  # every token of a window is scored: fewer sequences give as many scored positions as a task's answers
        n_quality = min(n_quality, lm_sequences)
    examples = _test_examples(meta, max(n_quality, n_time), every_token=lm)
    rows = []
    for rule, th in grid or grid_for(model, lm):
        for h in handlings or handlings_for(model.config):
            q = quality(model, examples[:n_quality], rule, th, h)
            ms = speed(model, examples[:n_time], rule, th, h)
            rows.append({"rule": rule, "threshold": th, "handling": h, **q, "per_token_ms": ms,
                         "speedup_vs_all_loops": ms["all_loops"] / ms["skip"],
                         "speedup_vs_exact_exit": ms["exact_exit"] / ms["skip"]})
    cfg = model.config
    return {"checkpoint": str(path), "backbone": cfg.backbone, "state_mode": cfg.state_mode, "n_layers": cfg.n_layers,
            "n_loops": cfg.n_loops, "d_model": cfg.d_model, "task": meta["dataset"].get("task") or "lm",
            "metric": "perplexity" if lm else "accuracy", "seed": _run_seed(path),
            "training": body_training(path), "n_quality": min(n_quality, len(examples)), "n_time": n_time, "rows": rows}


def _results(ckpt: str | Path) -> dict[str, Any]:
    """results.json of the run folder holding checkpoints/last.ckpt ({} when there is none)."""
    try:
        return json.loads((Path(ckpt).parent.parent / "results.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _run_seed(ckpt: str | Path) -> int | None:
    return _results(ckpt).get("seed")


def body_training(ckpt: str | Path) -> str:
    """How the looped body was trained: "exit-aware (HANDLING, p=P)" when the run — or, for a stage-2 gate, the run
    it started from (exit_gate.init_from) — trained with exit_gate.skip_train_prob > 0, else "standard"."""
    gate = (_results(ckpt).get("config") or {}).get("exit_gate") or {}
    if not float(gate.get("skip_train_prob") or 0) and gate.get("init_from"):
        gate = (_results(gate["init_from"]).get("config") or {}).get("exit_gate") or {}
    p = float(gate.get("skip_train_prob") or 0)
    return f"exit-aware ({gate.get('skip_compute')}, p={p:g})" if p else "standard"


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Across seeds: per (backbone, state mode, rule, threshold, handling), mean and 95% t-interval of each figure;
    `meets_target`: skip's speed-up vs all loops ≥ 1.5× while losing ≤ 1 point of accuracy against all loops."""
    from looplab.stats import t_interval

    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for run in runs:
        for row in run["rows"]:
            key = (run.get("task"), run["backbone"], run["state_mode"], run.get("training", "standard"), row["rule"],
                   row["threshold"], row["handling"])
            groups.setdefault(key, []).append((run, row))
    out = []
    for (task, bb, sm, training, rule, th, h), items in groups.items():
        def stat(values):
            values = [float(v) for v in values]
            lo, hi = t_interval(values) if len(values) > 1 else (float("nan"), float("nan"))
            return {"mean": statistics.fmean(values), "lo": lo, "hi": hi, "n": len(values)}

        rows = [r for _, r in items]
        loss = [r["accuracy"]["all_loops"] - r["accuracy"]["skip"] for r in rows]
        s = {"task": task, "backbone": bb, "state_mode": sm, "training": training, "rule": rule, "threshold": th, "handling": h,
             "accuracy_all_loops": stat(r["accuracy"]["all_loops"] for r in rows),
             "accuracy_exact_exit": stat(r["accuracy"]["exact_exit"] for r in rows),
             "accuracy_skip": stat(r["accuracy"]["skip"] for r in rows),
             "accuracy_lost_skip": stat(loss),
             "mean_exit_step_skip": stat(r["mean_exit_step"]["skip"] for r in rows),
             "speedup_vs_all_loops": stat(r["speedup_vs_all_loops"] for r in rows),
             "speedup_vs_exact_exit": stat(r["speedup_vs_exact_exit"] for r in rows),
             "ms_skip": stat(r["per_token_ms"]["skip"] for r in rows)}
        if all("perplexity" in r for r in rows):
            s["perplexity_all_loops"] = stat(r["perplexity"]["all_loops"] for r in rows)
            s["perplexity_skip"] = stat(r["perplexity"]["skip"] for r in rows)
        s["meets_target"] = (task == TARGET_TASK and s["speedup_vs_all_loops"]["mean"] >= TARGET_SPEEDUP
                             and s["accuracy_lost_skip"]["mean"] <= TARGET_LOSS)
        out.append(s)
    return out


def checkpoints_in(paths: Sequence[str | Path]) -> list[Path]:
    """Checkpoint files, or sweep/run folders holding runs whose results.json is ok (their last.ckpt)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            out.append(p)
            continue
        for res in sorted(p.glob("**/results.json")):
            try:
                r = json.loads(res.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            ckpt = Path(r.get("checkpoint") or res.parent / "checkpoints" / "last.ckpt")
            if not ckpt.exists():  # the run folder was moved since: its checkpoint moved with it
                ckpt = res.parent / "checkpoints" / "last.ckpt"
            if r.get("status") == "ok" and ckpt.exists():
                out.append(ckpt)
    return out


def _run_one(args: tuple[Path, int, int, int, int]) -> dict[str, Any] | None:
    ckpt, n_quality, n_time, threads, lm_sequences = args
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run_checkpoint(ckpt, n_quality, n_time, lm_sequences=lm_sequences)
    finally:
        torch.set_num_threads(old)


def run(paths: Sequence[str | Path], n_quality: int = 512, n_time: int = 4, threads: int = 1,
        jobs: int = 1, lm_sequences: int = 64) -> dict[str, Any]:
    """jobs > 1: that many checkpoints at once, each in its own process with `threads` threads (the three decoders of
    one configuration are still timed round-robin inside one process, so the load hits them alike)."""
    ckpts = checkpoints_in(paths)
    if not ckpts:
        raise SystemExit(f"no trained checkpoint in {', '.join(map(str, paths))}; run `make table8` (gated p-hop runs) first")
    work = [(c, n_quality, n_time, threads, lm_sequences) for c in ckpts]
    if jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(jobs, len(work)), mp_context=mp.get_context("spawn")) as pool:
            runs = list(pool.map(_run_one, work))
    else:
        runs = [_run_one(w) for w in work]
    runs = [r for r in runs if r is not None]  # N⊗1 checkpoints of the same sweeps
    return {"threads": threads, "jobs": jobs, "n_quality": n_quality, "lm_sequences": lm_sequences, "n_time": n_time,
            "grid": {k: list(v) for k, v in GRID.items()}, "grid_lm": {k: list(v) for k, v in GRID_LM.items()},
            "target": {"speedup_vs_all_loops": TARGET_SPEEDUP, "accuracy_lost": TARGET_LOSS},
            "runs": runs, "summary": summarize(runs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m looplab.bench.exit_grid", description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+", help="checkpoints, or sweep folders of trained task runs")
    ap.add_argument("--out", default="bench/exits.json")
    ap.add_argument("--n-quality", type=int, default=512, help="test sequences scored per configuration (batched)")
    ap.add_argument("--n-time", type=int, default=4, help="test sequences decoded token by token for the timing")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per checkpoint process")
    ap.add_argument("--jobs", type=int, default=1, help="checkpoints measured at once (one process each)")
    ap.add_argument("--lm-sequences", type=int, default=64, help="language models: test windows scored per configuration")
    args = ap.parse_args(argv)
    res = run(args.paths, args.n_quality, args.n_time, args.threads, args.jobs, args.lm_sequences)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    for s in res["summary"]:
        quality = (f"ppl skip {s['perplexity_skip']['mean']:.2f} (all {s['perplexity_all_loops']['mean']:.2f}) "
                   if s["task"] == "lm" else
                   f"acc skip {s['accuracy_skip']['mean']:.3f} (all {s['accuracy_all_loops']['mean']:.3f}) ")
        print(f"{s['task']:5s} {s['backbone']:7s} {s['state_mode']:17s} {s['training']:24s} {s['rule']:13s} {s['threshold']:<6g} "
              f"{s['handling']:13s} " + quality +
              f"exit {s['mean_exit_step_skip']['mean']:.2f} speed-up {s['speedup_vs_all_loops']['mean']:.2f}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
