"""Evaluation: perplexity per loop depth and zero-shot tasks through lm-evaluation-harness (docs/evaluation.md).

Importing this package registers `LooplabLM` with lm-eval under the model name `looplab`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from looplab.eval.lm_eval_adapter import LooplabLM
from looplab.eval.perplexity import evaluate_perplexity

# The StateLoop authors' suite (docs/evaluation.md#zero-shot); every entry is an lm-eval task name.
DEFAULT_TASKS = ["lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "sciq", "race"]
LOCAL_TASKS_DIR = Path(__file__).resolve().parent / "tasks"

__all__ = ["DEFAULT_TASKS", "LOCAL_TASKS_DIR", "LooplabLM", "evaluate_perplexity", "item_outcomes", "run_zeroshot"]


def _numbers(d: dict[str, Any]) -> dict[str, float]:
    """lm-eval's per-task dict → {metric: value}, ',none' filter suffixes dropped, NaN/'N/A' skipped."""
    out = {}
    for k, v in d.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v)):
            out[k[: -len(",none")] if k.endswith(",none") else k] = float(v)
    return out


def item_outcomes(samples: dict[str, list[dict[str, Any]]] | None, metric: str = "acc") -> dict[str, dict[str, Any]]:
    """lm-eval's logged samples (`log_samples=True`) → per task, each document's 0/1 `metric` in document order:
    {task: {"doc_ids": "start:stop" (contiguous) or [ids], "acc": "0110…" (one character per document)}}.
    Compact on purpose (zeroshot.json stays small); a task whose per-document values are not all 0/1, or that
    logged none, is left out. The paired zero-shot interval (looplab.stats.paired_item_interval) reads these."""
    out: dict[str, dict[str, Any]] = {}
    for task, rows in (samples or {}).items():
        filters = [r.get("filter") for r in rows]
        keep = "none" if "none" in filters else (filters[0] if filters else None)
        by_doc = {}
        for r in rows:
            if r.get("filter") == keep and metric in r:
                by_doc[int(r["doc_id"])] = r[metric]
        vals = [by_doc[i] for i in sorted(by_doc)]
        if not vals or any(v not in (0, 1) for v in vals):  # True/False and 0.0/1.0 compare equal to 0/1
            continue
        ids = sorted(by_doc)
        contiguous = ids == list(range(ids[0], ids[0] + len(ids)))
        out[task] = {"doc_ids": f"{ids[0]}:{ids[-1] + 1}" if contiguous else ids,
                     metric: "".join("1" if v else "0" for v in vals)}
    return out


def run_zeroshot(
    model: str | os.PathLike | torch.nn.Module | LooplabLM,
    tasks: Sequence[str] | None = None,
    limit: int | float | None = None,
    batch_size: int = 8,
    include_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    tokenizer: Any = None,
    device: str | None = None,
    num_fewshot: int | None = None,
    exit_threshold: float | None = None,
    max_length: int | None = None,
    include_defaults: bool = True,
    bootstrap_iters: int = 0,
) -> dict[str, Any]:
    """Zero-shot accuracy with lm-eval. `model`: checkpoint path, LoopedLM (then `tokenizer` is needed) or LooplabLM.

    Tasks are looked up among lm-eval's built-in tasks (unless include_defaults=False), looplab's
    local tasks (`looplab_tiny_mc`) and any YAML folders in include_path (offline: `dataset_path: json`).
    Returns {'results': {task: {metric: value}}, 'average_acc': mean 'acc' over tasks that have it,
    'tasks', 'limit', 'n_samples': {task: evaluated documents}, 'items': {task: each document's 0/1 acc} (`item_outcomes`:
    lm-eval's log_samples, kept compact)}.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    if isinstance(model, LooplabLM):
        lm = model
    elif isinstance(model, torch.nn.Module):
        if tokenizer is None:
            raise ValueError("run_zeroshot with an in-memory model needs tokenizer=SPEC (e.g. the dataset's tokenizer_spec)")
        lm = LooplabLM.from_model(model, tokenizer, batch_size=batch_size, device=device, exit_threshold=exit_threshold, max_length=max_length)
    else:
        lm = LooplabLM(checkpoint=str(model), batch_size=batch_size, device=device, exit_threshold=exit_threshold,
                       max_length=max_length, tokenizer=tokenizer)
    tasks = list(tasks or DEFAULT_TASKS)
    paths = [str(LOCAL_TASKS_DIR)]
    if include_path is not None:
        paths += [str(p) for p in ([include_path] if isinstance(include_path, (str, os.PathLike)) else include_path)]
    tm = TaskManager(include_path=paths, include_defaults=include_defaults)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; local tasks: {sorted(set(tm.all_tasks) & {p.stem for p in LOCAL_TASKS_DIR.rglob('*.yaml')})}, "
                         f"add a folder of task YAMLs with include_path")
    out = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=tm,
        bootstrap_iters=bootstrap_iters, log_samples=True,  # per-document outcomes: the paired zero-shot interval
    )
    results = {task: _numbers(r) for task, r in out["results"].items()}
    accs = [r["acc"] for r in results.values() if "acc" in r]
    return {
        "results": results,
        "average_acc": sum(accs) / len(accs) if accs else None,
        "tasks": tasks,
        "limit": limit,
        "n_samples": {t: v.get("effective", v.get("original")) if isinstance(v, dict) else v for t, v in out.get("n-samples", {}).items()},
        "items": {t: v for t, v in item_outcomes(out.get("samples")).items() if "acc" in results.get(t, {})},
    }
