"""Mamba-2's selective scan in pure PyTorch, in its SSD (state-space duality) form.

Per head h, with a scalar decay per step (Dao & Gu 2024, "Transformers are SSMs"):

    state_t = exp(dt_t·A) · state_{t-1} + dt_t · x_t ⊗ B_t        state: (headdim, d_state)
    y_t     = state_t · C_t + D · x_t

Unrolled, y = M·(dt ⊙ x) with M[t, s] = (C_t·B_s)·exp(Σ_{s<j≤t} dt_j A) for s ≤ t: a masked,
decay-weighted "attention" matrix. The chunked algorithm splits time into chunks of Q steps:

1. inside a chunk, the quadratic form above (a Q×Q matmul per head and chunk);
2. each chunk's contribution to the state at its end (B-weighted sum over the chunk);
3. state passing between chunks: a (chunks+1)×(chunks+1) decay matrix applied to the
   chunk states, so no Python loop runs over chunks or time steps;
4. each chunk's outputs read the state at its start through C.

Everything runs as batched matmuls with heads kept in the batch dimensions; B/C broadcast
over the heads of their group (the C·Bᵀ scores are formed once per group). The scan
computes in fp32 whatever the input dtype, also inside autocast. Measured on this CPU
(fp32, forward+backward of a 4-layer d=512 model): ~1.6x the tokens/s of transformers'
pure-PyTorch Mamba-2 fallback and ~4-7x the token-by-token recurrence (looplab.bench.mamba2).

`ssd_step` is the one-token recurrence used for decoding, `ssd_reference` the slow
token-by-token loop used by the tests as ground truth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ssd_chunked", "ssd_step", "ssd_reference", "segsum"]

# Log-decays are floored at −60 (factor ≈ 1e-26). Left alone, exp of a long chunk's decay gives
# subnormal floats (below 1.2e-38 = exp(−87)), and x86 CPUs run arithmetic on subnormals ~100x
# slower: at Mamba-2's init (A·dt up to 1.6 per step) this made the scan ~3x slower overall
# (measured). A factor of 1e-26 next to the always-present undecayed term is far below fp32
# resolution, so nothing measurable is lost.
LOG_DECAY_FLOOR = -60.0


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay) for log_decay ≤ 0 (−inf allowed), flushing what would be subnormal to zero."""
    return torch.exp(log_decay.masked_fill(log_decay < LOG_DECAY_FLOOR, float("-inf")))


class _DecayedScores(torch.autograd.Function):
    """M[..., t, s] = scores[t, s] · exp(clamp(a_cum[t] − a_cum[s], floor, 0)): the intra-chunk matrix.

    scores (b, g, 1, c, Q, Q) are per group and already causally masked; a_cum (b, g, hg, c, Q)
    per head. A hand-written backward, because autograd's chain (sub → clamp → exp → broadcast
    mul) makes ~10 passes over the (heads, Q, Q) tensor and this one makes 5: with M saved,
    ∂L/∂(log-decay) = dM ⊙ M, which is already zero above the diagonal (masked scores) and
    negligible below the floor, so no masks are needed.
    """

    @staticmethod
    def forward(ctx, scores, a_cum):
        decay = (a_cum[..., :, None] - a_cum[..., None, :]).clamp_(LOG_DECAY_FLOOR, 0.0).exp_()
        M = scores * decay
        ctx.save_for_backward(decay, M)
        return M

    @staticmethod
    def backward(ctx, dM):
        decay, M = ctx.saved_tensors
        dscores = (dM * decay).sum(2, keepdim=True)
        dlog = dM * M
        return dscores, dlog.sum(-1) - dlog.sum(-2)


def segsum(a: torch.Tensor) -> torch.Tensor:
    """Stable segment sums: out[..., i, j] = a[..., j+1] + … + a[..., i] for j ≤ i, −inf above the diagonal.

    Formed by a cumsum over a masked copy rather than as cumsum[i] − cumsum[j], which
    loses precision once the running sum is large (long sequences with strong decay).
    Used for the small chunk-to-chunk matrix, where that matters and the cost does not.
    """
    T = a.shape[-1]
    ones = torch.ones(T, T, dtype=torch.bool, device=a.device)
    x = a[..., None, :].expand(*a.shape, T).transpose(-1, -2)  # x[..., i, j] = a[..., i]
    x = x.masked_fill(~torch.tril(ones, diagonal=-1), 0.0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(ones), float("-inf"))


def _fp32(fn):
    """Run the scan in fp32 even inside an autocast region (bf16 decay products lose the state)."""

    def wrapper(*args, **kwargs):
        device_type = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        with torch.autocast(device_type=device_type, enabled=False):
            return fn(*args, **kwargs)

    wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = fn.__name__, fn.__doc__, fn
    return wrapper


