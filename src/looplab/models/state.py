"""StateLoop's persistent per-token state (docs/formulations.md#stateloop).

    s_r = update(s_{r−1}, h_r)             the update rule (state_mode; a StateBranch subclass)
    s_r ← s_r + Mixer(Norm(s_r))           the cross-token mixer (state_mixer: none | attn | mamba2)
    x_{r+1} = h_r + W_o s_r

The update rule and the mixer are two axes, each a registry (models/registry.py STATE_UPDATES, STATE_MIXERS);
the names `stateloop_attn` and `stateloop_mamba2` are aliases of stateloop + attn / mamba2. StateLoop's own
update is selective, as in Mamba:

    u_r = W_u h_r                          Δ_r = softplus(W_Δ h_r + b_Δ)
    a_r = exp(−Δ_r ⊙ exp(A_log))           s_r = a_r ⊙ s_{r−1} + (1 − a_r) ⊙ u_r

with exp(A_log) ~ U[state_A_init] and softplus(b_Δ) ~ logU[state_dt_init] at init, so at start the state
keeps between exp(−16·0.1) ≈ 0.2 and exp(−1e-3) ≈ 1 of its past per loop, depending on the channel.

One StateBranch per model, shared across loops like the backbone. W_o is zero-initialised in every update
rule: an untrained StateLoop model computes exactly what Vanilla Looped computes. A subclass adds its own
parameters in `build_update`, computes `update`, and initialises them in `reset_update_parameters`; the parts
every rule shares (W_o, s_0, the mixer) keep their names, so checkpoints and common random numbers do not
depend on the rule (docs/extending.md#a-state-update).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from looplab.models.config import LoopedLMConfig
from looplab.models.llama import CausalSelfAttention, RMSNorm
from looplab.models.registry import STATE_MIXERS, STATE_UPDATES, ConfigError, Supports, Variant, options_of

_STATEFUL = Supports(
    parallel_loops="the StateLoop state is updated along the loops of one token, and the parallel schedule puts "
                   "each loop of a token at a different step; use state_mode=vanilla",
    depthwise_routed="a routed StateLoop state is not batched across loops; use schedule='lockstep'",
)


# ------------------------------------------------------------------ mixers
class StateMixer(Variant):
    """A cross-token mixer over the state sequence: `build` returns its module (None: no mixer), which takes
    (x, positions, valid, cache) like a block layer's mixer and allocates its own cache entry per loop."""

    @classmethod
    def build(cls, cfg: LoopedLMConfig) -> nn.Module | None:
        raise NotImplementedError

    @classmethod
    def validate(cls, cfg: LoopedLMConfig) -> None:
        """Refuse, naming the field, a state width this mixer cannot take."""


_MIXING = dict(compile="the StateLoop mixer has its own cache; decode with compile=False",
               depthwise="the StateLoop mixer is not batched across loops; use schedule='lockstep'")


@STATE_MIXERS.register("none")
class NoMixer(StateMixer):
    supports = Supports(parallel_loops=True, export=True)

    @classmethod
    def build(cls, cfg):
        return None


