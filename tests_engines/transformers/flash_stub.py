"""transformers' real flash-attention path on the CPU, with a stand-in for the `flash_attn` package's kernels.

The `flash_attn` package needs CUDA, so on a CPU machine transformers' flash path never runs. `stub_flash_attn()`
puts a `flash_attn` module into sys.modules whose `flash_attn_func` / `flash_attn_varlen_func` are exact torch
references of the kernels' contract (flash-attn >= 2.1: (B, T, H, d) or unpadded (total, H, d) inputs, GQA by
head groups, the causal rule aligned bottom-right, fp16/bf16 only, as the CUDA kernels refuse anything else), and
makes transformers' modeling_flash_attention_utils import it. Everything between a model's attention call and
the kernel is transformers' own code: `integrations.flash_attention.flash_attention_forward` (which reads
`module.config._attn_implementation` and `module.is_causal`), `_flash_attention_forward` and its unpadding by
the (B, L) padding mask. Only the kernels are stood in for.

Used by tests/test_remote_code.py (transformers of the main venv) and test_exported_folder.py (every cell of
scripts/transformers-matrix). Imports torch and transformers only.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

CALLS = {"dense": 0, "varlen": 0}  # how often each kernel ran since the stub was installed


def _check(q, k, v):
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")  # the CUDA kernel's message


def _attend(q, k, v, softmax_scale, causal, window_size, softcap, dropout_p):
    """One sequence: q (Tq, H, d), k/v (Tk, Hkv, d) -> (Tq, H, d), computed in fp32."""
    assert dropout_p == 0.0 and tuple(window_size) == (-1, -1) and not softcap, (dropout_p, window_size, softcap)
    Tq, H, d = q.shape
    Tk, Hkv = k.shape[0], k.shape[1]
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))  # (heads, T, d)
    kf, vf = kf.repeat_interleave(H // Hkv, 0), vf.repeat_interleave(H // Hkv, 0)
    scores = qf @ kf.transpose(-1, -2) * (softmax_scale if softmax_scale is not None else d ** -0.5)
    if causal:  # bottom-right: query i sees keys j <= i + Tk - Tq
        allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _check(q, k, v)
    CALLS["dense"] += 1
    return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal, window_size, softcap, dropout_p)
                        for b in range(q.shape[0])])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    _check(q, k, v)
    assert block_table is None
    CALLS["varlen"] += 1
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        out[cq[i]:cq[i + 1]] = _attend(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], softmax_scale,
                                       causal, window_size, softcap, dropout_p)
    return out


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("the CPU stand-in has no paged kernel (continuous batching is not exercised here)")


@contextlib.contextmanager
def stub_flash_attn():
    """Within the block, transformers' flash_attention_2 path runs with the stand-in kernels (CALLS counts them)."""
    import transformers.modeling_flash_attention_utils as fa

    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = "2.8.3"
    pkg.flash_attn_func, pkg.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    pkg.flash_attn_with_kvcache = flash_attn_with_kvcache
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = fa._pad_input, fa._unpad_input  # transformers' own (un)padding
    pkg.bert_padding = padding
    lazy = [n for n in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                        "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn") if hasattr(fa, n)]
    saved = {n: getattr(fa, n) for n in lazy + ["is_flash_attn_2_available"]}
    modules = {k: sys.modules.get(k) for k in ("flash_attn", "flash_attn.bert_padding")}
    sys.modules.update({"flash_attn": pkg, "flash_attn.bert_padding": padding})
    for n in lazy:
        setattr(fa, n, None)  # transformers imports the kernels lazily, once: make it import the stand-in
    fa.is_flash_attn_2_available = lambda *a, **k: True
    CALLS.update(dense=0, varlen=0)
    try:
        yield CALLS
    finally:
        for n, v in saved.items():
            setattr(fa, n, v)
        for k, m in modules.items():
            if m is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = m


def use_flash(model, name: str = "flash_attention_2") -> None:
    """Route `model`'s attention through transformers' flash path without transformers' load-time availability
    check (it needs CUDA and the real package: on the CPU it refuses, which test_flash_refused_at_load checks)."""
    model.config._attn_implementation = name
    assert model.config._attn_implementation == name

