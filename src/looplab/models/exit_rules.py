"""Exit rules: at which loop a token stops (docs/formulations.md#exit-rules).

One rule decides, per token, after each loop t whether to stop there. Every rule looks only at
loops 1..t, so the same decision can be taken online while decoding (loop by loop) or read off
afterwards from all R loops (scoring, evaluation); `first_exit` is the latter and is defined
through `ExitRule.stops`, the per-loop decision, so the two cannot drift apart.

    rule            stops after loop t when                                        threshold
    gate            the learned Ouro gate's CDF(t) = Σ_{j≤t} p(j) ≥ q              q in (0, 1]
    kl              KL(p_t ‖ p_{t−1}) < τ  (t ≥ 2; next-token distributions)        τ in nats
    entropy         H(p_t) < τ                                                      τ in nats
    hidden_delta    ‖z_t − z_{t−1}‖ / ‖z_t‖ < τ  (t ≥ 2; final-normed readouts)       τ ≥ 0
    argmax_stable   argmax p_t equals argmax of the k loops before it (t ≥ k + 1)   k ≥ 1 (integer)

The zero-shot rules (kl, entropy, hidden_delta, argmax_stable) follow Huginn's; they need no
trained gate. A token stops no earlier than `min_loops` and always at R.

Each rule is a registered class (models/registry.py: EXIT_RULES) that says what it reads — the gate's exit
distribution, the loops' logits or their final-normed readouts — so that every decoder computes only that,
and a researcher's rule (docs/extending.md#an-exit-rule) runs in every decoder unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from looplab.models.registry import EXIT_RULES, ConfigError, Variant, refuse_as_config_error

READS = ("exit_probs", "logits", "hidden")


class ExitRule(Variant):
    """Stops a token after loop t from what loops 1..t produced. `reads` names that input:
    "exit_probs" (the gate's p(1..t), (..., ≥t)), "logits" ((t, ..., V)) or "hidden" (final-normed readouts, (t, ..., d)).
    `example_thresholds`: thresholds worth trying (docs, and the conformance kit, which picks the one that makes a
    tiny random model's tokens exit at the most mixed depths)."""

    reads: str = "logits"
    example_thresholds: tuple[float, ...] = ()

    @classmethod
    def check_threshold(cls, threshold: float) -> None:
        """Refuse a threshold this rule cannot take, naming it (the number check is done already)."""

    @classmethod
    def stops(cls, t: int, threshold: float, inputs: torch.Tensor) -> torch.Tensor:
        """Whether each token stops after loop t (1-based), from `inputs` (what `reads` names) over loops 1..t →
        bool (...)."""
        raise NotImplementedError

    @staticmethod
    def never(inputs: torch.Tensor, lead: int = 1, trail: int = 1) -> torch.Tensor:
        """No token stops (a rule that needs more loops than have run)."""
        shape = inputs.shape[lead:inputs.dim() - trail]
        return torch.zeros(shape, dtype=torch.bool, device=inputs.device)


@EXIT_RULES.register("gate")
class GateRule(ExitRule):
    reads = "exit_probs"
    example_thresholds = (0.3, 0.5, 0.7, 0.9)

    @classmethod
    def check_threshold(cls, threshold):
        # q is a level of the exit CDF: 0 stops every token at exit_min_loops, q > 1 reads the last loop (1.01 is
        # the sweeps' "no exit" row); below 0 it would stop every token too, which no one means
        if threshold < 0:
            raise ConfigError(f"exit_threshold={threshold!r} must be >= 0: the gate's q is a level of the exit "
                              "distribution's CDF (0: every token stops at exit_min_loops; above 1: the last loop)")

    @classmethod
    def stops(cls, t, threshold, inputs):
        return inputs[..., :t].sum(-1) >= threshold


class NonNegativeThreshold(ExitRule):
    """A rule whose threshold is a divergence, an entropy or a relative distance: any number >= 0."""

    @classmethod
    def check_threshold(cls, threshold):
        if threshold < 0:
            raise ValueError(f"exit_threshold={threshold!r}: rule {cls.name!r} takes a threshold >= 0")


@EXIT_RULES.register("kl")
class KLRule(NonNegativeThreshold):
    example_thresholds = (0.001, 0.01, 0.05, 0.2, 1.0)

    @classmethod
    def stops(cls, t, threshold, inputs):
        if t < 2:
            return cls.never(inputs)
        logp = F.log_softmax(inputs[t - 1].float(), dim=-1)
        prev = F.log_softmax(inputs[t - 2].float(), dim=-1)
        return (logp.exp() * (logp - prev)).sum(-1) < threshold


@EXIT_RULES.register("entropy")
class EntropyRule(NonNegativeThreshold):
    example_thresholds = (1.0, 2.0, 3.0, 3.5, 4.0, 4.1)

    @classmethod
    def stops(cls, t, threshold, inputs):
        logp = F.log_softmax(inputs[t - 1].float(), dim=-1)
        return -(logp.exp() * logp).sum(-1) < threshold


@EXIT_RULES.register("hidden_delta")
class HiddenDeltaRule(NonNegativeThreshold):
    reads = "hidden"
    example_thresholds = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)

    @classmethod
    def stops(cls, t, threshold, inputs):
        if t < 2:
            return cls.never(inputs)
        delta = (inputs[t - 1] - inputs[t - 2]).float().norm(dim=-1)
        return delta < threshold * inputs[t - 1].float().norm(dim=-1).clamp_min(1e-12)


@EXIT_RULES.register("argmax_stable")
class ArgmaxStableRule(ExitRule):
    example_thresholds = (1, 2)

    @classmethod
    def check_threshold(cls, threshold):
        if threshold < 1 or threshold != int(threshold):
            raise ValueError(f"exit_threshold={threshold!r}: argmax_stable takes an integer k >= 1 (loops without a "
                             "change)")

    @classmethod
    def stops(cls, t, threshold, inputs):
        k = int(threshold)
        if t < k + 1:
            return cls.never(inputs)
        top = inputs[t - k - 1:t].argmax(-1)  # (k + 1, ...)
        return (top == top[-1]).all(0)


def get_rule(rule: str | None) -> type[ExitRule]:
    """The registered rule class (None = "gate")."""
    cls = EXIT_RULES.get(rule or "gate")
    if getattr(cls, "reads", None) not in READS:
        raise ValueError(f"exit_rule={rule!r}: its class must set reads to one of {READS}")
    return cls


def zero_shot_rules() -> tuple[str, ...]:
    """The registered rules that need no trained gate."""
    return tuple(name for name, cls in EXIT_RULES.items() if cls.reads != "exit_probs")


def check_rule(rule: str, threshold: float, min_loops: int, n_loops: int) -> None:
    """Clear errors, naming the bad value, before anything runs."""
    cls = get_rule(rule)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
        raise ValueError(f"exit_threshold={threshold!r} must be a number")
    # a researcher's rule may refuse with a plain ValueError, naming the value or not: it is still bad input
    try:
        refuse_as_config_error(cls.check_threshold, threshold)
    except ConfigError as e:
        if "exit_threshold" in str(e):
            raise
        raise ConfigError(f"exit_threshold={threshold!r} with exit_rule={cls.name!r}: {e}") from e
    if isinstance(min_loops, bool) or not isinstance(min_loops, int) or not 1 <= min_loops <= n_loops:
        raise ValueError(f"exit_min_loops={min_loops!r} must be an integer in 1..{n_loops}")


def stops_at(rule: str, t: int, threshold: float, *, logits: torch.Tensor | None = None,
             hidden: torch.Tensor | None = None, exit_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Whether each token stops after loop t (1-based), from loops 1..t only: the rule reads its own input
    (logits (t, ..., V), hidden (t, ..., d) or exit_probs (..., ≥t)). Returns a bool tensor of shape (...)."""
    cls = get_rule(rule)
    inputs = {"exit_probs": exit_probs, "logits": logits, "hidden": hidden}[cls.reads]
    if inputs is None:
        if cls.reads == "exit_probs":
            raise ValueError(f"exit_rule={rule!r} needs a model with an exit gate (exit_gate=ouro)")
        raise ValueError(f"exit_rule={rule!r} reads the loops' {cls.reads}, which were not given")
    return cls.stops(t, threshold, inputs)


def first_exit(rule: str, threshold: float, n_loops: int, *, min_loops: int = 1, logits: torch.Tensor | None = None,
               hidden: torch.Tensor | None = None, exit_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Per token, the first loop t ≥ min_loops at which the rule stops it, else R (1-based, long).

    logits (R, B, T, V), hidden (R, B, T, d), exit_probs (B, T, R) → (B, T).
    """
    check_rule(rule, threshold, min_loops, n_loops)
    ref = exit_probs[..., 0] if exit_probs is not None else (logits if logits is not None else hidden)[0, ..., 0]
    steps = torch.full(ref.shape, n_loops, dtype=torch.long, device=ref.device)
    for t in range(n_loops - 1, min_loops - 1, -1):  # last to first, so the earliest stop wins
        stop = stops_at(rule, t, threshold, logits=logits, hidden=hidden, exit_probs=exit_probs)
        steps = torch.where(stop, torch.full_like(steps, t), steps)
    return steps
