"""Token-weighted perplexity, overall and per loop depth (docs/evaluation.md#perplexity-and-per-depth-metrics).

    NLL = Σ_batches Σ_tokens −log p(target) / (number of target tokens)
    perplexity = exp(NLL)

Summing over tokens before dividing (rather than averaging per-batch means)
keeps the figure independent of batch size and of a short last batch. Every
loop depth is decoded through the shared final norm and head
(`return_all_loops=True`), so `loop_perplexity[r]` is the perplexity the model
would have if it stopped after loop r + 1. With `exit_threshold=q` the
gate-selected depth per token is scored instead, and the mean exit step is
reported next to it.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F

IGNORE = -100


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


@torch.no_grad()
def evaluate_perplexity(
    model: torch.nn.Module,
    dataloader: Iterable[dict[str, torch.Tensor]],
    per_loop: bool = True,
    max_batches: int | None = None,
    exit_threshold: float | None = None,
    device: torch.device | str | None = None,
) -> dict[str, float | int | list[float]]:
    """{'nll', 'perplexity', 'tokens', 'batches'} plus 'loop_nll'/'loop_perplexity' (one per depth)
    and, with exit_threshold, 'mean_exit_step'."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    n_loops = model.config.n_loops
    total = torch.zeros((), dtype=torch.float64)
    loop_total = torch.zeros(n_loops, dtype=torch.float64)
    exit_sum, tokens, batches = 0.0, 0, 0
    try:
        for batch in dataloader:
            if max_batches is not None and batches >= max_batches:
                break
            ids = batch["input_ids"].to(device)
            targets = batch["targets"].to(device)
            kw = {}
            if per_loop:
                kw["return_all_loops"] = True
            if exit_threshold is not None:
                from looplab.models.exits import ExitPolicy

                kw["exits"] = ExitPolicy(threshold=exit_threshold)
            out = model(ids, **kw)
            total += _nll_sum(out.logits, targets).double().cpu()
            if per_loop:
                for r in range(n_loops):
                    loop_total[r] += _nll_sum(out.loop_logits[r], targets).double().cpu()
            mask = targets != IGNORE
            n = int(mask.sum())
            if exit_threshold is not None and out.exit_steps is not None:
                exit_sum += float(out.exit_steps[mask].double().sum())
            tokens += n
            batches += 1
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("no target tokens to evaluate (empty dataloader, or every target is -100)")
    nll = float(total) / tokens
    result: dict[str, float | int | list[float]] = {"nll": nll, "perplexity": math.exp(nll), "tokens": tokens, "batches": batches}
    if per_loop:
        loop_nll = (loop_total / tokens).tolist()
        result["loop_nll"] = loop_nll
        result["loop_perplexity"] = [math.exp(v) for v in loop_nll]
    if exit_threshold is not None:
        result["mean_exit_step"] = exit_sum / tokens
    return result


def checkpoint_perplexity(
    path: str,
    *,
    max_batches: int | None = None,
    val_tokens: int | None = None,
    batch_size: int | None = None,
    per_loop: bool = True,
    exit_threshold: float | None = None,
    device: str | None = None,
) -> dict[str, float | int | list[float]]:
    """Held-out perplexity of a checkpoint on the validation split of the dataset it was trained on
    (rebuilt from the dataset config stored in the checkpoint; val_tokens / batch_size override it)."""
    from looplab.checkpoint import load_model
    from looplab.data.registry import datamodule_from_meta

    model, meta = load_model(path)
    dataset = meta.get("dataset") or {}
    if not dataset.get("tokenizer"):
        raise ValueError(f"checkpoint {path!r} was trained on dataset {dataset.get('name', '?')!r}, not on text; perplexity needs an LM checkpoint")
    overrides = {k: v for k, v in (("val_tokens", val_tokens), ("val_batch_size", batch_size)) if v is not None}
    dm = datamodule_from_meta(dataset, source=f"checkpoint {str(path)!r}", **overrides)
    dm.setup("validate")
    if device is not None:
        model = model.to(device)
    return evaluate_perplexity(model, dm.val_dataloader(), per_loop=per_loop, max_batches=max_batches, exit_threshold=exit_threshold)


