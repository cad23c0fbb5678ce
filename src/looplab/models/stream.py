"""The stream a looped model's loops carry through one call (models/looped.py: `LoopedLM.run_loops`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class Stream:
    """What the loops carry through one call, every tensor (b, T, ·) for the call's b rows.

    x: the next loop's input; e: the prelude's output (what injection re-injects); s: the StateLoop state
    (None without one); h: the last loop's block output (None before the first loop); positions (b|1, T)
    and valid (b, T) (None = every token real) of the call's tokens; retention: the last loop's StateLoop
    a_r (diagnostics)."""

    x: torch.Tensor
    e: torch.Tensor
    s: torch.Tensor | None
    h: torch.Tensor | None
    positions: torch.Tensor
    valid: torch.Tensor | None
    retention: torch.Tensor | None = None

    def select(self, idx: torch.Tensor) -> "Stream":
        """Rows idx (b′,) of the call."""
        def rows(t):
            return None if t is None else (t if t.shape[0] == 1 and self.x.shape[0] != 1 else t[idx])
        return Stream(self.x[idx], self.e[idx], rows(self.s), rows(self.h), rows(self.positions), rows(self.valid))

    def merge(self, idx: torch.Tensor, sub: "Stream") -> "Stream":
        """This stream with rows idx replaced by sub's (out of place)."""
        def put(t, part):
            if part is None:
                return t
            base = self.x if t is None else t  # no loop ran yet: a row reads its input (as a routed token does)
            return base.index_copy(0, idx, part)
        return replace(self, x=put(self.x, sub.x), s=put(self.s, sub.s), h=put(self.h, sub.h), retention=None)
