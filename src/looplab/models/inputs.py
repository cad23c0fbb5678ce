"""What a model call is given: checked once, before anything runs, naming the bad value."""

from __future__ import annotations

import torch


def check_inputs(input_ids, attention_mask=None, vocab_size: int | None = None, *, values: bool = True,
                 max_len: int | None = None, on_device: bool = False) -> None:
    """Refuse, naming the value, token ids that are not a (B, T) integer tensor, more than `max_len` tokens per row
    (a cache-free call's RoPE positions are 0..T−1: a shape check, no host sync), ids outside [0, vocab_size)
    (values; an embedding lookup would fail deep inside, or on a GPU assert), and a mask of another shape.

    The ids' values are read on the host (one host sync) unless `on_device` (a training step, which must not wait
    for the device): then a device-side assertion checks them without a host read. On the CPU it fails at once and
    the error names the bad id as the host check does; on a GPU a bad id stops the device, as the embedding lookup
    it guards would."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a (B, T) tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids has dtype={input_ids.dtype}: token ids must be integers (torch.long)")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: give (B, T) token ids (one row per sequence)")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has shape "
                         f"{tuple(input_ids.shape)}: give one mask value per token")
    T = input_ids.shape[1]
    if max_len is not None and T > max_len:
        raise ValueError(f"input_ids has {T} tokens per row: position {T - 1} exceeds max_seq_len={max_len}; "
                         "raise backbone.max_seq_len")
    if values and vocab_size is not None and input_ids.numel():
        if on_device:
            lo, hi = torch.aminmax(input_ids)
            try:
                torch._assert_async((lo >= 0) & (hi < vocab_size),
                                    f"input_ids holds a token id outside the vocabulary [0, {vocab_size})")
                return  # on a GPU: queued, nothing read back
            except RuntimeError:  # the CPU asserts at once: name the id, as the host check does
                pass
        lo, hi = (int(v) for v in torch.stack([input_ids.min(), input_ids.max()]).tolist())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"input_ids holds token id {bad} outside the vocabulary [0, {vocab_size}) "
                             f"(vocab_size={vocab_size})")