@STATE_MIXERS.register("attn")
class AttentionMixer(StateMixer):
    """One causal attention layer over the state sequence (n_heads heads of d_s / n_heads)."""

    supports = Supports(cache="kv", export=True, **_MIXING)

    @classmethod
    def build(cls, cfg):
        return CausalSelfAttention(cfg.state_dim, cfg.n_heads, cfg.n_heads, cfg.max_seq_len, cfg.rope_base)

    @classmethod
    def validate(cls, cfg):
        if cfg.state_dim % cfg.n_heads or (cfg.state_dim // cfg.n_heads) % 2:
            raise ConfigError(f"state_dim={cfg.state_dim} must split into n_heads={cfg.n_heads} heads of even width "
                              "for the attention mixer")


@STATE_MIXERS.register("mamba2")
class Mamba2StateMixer(StateMixer):
    """One Mamba-2 mixer over the state sequence (the backbone's Mamba-2 settings, width d_s)."""

    supports = Supports(cache="ssm", export="its Mamba-2 state mixer is not in the exported code", **_MIXING)

    @classmethod
    def build(cls, cfg):
        from looplab.models.mamba2 import Mamba2Mixer

        return Mamba2Mixer.from_config(cfg, d_model=cfg.state_dim)

    @classmethod
    def validate(cls, cfg):
        cfg.validate_mamba_fields()
        d_inner = cfg.expand * cfg.state_dim
        if d_inner % cfg.headdim:
            raise ConfigError(f"expand*state_dim={d_inner} is not divisible by headdim={cfg.headdim}")


# ------------------------------------------------------------------ update rules
@STATE_UPDATES.register("vanilla")
class NoState(Variant):
    """Vanilla looping: x_{r+1} = h_r, no state branch (no parameters, no state-dict keys)."""

    supports = Supports(parallel_loops=True, export=True)
    builds_state = False


class StateBranch(nn.Module, Variant):
    """The state branch around an update rule: s_0, the mixer and W_o. Subclasses define the rule."""

    supports = _STATEFUL
    builds_state = True
    carries_state = True  # False: s_{r−1} is replaced by s_0 at every loop (the reset ablation)

    def __init__(self, cfg: LoopedLMConfig):
        super().__init__()
        d, ds = cfg.d_model, cfg.state_dim
        self.cfg = cfg
        self.options = options_of(type(self), cfg.options.get("state_update"))
        self.build_update(d, ds)
        self.state_out = nn.Linear(ds, d, bias=False)  # W_o, zero at init
        self.s0 = nn.Parameter(torch.zeros(ds)) if cfg.state_init == "learned" else None
        self.mixer = STATE_MIXERS.get(cfg.state_mixer).build(cfg)
        self.mixer_norm = RMSNorm(ds, cfg.norm_eps) if self.mixer is not None else None
        self.reset_special_parameters()

    # ---------------------------------------------------------- the rule
    def build_update(self, d: int, ds: int) -> None:
        """Create the rule's parameters (h has width d, the state d_s)."""
        raise NotImplementedError

    def update(self, h: torch.Tensor, s_prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h_r (B, T, d), s_{r−1} (B, T, d_s)) → (s_r, the retention: how much of s_{r−1} each channel kept)."""
        raise NotImplementedError

    def reset_update_parameters(self, generator: torch.Generator | None = None) -> None:
        """Initialise what LoopedLM's generic init must not (it has drawn every 2-D weight already)."""

    def update_flops(self, d: int, ds: int) -> int:
        """Forward FLOPs per token of the rule itself."""
        return 2 * 2 * d * ds + 8 * ds

    # ---------------------------------------------------------- shared
    @torch.no_grad()
    def reset_special_parameters(self, generator: torch.Generator | None = None) -> None:
        """Called by LoopedLM after its generic init, which must not touch these (generator: the
        branch's own, models/rng.py; None: the global one)."""
        self.reset_update_parameters(generator)
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
        if not self.carries_state:
            s_prev = self.initial_state(h)
        s, a = self.update(h, s_prev)
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
        flops = self.update_flops(d, ds) + 2 * d * ds  # the rule + W_o
        if self.mixer is not None:
            if hasattr(self.mixer, "flops_per_token"):
                flops += self.mixer.flops_per_token(seq_len)
            else:  # attention mixer: projections + QKᵀ/AV (over every key, or causally: models/flops.py)
                from looplab.models.flops import attention_keys

                flops += 2 * sum(p.numel() for p in self.mixer.parameters() if p.dim() == 2) + 4 * attention_keys(seq_len) * ds
        return flops


@STATE_UPDATES.register("stateloop")
class SelectiveState(StateBranch):
    """StateLoop's selective update: s_r = a_r ⊙ s_{r−1} + (1 − a_r) ⊙ W_u h_r, a_r = exp(−softplus(W_Δ h_r + b_Δ) ⊙ exp(A_log))."""

    supports = replace(_STATEFUL, export=True)

    def build_update(self, d, ds):
        self.in_proj = nn.Linear(d, ds, bias=False)  # W_u
        self.dt_proj = nn.Linear(d, ds, bias=True)  # W_Δ, b_Δ
        self.A_log = nn.Parameter(torch.zeros(ds))

    def update(self, h, s_prev):
        u = self.in_proj(h)
        dt = F.softplus(self.dt_proj(h))
        a = torch.exp(-dt * torch.exp(self.A_log))
        return a * s_prev + (1 - a) * u, a

    def reset_update_parameters(self, generator=None):
        lo, hi = self.cfg.state_A_init
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(lo, hi, generator=generator).log())
        lo, hi = self.cfg.state_dt_init
        dt = torch.exp(torch.empty_like(self.dt_proj.bias).uniform_(math.log(lo), math.log(hi), generator=generator))
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


@STATE_UPDATES.register("stateloop_reset")
class ResetState(SelectiveState):
    """The ablation: the selective update with s_{r−1} replaced by s_0 at every loop (nothing carried across loops)."""

    supports = replace(_STATEFUL, export=True)

    carries_state = False

