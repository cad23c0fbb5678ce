"""Token-weighted perplexity, overall and per loop depth (SPEC §6).

    NLL = Σ_batches Σ_tokens −log p(target) / (number of target tokens)
    perplexity = exp(NLL)

Summing over tokens before dividing (rather than averaging per-batch means)
keeps the figure independent of batch size and of a short last batch. Every
loop depth is decoded through the shared final norm and head
(`return_all_loops=True`), so `loop_perplexity[r]` is the perplexity the model
would have if it stopped after loop r + 1. With `exit_threshold=q` the
gate-selected depth per token is scored instead, and the mean exit step is
reported next to it (SPEC §4).
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
                kw["exit_threshold"] = exit_threshold
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
    import hydra.utils

    from looplab.checkpoint import load_model

    model, meta = load_model(path)
    # the training run stores extra facts under '_'-prefixed keys (_vocab_size, ...): not constructor arguments
    cfg = {k: v for k, v in (meta.get("dataset") or {}).items() if not k.startswith("_") or k == "_target_"}
    if not cfg.get("tokenizer"):
        raise ValueError(f"checkpoint {path!r} was trained on dataset {cfg.get('name', '?')!r}, not on text; perplexity needs an LM checkpoint")
    if val_tokens is not None:
        cfg["val_tokens"] = val_tokens
    if batch_size is not None:
        cfg["val_batch_size"] = batch_size
    dm = hydra.utils.instantiate(cfg)
    dm.setup("validate")
    if device is not None:
        model = model.to(device)
    return evaluate_perplexity(model, dm.val_dataloader(), per_loop=per_loop, max_batches=max_batches, exit_threshold=exit_threshold)