@_fp32
def ssd_chunked(
    x: torch.Tensor,  # (b, L, h, p)
    dt: torch.Tensor,  # (b, L, h), positive (after softplus)
    A: torch.Tensor,  # (h,), negative
    B: torch.Tensor,  # (b, L, g, n)
    C: torch.Tensor,  # (b, L, g, n)
    chunk_size: int,
    D: torch.Tensor | None = None,  # (h,)
    initial_state: torch.Tensor | None = None,  # (b, h, p, n)
    return_final_state: bool = False,
):
    """Chunked SSD scan. Returns y (b, L, h, p) in x's dtype, and the final state (b, h, p, n) fp32 if asked."""
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if h % g:
        raise ValueError(f"ngroups={g} must divide nheads={h}")
    hg = h // g
    Q = max(1, min(int(chunk_size), L))  # a chunk longer than the sequence only pads
    pad = (-L) % Q
    c = (L + pad) // Q
    out_dtype = x.dtype

    xf, dtf, Bf, Cf = x.float(), dt.float(), B.float(), C.float()
    if pad:  # padded steps get dt = 0: no decay, no input, so the final state is unchanged
        xf, dtf, Bf, Cf = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (xf, dtf, Bf, Cf))

    # Layouts: per-head tensors (b, g, hg, c, Q, ·); per-group tensors (b, g, 1, c, Q, ·).
    xdt = (xf * dtf[..., None]).view(b, c, Q, g, hg, p).permute(0, 3, 4, 1, 2, 5)
    a = (dtf * A.float()).view(b, c, Q, g, hg).permute(0, 3, 4, 1, 2)  # log-decay per step
    Bc = Bf.view(b, c, Q, g, n).permute(0, 3, 1, 2, 4).unsqueeze(2)
    Cc = Cf.view(b, c, Q, g, n).permute(0, 3, 1, 2, 4).unsqueeze(2)
    a_cum = torch.cumsum(a, dim=-1)  # (b, g, hg, c, Q), restarts at every chunk

    # 1. intra-chunk: y[t] = Σ_{s≤t} (C_t·B_s) exp(a_cum[t] − a_cum[s]) dt_s x_s.
    # The difference of chunk-local cumsums is bounded by one chunk's decay, as in the fused kernels.
    # The causal mask goes on the per-group scores; the per-head log-decays are clamped into
    # [floor, 0] (the acausal half, ≥ 0, becomes exp(0) = 1 and is zeroed by the mask).
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    scores = (Cc @ Bc.transpose(-1, -2)).masked_fill(~causal, 0.0)  # (b, g, 1, c, Q, Q), once per group
    y = _DecayedScores.apply(scores, a_cum) @ xdt  # (b, g, hg, c, Q, p)

    # 2. state contributed by each chunk, at its end: Σ_s exp(a_cum[-1] − a_cum[s]) B_s ⊗ dt_s x_s
    decay_to_end = torch.exp((a_cum[..., -1:] - a_cum).clamp_min(LOG_DECAY_FLOOR))  # (b, g, hg, c, Q)
    chunk_states = Bc.transpose(-1, -2) @ (xdt * decay_to_end[..., None])  # (b, g, hg, c, n, p)

    # 3. state passing: start_k = Σ_{m≤k} exp(S_k − S_m)·states_m, states_0 = initial state
    if initial_state is None:
        init = chunk_states.new_zeros(b, g, hg, 1, n, p)
    else:
        init = initial_state.float().view(b, g, hg, p, n).transpose(-1, -2).unsqueeze(3)
    states = torch.cat([init, chunk_states], dim=3)  # (b, g, hg, c+1, n, p)
    chunk_decay = _decay(segsum(F.pad(a_cum[..., -1], (1, 0))))  # (b, g, hg, c+1, c+1)
    states = (chunk_decay @ states.flatten(-2)).view(b, g, hg, c + 1, n, p)
    start_states, final_state = states[:, :, :, :-1], states[:, :, :, -1]

    # 4. inter-chunk: each step reads the state at its chunk's start, decayed up to the step
    y = y + (Cc @ start_states) * torch.exp(a_cum.clamp_min(LOG_DECAY_FLOOR))[..., None]

    y = y.permute(0, 3, 4, 1, 2, 5).reshape(b, c * Q, h, p)[:, :L]
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    y = y.to(out_dtype)
    if not return_final_state:
        return y
    return y, final_state.transpose(-1, -2).reshape(b, h, p, n)


@_fp32
def ssd_step(
    state: torch.Tensor,  # (b, h, p, n)
    x: torch.Tensor,  # (b, h, p)
    dt: torch.Tensor,  # (b, h)
    A: torch.Tensor,  # (h,)
    B: torch.Tensor,  # (b, g, n)
    C: torch.Tensor,  # (b, g, n)
    D: torch.Tensor | None = None,  # (h,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: state ← state·exp(dt·A) + dt·x⊗B, y = state·C + D·x. Returns (y (b, h, p), new state fp32)."""
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    xf, dtf = x.float(), dt.float()
    Bh = B.float().repeat_interleave(h // g, dim=1)  # (b, h, n)
    Ch = C.float().repeat_interleave(h // g, dim=1)
    dA = torch.exp(dtf * A.float())  # (b, h)
    new_state = state.float() * dA[..., None, None] + (dtf[..., None] * xf)[..., None] * Bh[:, :, None, :]
    y = (new_state @ Ch[..., None]).squeeze(-1)
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype), new_state


def ssd_reference(x, dt, A, B, C, D=None, initial_state=None):
    """Token-by-token recurrence (slow ground truth). Shapes as in `ssd_chunked`; returns (y, final state)."""
    b, L, h, p = x.shape
    n = B.shape[-1]
    state = x.new_zeros(b, h, p, n, dtype=torch.float32) if initial_state is None else initial_state.float()
    ys = []
    for t in range(L):
        y, state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        ys.append(y)
    return torch.stack(ys, dim=1), state
