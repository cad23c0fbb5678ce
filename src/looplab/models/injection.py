"""Input injection (docs/formulations.md#input-injection): the embedding output e = h_0 re-enters the stream before every loop after the first.

    none     x_{r+1} = x_{r+1}                                  (today)
    add      x_{r+1} = x_{r+1} + W_in e                         W_in = 0 at init
    concat   x_{r+1} = W_c [x_{r+1}; e]                         W_c = [I, 0] at init (Huginn's adapter)
    diag     x_{r+1} = x_{r+1} + tanh(g) ⊙ e                    g = 0 at init; each channel's gain in (−1, 1) (Parcae)

Every mode computes exactly the un-injected model at init, so an untrained injected model equals
Vanilla Looped (or StateLoop) and a checkpoint without injection warm-starts one. Shared across
loops like the block. Parameters are created without drawing random numbers (LoopedLM's generic
init skips them too), so a seeded model's other parameters equal the un-injected model's. Where it sits in the loop (after the state branch, after the readout) is
documented in models/looped.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from looplab.models.registry import INJECTIONS, Supports, Variant, options_of

# the parallel schedule re-enters the embedding itself (loop_mix a·E), so no injection runs under it
_INJECTING = Supports(parallel_loops="the parallel schedule has its own embedding term (loop_mix a·E); use "
                      "injection=none")
# looplab's own injections: the exported code (remote_code/modeling_looplab.py) computes each of them
_EXPORTED = replace(_INJECTING, export=True)


class Injection(nn.Module, Variant):
    """x_{r+1} ← Inject(x_{r+1}, e) before loops 2..R; must compute the un-injected model at init, drawing no random
    numbers (so a seeded model's other parameters equal the un-injected model's).

    Built as `cls(d_model)`, or `cls(d_model, options)` when the class declares `Options` (options: its instance,
    from `loop_depth.injection_options`). `forward(x, e)`: x (B, T, d) the stream entering the next loop (after the
    state branch), e (B, T, d) the embedding output (after the prelude, if any)."""

    supports = _INJECTING

    @torch.no_grad()
    def reset_special_parameters(self, generator: torch.Generator | None = None) -> None:
        """Back to the un-injected model (LoopedLM's generic init skips injection parameters)."""

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def flops_per_token(self) -> int:
        return 0


@INJECTIONS.register("none")
class NoInjection(Variant):
    """The stream goes on as it is: no module, no parameters, no state-dict keys."""

    supports = Supports(parallel_loops=True, export=True)


@INJECTIONS.register("add")
class AddInjection(Injection):
    supports = _EXPORTED

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d, d))  # W_in

    @torch.no_grad()
    def reset_special_parameters(self, generator: torch.Generator | None = None) -> None:  # draws nothing
        self.weight.zero_()

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return x + F.linear(e, self.weight)

    def flops_per_token(self) -> int:
        d = self.weight.shape[0]
        return 2 * d * d + d


@INJECTIONS.register("concat")
class ConcatInjection(Injection):
    supports = _EXPORTED

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d, 2 * d))  # W_c over [x; e]
        self.reset_special_parameters()

    @torch.no_grad()
    def reset_special_parameters(self, generator: torch.Generator | None = None) -> None:  # draws nothing
        d = self.weight.shape[0]
        self.weight.zero_()
        self.weight[:, :d].copy_(torch.eye(d))

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.cat([x, e], dim=-1), self.weight)

    def flops_per_token(self) -> int:
        return 2 * self.weight.numel()


@INJECTIONS.register("diag")
class DiagInjection(Injection):
    supports = _EXPORTED

    def __init__(self, d: int):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(d))  # g; the gain tanh(g) is bounded in (−1, 1)

    @torch.no_grad()
    def reset_special_parameters(self, generator: torch.Generator | None = None) -> None:  # draws nothing
        self.gate.zero_()

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.gate).to(x.dtype) * e

    def flops_per_token(self) -> int:
        return 2 * self.gate.numel()


def build_injection(cfg) -> nn.Module | None:
    """The injection module of cfg.injection (None: "none", or any mode that is not a module), given its options
    (cfg.options["injection"], over the defaults of its Options) when it declares any."""
    cls = INJECTIONS.get(cfg.injection)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return None
    if getattr(cls, "Options", None) is None:
        return cls(cfg.d_model)
    return cls(cfg.d_model, options_of(cls, cfg.options.get("injection")))
