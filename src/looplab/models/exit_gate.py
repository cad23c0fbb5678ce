"""Ouro-style exit gate (docs/formulations.md#exit-gate): which loop's output a token uses.

Per token and loop t = 1..R:  λ_t = σ(w·FinalNorm(z_t) + b),  S_t = Π_{j≤t}(1 − λ_j),
p(t) = λ_t·S_{t−1} for t < R and p(R) = S_{R−1}, so p sums to one by construction
(λ_R is never used). z_t is the loop's readout, the same vector the head reads.

Indexing used throughout (tested): `lambdas[..., t-1]` is λ_t, the gate evaluated
after loop t. In stage 2 the gate after loop t−1 decides between stopping at
t−1 and continuing to t, so its continue-probability 1 − λ_{t−1} is trained
toward w_t = σ(k·(I_t − γ)), I_t = max(0, L^(t−1) − L^(t)).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from looplab.models.registry import EXIT_GATES, Supports, Variant


@EXIT_GATES.register("none")
class NoExitGate(Variant):
    """Every token reads the last loop (zero-shot exit rules still apply): no module, no parameters."""

    supports = Supports(parallel_loops=True, export=True)


@EXIT_GATES.register("ouro")
class ExitGate(nn.Module, Variant):
    """λ_t = σ(w·FinalNorm(z_t) + b): Ouro's gate, one linear map shared by every loop."""

    supports = Supports(
        parallel_loops="an exit picks a loop of the same token, and under the parallel schedule loop r of a token "
                       "finishes at a later step than loop r−1; use exit_gate=none",
        routing="a router and an exit gate both choose the depth; combine them with exit_gate=none only",
        export=True)

    def __init__(self, d_model: int):
        super().__init__()
        self.proj = nn.Linear(d_model, 1, bias=True)

    # λ, the survival S_t and p(t) are float32 in every path (forward, the exit reference, skip decoding, depth-wise
    # serving): exit depths are a threshold on a running product, and a bf16 product in one path against a float32
    # one in another picked other depths for a few tokens
    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """normed (..., d) → λ (...) in (0, 1), float32."""
        return torch.sigmoid(self.logit(normed))

    def logit(self, normed: torch.Tensor) -> torch.Tensor:
        return self.proj(normed).squeeze(-1).float()


def exit_distribution(lambdas: torch.Tensor) -> torch.Tensor:
    """lambdas (..., R) → p (..., R): p(t) = λ_t S_{t−1} (t < R), p(R) = S_{R−1}."""
    R = lambdas.shape[-1]
    survival = torch.cumprod(1 - lambdas, dim=-1)  # S_1..S_R
    prev = torch.cat([torch.ones_like(survival[..., :1]), survival[..., :-1]], dim=-1)  # S_0..S_{R−1}
    if R == 1:
        return torch.ones_like(lambdas)
    return torch.cat([lambdas[..., :-1] * prev[..., :-1], prev[..., -1:]], dim=-1)


def threshold_exit_steps(exit_probs: torch.Tensor, q: float) -> torch.Tensor:
    """First 1-based depth t with CDF(t) ≥ q, else R. exit_probs (..., R) → (...) long."""
    R = exit_probs.shape[-1]
    cdf = exit_probs.cumsum(-1)
    hit = cdf >= q
    first = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(hit[..., 0], R - 1, dtype=torch.long))
    return first.long() + 1


def logits_at_depth(loop_logits: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Per-token readout at a chosen depth: loop_logits (R, B, T, V), steps (B, T) 1-based → (B, T, V)."""
    idx = (steps - 1)[None, ..., None].expand(1, *steps.shape, loop_logits.shape[-1])
    return loop_logits.gather(0, idx)[0]


def entropy(p: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    return -(p * torch.log(p.clamp_min(eps))).sum(-1)


def stage1_loss(loop_losses: torch.Tensor, exit_probs: torch.Tensor, beta: float = 0.1,
                final_loop_weight: float = 0.0, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_t p(t)·L^(t) − β·H(p) + w·L^(R), averaged over tokens.

    loop_losses (R, N) per-token cross-entropy from each depth; exit_probs (N, R). weights (N,): the average's
    token weights instead of 1/N (training: 1/n at the n supervised tokens, 0 elsewhere — no mask indexing).
    w = 0 is Ouro's objective. With w > 0 the deepest loop keeps a full-weight loss whatever
    the gate does: the expected loss alone gives loop R only p(R) of the gradient, and a task
    that needs all R loops (p-hop) can then stall at the shallow loops' accuracy.
    """
    expected = (exit_probs * loop_losses.transpose(0, 1)).sum(-1)
    per_token = expected - beta * entropy(exit_probs) + final_loop_weight * loop_losses[-1]
    return per_token.mean() if weights is None else (per_token * weights).sum()


def stage2_targets(loop_losses: torch.Tensor, k: float = 50.0, gamma: float = 0.005) -> torch.Tensor:
    """w_t = σ(k·(I_t − γ)) for t = 2..R, I_t = max(0, L^(t−1) − L^(t)) detached. (R, N) → (R−1, N)."""
    L = loop_losses.detach()
    improvement = (L[:-1] - L[1:]).clamp_min(0)
    return torch.sigmoid(k * (improvement - gamma))


def stage2_loss(loop_losses: torch.Tensor, gate_logits: torch.Tensor, k: float = 50.0, gamma: float = 0.005,
                weights: torch.Tensor | None = None) -> torch.Tensor:
    """BCE between the continue-probability 1 − λ_{t−1} and w_t, mean over tokens and t = 2..R.

    gate_logits (N, R): logit of λ_t; 1 − σ(x) = σ(−x), so the continue logit is −x. weights (N,): the token
    weights of the mean over tokens instead of 1/N (as stage1_loss's).
    """
    targets = stage2_targets(loop_losses, k, gamma)  # (R−1, N)
    continue_logits = -gate_logits[:, :-1].transpose(0, 1)  # gates after loops 1..R−1
    if weights is None:
        return F.binary_cross_entropy_with_logits(continue_logits, targets)
    bce = F.binary_cross_entropy_with_logits(continue_logits, targets, reduction="none")  # (R−1, N)
    return (bce.mean(0) * weights).sum()
