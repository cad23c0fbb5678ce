"""Randomized training depth (docs/formulations.md#randomized-training-depth): how many loops one optimizer step runs.

    fixed               R (today)
    uniform             U{min_loops, …, max_loops}
    poisson_lognormal   τ ~ N(log R − σ²/2, σ),  depth = clamp(Poisson(e^τ), min_loops, max_loops)

The log-normal Poisson is Huginn's (recurrent-depth pretraining): E[e^τ] = R, so the unclamped
mean is R and the tail reaches well past it. Each draw comes from a fresh generator seeded by
(run seed, global step): every rank draws the same depth with nothing to synchronise, and a
resumed run draws the depths the original run drew (no RNG state in the checkpoint).

`backprop_loops = k` runs the loops before the last k of each forward under no_grad (the
model's `backprop_loops=` argument); FLOPs then count the backward of min(k, depth) loops only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

SAMPLERS = ("fixed", "uniform", "poisson_lognormal")


def step_rng(seed: int, step: int, *keys: int) -> np.random.Generator:
    """A generator that is a function of (run seed, optimizer step, keys) alone: every rank draws the same
    numbers with nothing to synchronise, and a resumed run draws what the original run drew."""
    return np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, int(step), *keys])


@dataclass(frozen=True)
class DepthSampler:
    loops: int  # R, the configured depth (validation/test run it)
    sampler: str = "fixed"
    min_loops: int = 1
    max_loops: int | None = None  # None = 2R
    sigma: float = 0.5
    backprop_loops: int | None = None
    seed: int = 0

    @classmethod
    def from_config(cls, loop_depth: dict[str, Any], seed: int) -> "DepthSampler":
        """From the `loop_depth` group (keys absent or null take the defaults); errors name the key."""
        get = loop_depth.get
        s = cls(loops=get("loops"), sampler=get("sampler") or "fixed",
                min_loops=1 if get("min_loops") is None else get("min_loops"), max_loops=get("max_loops"),
                sigma=0.5 if get("sigma") is None else get("sigma"), backprop_loops=get("backprop_loops"), seed=int(seed))
        s.validate()
        return s

    def validate(self) -> None:
        from looplab.models.config import ConfigError

        if self.sampler not in SAMPLERS:
            raise ConfigError(f"loop_depth.sampler={self.sampler!r} is unknown; choose one of {SAMPLERS}")
        for key in ("min_loops", "max_loops", "backprop_loops"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"loop_depth.{key}={v!r} must be an integer >= 1 (or null)")
        if self.min_loops > self.hi:
            raise ConfigError(f"loop_depth.min_loops={self.min_loops} > loop_depth.max_loops={self.hi}: "
                              "the depth range is empty; lower min_loops or raise max_loops")
        if not isinstance(self.sigma, (int, float)) or not self.sigma > 0:
            raise ConfigError(f"loop_depth.sigma={self.sigma!r} must be > 0 (the log-normal's σ)")

    @property
    def hi(self) -> int:
        return self.max_loops if self.max_loops is not None else 2 * self.loops

    @property
    def active(self) -> bool:
        return self.sampler != "fixed"

    # ------------------------------------------------------------------ draws
    def draw(self, step: int) -> int:
        """The depth of optimizer step `step`: a function of (seed, step) alone."""
        if self.sampler == "fixed":
            return self.loops
        rng = step_rng(self.seed, step)
        if self.sampler == "uniform":
            return int(rng.integers(self.min_loops, self.hi + 1))
        tau = rng.normal(math.log(self.loops) - self.sigma ** 2 / 2, self.sigma)
        return int(min(max(rng.poisson(math.exp(tau)), self.min_loops), self.hi))

    # -------------------------------------------------------------- expected
    def pmf(self) -> dict[int, float]:
        """P(depth = d) for every reachable d (exact for fixed/uniform; Gauss–Hermite over τ for poisson)."""
        if self.sampler == "fixed":
            return {self.loops: 1.0}
        lo, hi = self.min_loops, self.hi
        if self.sampler == "uniform":
            return {d: 1.0 / (hi - lo + 1) for d in range(lo, hi + 1)}
        nodes, weights = np.polynomial.hermite.hermgauss(80)  # ∫ e^{−x²} f(x) dx
        tau = math.log(self.loops) - self.sigma ** 2 / 2 + math.sqrt(2) * self.sigma * nodes
        lam = np.exp(tau)
        w = weights / math.sqrt(math.pi)
        below = {k: float((w * np.exp(k * tau - lam - math.lgamma(k + 1))).sum()) for k in range(hi)}
        probs = {d: 0.0 for d in range(lo, hi + 1)}
        for k, p in below.items():
            probs[max(k, lo)] += p
        probs[hi] += max(0.0, 1.0 - sum(below.values()))
        return probs

    def expected_loops(self) -> float:
        return sum(d * p for d, p in self.pmf().items())

    def expected_backprop_loops(self) -> float:
        """E[min(k, depth)]: loops whose backward runs (all of them without truncation)."""
        k = self.backprop_loops
        return sum((d if k is None else min(k, d)) * p for d, p in self.pmf().items())
