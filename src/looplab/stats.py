"""The statistics behind every table, benchmark interval and verdict: plain Python, no looplab imports.

Low in the house on purpose: `bench/`, `eval/` and `tables/` all import from here and never from
each other for statistics.

* Intervals: Student-t over seeds (or repeated timings), Wilson over the test examples of one run, and the
  paired seed × item interval of two arms scored on the same items (`paired_item_interval`: zero-shot).
* Verdicts on a paired difference A − B with its 95% interval [lo, hi] (`judge`):
  - `sign`     — the paper reports the sign of A − B: reproduced when the interval excludes 0 on
                 the paper's side, contradicted on the other, inconclusive when it straddles 0;
                 `size` (the paper's value), when given, is reported as inside / outside the interval.
                 With a smallest effect of interest δ (`delta`, the sequential rule only) an interval
                 that straddles 0 but lies inside (−δ, +δ) is **negligible** (equivalence, TOST).
                 With the paper's effect carried to this setting's units (`claimed`, the scaling δ uses)
                 an interval that straddles 0 but excludes the claimed effect on 0's side is
                 **smaller than claimed** (one-sided: the effect, if any, is smaller than the paper's).
  - `at_most`  — "A adds at most X": reproduced when hi ≤ X, contradicted when lo > X.
  - `near`     — "A − B is about X" within a stated tolerance δ (an equivalence claim):
                 reproduced when the interval lies inside [X − δ, X + δ], contradicted when it lies
                 wholly outside, inconclusive otherwise.
  - `not tested` — an arm missed the finding's precondition; no comparison is made.
* Each decisive rule has a p-value that agrees with it (p < 0.05 exactly when the plain rule decides),
  and the Holm step-down over a family of verdicts gives the adjusted verdict beside the plain one.
* Sequential seeds (`SequentialDesign`): repeated confidence intervals that stay valid when seeds are
  added until a claim is decided — Pocock's constant nominal level α′, set by simulation so that the
  chance that any look n = 3..K misses the true mean is α (normal paired differences; the t-statistic
  is pivotal there, so the calibration holds for every mean and variance).
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
from dataclasses import dataclass, field

LEVEL = 0.95  # every interval in the tables
ALPHA = 1 - LEVEL
VERDICTS = ("reproduced", "contradicted", "negligible", "smaller than claimed", "inconclusive", "not tested",
            "by construction")
DECISIVE = ("reproduced", "contradicted", "negligible", "smaller than claimed")  # the verdicts that decide a claim
BY_CONSTRUCTION = "by construction"  # an accounting identity (e.g. KV-cache bytes): computed, not measured; never judged
KINDS = ("sign", "at_most", "near")

# Two-sided 95% quantiles of Student's t (df 1..30, then 40, 60, 120) for machines without scipy;
# with scipy (installed with the eval extra) scipy.stats computes every interval.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
         21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042,
         40: 2.021, 60: 2.000, 120: 1.980}
_Z975 = 1.959963984540054


def _scipy_stats():
    try:
        from scipy import stats

        return stats
    except ImportError:  # pragma: no cover - scipy comes with the eval extra
        return None


def t_quantile(df: int, level: float = LEVEL) -> float:
    """The (1 + level)/2 quantile of Student's t with df degrees of freedom."""
    st = _scipy_stats()
    if st is not None:
        return float(st.t.ppf((1 + level) / 2, df))
    if level != 0.95:
        raise ValueError("without scipy only 95% intervals are available")
    if df in _T975:
        return _T975[df]
    for lo, hi in ((30, 40), (40, 60), (60, 120)):
        if lo < df < hi:  # linear in 1/df between the tabulated points
            w = (1 / df - 1 / hi) / (1 / lo - 1 / hi)
            return _T975[hi] + w * (_T975[lo] - _T975[hi])
    return _Z975 + (_T975[120] - _Z975) * 120 / df  # df > 120: towards the normal quantile


