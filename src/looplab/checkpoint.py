"""Reading looplab checkpoints without Lightning.

A training checkpoint is Lightning's dict plus a `looplab` entry written by the
LightningModule: the model config, the resolved dataset config, and an
architecture hash. `load_model` rebuilds the plain `LoopedLM` from it, and
`check_compatible` refuses a checkpoint from another architecture with the
differing fields named.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from looplab.models import ConfigError, LoopedLM, LoopedLMConfig

MODEL_PREFIX = "model."


def architecture_hash(cfg: LoopedLMConfig) -> str:
    blob = json.dumps(cfg.architecture_dict(), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def looplab_meta(cfg: LoopedLMConfig, dataset: dict[str, Any] | None = None, **extra) -> dict[str, Any]:
    return {"model_config": cfg.to_dict(), "architecture_hash": architecture_hash(cfg), "dataset": dataset or {}, **extra}


def read_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.stat().st_size == 0:
        raise ValueError(f"checkpoint {str(path)!r} is empty (an interrupted write?)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # truncated zip, not a torch file, ...
        raise ValueError(f"checkpoint {str(path)!r} cannot be read: {e}") from e
    if "looplab" not in ckpt:
        raise ValueError(f"{str(path)!r} is not a looplab checkpoint (no 'looplab' entry)")
    return ckpt


def check_compatible(meta: dict[str, Any], cfg: LoopedLMConfig, *, allow_new_branches: bool = False) -> None:
    """Raise ConfigError naming every architecture field that differs.

    allow_new_branches: warm-starting a StateLoop / gated model from a vanilla one
    (SPEC §3) may differ in state_mode, state fields and exit_gate only.
    """
    old = LoopedLMConfig.from_dict(meta["model_config"]).architecture_dict()
    new = cfg.architecture_dict()
    diff = {k: (old.get(k), new.get(k)) for k in new if old.get(k) != new.get(k)}
    if allow_new_branches:
        diff = {k: v for k, v in diff.items() if not (k.startswith("state_") or k == "exit_gate")}
    if diff:
        lines = ", ".join(f"{k}: checkpoint={a!r} vs config={b!r}" for k, (a, b) in sorted(diff.items()))
        raise ConfigError(f"checkpoint was trained with another architecture ({lines}); use the matching config")


def model_state_dict(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k[len(MODEL_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(MODEL_PREFIX)}


def load_model(path: str | os.PathLike, map_location="cpu", **config_overrides) -> tuple[LoopedLM, dict[str, Any]]:
    """Rebuild the LoopedLM of a checkpoint; config_overrides may change non-architecture fields (kernel, ...)."""
    ckpt = read_checkpoint(path, map_location)
    meta = ckpt["looplab"]
    cfg = LoopedLMConfig.from_dict({**meta["model_config"], **config_overrides})
    model = LoopedLM(cfg)
    model.load_state_dict(model_state_dict(ckpt))
    model.eval()
    return model, meta
