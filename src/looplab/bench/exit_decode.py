"""Exit-gate decoding on trained, gated models (table 4's exit columns; SPEC §4).

Each checkpoint (table 8's stage-2 runs of the attention-only backbones: a trained backbone with a
trained gate) decodes sequences of its own task's test split one token at a time, teacher-forced on
the true sequence, with three decoders fed the same tokens:

  all_loops   every loop, the prediction of loop R (the fixed-depth model)
  exact_exit  every loop computed, the prediction taken at the gate's exit depth (threshold q)
  skip        `skip_compute`: loops after a token's exit are not run; the deeper loops' caches get
              what the handling says (models/exit_compute.py): kv_copy (attention-only models,
              the default there) or ssm_skip / ssm_propagate (the default for Mamba-2 and hybrid
              models is ssm_skip)

Quality is the task's answer accuracy of each decoder (the position results.json scores), the
top-1 agreement of skip with exact_exit over every decoded token, and the exit depths skip chose;
speed is the median per-token latency of each decoder, timed round-robin token by token.
Nothing here is hand-set: exits are the trained gate's.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from looplab.models.exit_compute import has_ssm
from looplab.models.generation import decode_step, skip_compute_unsupported

DECODERS = ("all_loops", "exact_exit", "skip")


def _test_examples(meta: dict[str, Any], n: int, every_token: bool = False) -> list[dict[str, torch.Tensor]]:
    """The first n test sequences with their scored positions: a task's answers; every_token: a language-model
    split's windows have none, and every next token is scored."""
    from looplab.eval.__main__ import build_datamodule

    dm = build_datamodule(meta["dataset"])
    if hasattr(dm, "prepare_data"):
        dm.prepare_data()
    dm.setup("test")
    out: list[dict[str, torch.Tensor]] = []
    for batch in dm.test_dataloader():
        if "answer_mask" not in batch and every_token:
            batch = {**batch, "answer_mask": torch.ones_like(batch["targets"], dtype=torch.bool)}
        if "answer_mask" not in batch:
            raise ValueError(f"dataset {meta['dataset'].get('name')!r} has no answer positions: exit decoding "
                             "measures a task's answer accuracy (table 8's p-hop checkpoints)")
        for i in range(batch["input_ids"].shape[0]):
            out.append({k: v[i] for k, v in batch.items()})
            if len(out) == n:
                return out
    return out


@torch.no_grad()
def decode_checkpoint(path: str | Path, n_sequences: int = 256, q: float = 0.5, warmup: int = 4,
                      handling: str | None = None) -> dict[str, Any]:
    """The three decoders on `n_sequences` test sequences of one trained, gated checkpoint.
    handling: skip_compute's state handling (None: kv_copy, or ssm_skip for models with Mamba-2 layers)."""
    from looplab.checkpoint import load_model

    model, meta = load_model(path)
    handling = handling or ("ssm_skip" if has_ssm(model.config) else "kv_copy")
    reason = skip_compute_unsupported(model.config, skip_compute=handling)
    if reason:
        raise ValueError(f"{path}: {reason}")
    R = model.config.n_loops
    examples = _test_examples(meta, n_sequences)
    options = {"all_loops": {}, "exact_exit": {"exit_threshold": q}, "skip": {"exit_threshold": q, "skip_compute": handling}}
    times: dict[str, list[float]] = {k: [] for k in DECODERS}
    correct = {k: 0 for k in DECODERS}
    answers = tokens = agree = timed = 0
    exit_hist = [0] * R
    exact_steps_sum = 0
    for ex in examples:
        ids, targets, answer = ex["input_ids"], ex["targets"], ex["answer_mask"]
        T = ids.shape[0]
        caches = {k: model.allocate_cache(1, T) for k in DECODERS}
        for t in range(T):
            tok = ids[t].view(1, 1)
            logits, steps = {}, {}
            for k in DECODERS:  # round-robin: load on the machine hits all three alike
                t0 = time.perf_counter()
                logits[k], steps[k] = decode_step(model, tok, caches[k], **options[k])
                dt = time.perf_counter() - t0
                if timed >= warmup:
                    times[k].append(dt)
            timed += 1
            tokens += 1
            agree += int(logits["skip"].argmax() == logits["exact_exit"].argmax())
            exit_hist[int(steps["skip"][0]) - 1] += 1
            exact_steps_sum += int(steps["exact_exit"][0])
            if bool(answer[t]):
                answers += 1
                for k in DECODERS:
                    correct[k] += int(logits[k].argmax(-1).item() == int(targets[t]))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
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


def run(checkpoints: Sequence[str | Path], n_sequences: int = 256, q: float = 0.5) -> dict[str, Any]:
    """decode_checkpoint for each checkpoint, grouped by state mode (one group = one model family
    across seeds), with each group's mean and 95% t-interval over its checkpoints."""
    from looplab.stats import t_interval

    runs = [decode_checkpoint(p, n_sequences, q) for p in checkpoints]
    groups: dict[str, dict[str, Any]] = {}
    for r in runs:
        groups.setdefault(r["state_mode"], {"runs": []})["runs"].append(r)
    for name, g in groups.items():
        rs = g["runs"]
        metrics = {"speedup_vs_all_loops": [r["speedup_vs_all_loops"] for r in rs],
                   "mean_exit_step": [r["mean_exit_step"] for r in rs],
                   "top1_agreement_vs_exact_exit": [r["top1_agreement_vs_exact_exit"] for r in rs],
                   **{f"accuracy_{k}": [r["accuracy"][k] for r in rs] for k in DECODERS}}
        g["summary"] = {k: {"mean": statistics.fmean(v), "interval": t_interval(v), "n": len(v)} for k, v in metrics.items()}
    return {"q": q, "sequences_per_checkpoint": n_sequences, "groups": groups}
