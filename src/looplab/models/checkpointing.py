"""Activation checkpointing of a looped model: what `hardware.activation_checkpointing` chooses.

    loop       one checkpoint around each loop (all N block layers): the backward recomputes a whole loop at
               once, so its peak holds one loop's activations. For N⊗1 presets (24x1) that is the whole stack:
               no saving at all.
    layer      one checkpoint around each layer application: every block layer at every loop, each prelude
               and coda layer, the StateLoop state update; a layer's input is all that is kept, and the
               backward recomputes one layer at a time.
    selective  `layer` with torch's selective activation checkpointing policy inside each layer
               (torch.utils.checkpoint.create_selective_checkpoint_contexts): the outputs of the matmuls and
               of attention are kept, the pointwise ops (norms, RoPE, SiLU, residual adds, casts) are
               recomputed — less memory than none, less recomputation than `layer` (no matmul is redone).

`true` is `layer` (the useful default for the paper presets); `false` / `none` turns it off. Plain PyTorch: the
model holds the mode (`LoopedLM.activation_checkpointing`), the training config sets it.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, Callable

import torch
from torch.utils.checkpoint import (  # the SAC modes: private, subclassed below to let communication through
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    checkpoint,
)

MODES = ("loop", "layer", "selective")
PER_LAYER = ("layer", "selective")

__all__ = ["MODES", "PER_LAYER", "checkpoint_mode", "checkpointed"]


def checkpoint_mode(value: Any) -> str | None:
    """hardware.activation_checkpointing as given (false/none/null, true, loop, layer, selective) → a mode or None."""
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("false", "none", "off", "")):
        return None
    if value is True or (isinstance(value, str) and value.lower() == "true"):
        return "layer"
    if isinstance(value, str) and value.lower() in MODES:
        return value.lower()
    raise ValueError(f"activation_checkpointing={value!r} is unknown; choose false, loop, layer, selective "
                     "(true = layer)")


def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention kernels (what is expensive to
    redo); everything else is recomputed."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward")
    ops = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            ops.add(packet.default)
    return frozenset(ops)


@functools.lru_cache(maxsize=1)
def _policy() -> Callable:
    saved = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# Communication is not computation: an FSDP2 unit nested inside a checkpointed layer (Mamba-2's fp32 parameters under
# bf16 all-gathers, training/fsdp.py) is all-gathered inside the region, and whether that happens in the forward, the
# recompute or both depends on FSDP's schedule (resharded after forward, prefetched, kept across micro-batches), not
# on the layer. torch's SAC replays the region op by op and refuses an op the forward did not record
# ("fsdp.split_with_sizes_copy.default encountered during backward but not found in storage"), so these namespaces
# pass through both modes as torch's own SAC_IGNORED_OPS do: run, neither saved nor replayed.
_COMMUNICATION_NAMESPACES = frozenset({"fsdp", "c10d", "_c10d_functional", "c10d_functional", "_dtensor"})


def _communication(func) -> bool:
    return getattr(func, "namespace", None) in _COMMUNICATION_NAMESPACES


class _SavingMode(_CachingTorchDispatchMode):
    """The forward's SAC mode (saves what the policy keeps), letting communication through."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _communication(func):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _ReplayingMode(_CachedTorchDispatchMode):
    """The recompute's SAC mode (hands back what the forward saved), letting communication through."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _communication(func):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _selective_contexts():
    """torch's create_selective_checkpoint_contexts(policy) with communication passed through (above)."""
    storage: dict = defaultdict(dict)
    return _SavingMode(_policy(), storage), _ReplayingMode(None, storage)


def checkpointed(fn: Callable, *args, selective: bool = False, **kwargs):
    """fn(*args, **kwargs) under a non-reentrant checkpoint (selective: keeping matmul and attention outputs)."""
    if selective:
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)
