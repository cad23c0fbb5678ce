"""Trained runs as the decoding benchmarks read them (exit_grid, speculative, routed_decode): their checkpoints,
the results.json beside each, and the held-out sequences and prompts of the data they were trained on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch


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


def run_results(ckpt: str | Path) -> dict[str, Any]:
    """results.json of the run folder holding checkpoints/last.ckpt ({} when there is none)."""
    try:
        return json.loads((Path(ckpt).parent.parent / "results.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def run_seed(ckpt: str | Path) -> int | None:
    return run_results(ckpt).get("seed")


def body_training(ckpt: str | Path) -> str:
    """How the looped body was trained: "exit-aware (HANDLING, p=P)" when the run — or, for a stage-2 gate, the run
    it started from (exit_gate.init_from) — trained with exit_gate.skip_train_prob > 0, else "standard"."""
    gate = (run_results(ckpt).get("config") or {}).get("exit_gate") or {}
    if not float(gate.get("skip_train_prob") or 0) and gate.get("init_from"):
        gate = (run_results(gate["init_from"]).get("config") or {}).get("exit_gate") or {}
    p = float(gate.get("skip_train_prob") or 0)
    return f"exit-aware ({gate.get('skip_compute')}, p={p:g})" if p else "standard"


def held_out_examples(meta: dict[str, Any], n: int, every_token: bool = False) -> list[dict[str, torch.Tensor]]:
    """The first n test sequences of the checkpoint's dataset with their scored positions: a task's answers;
    every_token: a language-model split's windows have none, and every next token is scored."""
    from looplab.data.registry import datamodule_from_meta

    dm = datamodule_from_meta(meta["dataset"], source="the trained run's checkpoint")
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


def held_out_prompts(model, meta: dict[str, Any] | None, batch: int, prompt_len: int, seed: int = 0) -> torch.Tensor:
    """(batch, prompt_len) prompts: the first prompt_len tokens of the checkpoint's first test sequences, one per
    row; without a dataset in `meta` (a model built here), random tokens of the model's vocabulary."""
    if (meta or {}).get("dataset"):
        rows = [ex["input_ids"][:prompt_len] for ex in held_out_examples(meta, batch, every_token=True)]
        if len(rows) < batch or any(len(r) < prompt_len for r in rows):
            raise ValueError(f"the test split has fewer than {batch} sequences of {prompt_len} tokens")
        return torch.stack(rows)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g)
