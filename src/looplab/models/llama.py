"""LLaMA-style decoder pieces (docs/formulations.md#backbones): RMSNorm → RoPE attention → SwiGLU.

Read top to bottom: norm, rotary embedding, attention (with its KV cache),
MLP, and the pre-norm layer that the looped block stacks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from looplab.models.cache import KVCache
from looplab.models.config import LoopedLMConfig
from looplab.models.flops import attention_keys
from looplab.models.backbone import Layer
from looplab.models.registry import LAYERS, ConfigError, Supports


# --- CPU autograd -------------------------------------------------------------
# On CPU every elementwise op streams its (B, T, width) operands through memory, and a
# training step of the issue-9 config spends a third of its time outside the matmuls.
# Autograd's generic backward of rms_norm (ten element-wise ops), of rotate-half RoPE (a
# chunk and a cat per call) and of silu(gate)·up (a cat of the two halves' gradients) does
# needless passes, so on CPU these three get hand-written backward passes with the same
# forward arithmetic. CUDA keeps torch's own kernels (fused rms_norm backward, autocast).


def _hand_autograd(x: torch.Tensor) -> bool:
    # under torch.compile the plain ops are better: inductor fuses them, while a custom
    # autograd.Function splits the layer's graph around itself. Without a graph (decoding,
    # evaluation) there is no backward to hand-write, and Function.apply costs more than the
    # one-token op it wraps.
    return (x.device.type == "cpu" and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)  # what F.rms_norm runs
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        xhat = x * rstd
        gw = (g * xhat).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        gxhat = g * weight
        dot = (gxhat * xhat).mean(-1, keepdim=True)
        gx = gxhat.sub_(xhat.mul_(dot)).mul_(rstd)  # rstd·(ĝ − x̂·mean(ĝ·x̂))
        return gx, gw, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _hand_autograd(x) and x.dtype == self.weight.dtype:
            return _RMSNormFn.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, looked up by absolute position."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_seq_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (max_T, hd/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B or 1, T) → cos, sin of shape (B or 1, 1, T, hd/2). checked: the caller
        guarantees positions < max_seq_len (a decoding cache, sized at most max_seq_len)."""
        # The bound is checked on shapes, never on values (reading positions.max() on the host waited for the
        # device at every attention layer of every loop): a cache-free call's positions are 0..T−1 (LoopedLM.positions;
        # a depth router gathers a subset of them), so T ≤ max_seq_len bounds them — LoopedLM.forward refuses a
        # longer input first (check_inputs(max_len=)), and this repeats it for a layer called on its own. A cache
        # hands out positions below its max_len ≤ max_seq_len (allocate_cache). Any other out-of-range position
        # still fails in the lookup below (IndexError on the CPU, a device assert on a GPU).
        if not checked and positions.shape[-1] > self.cos.shape[0]:
            raise ValueError(
                f"position {positions.shape[-1] - 1} exceeds max_seq_len={self.cos.shape[0]}; "
                "raise backbone.max_seq_len"
            )
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if _hand_autograd(x):
        return _RoPEFn.apply(x, cos, sin)
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _rotate(x, cos, sin)  # the same arithmetic, written in place (no graph to keep)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE written into one output (no temporaries, no cat)."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out


class _RoPEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, -sin), None, None  # a rotation's transpose is the rotation by −θ


