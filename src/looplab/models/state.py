"""StateLoop's persistent per-token state (docs/formulations.md#stateloop).

    u_r = W_u h_r                          Δ_r = softplus(W_Δ h_r + b_Δ)
    a_r = exp(−Δ_r ⊙ exp(A_log))           s_r = a_r ⊙ s_{r−1} + (1 − a_r) ⊙ u_r
    s_r ← s_r + Mixer(Norm(s_r))           x_{r+1} = h_r + W_o s_r

One StateBranch per model, shared across loops like the backbone block. The
retention a_r is a selective (input-dependent) exponential decay as in Mamba:
exp(A_log) ~ U[state_A_init] and softplus(b_Δ) ~ logU[state_dt_init] at init,
so at start the state keeps between exp(−16·0.1) ≈ 0.2 and exp(−1e-3) ≈ 1 of
its past per loop, depending on the channel. W_o is zero-initialised: an
untrained StateLoop model computes exactly what Vanilla Looped computes.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from looplab.models.config import LoopedLMConfig
from looplab.models.llama import CausalSelfAttention, RMSNorm


def _build_mixer(cfg: LoopedLMConfig) -> nn.Module | None:
    if cfg.state_mode == "stateloop_attn":
        return CausalSelfAttention(cfg.state_dim, cfg.n_heads, cfg.n_heads, cfg.max_seq_len, cfg.rope_base)
    if cfg.state_mode == "stateloop_mamba2":
        from looplab.models.mamba2 import Mamba2Mixer

        return Mamba2Mixer.from_config(cfg, d_model=cfg.state_dim)
    return None


class StateBranch(nn.Module):
    def __init__(self, cfg: LoopedLMConfig):
        super().__init__()
        d, ds = cfg.d_model, cfg.state_dim
        self.cfg = cfg
        self.reset_each_loop = cfg.state_mode == "stateloop_reset"
        self.in_proj = nn.Linear(d, ds, bias=False)  # W_u
        self.dt_proj = nn.Linear(d, ds, bias=True)  # W_Δ, b_Δ
        self.A_log = nn.Parameter(torch.zeros(ds))
        self.state_out = nn.Linear(ds, d, bias=False)  # W_o, zero at init
        self.s0 = nn.Parameter(torch.zeros(ds)) if cfg.state_init == "learned" else None
        self.mixer = _build_mixer(cfg)
        self.mixer_norm = RMSNorm(ds, cfg.norm_eps) if self.mixer is not None else None
        self.reset_special_parameters()

    @torch.no_grad()
    def reset_special_parameters(self, generator: torch.Generator | None = None) -> None:
        """Called by LoopedLM after its generic init, which must not touch these (generator: the
        branch's own, models/rng.py; None: the global one)."""
        lo, hi = self.cfg.state_A_init
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(lo, hi, generator=generator).log())
        lo, hi = self.cfg.state_dt_init
        dt = torch.exp(torch.empty_like(self.dt_proj.bias).uniform_(math.log(lo), math.log(hi), generator=generator))
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.state_out.weight.zero_()

    def initial_state(self, h: torch.Tensor) -> torch.Tensor:
        B, T, _ = h.shape
        if self.s0 is None:
            return h.new_zeros(B, T, self.cfg.state_dim)
        return self.s0.to(h.dtype).expand(B, T, -1)

    def forward(
        self,
        h: torch.Tensor,  # (B, T, d): this loop's block output h_r
        s_prev: torch.Tensor,  # (B, T, d_s)
        positions: torch.Tensor,
        valid: torch.Tensor | None = None,
        cache=None,
        call=None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (s_r, x_{r+1} = h_r + W_o s_r, retention a_r).

        call(module, key, x, positions, valid, cache): how the mixer is applied (the exit reference's frozen
        inputs, models/exit_compute.py: tokens that exited at an earlier loop feed the mixer their exit-loop
        input, as the backbone layers do)."""
        if self.reset_each_loop:
            s_prev = self.initial_state(h)
        u = self.in_proj(h)
        dt = F.softplus(self.dt_proj(h))
        a = torch.exp(-dt * torch.exp(self.A_log))
        s = a * s_prev + (1 - a) * u
        if self.mixer is not None:
            m_in = self.mixer_norm(s)
            if call is None:
                s = s + self.mixer(m_in, positions, valid, cache)
            else:
                s = s + call(self.mixer, "state", m_in, positions, valid, cache)
        return s, h + self.state_out(s), a

    def allocate_cache(self, batch_size, max_len, device, dtype):
        if self.mixer is None:
            return None
        return self.mixer.allocate_cache(batch_size, max_len, device, dtype)

    def flops_per_token(self, seq_len: int) -> int:
        d, ds = self.cfg.d_model, self.cfg.state_dim
        flops = 2 * (3 * d * ds) + 8 * ds  # W_u, W_Δ, W_o matmuls + the gate's elementwise work
        if self.mixer is not None:
            if hasattr(self.mixer, "flops_per_token"):
                flops += self.mixer.flops_per_token(seq_len)
            else:  # attention mixer: projections + QKᵀ/AV
                flops += 2 * sum(p.numel() for p in self.mixer.parameters() if p.dim() == 2) + 4 * seq_len * ds
        return flops
