"""The memory a configuration needs at the least, checked before anything is allocated.

A config is validated field by field (models/config.py), but a valid config can still be impossible on the machine
that runs it: `loop_depth.loops=10**12` kept a growing set of per-loop activations until the kernel killed the run,
and a config.json with `vocab_size=10**9` tried to allocate 256 GB of embedding before any check. These bounds are
deliberately *lower* bounds, so that they never refuse a run that could fit: the parameters' fp32 bytes (the
embedding, the head when untied, and 2·d² per layer, which every layer kind exceeds), and for training the residual
stream that every loop keeps for the backward, even under activation checkpointing (B·T·d per loop). What a run
really needs, with a breakdown, is the plan's business (`python -m looplab.plan`).
"""

from __future__ import annotations

import os

from looplab.models.registry import ConfigError

GB = 1e9


def min_parameter_bytes(cfg) -> int:
    """fp32 bytes of the parameters the config has at the least."""
    d, v = int(cfg.d_model), int(cfg.vocab_size)
    layers = int(cfg.n_layers) + int(getattr(cfg, "prelude_layers", 0) or 0) + int(getattr(cfg, "coda_layers", 0) or 0)
    embeddings = v * d * (1 if getattr(cfg, "tie_embeddings", False) else 2)
    return 4 * (embeddings + 2 * d * d * layers)


def min_activation_bytes(cfg, tokens: int, training: bool, n_loops: int | None = None) -> int:
    """Bytes that `tokens` tokens (per device) need at the least across the loops: training keeps one (B·T·d) bf16
    iterate per loop for the backward; inference (a decoding cache) one fp32 d-vector per token and loop."""
    loops = int(n_loops if n_loops is not None else cfg.n_loops)
    return int(tokens) * loops * int(cfg.d_model) * (2 if training else 4)


def memory_capacity(device: str = "cpu") -> tuple[int, str]:
    """(bytes, what they are) of the memory a run on `device` has: one GPU's memory, or this machine's RAM."""
    if str(device).startswith(("cuda", "gpu")):
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), f"{props.name} memory"
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine's RAM"
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no bound known
        return 1 << 62, "memory (unknown)"


def check_fits(cfg, *, where: str, tokens: int = 1, training: bool = False, device: str = "cpu",
               shards: int = 1, n_loops: int | None = None) -> None:
    """ConfigError, in one line naming the size, when the config cannot fit on `device` even at its lower bound
    (`shards`: ranks that share the parameters, FSDP)."""
    params = min_parameter_bytes(cfg) // max(1, int(shards))
    acts = min_activation_bytes(cfg, tokens, training, n_loops)
    need = params + acts
    have, what = memory_capacity(device)
    if need > have:
        loops = int(n_loops if n_loops is not None else cfg.n_loops)
        raise ConfigError(
            f"{where} cannot fit: vocab_size={cfg.vocab_size}, d_model={cfg.d_model}, n_loops={loops} need at least "
            f"{need / GB:,.1f} GB ({params / GB:,.1f} GB of parameters, {acts / GB:,.1f} GB of "
            f"{'activations' if training else 'per-loop state'} for {tokens:,} tokens), but {what} is {have / GB:,.1f} GB"
            f"{'; python -m looplab.plan sizes a run' if training else ''}")
