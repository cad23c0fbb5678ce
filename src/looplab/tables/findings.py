"""The paper's findings judged on a table's units: paired differences, their verdicts and Holm's adjustment.

Each finding (spec.Finding) compares arm A with arm B (and, for a difference in differences, A′ with B′)
per stratum, paired by seed (table 4: by repeated timing), with a 95% t-interval over the paired
differences, widened for accuracies by the test examples' sampling noise; the verdict rule and the
p-values come from looplab.stats (docs/tables.md#verdicts, docs/tables.md#preconditions).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from looplab.stats import (BY_CONSTRUCTION, Rule, SequentialDesign, adjusted_verdict, decisive_p, holm,
                           judge, t_interval, z_quantile)
from looplab.tables.load import Unit, base_experiment, facet_is, sweep_protocol
from looplab.tables.spec import Finding, TableSpec


PROPORTIONS = ("accuracy", "accuracy at 2R", "zero-shot")  # metrics whose paired intervals also carry the examples' sampling noise


@dataclass
class Verdict:
    """One line of a table's findings: a paired difference, its 95% interval and the verdict.

    not_tested: why an arm missed the finding's precondition (then no comparison is judged);
    p / p_holm / family: the p-value the plain verdict rests on (looplab.stats.decisive_p), its Holm
    adjustment over the table's family of verdicts, and that family's size.
    design: set for a sequential build (tables/sequential.py): the interval is the design's repeated confidence
    interval, the rule adds the negligible verdict (the finding's δ) and p is the design's repeated p-value;
    h_ex: the examples' half-width added in quadrature; look / status / stop / more_seeds: the round whose
    look gave this line, whether it decided, why its seeds stopped there, and (undecided) how many seeds its
    observed mean and sd say would decide it."""

    finding: Finding
    stratum: str
    arms: str  # which configurations were compared
    diffs: list[float] = field(default_factory=list)
    reps: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # reps with only some arms
    lo: float | None = None
    hi: float | None = None
    reason: str = ""
    not_tested: str = ""
    p: float | None = None
    p_holm: float | None = None
    family: int | None = None
    design: SequentialDesign | None = None
    h_ex: float = 0.0
    look: int | None = None
    status: str = ""
    stop: str = ""
    more_seeds: int | None = None
    scale: str | None = None  # the paper's own scale compares with its unscaled effect

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.diffs) if self.diffs else None

    @property
    def rule(self) -> Rule:
        """The claim's rule for this line: its claimed effect in this setting's units (smaller than claimed) and, in a
        sequential build, its δ (negligible)."""
        return self.finding.rule_for(self.stratum, self.scale, sequential=self.design is not None)

    @property
    def claimed(self) -> float | None:
        return self.finding.claimed(self.stratum, self.scale)

    @property
    def verdict(self) -> str:
        if self.not_tested:
            return "not tested"
        plain = judge(self.rule, self.lo, self.hi)
        return BY_CONSTRUCTION if self.finding.by_construction and plain == "reproduced" else plain

    @property
    def holm_verdict(self) -> str:
        return adjusted_verdict(self.verdict, self.p_holm)

    def _fmt(self, v: float) -> str:
        if self.finding.contrast == "ratio":
            return f"{100 * v:+.2f}%"
        return f"{v:+.3f}" if self.finding.metric != "perplexity" or abs(v) < 100 else f"{v:+.1f}"

    def size_note(self) -> str:
        """What the interval says about the paper's size, for claims that state one (and, in a sequential build,
        the smallest effect of interest δ a sign claim's negligible verdict reads)."""
        fd = self.finding
        if self.lo is None:
            return ""
        delta = (f"negligible band ±{self._fmt(fd.delta).lstrip('+')}"
                 if self.design is not None and fd.kind == "sign" and fd.delta else "")
        if fd.kind == "at_most" and fd.size is not None:
            return f"bound: the paper's {self._fmt(fd.size)}"
        if fd.kind == "near" and fd.size is not None:
            return f"band: the paper's {self._fmt(fd.size)} ± {self._fmt(fd.tolerance).lstrip('+')}"
        claimed = self.claimed
        if claimed is None:
            return delta
        raw = fd.effect if not isinstance(fd.effect, tuple) else dict(fd.effect).get(self.stratum)
        x = self._fmt(claimed)
        if raw is not None and abs(claimed - raw) > 1e-9:
            x = f"{self._fmt(raw)} × {claimed / raw:.2f} = {x} in this setting's units"
        inside = self.lo <= claimed <= self.hi
        return f"the paper's {x} is {'inside' if inside else 'outside'} the interval" + (f"; {delta}" if delta else "")

    def measured(self) -> str:
        if self.mean is None:
            return f"not measured ({self.reason})"
        unit = "repeated timings" if self.finding.metric == "latency" else "seeds"
        s = self._fmt(self.mean)
        if self.lo is not None:
            s += f" [{self._fmt(self.lo)}, {self._fmt(self.hi)}]"
        s += f", {len(self.diffs)} paired {unit}"
        if self.size_note():
            s += f"; {self.size_note()}"
        if self.reason:
            s += f" ({self.reason})"
        if self.missing:
            s += f"; unpaired: {', '.join(self.missing)}"
        if self.not_tested:
            s += f"; not tested: {self.not_tested}"
        return s

    def title(self) -> str:
        f = self.finding
        where = "; ".join(x for x in (self.stratum, self.arms) if x)
        return f"{f.label}, {f.metric}" + (f" ({where})" if where else "")

    def holm_text(self) -> str:
        if self.verdict in ("not tested", BY_CONSTRUCTION) or self.family is None:
            return "—"
        p = "" if self.p_holm is None else f", p_Holm {self.p_holm:.3g}"
        return f"{self.holm_verdict} (family {self.family}{p})"

    def line(self) -> str:
        seeds = f" Seeds: {self.stop}." if self.design is not None and self.stop else ""
        return (f"- **{self.verdict}** (Holm: {self.holm_text()}) — {self.title()}. Paper: {self.finding.claim}. "
                f"Here: {self.measured()}.{seeds}")

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.finding.label, "metric": self.finding.metric, "claim": self.finding.claim,
                "expected_sign": self.finding.sign, "kind": self.finding.kind, "size": self.finding.size,
                "tolerance": self.finding.tolerance, "requires": [p.describe() for p in self.finding.requires],
                "stratum": self.stratum, "arms": self.arms, "title": self.title(),
                "diffs": self.diffs, "reps": self.reps, "mean": self.mean, "lo": self.lo, "hi": self.hi,
                "missing": self.missing, "measured": self.measured(), "not_tested": self.not_tested,
                "p": self.p, "p_holm": self.p_holm, "family": self.family,
                "verdict": self.verdict, "holm_verdict": self.holm_verdict,
                "claimed": self.claimed, "by_construction": self.finding.by_construction, "rule": _rule_dict(self.rule),
                **({} if self.design is None else {
                    "delta": self.finding.delta, "delta_why": self.finding.delta_why, "examples_half_width": self.h_ex,
                    "critical_t": self.design.critical(len(self.diffs)), "look": self.look, "seeds_used": len(self.diffs),
                    "status": self.status, "stopped": self.stop, "more_seeds": self.more_seeds})}