def z_quantile(level: float = LEVEL) -> float:
    st = _scipy_stats()
    return float(st.norm.ppf((1 + level) / 2)) if st is not None else _Z975


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with df degrees of freedom."""
    st = _scipy_stats()
    if st is not None:
        return float(st.t.sf(t, df))
    if t < 0:
        return 1 - t_sf(-t, df)
    # without scipy: the regularised incomplete beta by Simpson's rule on the density, fine for tables
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    n, hi = 2000, t
    h = hi / n
    f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
    area = h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))
    return max(0.0, 0.5 - area)


def t_interval(values: list[float], level: float = LEVEL) -> tuple[float, float] | None:
    """Two-sided t-interval for the mean of `values` (None with fewer than 2)."""
    n = len(values)
    if n < 2:
        return None
    m, s = statistics.fmean(values), statistics.stdev(values)
    if s == 0:
        return (m, m)
    h = t_quantile(n - 1, level) * s / math.sqrt(n)
    return m - h, m + h


def wilson_interval(k: int, n: int, level: float = LEVEL) -> tuple[float, float] | None:
    """Wilson score interval for k successes out of n."""
    if not n or n < 1:
        return None
    k = max(0, min(int(k), int(n)))
    z = z_quantile(level)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


@dataclass(frozen=True)
class PairedItemInterval:
    """`paired_item_interval`'s result: mean ± √(h_seeds² + h_items²). disagree: the share of (seed, item) cells
    where the two arms' outcomes differ."""

    mean: float
    h_seeds: float
    h_items: float
    n_seeds: int
    n_items: int
    disagree: float

    @property
    def half(self) -> float:
        return math.hypot(self.h_seeds, self.h_items)

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half


