"""What a model call is given: checked once, before anything runs, naming the bad value."""

from __future__ import annotations

import torch


def check_inputs(input_ids, attention_mask=None, vocab_size: int | None = None, *, values: bool = True) -> None:
    """Refuse, naming the value, token ids that are not a (B, T) integer tensor, ids outside [0, vocab_size) (values:
    one host sync; an embedding lookup would fail deep inside, or on a GPU assert), and a mask of another shape."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a (B, T) tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids has dtype={input_ids.dtype}: token ids must be integers (torch.long)")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: give (B, T) token ids (one row per sequence)")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has shape "
                         f"{tuple(input_ids.shape)}: give one mask value per token")
    if values and vocab_size is not None and input_ids.numel():
        lo, hi = (int(v) for v in torch.stack([input_ids.min(), input_ids.max()]).tolist())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"input_ids holds token id {bad} outside the vocabulary [0, {vocab_size}) "
                             f"(vocab_size={vocab_size})")