def _rule_dict(rule: Rule) -> dict[str, Any]:
    return {"kind": rule.kind, "sign": rule.sign, "size": rule.size, "tolerance": rule.tolerance, "delta": rule.delta,
            "claimed": rule.claimed}


def decide(lo: float | None, hi: float | None, expected_sign: int) -> str:
    """The sign rule (looplab.stats.judge with a sign Rule): reproduced when the interval excludes 0 on the
    paper's side, contradicted on the other, else inconclusive."""
    return judge(Rule("sign", expected_sign), lo, hi)


def check_preconditions(fd: Finding, terms) -> str:
    """'' when every precondition of the finding holds for the compared arms, else why not (arm and figure).
    terms: [(coef, units, q)] of the comparison, arm A first. An arm's figure is its mean over seeds."""
    problems = []
    names = ("A", "B", "A′", "B′")
    for pre in fd.requires:
        idx = {"each": range(len(terms)), "any": range(len(terms)), "a": [0], "b": [1]}[pre.arms]
        verdicts = []
        for i in idx:
            _, us, q = terms[i]
            vals = [u.value(pre.metric, q if pre.metric == "accuracy" else None) for u in us]
            vals = [v for v in vals if v is not None]
            label = f"{names[i]} = {us[0].label()}"
            if pre.threshold == "unigram":
                bars = [u.value("unigram perplexity") for u in us]
                bars = [b for b in bars if b is not None]
                bar = statistics.fmean(bars) if bars else None
                bar_txt = f"its unigram perplexity {bar:.4g}" if bar is not None else "its unigram perplexity"
            else:
                bar, bar_txt = float(pre.threshold), f"{float(pre.threshold):g}"
            if not vals or bar is None:
                verdicts.append((None, f"{label}: {pre.metric} vs {bar_txt} not measured"))
                continue
            v = statistics.fmean(vals)
            ok = v < bar if pre.op == "<" else v >= bar
            verdicts.append((ok, f"{label}: {pre.metric} {v:.4g}, needs {pre.op} {bar_txt}"))
        if pre.arms == "any":
            if not any(ok for ok, _ in verdicts):
                problems.append("no arm passes (" + "; ".join(t for _, t in verdicts) + ")")
        else:
            problems += [t for ok, t in verdicts if not ok]
    return "; ".join(problems)