def paired_item_interval(a: list[list[float]], b: list[list[float]] | None = None, groups: list | None = None,
                         critical: float | None = None, level: float = LEVEL) -> PairedItemInterval | None:
    """Interval of the mean difference of two arms scored on the same items, over seeds and over items.

    a[s][i], b[s][i]: the arms' outcomes (0/1) on item i with seed s (b None: a holds the differences d = a − b, e.g.
    a contrast of four arms). groups[i]: item i's task; the mean weighs every task equally and the items of a task
    equally (the zero-shot average: accuracy per task, then the mean over tasks); None: one task.

    Model (two-way crossed random effects, per task g, no replication): d[s][i] = μ_g + α_s + β_i + γ_si, seed
    effects α (var σ_α²), item effects β (σ_β,g², the items a suite happened to draw), seed × item noise γ (σ_γ,g²).
    The grand mean D̄ = mean_g mean_s mean_{i∈g} d has Var = σ_α²/S + Σ_g σ_β,g²/(k² n_g) + Σ_g σ_γ,g²/(k² n_g S).
      seed part  V_s = var_s(D_s)/S, D_s each seed's weighted mean: unbiased for the 1st and 3rd terms (the
                 ordinary paired t over seeds, which holds the items fixed).
      item part  V_i = Σ_g max(0, var_{i∈g}(d̄_i) − MS_res,g/S)/(k² n_g), d̄_i = mean_s d[s][i], MS_res,g the
                 two-way residual mean square: (MS_items − MS_res)/S per task is the ANOVA (moment) estimator of
                 σ_β,g², i.e. the 2nd term only. var(d̄_i)/n alone would also hold σ_γ²/(nS), which V_s already
                 counts (double counting: up to 2× the variance when the arms' disagreements are seed noise); the
                 truncation at 0 errs wide.
    Half-width √((c·√V_s)² + (z·√V_i)²): c = `critical` (a sequential look's critical t; default t_{S−1}) on the
    seed part, the normal quantile z at `level` on the item part (many items), as the tables add the examples'
    noise. None with fewer than 2 seeds, ragged rows or a task of fewer than 2 items."""
    S = len(a)
    if S < 2:
        return None
    d = [list(r) for r in a] if b is None else [[x - y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
    n = len(d[0])
    if n == 0 or any(len(r) != n for r in d) or (b is not None and (len(b) != S or any(len(r) != n for r in b))):
        return None
    groups = list(groups) if groups is not None else [0] * n
    if len(groups) != n:
        return None
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    k = len(members)
    per_seed = [0.0] * S
    v_items = 0.0
    for idx in members.values():
        m = len(idx)
        if m < 2:
            return None
        item_mean = [math.fsum(d[s][i] for s in range(S)) / S for i in idx]
        seed_mean = [math.fsum(d[s][i] for i in idx) / m for s in range(S)]
        grand = math.fsum(seed_mean) / S
        var_items = math.fsum((x - grand) ** 2 for x in item_mean) / (m - 1)
        ms_res = math.fsum((d[s][i] - item_mean[j] - seed_mean[s] + grand) ** 2
                           for s in range(S) for j, i in enumerate(idx)) / ((S - 1) * (m - 1))
        v_items += max(0.0, var_items - ms_res / S) / m
        for s in range(S):
            per_seed[s] += seed_mean[s] / k
    v_items /= k * k
    mean = math.fsum(per_seed) / S
    v_seeds = math.fsum((x - mean) ** 2 for x in per_seed) / (S - 1) / S
    c = t_quantile(S - 1, level) if critical is None else critical
    disagree = sum(x != 0 for r in d for x in r) / (S * n)
    return PairedItemInterval(mean, c * math.sqrt(v_seeds), z_quantile(level) * math.sqrt(v_items), S, n, disagree)


@dataclass
class Stat:
    """Values over seeds (or repeated timings): mean with a 95% t-interval (none with one value).

    examples: test examples (items) of one run; set for accuracies, which then also carry a 95%
    Wilson interval over those examples at the seed-mean accuracy (`wilson`).
    """

    values: list[float]
    examples: int | None = None

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    @property
    def interval(self) -> tuple[float, float] | None:
        return t_interval(self.values)

    @property
    def half(self) -> float | None:
        ci = self.interval
        return None if ci is None else (ci[1] - ci[0]) / 2

    @property
    def wilson(self) -> tuple[float, float] | None:
        if self.examples is None or self.mean is None:
            return None
        return wilson_interval(round(self.mean * self.examples), self.examples)

    def fmt(self, digits: int = 3) -> str:
        if not self.values:
            return "n/a"
        s = f"{self.mean:.{digits}f}"
        return s + (f" ± {self.half:.{digits}f}" if self.half is not None else "")


# ----------------------------------------------------------------------------- verdicts
@dataclass(frozen=True)
class Rule:
    """How a finding's interval is judged (see the module docstring).

    sign: the sign of A − B the paper reports (+1 / −1); size: the paper's value X of A − B (sign: only
    reported, at_most: the bound, near: the centre); tolerance: δ of a `near` claim; delta: a sign claim's
    smallest effect of interest δ — an interval inside (−δ, +δ) that does not exclude 0 is negligible; claimed:
    a sign claim's effect in this setting's units (the paper's size carried by the scaling δ uses) — an interval
    that does not exclude 0 but lies wholly on 0's side of it is smaller than claimed."""

    kind: str = "sign"
    sign: int = 1
    size: float | None = None
    tolerance: float | None = None
    delta: float | None = None
    claimed: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"verdict rule kind={self.kind!r} is unknown; choose one of {KINDS}")
        if self.sign not in (-1, 1):
            raise ValueError(f"sign={self.sign!r} must be +1 or -1")
        if self.kind in ("at_most", "near") and self.size is None:
            raise ValueError(f"a {self.kind} rule needs the paper's size")
        if self.kind == "near" and not (self.tolerance and self.tolerance > 0):
            raise ValueError(f"a near rule needs a positive tolerance, got {self.tolerance!r}")
        if self.delta is not None and (self.kind != "sign" or not self.delta > 0):
            raise ValueError(f"delta={self.delta!r}: a smallest effect of interest belongs to a sign rule and is > 0")
        if self.claimed is not None and (self.kind != "sign" or not self.claimed * self.sign > 0):
            raise ValueError(f"claimed={self.claimed!r}: a claimed effect belongs to a sign rule and has the claim's sign "
                             f"({self.sign:+d})")


def smaller_than_claimed(rule: Rule, lo: float, hi: float) -> bool:
    """The interval lies wholly on 0's side of the claimed effect (one-sided: it excludes the claim towards 0)."""
    if rule.claimed is None:
        return False
    return lo > rule.claimed if rule.claimed < 0 else hi < rule.claimed


def judge(rule: Rule, lo: float | None, hi: float | None) -> str:
    """The plain verdict of an interval under a rule (no interval: inconclusive)."""
    if lo is None or hi is None:
        return "inconclusive"
    if rule.kind == "sign":
        if lo > 0 or hi < 0:
            return "reproduced" if (1 if lo > 0 else -1) == rule.sign else "contradicted"
        if rule.delta is not None and -rule.delta < lo and hi < rule.delta:
            return "negligible"
        if smaller_than_claimed(rule, lo, hi):
            return "smaller than claimed"
        return "inconclusive"
    if rule.kind == "at_most":
        if hi <= rule.size:
            return "reproduced"
        return "contradicted" if lo > rule.size else "inconclusive"
    band_lo, band_hi = rule.size - rule.tolerance, rule.size + rule.tolerance
    if band_lo <= lo and hi <= band_hi:
        return "reproduced"
    return "contradicted" if hi < band_lo or lo > band_hi else "inconclusive"


def decisive_p(rule: Rule, mean: float | None, half: float | None, df: int | None,
               quantile: float | None = None) -> float | None:
    """The p-value of the test the rule's verdict rests on, scaled so that p < 1 − LEVEL exactly when the
    plain rule decides (reproduced, contradicted or negligible): two-sided against 0 (sign), against X
    (at_most), the larger of the two one-sided tests of the band (near, reproduced side; a sign rule's
    (−δ, +δ) when it says negligible) or the one-sided test against the nearer edge (near, contradicted
    side). The standard error is the one the interval used (se = half / quantile, by default
    t_quantile(df)), so intervals widened by the examples' sampling noise keep agreeing; a sequential
    interval passes its own critical value and gets the nominal p its design compares with α′."""
    if mean is None or half is None or not df:
        return None
    se = half / (quantile if quantile is not None else t_quantile(df))
    if se == 0:
        return 0.0

    def two_sided(x: float) -> float:
        return min(1.0, 2 * t_sf(abs(mean - x) / se, df))

    def equivalence(lo: float, hi: float) -> float:  # TOST: both one-sided tests, each at 1 − LEVEL / 2
        return min(1.0, 2 * max(t_sf((mean - lo) / se, df), t_sf((hi - mean) / se, df)))

    if rule.kind == "sign":
        p = two_sided(0.0)
        if judge(rule, mean - half, mean + half) in ("reproduced", "contradicted"):
            return p
        if rule.delta is not None:
            p = min(p, equivalence(-rule.delta, rule.delta))
        if rule.claimed is not None and (mean > rule.claimed if rule.claimed < 0 else mean < rule.claimed):
            p = min(p, two_sided(rule.claimed))  # the interval's far end against the claim: p < 0.05 iff it excludes it
        return p
    if rule.kind == "at_most":
        return two_sided(rule.size)
    band_lo, band_hi = rule.size - rule.tolerance, rule.size + rule.tolerance
    if band_lo <= mean <= band_hi:  # equivalence: both one-sided tests must reject (TOST), each at 1 − LEVEL / 2
        return equivalence(band_lo, band_hi)
    return two_sided(band_lo if mean < band_lo else band_hi)


def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm step-down adjusted p-values (None stays None and does not count towards the family)."""
    idx = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    m, out, running = len(idx), [None] * len(pvalues), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def benjamini_hochberg(pvalues: list[float | None]) -> list[float | None]:
    """Benjamini–Hochberg adjusted p-values (q-values; None stays None and does not count): a line with q < α is a
    discovery at false-discovery rate α over the family — a weaker promise than Holm's (family-wise error), reported
    beside it."""
    idx = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    m, out, running = len(idx), [None] * len(pvalues), 1.0
    for rank in range(m - 1, -1, -1):
        i = idx[rank]
        running = min(running, min(1.0, m * pvalues[i] / (rank + 1)))
        out[i] = running
    return out


def adjusted_verdict(plain: str, p_adjusted: float | None, alpha: float = ALPHA) -> str:
    """The plain verdict kept when its adjusted p-value still decides, else inconclusive."""
    if plain in DECISIVE:
        return plain if p_adjusted is not None and p_adjusted < alpha else "inconclusive"
    return plain


# ----------------------------------------------------------------------------- sequential seeds
SEQUENTIAL_FIRST_LOOK = 3  # the first look that judges: 3 paired seeds, as the fixed-seed tables
SEQUENTIAL_SIMULATIONS = 200_000  # paths of the calibration (Monte-Carlo error of the error rate ≈ ±0.0005 at α = 0.05)
SEQUENTIAL_SEED = 49  # the calibration's random stream (numpy's legacy RandomState: the same numbers in every version)
SEQUENTIAL_MIN_ALPHA_LEFT = 0.001  # a restart needs at least this much α left (200 of the calibration's paths)


@functools.lru_cache(maxsize=8)
def _min_p_sample(cap: int, first_look: int, simulations: int, seed: int):
    """Sorted smallest two-sided t-test p-value over the looks n = first_look..cap of `simulations` null paths of
    i.i.d. standard normal differences (the t-statistic is pivotal: the same for every mean and variance)."""
    try:
        import numpy as np
        from scipy import special
    except ImportError as e:  # pragma: no cover - numpy comes with torch, scipy with the eval extra
        raise ImportError("sequential seeds need numpy and scipy (pip install 'looplab[eval]')") from e
    z = np.random.RandomState(seed).standard_normal((simulations, cap))
    s1, s2 = np.cumsum(z, axis=1), np.cumsum(z * z, axis=1)
    low = np.ones(simulations)
    for n in range(first_look, cap + 1):
        m = s1[:, n - 1] / n
        var = np.maximum((s2[:, n - 1] - n * m * m) / (n - 1), 1e-300)
        low = np.minimum(low, 2 * special.stdtr(n - 1, -np.abs(m) * np.sqrt(n / var)))
    low.sort()
    return low


@functools.lru_cache(maxsize=16)
def _min_p_at_looks(cap: int, looks: tuple[int, ...], simulations: int, seed: int):
    """Smallest two-sided t-test p-value over the looks `looks` (each n in 2..cap) of each of the same null paths
    `_min_p_sample(cap, …, simulations, seed)` draws, in path order (1 for a path of no look): the α a design has
    spent at the looks it actually made is the share of these below its α′."""
    import numpy as np
    from scipy import special

    z = np.random.RandomState(seed).standard_normal((simulations, cap))
    s1, s2 = np.cumsum(z, axis=1), np.cumsum(z * z, axis=1)
    low = np.ones(simulations)
    for n in sorted(set(looks)):
        m = s1[:, n - 1] / n
        var = np.maximum((s2[:, n - 1] - n * m * m) / (n - 1), 1e-300)
        low = np.minimum(low, 2 * special.stdtr(n - 1, -np.abs(m) * np.sqrt(n / var)))
    return low


@dataclass(frozen=True)
class SequentialDesign:
    """Repeated confidence intervals for seeds added in rounds (a group-sequential design, Pocock's boundary).

    At every look with n paired differences (first_look ≤ n ≤ cap) the interval is the ordinary t-interval at
    the nominal level 1 − α′: mean ± t_{1−α′/2, n−1}·s/√n. α′ is set by simulation so that, for i.i.d. normal
    differences, the chance that *any* of the looks n = first_look..cap misses the true mean is α: the
    intervals hold together, so a verdict read at any look — after any data-dependent choice of when to stop
    (decided, cap, time budget) — is wrong with probability at most α. Looking at fewer n (rounds of several
    seeds) only lowers that chance. The cap belongs to the design: a build may stop before it, never go
    past it (a larger cap needs a new design, calibrated for it, before the first look).

    `repeated_p` maps a look's nominal p-value to the design's error scale (the repeated p-value: the smallest
    α at which this design would decide at that look), so that p < α exactly when the look's interval
    decides, and Holm can adjust it with the rest of the table.

    α-spending across restarts: a design that looked at some n and is replaced by a larger one on the same runs
    has spent `alpha_spent(looks)` (the share of its null paths whose smallest nominal p over the looks it made is
    below α′); `restarted(cap, looks)` gives the new design `alpha` = what is left, `spent` = what earlier designs
    spent and `history` = their dicts (cap, looks, α spent), so that all of them together err with probability at
    most spent + alpha = the overall α (union bound). Its repeated p-values are scaled by overall / alpha (a
    weighted Bonferroni), so that p < the overall α exactly when its interval decides."""

    cap: int
    alpha: float = ALPHA
    first_look: int = SEQUENTIAL_FIRST_LOOK
    simulations: int = SEQUENTIAL_SIMULATIONS
    seed: int = SEQUENTIAL_SEED
    method: str = "pocock-rci"
    spent: float = 0.0  # α spent at their looks by earlier designs on the same runs; alpha is what they left
    history: tuple = field(default=(), hash=False)  # those designs' dicts, each with its "looks" and "alpha_spent"

    def __post_init__(self):
        if self.first_look < 2 or self.cap < self.first_look:
            raise ValueError(f"a sequential design needs 2 <= first_look <= cap; got first_look={self.first_look}, "
                             f"cap={self.cap}: raise --max-seeds to at least {max(self.first_look, 2)}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha={self.alpha!r} must lie in (0, 1)")
        if not 0 <= self.spent < 1 - self.alpha:
            raise ValueError(f"spent={self.spent!r}: the α earlier designs spent must lie in [0, 1 − alpha)")

    def _sample(self):
        return _min_p_sample(self.cap, self.first_look, self.simulations, self.seed)

    def nominal_level(self, alpha: float | None = None) -> float:
        """α′: the per-look two-sided level whose looks n = first_look..cap together miss with probability alpha."""
        sample, a = self._sample(), self.alpha if alpha is None else alpha
        k = max(1, min(len(sample), math.ceil(a * len(sample))))  # the smallest k with k / P ≥ a, in floating point too,
        while k < len(sample) and k / len(sample) < a:  # so that repeated_p(p) < a exactly when p < this level
            k += 1
        while k > 1 and (k - 1) / len(sample) >= a:
            k -= 1
        return float(sample[k - 1])

    @property
    def nominal(self) -> float:
        return self.nominal_level()

    def critical(self, n: int) -> float | None:
        """t_{1−α′/2, n−1}: the half-width of the look's interval in standard errors (None outside the design)."""
        if n < self.first_look or n > self.cap:
            return None
        return _critical(n - 1, self.nominal)

    def interval(self, values: list[float]) -> tuple[float, float] | None:
        """The repeated confidence interval of the mean of `values` (None before the first look or past the cap)."""
        c = self.critical(len(values))
        if c is None:
            return None
        m, s = _mean_sd(values)
        h = c * s / math.sqrt(len(values))
        return m - h, m + h

    def repeated_p(self, p_nominal: float | None) -> float | None:
        """The design's p-value of a look whose nominal p-value is p_nominal: the share of null paths whose smallest
        nominal p over the looks is ≤ p_nominal. p_nominal < α′ exactly when repeated_p < α."""
        if p_nominal is None:
            return None
        sample = self._sample()
        share = bisect.bisect_right(sample, p_nominal) / len(sample)
        if not self.spent:
            return share
        overall, p = self.overall, min(1.0, share * self.overall / self.alpha)  # weighted Bonferroni across designs
        return max(p, overall) if share >= self.alpha else min(p, math.nextafter(overall, 0.0))  # p < overall iff decided

    # ------------------------------------------------------------------ α-spending across restarts
    @property
    def overall(self) -> float:
        """The α of every design on these runs together: this one's plus what the earlier ones spent (union bound)."""
        return round(self.alpha + self.spent, 12)

    def looks_within(self, looks) -> tuple[int, ...]:
        """The looks (numbers of paired seeds) this design judges at: those in first_look..cap, sorted, once each."""
        return tuple(sorted({int(n) for n in looks if self.first_look <= int(n) <= self.cap}))

    def alpha_spent(self, looks) -> float:
        """The α this design has spent at the looks it actually made (e.g. n = 3, 5, 7, 9): the share of its simulated
        null paths (the calibration's own, the same RandomState) whose smallest nominal p over those looks is below
        α′ — at most alpha, and below it when some n = first_look..cap was not looked at."""
        made = self.looks_within(looks)
        if not made:
            return 0.0
        low = _min_p_at_looks(self.cap, made, self.simulations, self.seed)
        return int((low < self.nominal).sum()) / self.simulations

    def restarted(self, cap: int, looks, **note) -> "SequentialDesign":
        """A new design capped at `cap` for the same runs after this one looked at `looks`: calibrated at the α left
        (alpha − alpha_spent(looks)), its history this design's dict with the looks, the α spent and `note`."""
        spent = self.alpha_spent(looks)
        left = self.alpha - spent
        if left < SEQUENTIAL_MIN_ALPHA_LEFT:
            raise ValueError(f"the designs on these runs have spent α = {self.spent + spent:.4f} of {self.overall:.2f}; "
                             f"the {left:.4f} left is too little for a new design")
        entry = {**self.as_dict(), "looks": list(self.looks_within(looks)), "alpha_spent": spent, **note}
        entry.pop("history", None)
        return SequentialDesign(cap, alpha=left, first_look=self.first_look, simulations=self.simulations, seed=self.seed,
                                method=self.method, spent=self.spent + spent, history=(*self.history, entry))

    def as_dict(self) -> dict:
        d = {"method": self.method, "alpha": self.alpha, "cap": self.cap, "first_look": self.first_look,
             "simulations": self.simulations, "seed": self.seed, "nominal_alpha": self.nominal}
        if self.spent or self.history:  # a restarted design (a first design's dict is as before)
            d.update(spent_alpha=self.spent, overall_alpha=self.overall, history=[dict(h) for h in self.history])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SequentialDesign":
        if d.get("method", "pocock-rci") != "pocock-rci":
            raise ValueError(f"unknown sequential design {d.get('method')!r}")
        return cls(cap=int(d["cap"]), alpha=float(d.get("alpha", ALPHA)), first_look=int(d.get("first_look", SEQUENTIAL_FIRST_LOOK)),
                   simulations=int(d.get("simulations", SEQUENTIAL_SIMULATIONS)), seed=int(d.get("seed", SEQUENTIAL_SEED)),
                   spent=float(d.get("spent_alpha", 0.0)), history=tuple(dict(h) for h in d.get("history") or ()))


def _mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation in floating point (statistics.stdev is exact and slow; the sequential
    rule is simulated thousands of times in the tests)."""
    n = len(values)
    m = math.fsum(values) / n
    return m, math.sqrt(math.fsum((x - m) ** 2 for x in values) / (n - 1))


@functools.lru_cache(maxsize=4096)
def _critical(df: int, nominal: float) -> float:
    return t_quantile(df, 1 - nominal)


def seeds_to_decide(rule: Rule, values: list[float], design: SequentialDesign, extra_half: float = 0.0,
                    limit: int = 1000) -> int | None:
    """A projection for an undecided finding: the smallest number of paired seeds N (> len(values)) at which the
    interval would decide if the observed mean and standard deviation held, at the design's per-look level α′
    (a larger design's α′ is smaller, so this is a lower bound); extra_half: the examples' fixed half-width,
    added in quadrature. None when no N ≤ limit decides (e.g. the examples' noise alone exceeds the margin)."""
    n = len(values)
    if n < 2:
        return None
    m, s = _mean_sd(values)
    for N in range(n + 1, limit + 1):
        h = math.sqrt((_critical(N - 1, design.nominal) * s / math.sqrt(N)) ** 2 + extra_half ** 2)
        if judge(rule, m - h, m + h) in DECISIVE:
            return N
    return None


# ----------------------------------------------------------------------------- evaluation sizes
def eval_batches(limit, num_batches: int) -> int:
    """Batches Lightning evaluates under limit_{val,test}_batches (None/1.0: all; int: at most; float: fraction):
    the number of test items behind a Wilson interval or a perplexity."""
    if limit is None or (isinstance(limit, float) and limit == 1.0):
        return num_batches
    if isinstance(limit, bool):
        raise ValueError(f"limit_batches={limit!r}")
    if isinstance(limit, int):
        return min(num_batches, limit)
    return int(num_batches * float(limit))
