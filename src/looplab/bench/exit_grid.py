"""Exit decoding on trained models: quality against measured speed of all-loops, exact-exit and skip decoding.

`python -m looplab.bench.exit_grid CKPT_OR_SWEEP_DIR ... --out bench/exits.json`

Three decoders, fed a test sequence's true tokens one at a time (teacher-forced cached decoding):

  all_loops   every loop, the prediction of loop R (the fixed-depth model)
  exact_exit  every loop computed, each token read out at the rule's exit (forward(exit_rule=...))
  skip        skip_compute: loops after a token's exit do not run; its deeper-loop cache entries
              come from the state handling (models/exit_compute.py): kv_copy for attention-only
              models, ssm_skip or ssm_propagate for models with Mamba-2 layers or a Mamba-2 state mixer

timed round-robin token by token (common.time_round_robin: ABBA, so load on the machine hits them alike);
speed is the median ms per token of each, the speed-up all_loops / skip and exact_exit / skip (ratios of
the medians). Two measurements use them:

- the exit grid (table 10; `run`, this CLI): for each trained looped checkpoint (R > 1; N⊗1 ones are
  skipped: nothing to exit) — a task model (p-hop or Mano: answer accuracy at the answer positions) or
  a language model (`lm_tiny`: perplexity of every next token of the first `lm_sequences` test windows)
  — and each configuration (exit rule, threshold, handling): quality over `n_quality` test sequences in
  batched forward passes (skip: `forward_with_exits` with the rule deciding online, which equals
  token-by-token skip decoding — tests/test_exit_compute.py), speed over `n_time` sequences. Gate rules
  need a gated checkpoint (table 8's stage-2 runs); the zero-shot rules run on any.
- the gate's exit at one threshold q (table 4's exit columns; `decode_checkpoint`, `decode_checkpoints`,
  run by bench/decode.py's skip_compute section): quality and speed from the same decoding of
  `n_sequences` test sequences — answer accuracy of each decoder, skip's top-1 agreement with exact_exit
  over every decoded token, and the exit depths skip chose. Nothing is hand-set: exits are the trained gate's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from looplab.bench.common import Stepper, Timings, device_of, time_round_robin
from looplab.bench.trained_runs import body_training, checkpoints_in, held_out_examples, run_seed
from looplab.models.exit_compute import forward_with_exits, has_ssm, skip_compute_unsupported
from looplab.models.exits import ExitPolicy
from looplab.models.generation import decode_one_token
from looplab.targets import EXIT_LOSS_TARGET as TARGET_LOSS, EXIT_SPEEDUP_TARGET as TARGET_SPEEDUP, EXIT_TARGET_TASK as TARGET_TASK

DECODERS = ("all_loops", "exact_exit", "skip")


# ------------------------------------------------------------ the three decoders, timed
def handlings_for(config) -> tuple[str, ...]:
    return ("ssm_skip", "ssm_propagate") if has_ssm(config) else ("kv_copy",)


def decoder_options(threshold: float, handling: str, rule: str | None = None) -> dict[str, ExitPolicy | None]:
    """The exit policy of each decoder (rule None: the gate)."""
    return {"all_loops": None, "exact_exit": ExitPolicy(threshold, rule),
            "skip": ExitPolicy(threshold, rule, skip=handling)}


class TeacherForced(Stepper):
    """One decoder over test sequences: `start(i)` gives it a fresh cache for sequence i (untimed), `step(t)`
    decodes that sequence's token t → (logits (1, V), exit steps (1,) or None)."""

    def __init__(self, model, examples: list[dict[str, torch.Tensor]], exits: ExitPolicy | None):
        self.model, self.examples, self.exits = model, examples, exits

    def start(self, episode: int) -> None:
        self.ids = self.examples[episode]["input_ids"]
        self.cache = self.model.allocate_cache(1, self.ids.shape[0])

    def step(self, t: int):
        return decode_one_token(self.model, self.ids[t].view(1, 1), self.cache, exits=self.exits)


def decode_timed(model, examples, options: dict[str, ExitPolicy | None], warmup: int = 4, after=None) -> Timings:
    """The decoders (name → exit policy) side by side over the examples, token by token; the first
    `warmup` tokens untimed; `after(name, (logits, steps))` sees every token's output."""
    steppers = {k: TeacherForced(model, examples, exits) for k, exits in options.items()}
    return time_round_robin(steppers, episodes=[ex["input_ids"].shape[0] for ex in examples], warmup=warmup,
                            device=device_of(model), after=after)


def per_token_ms(timings: Timings) -> dict[str, float]:
    return {k: 1e3 * statistics.median(v) for k, v in timings.wall.items()}


# ------------------------------------------------------------ the exit grid (table 10)
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


def _batches(examples: list[dict[str, torch.Tensor]], size: int):
    for i in range(0, len(examples), size):
        chunk = examples[i:i + size]
        yield {k: torch.stack([e[k] for e in chunk]) for k in chunk[0]}


@torch.no_grad()
def quality(model, examples, rule: str, threshold: float, handling: str, batch_size: int = 64) -> dict[str, Any]:
    """Answer accuracy, mean loss (nats) and exit steps of exact_exit and skip (and all_loops) over the examples'
    scored positions, batched."""
    R = model.config.n_loops
    correct = {k: 0 for k in DECODERS}
    nll = {k: 0.0 for k in DECODERS}
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
    return per_token_ms(decode_timed(model, examples, decoder_options(threshold, handling, rule), warmup))


