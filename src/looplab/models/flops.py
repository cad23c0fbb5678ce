"""Causal attention counted as causal: the FLOP count behind MFU (results.json, `make bench`, the plan).

`LoopedLM.flops_per_token` counts every attention query against all T keys of its sequence: the convention of
`torch.utils.flop_counter.FlopCounterMode`, which scores scaled_dot_product_attention over all T² query-key pairs
whether or not it is causal, and the one the FLOP-matched tables (tables/isoflop.py) were built with. A causal
layer computes only the T(T + 1)/2 pairs its mask keeps — query t (1-based) reads t keys, (T + 1)/2 on average —
and a causal kernel (flash attention) skips the rest, so the non-causal count puts MFU too high by the share of the
attention terms in the step (5–8% at the paper's sizes).

`causal_flops_per_token(model, T, ...)` is `model.flops_per_token(T, ...)` with every attention score counted over
the causal mean of (T + 1)/2 keys instead of T:

    attention layer, forward, per token:  2·(matmul weights) + 2·2·H·hd·(T + 1)/2    (QKᵀ and A·V)
    training: forward + backward = 3 × forward (the backward's recomputed scores are recomputation, not counted)

The same holds wherever a layer's keys are a subset (a depth router's k_r gathered tokens attend causally among
themselves: (k_r + 1)/2) and for StateLoop's attention mixer. Mamba-2's chunked scan is counted as before (its
intra-chunk products are computed in full by the kernels).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

_CAUSAL = contextvars.ContextVar("looplab_causal_attention_flops", default=False)


def attention_keys(seq_len: float) -> float:
    """Keys a query's attention scores are counted over: all `seq_len` of them (FlopCounterMode's convention), or
    their causal mean (seq_len + 1)/2 inside `causal_attention()`."""
    return (seq_len + 1) / 2 if _CAUSAL.get() else seq_len


@contextlib.contextmanager
def causal_attention() -> Iterator[None]:
    """Count attention as causal in every `flops_per_token` called inside (the current thread/task only)."""
    token = _CAUSAL.set(True)
    try:
        yield
    finally:
        _CAUSAL.reset(token)


def causal_flops_per_token(model, seq_len: int, **options: Any) -> int:
    """FLOPs per token of `model` (a LoopedLM) with causal attention counted as causal: `model.flops_per_token(seq_len,
    **options)` (training=, loops=, backprop_loops=, all_readouts=, loop_fractions=) with each attention query's
    scores over (seq_len + 1)/2 keys, the mean of the T(T + 1)/2 query-key pairs a causal mask keeps."""
    with causal_attention():
        return model.flops_per_token(seq_len, **options)


def causal_training_flops(model, depth, seq_len: int) -> tuple[int, int]:
    """(forward, training) causal FLOPs per token of a training run, at its depth sampler's expected depth and
    expected backpropagated loops (training/depth.py DepthSampler; a depth-routed model runs R loops at its
    router's fractions): what `looplab.train` reports and MFU divides by."""
    loops = None if getattr(model, "router", None) is not None else depth.expected_loops()
    back = depth.expected_backprop_loops()
    return (causal_flops_per_token(model, seq_len, loops=loops),
            causal_flops_per_token(model, seq_len, training=True, loops=loops, backprop_loops=back))