def attention_mask(valid: torch.Tensor | None, T: int, L: int, device) -> torch.Tensor | None:
    """Boolean (B|1, 1, T, L) mask: causal over the last T of L keys, restricted to valid keys.

    Every query may always see itself, so a left-padding query row is never
    fully masked (a fully masked row gives NaN, and 0·NaN still poisons the
    real tokens through V).
    """
    if valid is None and (T == L or T == 1):
        return None  # full sequence: SDPA's is_causal path; one decoding query: it may see every key
    q_pos = torch.arange(L - T, L, device=device).unsqueeze(1)  # (T, 1)
    k_pos = torch.arange(L, device=device).unsqueeze(0)  # (1, L)
    mask = (k_pos <= q_pos).unsqueeze(0)  # (1, T, L)
    if valid is not None:
        mask = (mask & valid[:, None, :L]) | (k_pos == q_pos).unsqueeze(0)
    return mask.unsqueeze(1)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, max_seq_len: int, rope_base: float):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.qkv_proj = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.out_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.rope = RotaryEmbedding(self.head_dim, max_seq_len, rope_base)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor | None = None,  # (B, T): which of these tokens are real (without a cache)
        cache: KVCache | None = None,
        residual: torch.Tensor | None = None,  # the layer's input before its norm (a parallel-loop gate's input)
    ) -> torch.Tensor:
        B, T, _ = x.shape
        hd, H, Hkv = self.head_dim, self.n_heads, self.n_kv_heads
        q, k, v = self.qkv_proj(x).split((H * hd, Hkv * hd, Hkv * hd), dim=-1)
        q = q.view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, Hkv, hd).transpose(1, 2)
        v = v.view(B, T, Hkv, hd).transpose(1, 2)
        cos, sin = self.rope(positions, checked=cache is not None)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if hasattr(cache, "attend"):  # loop_schedule=parallel: which loop's keys each query reads (models/parallel.py)
            y = cache.attend(q, k, v, self, x if residual is None else residual)
            return self.out_proj(y.transpose(1, 2).reshape(B, T, H * hd))
        if cache is not None:
            # (b, Hkv, L, hd) and the (b, 1, T, L) mask of what each query reads (None: causal), from the
            # entry: the cache's columns (models/cache.py), or a routed loop's own (models/router.py)
            k, v, mask = cache.update(k, v)
        else:
            mask = attention_mask(valid, T, T, x.device)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, enable_gqa=Hkv != H
        )
        return self.out_proj(y.transpose(1, 2).reshape(B, T, H * hd))

    def allocate_cache(self, batch_size: int, max_len: int, device, dtype) -> KVCache:
        return KVCache(batch_size, self.n_kv_heads, max_len, self.head_dim, device, dtype)


class _SiluMulFn(torch.autograd.Function):
    """silu(gate)·up of the fused gate_up projection; the backward writes both halves' gradients
    into one (B, T, 2·hidden) buffer and recomputes silu instead of keeping it alive."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, g):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad = torch.empty_like(gate_up)
        g_gate, g_up = grad.chunk(2, dim=-1)
        torch.mul(F.silu(gate), g, out=g_up)
        torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=g_gate)
        return grad


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)  # fused: one matmul instead of two
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if _hand_autograd(gate_up):
            return self.down_proj(_SiluMulFn.apply(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@LAYERS.register("A")
class AttentionLayer(nn.Module, Layer):
    """Pre-norm LLaMA layer: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    kind = "A"
    title = "attention"
    supports = Supports(cache="kv", parallel_loops=True, export=True)

    @classmethod
    def validate(cls, cfg: LoopedLMConfig) -> None:
        if cfg.d_model % cfg.n_heads:
            raise ConfigError(f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}; pick n_heads among the "
                              f"divisors of {cfg.d_model}")
        if (cfg.d_model // cfg.n_heads) % 2:
            raise ConfigError(f"head dim d_model/n_heads={cfg.d_model // cfg.n_heads} must be even for RoPE")
        if not (cfg.n_kv_heads >= 1 and cfg.n_heads % cfg.n_kv_heads == 0):
            raise ConfigError(f"n_kv_heads={cfg.n_kv_heads} must divide n_heads={cfg.n_heads}")

    def __init__(self, cfg: LoopedLMConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.max_seq_len, cfg.rope_base)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x, positions, valid=None, cache=None):
        x = x + self.attn(self.attn_norm(x), positions, valid, cache, residual=x)
        return x + self.mlp(self.mlp_norm(x))

    def allocate_cache(self, batch_size, max_len, device, dtype):
        return self.attn.allocate_cache(batch_size, max_len, device, dtype)

    def flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs per token: 2·(matmul weights) + QKᵀ and AV over the keys a query sees: all seq_len of
        them (FlopCounterMode's convention), or their causal mean (seq_len + 1)/2 inside
        `models.flops.causal_attention()` (models/flops.py)."""
        matmul = sum(p.numel() for n, p in self.named_parameters() if p.dim() == 2)
        H, hd = self.attn.n_heads, self.attn.head_dim
        return 2 * matmul + 2 * 2 * attention_keys(seq_len) * H * hd