@torch.no_grad()
def split_metrics(
    model: torch.nn.Module,
    dataloader: Iterable[dict[str, torch.Tensor]],
    thresholds: Iterable[float] = (),
    max_batches: int | None = None,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """The held-out metrics exactly as training logs them (`LoopedLMModule`, results.json `metrics`), from sums.

    Names as the module logs them, without the `test/` prefix: `loss_loop{d}` (mean NLL over every
    supervised target token), `acc_loop{d}` (answer positions, synthetic tasks), `loss`/`ppl`/`acc`
    (the last depth), and for gated models `exit_expected_step` (Σ_t p(t)·t over target tokens) and, per
    threshold q, `exit_q{q}_loss`, `exit_q{q}_mean_step` (target tokens), `exit_q{q}_acc`,
    `exit_q{q}_answer_step` (answer positions); StateLoop models add the diagnostics of the first batch
    (`state_{key}_loop{r}`), as the module does. Every mean is a ratio of float64 sums over the
    whole split, so batch size and a short last batch do not matter.
    """
    from looplab.models.exit_gate import logits_at_depth, threshold_exit_steps

    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    R = model.config.n_loops
    gated = getattr(model, "exit_gate", None) is not None
    thresholds = [float(q) for q in thresholds] if gated else []
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    diagnostics: dict[str, list[float]] = {}

    def add(name: str, total: float, n: int) -> None:
        sums[name] = sums.get(name, 0.0) + total
        counts[name] = counts.get(name, 0) + n

    try:
        for i, batch in enumerate(dataloader):
            if max_batches is not None and i >= max_batches:
                break
            ids, targets = batch["input_ids"].to(device), batch["targets"].to(device)
            answer = batch["answer_mask"].to(device) if "answer_mask" in batch else None
            first = i == 0 and getattr(model, "state", None) is not None
            out = model(ids, return_all_loops=True, return_diagnostics=first)
            if first:
                diagnostics = dict(out.diagnostics or {})
            mask = targets != IGNORE
            n_tok = int(mask.sum())
            n_ans = int(answer.sum()) if answer is not None else 0
            for d in range(1, R + 1):
                logits = out.loop_logits[d - 1]
                add(f"loss_loop{d}", float(_nll_sum(logits, targets)), n_tok)
                if answer is not None:
                    add(f"acc_loop{d}", float((logits.argmax(-1) == targets)[answer].sum()), n_ans)
            if gated:
                steps = torch.arange(1, R + 1, device=device, dtype=torch.float64)
                add("exit_expected_step", float((out.exit_probs.double()[mask] * steps).sum()), n_tok)
                for q in thresholds:
                    chosen = threshold_exit_steps(out.exit_probs, q)
                    logits_q = logits_at_depth(out.loop_logits, chosen)
                    add(f"exit_q{q}_loss", float(_nll_sum(logits_q, targets)), n_tok)
                    add(f"exit_q{q}_mean_step", float(chosen[mask].double().sum()), n_tok)
                    if answer is not None:
                        add(f"exit_q{q}_acc", float((logits_q.argmax(-1) == targets)[answer].sum()), n_ans)
                        add(f"exit_q{q}_answer_step", float(chosen[answer].double().sum()), n_ans)
    finally:
        model.train(was_training)
    values = {k: sums[k] / counts[k] for k in sums if counts[k] > 0}
    if f"loss_loop{R}" in values:
        values["loss"] = values[f"loss_loop{R}"]
        values["ppl"] = math.exp(min(values["loss"], 50.0))
    if f"acc_loop{R}" in values:
        values["acc"] = values[f"acc_loop{R}"]
    for key, series in diagnostics.items():
        for r, v in enumerate(series, start=1):
            values[f"state_{key}_loop{r}"] = float(v)
    values["_scored_tokens"] = counts.get(f"loss_loop{R}", 0)
    values["_scored_answers"] = counts.get(f"acc_loop{R}", 0)
    return values
