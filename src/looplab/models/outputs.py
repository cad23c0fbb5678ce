"""What a LoopedLM forward returns. Its own module, so that the decoders and the exit reference
(models/exit_compute.py), which the model calls, can build one without importing the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LoopedLMOutput"]


@dataclass
class LoopedLMOutput:
    logits: torch.Tensor | None  # (B, T, V); None from a forward given targets (token_loss instead)
    loop_logits: torch.Tensor | None = None  # (R, B, T, V)
    loop_hidden: torch.Tensor | None = None  # (R, B, T, d), after the shared final norm
    exit_probs: torch.Tensor | None = None  # (B, T, R)
    exit_gate_logits: torch.Tensor | None = None  # (B, T, R): logit of λ_t
    exit_steps: torch.Tensor | None = None  # (B, T), 1-based depth used per token
    diagnostics: dict[str, list[float]] = field(default_factory=dict)
    routing: Any = None  # models/router.RoutingInfo with depth_router (aux losses, per-token depth), else None
    token_loss: torch.Tensor | None = None  # (B, T) fp32 cross-entropy, 0 at ignored targets: forward(targets=...)
    loop_token_loss: torch.Tensor | None = None  # (R, B, T): the same at every depth (with return_all_loops)
