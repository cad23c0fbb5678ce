"""The training loss's head and cross-entropy in chunks of tokens: `LoopedLM.forward(ids, targets=...)`.

Plain `head(hidden)` then `cross_entropy(logits.float())` keeps, at the peak of a training step, the (N, V) logits,
their fp32 copy and log-softmax's fp32 output (saved for the backward): at the paper presets (V = 50,304, 2 × 2048
tokens per micro-batch) about 2.5 GB beside the layers. Here the N tokens are cut into chunks and each chunk's head
and cross-entropy run under a checkpoint: the forward keeps only each chunk's per-token losses (N fp32 in all), and
the backward recomputes one chunk's logits at a time. The price is one more head matmul per token (2·d·V FLOPs,
a few % of a step at the paper presets), so small problems — every tiny CPU run — take the unchunked path, which
is exactly the plain computation.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100  # targets with no loss (torch's cross_entropy ignore_index)
# chunk when the fp32 logits of the call would exceed this many elements (512 MiB), in chunks of CHUNK_ELEMENTS
# (128 MiB fp32 each); below it one piece, unchunked: the plain computation, no recomputation
CHUNK_ABOVE_ELEMENTS = 2**27
CHUNK_ELEMENTS = 2**25

__all__ = ["IGNORE", "chunked_token_losses", "chunk_tokens"]


def chunk_tokens(n_tokens: int, vocab_size: int, chunk: int | None = None) -> int:
    """Tokens per chunk: `chunk` when given, else all of them when their fp32 logits stay under
    CHUNK_ABOVE_ELEMENTS, else CHUNK_ELEMENTS // V."""
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"loss_chunk_tokens={chunk!r} must be an integer >= 1 (or None: by size)")
        return chunk
    if n_tokens * vocab_size <= CHUNK_ABOVE_ELEMENTS:
        return max(n_tokens, 1)
    return max(1, CHUNK_ELEMENTS // vocab_size)


def _ce(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # the logits in the compute dtype (bf16 under autocast), the softmax in fp32 (only this chunk's copy)
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE, reduction="none")


def chunked_token_losses(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy of head(hidden) against targets, fp32, 0 where the target is IGNORE.

    hidden (…, d), targets (…) → (…). The head runs inside this call (under FSDP2 inside the model's forward, where
    its weight is gathered)."""
    shape = targets.shape
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    n = t.shape[0]
    size = chunk_tokens(n, head.weight.shape[0], chunk)
    if size >= n:
        return _ce(head, h, t).view(shape)
    losses = [checkpoint(_ce, head, hc, tc, use_reentrant=False) for hc, tc in zip(h.split(size), t.split(size))]
    return torch.cat(losses).view(shape)
