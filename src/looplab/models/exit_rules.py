"""Exit rules: at which loop a token stops (docs/formulations.md#exit-rules).

One rule decides, per token, after each loop t whether to stop there. Every rule looks only at
loops 1..t, so the same decision can be taken online while decoding (loop by loop) or read off
afterwards from all R loops (scoring, evaluation); `first_exit` is the latter and is defined
through `stops_at`, the per-loop decision, so the two cannot drift apart.

    rule            stops after loop t when                                        threshold
    gate            the learned Ouro gate's CDF(t) = Σ_{j≤t} p(j) ≥ q              q in (0, 1]
    kl              KL(p_t ‖ p_{t−1}) < τ  (t ≥ 2; next-token distributions)        τ in nats
    entropy         H(p_t) < τ                                                      τ in nats
    hidden_delta    ‖z_t − z_{t−1}‖ / ‖z_t‖ < τ  (t ≥ 2; final-normed readouts)       τ ≥ 0
    argmax_stable   argmax p_t equals argmax of the k loops before it (t ≥ k + 1)   k ≥ 1 (integer)

The zero-shot rules (kl, entropy, hidden_delta, argmax_stable) follow Huginn's; they need no
trained gate. A token stops no earlier than `min_loops` and always at R.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EXIT_RULES = ("gate", "kl", "entropy", "hidden_delta", "argmax_stable")


def check_rule(rule: str, threshold: float, min_loops: int, n_loops: int) -> None:
    """Clear errors, naming the bad value, before anything runs."""
    if rule not in EXIT_RULES:
        raise ValueError(f"exit_rule={rule!r} is unknown; choose one of {EXIT_RULES}")
    if not isinstance(threshold, (int, float)) or math.isnan(threshold):
        raise ValueError(f"exit_threshold={threshold!r} must be a number")
    if rule == "argmax_stable" and (threshold < 1 or threshold != int(threshold)):
        raise ValueError(f"exit_threshold={threshold!r}: argmax_stable takes an integer k >= 1 (loops without a change)")
    if rule in ("kl", "entropy", "hidden_delta") and threshold < 0:
        raise ValueError(f"exit_threshold={threshold!r}: rule {rule!r} takes a threshold >= 0")
    if not isinstance(min_loops, int) or not 1 <= min_loops <= n_loops:
        raise ValueError(f"exit_min_loops={min_loops!r} must be an integer in 1..{n_loops}")


def stops_at(rule: str, t: int, threshold: float, *, logits: torch.Tensor | None = None,
             hidden: torch.Tensor | None = None, exit_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Whether each token stops after loop t (1-based), from loops 1..t only.

    logits (t, ..., V) and hidden (t, ..., d): the readouts of loops 1..t (only the rule's own input is
    needed); exit_probs (..., ≥t): the gate's exit distribution. Returns a bool tensor of shape (...).
    """
    if rule == "gate":
        if exit_probs is None:
            raise ValueError("exit_rule='gate' needs a model with an exit gate (exit_gate=ouro)")
        return exit_probs[..., :t].sum(-1) >= threshold
    if rule == "hidden_delta":
        if t < 2:
            return torch.zeros(hidden.shape[1:-1], dtype=torch.bool, device=hidden.device)
        delta = (hidden[t - 1] - hidden[t - 2]).float().norm(dim=-1)
        return delta < threshold * hidden[t - 1].float().norm(dim=-1).clamp_min(1e-12)
    logp = F.log_softmax(logits[t - 1].float(), dim=-1)
    if rule == "entropy":
        return -(logp.exp() * logp).sum(-1) < threshold
    if rule == "kl":
        if t < 2:
            return torch.zeros(logp.shape[:-1], dtype=torch.bool, device=logp.device)
        prev = F.log_softmax(logits[t - 2].float(), dim=-1)
        return (logp.exp() * (logp - prev)).sum(-1) < threshold
    if rule == "argmax_stable":
        k = int(threshold)
        if t < k + 1:
            return torch.zeros(logp.shape[:-1], dtype=torch.bool, device=logp.device)
        top = logits[t - k - 1:t].argmax(-1)  # (k + 1, ...)
        return (top == top[-1]).all(0)
    raise ValueError(f"exit_rule={rule!r} is unknown; choose one of {EXIT_RULES}")


def first_exit(rule: str, threshold: float, n_loops: int, *, min_loops: int = 1, logits: torch.Tensor | None = None,
               hidden: torch.Tensor | None = None, exit_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Per token, the first loop t ≥ min_loops at which `stops_at` holds, else R (1-based, long).

    logits (R, B, T, V), hidden (R, B, T, d), exit_probs (B, T, R) → (B, T).
    """
    check_rule(rule, threshold, min_loops, n_loops)
    ref = exit_probs[..., 0] if exit_probs is not None else (logits if logits is not None else hidden)[0, ..., 0]
    steps = torch.full(ref.shape, n_loops, dtype=torch.long, device=ref.device)
    for t in range(n_loops - 1, min_loops - 1, -1):  # last to first, so the earliest stop wins
        stop = stops_at(rule, t, threshold, logits=logits, hidden=hidden, exit_probs=exit_probs)
        steps = torch.where(stop, torch.full_like(steps, t), steps)
    return steps
