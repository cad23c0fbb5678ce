"""The statistics behind every table, benchmark interval and verdict: plain Python, no looplab imports.

Low in the house on purpose: `bench/`, `eval/` and `tables/` all import from here and never from
each other for statistics.

* Intervals: Student-t over seeds (or repeated timings), Wilson over the test examples of one run.
* Verdicts on a paired difference A − B with its 95% interval [lo, hi] (`judge`):
  - `sign`     — the paper reports the sign of A − B: reproduced when the interval excludes 0 on
                 the paper's side, contradicted on the other, inconclusive when it straddles 0;
                 `size` (the paper's value), when given, is reported as inside / outside the interval.
  - `at_most`  — "A adds at most X": reproduced when hi ≤ X, contradicted when lo > X.
  - `near`     — "A − B is about X" within a stated tolerance δ (an equivalence claim):
                 reproduced when the interval lies inside [X − δ, X + δ], contradicted when it lies
                 wholly outside, inconclusive otherwise.
  - `not tested` — an arm missed the finding's precondition; no comparison is made.
* Each decisive rule has a p-value that agrees with it (p < 0.05 exactly when the plain rule decides),
  and the Holm step-down over a family of verdicts gives the adjusted verdict beside the plain one.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

LEVEL = 0.95  # every interval in the tables
ALPHA = 1 - LEVEL
VERDICTS = ("reproduced", "contradicted", "inconclusive", "not tested")
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
    reported, at_most: the bound, near: the centre); tolerance: δ of a `near` claim."""

    kind: str = "sign"
    sign: int = 1
    size: float | None = None
    tolerance: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"verdict rule kind={self.kind!r} is unknown; choose one of {KINDS}")
        if self.sign not in (-1, 1):
            raise ValueError(f"sign={self.sign!r} must be +1 or -1")
        if self.kind in ("at_most", "near") and self.size is None:
            raise ValueError(f"a {self.kind} rule needs the paper's size")
        if self.kind == "near" and not (self.tolerance and self.tolerance > 0):
            raise ValueError(f"a near rule needs a positive tolerance, got {self.tolerance!r}")


def judge(rule: Rule, lo: float | None, hi: float | None) -> str:
    """The plain verdict of an interval under a rule (no interval: inconclusive)."""
    if lo is None or hi is None:
        return "inconclusive"
    if rule.kind == "sign":
        if lo > 0 or hi < 0:
            return "reproduced" if (1 if lo > 0 else -1) == rule.sign else "contradicted"
        return "inconclusive"
    if rule.kind == "at_most":
        if hi <= rule.size:
            return "reproduced"
        return "contradicted" if lo > rule.size else "inconclusive"
    band_lo, band_hi = rule.size - rule.tolerance, rule.size + rule.tolerance
    if band_lo <= lo and hi <= band_hi:
        return "reproduced"
    return "contradicted" if hi < band_lo or lo > band_hi else "inconclusive"


def decisive_p(rule: Rule, mean: float | None, half: float | None, df: int | None) -> float | None:
    """The p-value of the test the rule's verdict rests on, scaled so that p < 1 − LEVEL exactly when the
    plain rule decides (reproduced or contradicted): two-sided against 0 (sign), against X (at_most), the
    larger of the two one-sided tests of the band (near, reproduced side) or the one-sided test against
    the nearer edge (near, contradicted side). The standard error is the one the interval used
    (se = half / t_quantile(df)), so intervals widened by the examples' sampling noise keep agreeing."""
    if mean is None or half is None or not df:
        return None
    se = half / t_quantile(df)
    if se == 0:
        return 0.0

    def two_sided(x: float) -> float:
        return min(1.0, 2 * t_sf(abs(mean - x) / se, df))

    if rule.kind == "sign":
        return two_sided(0.0)
    if rule.kind == "at_most":
        return two_sided(rule.size)
    band_lo, band_hi = rule.size - rule.tolerance, rule.size + rule.tolerance
    if band_lo <= mean <= band_hi:  # equivalence: both one-sided tests must reject (TOST), each at 1 − LEVEL / 2
        return min(1.0, 2 * max(t_sf((mean - band_lo) / se, df), t_sf((band_hi - mean) / se, df)))
    return two_sided(band_lo if mean < band_lo else band_hi)


def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm step-down adjusted p-values (None stays None and does not count towards the family)."""
    idx = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    m, out, running = len(idx), [None] * len(pvalues), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def adjusted_verdict(plain: str, p_adjusted: float | None, alpha: float = ALPHA) -> str:
    """The plain verdict kept when its adjusted p-value still decides, else inconclusive."""
    if plain in ("reproduced", "contradicted"):
        return plain if p_adjusted is not None and p_adjusted < alpha else "inconclusive"
    return plain


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