def _is_extreme(v: str) -> bool:
    return v in ("max", "min")


def _num_or_str(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def _matches(u: Unit, flt: tuple[tuple[str, str], ...], resolved: dict[str, str] | None = None) -> bool:
    for k, v in flt:
        if k == "q":
            continue
        v = (resolved or {}).get(k, v)
        if _is_extreme(v):
            continue
        if not facet_is(k, u.facets.get(k), v):
            return False
    return True


def _resolve(flt, units: list[Unit]) -> dict[str, str]:
    """max/min values of a filter → the facet's largest/smallest value among the units matching the rest."""
    out = {}
    cands = [u for u in units if _matches(u, flt)]
    for k, v in flt:
        if k != "q" and _is_extreme(v):
            vals = [u.facets.get(k) for u in cands if u.facets.get(k) is not None]
            if vals:
                pick = (max if v == "max" else min)(vals, key=_num_or_str)
                out[k] = str(pick)
    return out


def comparisons(fd: Finding, units: list[Unit]):
    """The comparisons a finding makes among `units`: (stratum, arms, terms) per stratum and arm-A
    configuration, terms = [(coef, units, q)] with arm A first (then B, and A′, B′ for a difference in
    differences), or (stratum, arms, problem) when an arm cannot be paired. The report judges these;
    tests/test_common_random_numbers.py builds the same arms to check that they share their random numbers."""
    filters = [fd.a, fd.b] + (list(fd.minus) if fd.minus else [])
    relevant = [u for u in units if any(_matches(u, f) for f in filters)]
    strata: dict[tuple, list[Unit]] = {}
    for u in relevant:
        strata.setdefault(tuple(str(u.facets.get(k)) for k in fd.per), []).append(u)
    for key, us in sorted(strata.items(), key=lambda kv: [_num_or_str(x) for x in kv[0]]):
        stratum = ", ".join(f"{k} = {v}" for k, v in zip(fd.per, key) if v != "None")
        res = [_resolve(f, us) for f in filters]
        qs = [dict(f).get("q") for f in filters]
        a_units = [u for u in us if _matches(u, filters[0], res[0])]
        if not a_units:
            yield stratum, "", "no run of arm A"
            continue
        by_cfg: dict[tuple, list[Unit]] = {}
        for u in a_units:
            by_cfg.setdefault(u.config(), []).append(u)
        for cfg_units in by_cfg.values():
            ref = cfg_units[0].facets

            def partner(i: int) -> list[Unit] | str:
                cand = [u for u in us if _matches(u, filters[i], res[i])
                        and all(str(u.facets.get(k)) == str(ref.get(k)) for k in fd.match)]
                cfgs = {u.config() for u in cand}
                if not cfgs:
                    return "no run of arm " + ("B", "A′", "B′")[i - 1] + " in these sweeps"
                if len(cfgs) > 1:
                    return f"{len(cfgs)} configurations match arm " + ("B", "A′", "B′")[i - 1]
                return cand

            terms: list[tuple[int, list[Unit], str | None]] = [(1, cfg_units, qs[0])]
            problems = []
            for i, coef in ((1, -1), (2, -1), (3, 1))[: len(filters) - 1]:
                p = partner(i)
                if isinstance(p, str):
                    problems.append(p)
                else:
                    terms.append((coef, p, qs[i]))
            arms = " − ".join(f"{t[1][0].label()}" + (f" q = {t[2]}" if t[2] else "") for t in terms[:2])
            if fd.minus and len(terms) == 4:
                arms = f"({arms}) − ({terms[2][1][0].label()} − {terms[3][1][0].label()})"
            if problems:
                yield stratum, arms, "; ".join(problems)
            elif any(t[1][0].config() == terms[0][1][0].config() and t[2] == terms[0][2] for t in terms[1:2]):
                yield stratum, arms, "arms A and B are the same runs"
            else:
                yield stratum, arms, terms


def evaluate_finding(fd: Finding, units: list[Unit], design: SequentialDesign | None = None) -> list[Verdict]:
    filters = [fd.a, fd.b] + (list(fd.minus) if fd.minus else [])
    if not any(_matches(u, f) for u in units for f in filters):
        return [Verdict(fd, "", "", reason="no runs of these arms", design=design)]
    out = []
    for stratum, arms, terms in comparisons(fd, units):
        if isinstance(terms, str):
            out.append(Verdict(fd, stratum, arms, reason=terms, design=design))
            continue
        v = _paired(fd, stratum, arms, terms, design)
        v.not_tested = check_preconditions(fd, terms)
        out.append(v)
    return out


def _item_halves(fd: Finding, terms, reps: list[str], diffs: list[float],
                 design: SequentialDesign | None) -> tuple[float, float, str] | str:
    """Zero-shot: (seed half-width, item half-width, note) of the paired seed × item interval
    (looplab.stats.paired_item_interval) from every unit's per-item outcomes (zeroshot.json 'items'), the items
    weighed as the average over tasks weighs them; or why it cannot be used."""
    from looplab.stats import paired_item_interval
    from looplab.tables.load import zeroshot_outcomes

    if fd.contrast == "ratio":
        return "a ratio"
    ref, d = None, [None] * len(reps)
    for coef, us, _ in terms:
        by = {u.rep: u for u in us}
        for s, r in enumerate(reps):
            out = zeroshot_outcomes(by[r].zeroshot)
            if out is None:
                return "an older zeroshot.json, without per-item outcomes"
            ids = {t: x[0] for t, x in out.items()}
            if ref is None:
                ref = ids
            elif ids != ref:
                return "the runs' zeroshot.json score different items"
            flat = [coef * x for t in sorted(out) for x in out[t][1]]
            d[s] = flat if d[s] is None else [y + x for y, x in zip(d[s], flat)]
    groups = [t for t in sorted(ref) for _ in ref[t]]
    pi = paired_item_interval(d, groups=groups, critical=None if design is None else design.critical(len(reps)))
    if pi is None:
        return "too few items per task"
    if abs(pi.mean - statistics.fmean(diffs)) > 1e-9:
        return "the per-item outcomes do not give the runs' average_acc"
    return pi.h_seeds, pi.h_items, f"item noise paired over {pi.n_items} items, arms differ on {100 * pi.disagree:.1f}%"


def _paired(fd: Finding, stratum: str, arms: str, terms, design: SequentialDesign | None = None) -> Verdict:
    by_rep = [{u.rep: u.value(fd.metric, q) for u in us} for _, us, q in terms]
    all_reps = set().union(*by_rep)
    reps = sorted((r for r in all_reps if all(m.get(r) is not None for m in by_rep)), key=_num_or_str)
    missing = [f"{'seed' if fd.metric != 'latency' else 'timing'} {r}" for r in sorted(all_reps - set(reps), key=_num_or_str)]
    diffs = []
    for r in reps:
        if fd.contrast == "ratio":
            diffs.append(by_rep[0][r] / by_rep[1][r] - 1)
        else:
            diffs.append(sum(c * m[r] for (c, _, _), m in zip(terms, by_rep)))
    v = Verdict(fd, stratum, arms, diffs, reps, missing, design=design)
    if len(diffs) < 2:
        v.reason = f"an interval needs ≥ 2 paired {'repeated timings' if fd.metric == 'latency' else 'seeds'}"
        return v
    if design is not None and design.interval(diffs) is None:
        v.reason = (f"the sequential rule looks from {design.first_look} paired seeds" if len(diffs) < design.first_look
                    else f"{len(diffs)} paired seeds: past the design's cap of {design.cap}")
        return v
    lo, hi = t_interval(diffs) if design is None else design.interval(diffs)
    if fd.metric in PROPORTIONS:
        # zero-shot with per-item outcomes: the paired seed × item interval (the seed part is the t-interval above)
        items = _item_halves(fd, terms, reps, diffs, design) if fd.metric == "zero-shot" else None
        if isinstance(items, tuple):
            h_t, h_ex, v.reason = items
        else:
            # ⊕ the test examples' sampling noise: each arm's seed-mean proportion p over n examples adds
            # p(1 − p)/n to the variance of the difference (conservative: both arms score the same examples)
            var, known = 0.0, True
            for (_, us, _), m in zip(terms, by_rep):
                p = statistics.fmean(m[r] for r in reps)
                n = min((u.n_examples(fd.metric) or 0) for u in us)
                if n <= 0:
                    known = False
                    continue
                var += p * (1 - p) / n
            h_t, h_ex = (hi - lo) / 2, z_quantile() * math.sqrt(var)
            if not known:
                v.reason = "test-example counts unknown: t over seeds only"
            elif items:
                v.reason = f"{items}: item noise of the arms taken as independent, conservative"
        h = math.sqrt(h_t ** 2 + h_ex ** 2)
        mid = statistics.fmean(diffs)
        lo, hi = mid - h, mid + h
        v.h_ex = h_ex
    v.lo, v.hi = lo, hi
    return v


def evaluate_findings(spec: TableSpec, units: list[Unit], scale: str | None = None,
                      design: SequentialDesign | None = None) -> list[Verdict]:
    """Every finding of the table; per-experiment findings also get a line for each expected experiment
    of the table's sweeps that has no runs at all (so a missing sweep is visible among the verdicts).
    design: judge with a sequential design's repeated confidence intervals (one look: tables/sequential.py
    freezes each line at the look that decided it)."""
    out = []
    expected = []
    if scale is not None:
        for sw in spec.sweeps_for(scale):
            exp = base_experiment(sw.experiment)
            f = {"experiment": exp, "protocol": sweep_protocol(sw)}
            if f not in expected:
                expected.append(f)
    for fd in spec.findings:
        vs = evaluate_finding(fd, units, design)
        if "experiment" in fd.per and expected:
            seen = {v.stratum for v in vs}
            for f in expected:
                known = {k: v for k, v in fd.a if k in f}
                stratum = f"experiment = {f['experiment']}"
                if stratum not in seen and all(facet_is(k, f[k], v) for k, v in known.items()):
                    vs.append(Verdict(fd, stratum, "", reason="no runs of this experiment", design=design))
            vs = [v for v in vs if v.stratum or v.mean is not None or not any(x.stratum for x in vs)]
        out += vs
    for v in out:
        v.scale = scale
    adjust_family(out)
    return out


def adjust_family(verdicts: list[Verdict]) -> None:
    """Each verdict's decisive p-value and its Holm adjustment over the family: every verdict of the table
    that was judged (not the ones not tested or without an interval). A sequential line's p is its design's
    repeated p-value (valid at whichever look the line stopped), so Holm adjusts it like any other."""
    for v in verdicts:
        half = None if v.lo is None else (v.hi - v.lo) / 2
        df = len(v.diffs) - 1 if v.diffs else None
        if v.not_tested or v.verdict == BY_CONSTRUCTION:  # nothing judged: no test joins the family
            v.p = None
            continue
        if v.design is None:
            v.p = decisive_p(v.rule, v.mean, half, df)
            continue
        c = v.design.critical(len(v.diffs))
        v.p = (None if c is None or half is None else
               v.design.repeated_p(decisive_p(v.rule, v.mean, half, df, quantile=c)))
    adjusted = holm([v.p for v in verdicts])
    family = sum(p is not None for p in adjusted)
    for v, pa in zip(verdicts, adjusted):
        v.p_holm, v.family = pa, (family if pa is not None else None)


def p_of_file(f: dict[str, Any]) -> float | None:
    """A stored line's decisive p-value: as stored, or (a file from before p-values were stored) from its interval
    under the sign rule it was judged by; None for a line that judged nothing."""
    if f.get("verdict") in ("not tested", BY_CONSTRUCTION):
        return None
    if "p" in f:
        return f["p"]
    lo, hi, diffs = f.get("lo"), f.get("hi"), f.get("diffs") or []
    half = None if lo is None or hi is None else (hi - lo) / 2
    return decisive_p(Rule("sign", int(f.get("expected_sign") or 1)), f.get("mean"), half, len(diffs) - 1 if diffs else None)


def holm_of_file(findings: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(Holm verdict, its cell) of each finding of one findings.json: as stored, or, for a file written before
    the Holm column existed, recomputed from its stored intervals under the sign rule it was judged by."""
    if all("holm_verdict" in f for f in findings):
        return [(f["holm_verdict"], "—" if f["verdict"] == "not tested" or f.get("family") is None else
                 f"{f['holm_verdict']} (family {f['family']}, p_Holm {f['p_holm']:.3g})") for f in findings]
    ps = []
    for f in findings:
        lo, hi, diffs = f.get("lo"), f.get("hi"), f.get("diffs") or []
        half = None if lo is None or hi is None else (hi - lo) / 2
        ps.append(decisive_p(Rule("sign", int(f.get("expected_sign") or 1)), f.get("mean"), half, len(diffs) - 1 if diffs else None))
    adjusted = holm(ps)
    family = sum(p is not None for p in adjusted)
    return [(adjusted_verdict(f["verdict"], pa), "—" if pa is None else
             f"{adjusted_verdict(f['verdict'], pa)} (family {family}, p_Holm {pa:.3g})") for f, pa in zip(findings, adjusted)]
