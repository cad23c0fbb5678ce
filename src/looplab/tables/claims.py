"""The papers' claims each table checks: `Finding` (arm A − arm B, the metric, the paper's claim and how its interval is
judged), `finding` (its checked constructor), and the `Precondition`s an arm must meet before a claim is judged,
by name (`PRECONDITIONS`). Each table's findings are data in its spec, tables/specs/tableN.yaml (tables/paper_specs.py
reads them through `finding`); `FINDINGS` gives them by table number.

Signs are those of A − B in the paper. A sign claim names in advance its smallest effect of interest δ (`delta`, with
the reason for its size in `delta_why`): a sequential build (`--seeds auto`, tables/sequential.py) calls a finding
**negligible** when its whole interval lies inside (−δ, +δ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Filter = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Precondition:
    """What the arms of a finding must show for the comparison to test its claim; when an arm misses,
    the finding's verdict is **not tested** and the line names the arm and its figure.

    metric: a finding metric (load.METRICS), taken as the arm's mean over its seeds.
    op: '<' or '>='. threshold: a number, or 'unigram' (the run's own unigram perplexity of its
    held-out targets, recorded by LM runs). arms: 'each' (every arm of the comparison) or 'any'
    (at least one: a task the setting cannot teach any arm tests nothing). why: said in the report."""

    metric: str
    op: str
    threshold: float | str
    arms: str = "each"
    why: str = ""

    def __post_init__(self):
        if self.op not in ("<", ">=") or self.arms not in ("each", "any", "a", "b"):
            raise ValueError(f"precondition {self!r}: op must be < or >=, arms each, any, a or b")

    def describe(self) -> str:
        who = {"each": "every arm", "any": "at least one arm", "a": "arm A", "b": "arm B"}[self.arms]
        t = "its unigram perplexity" if self.threshold == "unigram" else f"{self.threshold:g}"
        return f"{who}: {self.metric} {self.op} {t}"


@dataclass(frozen=True)
class Finding:
    """One claim of a paper, checked as a paired difference A − B across seeds.

    Arms are filters on a run's facets (load.run_facets: `experiment` — the experiment name without
    `_tiny`/`_paper` —, `arm`, `backbone`, `size` (a swept backbone preset), `N`, `R`, `NR`,
    `mode` (table 8), `model` (table 4)); a value `max`/`min` picks the largest/smallest value
    of that facet among the stratum's runs matching the rest of the filter; the key `q` is not a
    facet but the exit threshold whose readout the metric takes (table 8).
    A and B are paired by seed (table 4: by repeated timing) and must agree on the `per` and
    `match` facets; one verdict line per value of the `per` facets (and per A configuration).
    `minus` turns it into a difference in differences: (A − B) − (A' − B').
    sign: the sign of A − B the paper reports (−1: A is lower).
    contrast: 'diff' (A − B) or 'ratio' (A / B − 1).
    kind / size / tolerance: how the interval is judged (looplab.stats.Rule): 'sign' (size, if given,
    is the paper's value, reported as inside or outside the interval), 'at_most' (A − B ≤ size) or
    'near' (A − B within size ± tolerance).
    requires: the preconditions the arms must meet before any verdict (else **not tested**).
    delta / delta_why: a sign claim's smallest effect of interest δ (in the contrast's units) and why it has
    that size, fixed before any sequential build; the sequential rule (`sequential_rule`) calls an interval
    that does not exclude 0 but lies inside (−δ, +δ) **negligible**. Fixed-seed builds keep `rule`.
    effect / scaling / scaling_why: the paper's effect of a sign claim in the paper's units (a number, or one per
    stratum: ((stratum, value), ...)), and the factor that carries it to this setting's units — the one δ uses
    (perplexity: this setting's ≈ 44 ppl over the paper's 9.04; accuracy shares and ratios: 1). Every comparison
    with the paper's number uses `claimed(stratum, scale)`; an interval that does not exclude 0 but lies wholly on
    0's side of it is **smaller than claimed** (both rules). The paper's own scale uses the unscaled effect.
    by_construction: an accounting identity (KV-cache bytes of a schedule): its figure is computed, not measured,
    so its line says **by construction** instead of reproduced and joins no Holm family.
    """

    label: str  # what is compared, e.g. "StateLoop − Vanilla Looped"
    claim: str  # what the paper reports, with its numbers
    metric: str  # perplexity | accuracy | accuracy at 2R | zero-shot | exit fraction | latency
    a: Filter
    b: Filter
    sign: int
    per: tuple[str, ...] = ()
    match: tuple[str, ...] = ()
    minus: tuple[Filter, Filter] | None = None
    contrast: str = "diff"
    kind: str = "sign"
    size: float | None = None
    tolerance: float | None = None
    requires: tuple[Precondition, ...] = ()
    delta: float | None = None
    delta_why: str = ""
    effect: float | tuple[tuple[str, float], ...] | None = None
    scaling: float = 1.0
    scaling_why: str = ""
    by_construction: bool = False

    def claimed(self, stratum: str = "", scale: str | None = None) -> float | None:
        """The paper's effect in this setting's units (None: the claim gives no size, or none for this stratum)."""
        e = self.effect
        if isinstance(e, tuple):
            e = dict(e).get(stratum)
        if e is None or self.kind != "sign":
            return None
        return round(e * (1.0 if scale == "paper" else self.scaling), 4)

    def rule_for(self, stratum: str = "", scale: str | None = None, sequential: bool = False):
        """The verdict rule of one line: the claim's kind, its claimed effect in this setting's units and (a sequential
        build) its smallest effect of interest δ."""
        from looplab.stats import Rule

        return Rule(self.kind, self.sign, self.size, self.tolerance, self.delta if sequential else None,
                    self.claimed(stratum, scale))

    @property
    def rule(self):
        from looplab.stats import Rule

        return Rule(self.kind, self.sign, self.size, self.tolerance)

    @property
    def sequential_rule(self):
        """The rule of a sequential build: the same, plus the negligible verdict of a sign claim (its δ)."""
        from looplab.stats import Rule

        return Rule(self.kind, self.sign, self.size, self.tolerance, self.delta)

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "claim": self.claim, "metric": self.metric, "a": dict(self.a), "b": dict(self.b),
                "sign": self.sign, "per": list(self.per), "match": list(self.match),
                "minus": [dict(m) for m in self.minus] if self.minus else None, "contrast": self.contrast,
                "kind": self.kind, "size": self.size, "tolerance": self.tolerance,
                "requires": [p.describe() for p in self.requires], "delta": self.delta, "delta_why": self.delta_why,
                "effect": dict(self.effect) if isinstance(self.effect, tuple) else self.effect, "scaling": self.scaling,
                "scaling_why": self.scaling_why, "by_construction": self.by_construction}


def finding(label: str, claim: str, metric: str, a: dict[str, Any], b: dict[str, Any], sign: int, *,
            per: tuple[str, ...] = (), match: tuple[str, ...] = (),
            minus: tuple[dict[str, Any], dict[str, Any]] | None = None, contrast: str = "diff",
            kind: str = "sign", size: float | None = None, tolerance: float | None = None,
            requires: tuple[Precondition, ...] = (), delta: float | None = None, delta_why: str = "",
            effect: float | dict[str, float] | None = None, scaling: float = 1.0, scaling_why: str = "",
            by_construction: bool = False) -> Finding:
    if sign not in (-1, 1) or contrast not in ("diff", "ratio"):
        raise ValueError(f"finding {label!r}: sign must be ±1 and contrast diff|ratio")
    if delta is not None and not delta_why:
        raise ValueError(f"finding {label!r}: a smallest effect of interest δ = {delta} needs its reason (delta_why)")

    def f(d):
        return tuple((k, str(v)) for k, v in d.items())

    if effect is None and kind == "sign":
        effect = size  # a sign claim's size is the paper's effect
    if scaling != 1.0 and not scaling_why:
        raise ValueError(f"finding {label!r}: a scaling of the paper's effect ({scaling}) needs its reason (scaling_why)")
    fd = Finding(label, claim, metric, f(a), f(b), sign, tuple(per), tuple(match),
                 (f(minus[0]), f(minus[1])) if minus else None, contrast, kind, size, tolerance, tuple(requires),
                 delta, delta_why, tuple(effect.items()) if isinstance(effect, dict) else effect, scaling, scaling_why,
                 by_construction)
    fd.sequential_rule  # validates kind / size / tolerance / delta now, not when the report runs
    for stratum in (dict(fd.effect) if isinstance(fd.effect, tuple) else {"": fd.effect}):
        fd.rule_for(stratum, sequential=True)  # and the claimed effect's sign
    return fd


# Preconditions (docs/tables.md#preconditions): a comparison tests a claim only when its arms did what the claim needs; an arm
# that misses makes the verdict **not tested** and the report names the arm and its figure.
LM_LEARNED = Precondition(
    "perplexity", "<", "unigram", "each",
    "a language model above the unigram perplexity of its held-out text has learned nothing from context")
# Mano at modulus 5 scores 0.2 by guessing; p-hop's last-position shortcut reaches ≈ 0.49.
MANO_TAUGHT = Precondition("accuracy", ">=", 0.5, "any",
                           "a setting that teaches Mano to no arm (guessing: 0.2) cannot show what looping adds")
PHOP_TAUGHT = Precondition("accuracy", ">=", 0.6, "any",
                           "a setting that teaches p-hop to no arm (the shortcut reaches ≈ 0.49) cannot show what looping adds")
PHOP_LEARNED_AT_R = Precondition(
    "accuracy at R", ">=", 0.9, "each",
    "an extrapolation claim is about arms that solve p-hop at their trained depth; an arm below 0.9 there did not "
    "learn the task, and its accuracy beyond R says nothing about extrapolation")
PHOP_CLEARS_SHORTCUT = Precondition(
    "accuracy", ">=", 0.6, "each",
    "a p-hop comparison is about arms that learned the task: an arm near the ≈ 0.49 last-position shortcut never "
    "learned it, so no difference between such arms says anything about the mechanism compared")
GATE_CAN_ACT = Precondition(
    "best shallower loop accuracy", ">=", 0.6, "b",
    "an exit gate can only lose when no shallower loop solves anything: the fixed-loop body read at some loop r < R "
    "must clear the task's shortcut (≈ 0.49 on p-hop) before exiting early has anything to choose")
GATE_BODY_LEARNED = Precondition(
    "accuracy", ">=", 0.9, "b",
    "a gate on a fixed-loop body that did not learn the task (< 0.9 at R) has no good depth to choose")

# The preconditions a spec (tables/specs/tableN.yaml) names in `require:`, by name.
PRECONDITIONS: dict[str, Precondition] = {
    "LM_LEARNED": LM_LEARNED, "MANO_TAUGHT": MANO_TAUGHT, "PHOP_TAUGHT": PHOP_TAUGHT,
    "PHOP_LEARNED_AT_R": PHOP_LEARNED_AT_R, "PHOP_CLEARS_SHORTCUT": PHOP_CLEARS_SHORTCUT,
    "GATE_CAN_ACT": GATE_CAN_ACT, "GATE_BODY_LEARNED": GATE_BODY_LEARNED,
}

# Why some findings in the specs read as they do (their yaml keeps no comments):
# - table 4's first finding is a claim about a size: reproduced only if the whole interval is at or below 1.42%.
# - table 8's exit finding was "mean exit step − R", which cannot come out positive (an exit is ≤ R); it is restated as
#   the share of the R loops the gate saves, judged against the paper's 3.00 of 4 within half a loop either way.
# - table 12 (MoR) and 13 (PLT): "matches" / "keeps the quality" is parity, fixed in advance: perplexity at most
#   MOR_PARITY / PLT_PARITY above (a ratio), p-hop accuracy at most 2 pp below. PLT's figures are from Wu, Chen et al.,
#   arXiv 2510.24824 (680M/13B Seed-MoE: no loop 34.7, sequential 2 loops 39.7, + CLP 39.6, + shared KV only 36.2,
#   + G-SWA 39.7 accuracy; latency 4.8 / 9.4 / 5.9 / 4.8 / 4.9 ms; KV 280M / 560M / 560M / 280M / 284M); the loop
#   count's from LoopCoder-v2 (arXiv 2606.18023: SWE-bench Verified 43.0, 64.4, 27.6, 22.4 at 1–4 loops). Table 13's
#   decoding line A / B − 1 of tokens/s with A the 1⊗1 block is B's latency per token over the block's, − 1, bounded
#   by PLT_DECODE_BOUND; its KV bound is loop 1's full cache plus R − 1 windows of w tokens over the decoded
#   PLT_DECODE_TOKENS: (R − 1)·w / T (tests/test_paper_specs.py checks the specs' sizes against these constants).
PLT_PARITY = 0.02  # table 13: "keeps the quality" = within 2% perplexity (a ratio) or 2 pp accuracy of sequential looping
PLT_DECODE_BOUND = 0.25  # table 13: "costs close to the unlooped model" = at least 0.8× its tokens/s (1⊗1 / parallel − 1 <= 0.25)
PLT_DECODE_TOKENS = 32 + 64  # table 13: the tokens in the cache after decoding (routed_decode's --prompt + --new)
MOR_PARITY = 0.02  # table 12: "matches" = within 2% perplexity (a ratio) or 2 pp accuracy of the unrolled model

# Smallest effects of interest (δ) of the sign claims (docs/tables.md#sequential-seeds), fixed before any sequential
# build, each with its reason in its spec's delta_why (tables/specs/tableN.yaml): perplexity — half the paper's own
# effect as a share of its perplexity, carried to this setting's perplexity (δ = ½·|effect| / PAPER_PPL · TINY_PPL,
# and the effect's `scaling` PPL_SCALING); accuracy — half the paper's gain where it is a few points, 5 pp on the
# synthetic tasks whose looping gaps are 60–90 pp; speed and size ratios — 5%; table 13's quality claims — its 2%
# parity margin.
PAPER_PPL = 9.04  # the StateLoop paper's perplexity with the state carried (reset ablation: 9.04 → 9.25), the only level it gives
TINY_PPL = 44.0  # this setting's perplexity (lm_tiny, 1,024-token BPE, 600 steps): Vanilla Looped 43.8 (table 1), 41–46 (table 2)
PPL_SCALING = TINY_PPL / PAPER_PPL  # ×4.87: a perplexity effect as a share of the paper's 9.04, at this setting's ≈ 44


# Each table's findings by number, as they were when written here: they now live in the specs (tables/specs/tableN.yaml)
# and tables/spec.py fills this when it loads them (the package's __init__ imports it, so that is done before any
# `from looplab.tables.claims import FINDINGS` returns). Filled there, not loaded here: spec imports this module.
FINDINGS: dict[int, tuple[Finding, ...]] = {}