def grid_for(model, lm: bool = False) -> list[tuple[str, float]]:
    grid = GRID_LM if lm else GRID
    rules = [r for r in grid if r != "gate" or model.exit_gate is not None]
    return [(r, th) for r in rules for th in grid[r]]


def run_checkpoint(path: str | Path, n_quality: int = 512, n_time: int = 4, grid: list[tuple[str, float]] | None = None,
                   handlings: Sequence[str] | None = None, lm_sequences: int = 64) -> dict[str, Any] | None:
    """One checkpoint's rows; None for an N⊗1 model (one loop: no exit to take)."""
    from looplab.checkpoint import load_model

    model, meta = load_model(path)
    model.eval()
    if model.config.n_loops < 2:
        return None
    lm = not meta["dataset"].get("task")
    if lm:  # every token of a window is scored: fewer sequences give as many scored positions as a task's answers
        n_quality = min(n_quality, lm_sequences)
    examples = held_out_examples(meta, max(n_quality, n_time), every_token=lm)
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
            "metric": "perplexity" if lm else "accuracy", "seed": run_seed(path),
            "training": body_training(path), "n_quality": min(n_quality, len(examples)), "n_time": n_time, "rows": rows}


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


# ------------------------------------------------------------ the gate's exit at one threshold (table 4)
@torch.no_grad()
def decode_checkpoint(path: str | Path, n_sequences: int = 256, q: float = 0.5, warmup: int = 4,
                      handling: str | None = None) -> dict[str, Any]:
    """The three decoders on `n_sequences` test sequences of one trained, gated checkpoint, the gate exiting at q.
    handling: skip_compute's state handling (None: kv_copy, or ssm_skip for models with Mamba-2 layers)."""
    from looplab.checkpoint import load_model

    model, meta = load_model(path)
    handling = handling or handlings_for(model.config)[0]
    reason = skip_compute_unsupported(model.config, skip_compute=handling)
    if reason:
        raise ValueError(f"{path}: {reason}")
    R = model.config.n_loops
    examples = held_out_examples(meta, n_sequences)
    decoded: dict[str, list[tuple[int, int | None]]] = {k: [] for k in DECODERS}  # (argmax, exit step) per token

    def keep(name: str, out) -> None:
        logits, steps = out
        decoded[name].append((int(logits.argmax()), None if steps is None else int(steps[0])))

    ms = per_token_ms(decode_timed(model, examples, decoder_options(q, handling), warmup, after=keep))
    correct = {k: 0 for k in DECODERS}
    answers = tokens = agree = exact_steps_sum = 0
    exit_hist = [0] * R
    for ex in examples:
        targets, answer = ex["targets"], ex["answer_mask"]
        for t in range(ex["input_ids"].shape[0]):
            pred = {k: decoded[k][tokens] for k in DECODERS}
            agree += int(pred["skip"][0] == pred["exact_exit"][0])
            exit_hist[pred["skip"][1] - 1] += 1
            exact_steps_sum += pred["exact_exit"][1]
            tokens += 1
            if bool(answer[t]):
                answers += 1
                for k in DECODERS:
                    correct[k] += int(pred[k][0] == int(targets[t]))
    return {
        "checkpoint": str(path),
        "task": meta["dataset"].get("task") or meta["dataset"].get("name"),
        "state_mode": model.config.state_mode,
        "handling": handling,
        "n_loops": R,
        "q": q,
        "sequences": len(examples),
        "tokens": tokens,
        "answers": answers,
        "per_token_ms": ms,
        "speedup_vs_all_loops": ms["all_loops"] / ms["skip"],
        "speedup_vs_exact_exit": ms["exact_exit"] / ms["skip"],
        "accuracy": {k: correct[k] / max(answers, 1) for k in DECODERS},
        "top1_agreement_vs_exact_exit": agree / max(tokens, 1),
        "mean_exit_step": sum((i + 1) * c for i, c in enumerate(exit_hist)) / max(tokens, 1),
        "mean_exit_step_exact_exit": exact_steps_sum / max(tokens, 1),
        "exit_histogram": exit_hist,
    }


def decode_checkpoints(checkpoints: Sequence[str | Path], n_sequences: int = 256, q: float = 0.5) -> dict[str, Any]:
    """decode_checkpoint for each checkpoint, grouped by state mode (one group = one model family
    across seeds), with each group's mean and 95% t-interval over its checkpoints."""
    from looplab.stats import t_interval

    runs = [decode_checkpoint(p, n_sequences, q) for p in checkpoints]
    groups: dict[str, dict[str, Any]] = {}
    for r in runs:
        groups.setdefault(r["state_mode"], {"runs": []})["runs"].append(r)
    for g in groups.values():
        rs = g["runs"]
        metrics = {"speedup_vs_all_loops": [r["speedup_vs_all_loops"] for r in rs],
                   "mean_exit_step": [r["mean_exit_step"] for r in rs],
                   "top1_agreement_vs_exact_exit": [r["top1_agreement_vs_exact_exit"] for r in rs],
                   **{f"accuracy_{k}": [r["accuracy"][k] for r in rs] for k in DECODERS}}
        g["summary"] = {k: {"mean": statistics.fmean(v), "interval": t_interval(v), "n": len(v)} for k, v in metrics.items()}
    return {"q": q, "sequences_per_checkpoint": n_sequences, "groups": groups}


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
