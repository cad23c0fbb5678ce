"""Aggregate a table from its runs' results.json files (never imports the model or trainer).

For every sweep of the table the expected jobs come from the sweep grid (spec.py);
each expected configuration becomes one row, its seeds pooled: mean with a 95% t-interval
over seeds (`m ± h`), accuracies also with a 95% Wilson interval over one run's test
examples. Configurations (and seeds) without a results.json are listed as missing,
failed runs as failed (with their error), runs outside the grid as extra rows: nothing
is silently dropped. The report ends with the paper's findings (spec.FINDINGS), each a
paired difference across seeds with its interval and a verdict computed from it;
`write` also regenerates the verdict summary `README.md` next to the tables.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looplab.stats import (  # noqa: F401  (t_quantile, z_quantile: part of the report's surface)
    LEVEL, Stat, adjusted_verdict, decisive_p, eval_batches, holm, judge, t_interval, t_quantile, wilson_interval,
    z_quantile,
)
from looplab.runs import Run, load_runs, parse_overrides  # noqa: F401  (part of the report's surface)
from looplab.tables.spec import (DEFAULT_EXITS_JSON, DEFAULT_ROUTING_JSON, DEFAULT_SPECULATION_JSON, SCALES, Finding, Sweep, TableSpec,
                                 default_seeds, get)

DEFAULT_OUT_ROOT = Path("outputs/tables")
DEFAULT_TABLE_DIR = Path("experiments/tables")
DEFAULT_DECODE_JSON = Path("bench/decode.json")


# ----------------------------------------------------------------------------- stats (looplab/stats.py)
def stat(runs: list[Run], get_value, examples=None) -> Stat:
    """Stat of get_value(results) over runs; examples(run) → that run's test examples (accuracy)."""
    vals = []
    for r in runs:
        v = _value(get_value, r.data)
        if v is not None:
            vals.append(v)
    ns = [examples(r) for r in runs] if examples else []
    ns = [x for x in ns if x]
    return Stat(vals, min(ns) if ns else None)


def _value(get_value, data) -> float | None:
    try:
        v = get_value(data)
    except (KeyError, TypeError, IndexError, AttributeError):
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def paired_stat(runs_a: list[Run], runs_b: list[Run], get_value) -> Stat:
    """A − B over the seeds both arms have (paired: same seed in both)."""
    b = {str(r.seed): _value(get_value, r.data) for r in runs_b}
    diffs = []
    for r in runs_a:
        va, vb = _value(get_value, r.data), b.get(str(r.seed))
        if va is not None and vb is not None:
            diffs.append(va - vb)
    return Stat(diffs)


# ----------------------------------------------------------------------------- evaluation sizes
def held_out_size(data: dict[str, Any]) -> tuple[int | None, str]:
    """(scored test items, unit) of one run, from the config its results.json records.

    Synthetic tasks: answer positions = examples of the test split (`dataset.test_size`, cut by
    `trainer.limit_test_batches`). Language modelling: target tokens = windows of `dataset.seq_len`
    among the first `dataset.val_tokens` held-out tokens (cut by limit_test_batches); this assumes
    the held-out split has at least val_tokens tokens (lm_tiny: 142,881; the Pile: 16.8M prepared).
    """
    cfg = data.get("config") or {}
    ds, tr = cfg.get("dataset") or {}, cfg.get("trainer") or {}
    split = data.get("final_split") or "test"
    limit = tr.get("limit_test_batches" if split == "test" else "limit_val_batches")
    try:
        if "task" in ds:
            size, batch = ds.get("test_size" if split == "test" else "val_size"), ds.get("batch_size")
            if not size or not batch:
                return None, "examples"
            return min(int(size), eval_batches(limit, math.ceil(size / batch)) * int(batch)), "examples"
        T, vt = ds.get("seq_len"), ds.get("val_tokens")
        batch = ds.get("val_batch_size") or ds.get("batch_size")
        if not T or not vt or not batch:
            return None, "tokens"
        windows = int(vt) // int(T)
        return min(windows, eval_batches(limit, math.ceil(windows / batch)) * int(batch)) * int(T), "tokens"
    except (TypeError, ValueError):
        return None, "examples" if "task" in ds else "tokens"


def _examples(run: Run) -> int | None:
    return held_out_size(run.data)[0]


def _zeroshot_items(z: dict[str, Any]) -> int | None:
    ns = [v for v in (z.get("n_samples") or {}).values() if isinstance(v, int)]
    return sum(ns) or None


# ----------------------------------------------------------------------------- findings
@dataclass
class Unit:
    """One run (or, for table 4, one model at one context) as the findings see it."""

    facets: dict[str, Any]
    rep: str  # what pairs A with B: the seed (table 4: the repeated timing)
    data: dict[str, Any]
    examples: int | None = None  # test examples of the run (accuracy)
    zeroshot: dict[str, Any] | None = None

    def value(self, metric: str, q: str | None = None) -> float | None:
        d = self.data
        if metric == "perplexity":
            return _value(lambda d: d["perplexity"], d)
        if metric == "accuracy":
            return _value(lambda d: d["exit"][q]["acc"], d) if q else _value(lambda d: d["accuracy"], d)
        if metric in ("exit step", "exit fraction"):
            R = _value(lambda d: d["model"]["loops"], d)
            if q:
                step = _value(lambda d: d["exit"][q]["answer_step"], d)
                step = step if step is not None else _value(lambda d: d["exit"][q]["mean_step"], d)
            else:
                step = R  # a fixed-loop model always uses all R loops
            if metric == "exit step" or step is None:
                return step
            return step / R if R else None
        if metric == "zero-shot":
            return _value(lambda z: z["average_acc"], self.zeroshot) if self.zeroshot else None
        if metric == "latency":
            return _value(lambda d: d["latency"], d)
        if metric == "accuracy at 2R":  # table 9: the final model tested at twice its trained depth
            return _value(lambda d: d["per_depth"]["eval_loops"][str(2 * d["model"]["loops"])]["accuracy"], d)
        if metric == "accuracy at R":  # table 9's precondition: the final model at its trained depth
            v = _value(lambda d: d["per_depth"]["eval_loops"][str(d["model"]["loops"])]["accuracy"], d)
            return v if v is not None else _value(lambda d: d["accuracy"], d)
        if metric in ("causal perplexity", "causal accuracy"):  # table 12: each token's depth chosen causally
            return _value(lambda d: _causal(d, metric.split()[1]), d)
        if metric == "training tokens/s":
            return _value(lambda d: d["throughput"]["tokens_per_s"], d)
        if metric in ("decode tokens/s", "KV bytes"):  # table 12: bench/routed_decode.py, merged in by build_routing
            return _value(lambda d: d["decode"]["tokens_per_s" if metric == "decode tokens/s" else "kv_bytes"], d)
        if metric == "unigram perplexity":  # recorded by LM runs (train.py): the bar of the LM_LEARNED precondition
            return _value(lambda d: d["unigram_perplexity"], d)
        raise ValueError(f"unknown finding metric {metric!r}")

    def n_examples(self, metric: str) -> int | None:
        if metric in ("accuracy", "accuracy at 2R"):
            return self.examples
        if metric == "zero-shot" and self.zeroshot:
            return _zeroshot_items(self.zeroshot)
        return None

    def config(self) -> tuple:
        return tuple(sorted((k, str(v)) for k, v in self.facets.items()))

    def label(self) -> str:
        f = self.facets
        parts = [str(f[k]) for k in ("model", "mode", "arm") if f.get(k) is not None]
        if f.get("N") is not None and f.get("model") is None:
            parts.append(f"{f['N']}⊗{f['R']}")
        if f.get("size"):
            parts.append(str(f["size"]))
        return " ".join(parts) or "?"


PROPORTIONS = ("accuracy", "accuracy at 2R", "zero-shot")  # metrics whose paired intervals also carry the examples' sampling noise


@dataclass
class Verdict:
    """One line of a table's findings: a paired difference, its 95% interval and the verdict.

    not_tested: why an arm missed the finding's precondition (then no comparison is judged);
    p / p_holm / family: the p-value the plain verdict rests on (looplab.stats.decisive_p), its Holm
    adjustment over the table's family of verdicts, and that family's size."""

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

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.diffs) if self.diffs else None

    @property
    def verdict(self) -> str:
        return "not tested" if self.not_tested else judge(self.finding.rule, self.lo, self.hi)

    @property
    def holm_verdict(self) -> str:
        return adjusted_verdict(self.verdict, self.p_holm)

    def _fmt(self, v: float) -> str:
        if self.finding.contrast == "ratio":
            return f"{100 * v:+.2f}%"
        return f"{v:+.3f}" if self.finding.metric != "perplexity" or abs(v) < 100 else f"{v:+.1f}"

    def size_note(self) -> str:
        """What the interval says about the paper's size, for claims that state one."""
        fd = self.finding
        if fd.size is None or self.lo is None:
            return ""
        x = self._fmt(fd.size)
        if fd.kind == "at_most":
            return f"bound: the paper's {x}"
        if fd.kind == "near":
            return f"band: the paper's {x} ± {self._fmt(fd.tolerance).lstrip('+')}"
        inside = self.lo <= fd.size <= self.hi
        return f"the paper's {x} is {'inside' if inside else 'outside'} the interval"

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
        if self.verdict in ("not tested",) or self.family is None:
            return "—"
        p = "" if self.p_holm is None else f", p_Holm {self.p_holm:.3g}"
        return f"{self.holm_verdict} (family {self.family}{p})"

    def line(self) -> str:
        return (f"- **{self.verdict}** (Holm: {self.holm_text()}) — {self.title()}. Paper: {self.finding.claim}. "
                f"Here: {self.measured()}.")

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.finding.label, "metric": self.finding.metric, "claim": self.finding.claim,
                "expected_sign": self.finding.sign, "kind": self.finding.kind, "size": self.finding.size,
                "tolerance": self.finding.tolerance, "requires": [p.describe() for p in self.finding.requires],
                "stratum": self.stratum, "arms": self.arms, "title": self.title(),
                "diffs": self.diffs, "reps": self.reps, "mean": self.mean, "lo": self.lo, "hi": self.hi,
                "missing": self.missing, "measured": self.measured(), "not_tested": self.not_tested,
                "p": self.p, "p_holm": self.p_holm, "family": self.family,
                "verdict": self.verdict, "holm_verdict": self.holm_verdict}


def decide(lo: float | None, hi: float | None, expected_sign: int) -> str:
    """The sign rule (looplab.stats.judge with a sign Rule): reproduced when the interval excludes 0 on the
    paper's side, contradicted on the other, else inconclusive."""
    from looplab.stats import Rule

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
        if not _facet_is(k, u.facets.get(k), v):
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


def evaluate_finding(fd: Finding, units: list[Unit]) -> list[Verdict]:
    filters = [fd.a, fd.b] + (list(fd.minus) if fd.minus else [])
    if not any(_matches(u, f) for u in units for f in filters):
        return [Verdict(fd, "", "", reason="no runs of these arms")]
    out = []
    for stratum, arms, terms in comparisons(fd, units):
        if isinstance(terms, str):
            out.append(Verdict(fd, stratum, arms, reason=terms))
            continue
        v = _paired(fd, stratum, arms, terms)
        v.not_tested = check_preconditions(fd, terms)
        out.append(v)
    return out


def _paired(fd: Finding, stratum: str, arms: str, terms) -> Verdict:
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
    v = Verdict(fd, stratum, arms, diffs, reps, missing)
    if len(diffs) < 2:
        v.reason = f"an interval needs ≥ 2 paired {'repeated timings' if fd.metric == 'latency' else 'seeds'}"
        return v
    lo, hi = t_interval(diffs)
    if fd.metric in PROPORTIONS:
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
        h = math.sqrt(h_t ** 2 + h_ex ** 2)
        mid = statistics.fmean(diffs)
        lo, hi = mid - h, mid + h
        if not known:
            v.reason = "test-example counts unknown: t over seeds only"
    v.lo, v.hi = lo, hi
    return v


def evaluate_findings(spec: TableSpec, units: list[Unit], scale: str | None = None) -> list[Verdict]:
    """Every finding of the table; per-experiment findings also get a line for each expected experiment
    of the table's sweeps that has no runs at all (so a missing sweep is visible among the verdicts)."""
    out = []
    expected = []
    if scale is not None:
        for sw in spec.sweeps_for(scale):
            exp = _base_experiment(sw.experiment)
            f = {"experiment": exp, "protocol": _protocol(sw)}
            if f not in expected:
                expected.append(f)
    for fd in spec.findings:
        vs = evaluate_finding(fd, units)
        if "experiment" in fd.per and expected:
            seen = {v.stratum for v in vs}
            for f in expected:
                known = {k: v for k, v in fd.a if k in f}
                stratum = f"experiment = {f['experiment']}"
                if stratum not in seen and all(_facet_is(k, f[k], v) for k, v in known.items()):
                    vs.append(Verdict(fd, stratum, "", reason="no runs of this experiment"))
            vs = [v for v in vs if v.stratum or v.mean is not None or not any(x.stratum for x in vs)]
        out += vs
    adjust_family(out)
    return out


def adjust_family(verdicts: list[Verdict]) -> None:
    """Each verdict's decisive p-value and its Holm adjustment over the family: every verdict of the table
    that was judged (not the ones not tested or without an interval)."""
    for v in verdicts:
        half = None if v.lo is None else (v.hi - v.lo) / 2
        v.p = None if v.not_tested else decisive_p(v.finding.rule, v.mean, half, len(v.diffs) - 1 if v.diffs else None)
    adjusted = holm([v.p for v in verdicts])
    family = sum(p is not None for p in adjusted)
    for v, pa in zip(verdicts, adjusted):
        v.p_holm, v.family = pa, (family if pa is not None else None)


def _protocol(sw) -> str | None:
    """Table 7's comparison protocol(s) of a sweep: 'isoparam', 'isoflop', or 'isoparam+isoflop' for a sweep
    that holds both (the tiny ones: the shared looped arm is trained once), from the experiment's tags or,
    failing that, its name."""
    tags = set(sw.experiment_tags()) | {p for p in ("isoparam", "isoflop") if p in sw.experiment}
    found = [p for p in ("isoparam", "isoflop") if p in tags]
    return "+".join(found) or None


def _facet_is(key: str, value: Any, want: str) -> bool:
    """A facet equals a filter value; a sweep holding both protocols matches either."""
    if key == "protocol" and value is not None:
        return want in str(value).split("+")
    return str(value) == want


def _base_experiment(name: str) -> str:
    for suffix in ("_tiny", "_paper"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def run_facets(cell: "Cell", run: Run) -> dict[str, Any]:
    m = run.data.get("model") or {}
    N, R = m.get("layers"), m.get("loops")
    if (N is None or R is None) and cell.combo.get("loop_depth"):
        N, R = (int(x) for x in cell.combo["loop_depth"].split("x"))
    exp = _base_experiment(cell.sweep.experiment)
    return {
        "experiment": exp,
        "protocol": _protocol(cell.sweep),
        "arm": cell.combo.get("arm"),
        "injection": cell.combo.get("loop_depth.injection"),
        "size": cell.combo.get("backbone"),
        "backbone": m.get("backbone"),
        "state": m.get("state_mode"),
        "N": N, "R": R, "NR": N * R if N and R else None,
    }


def units_for(cells: list["Cell"], mode_of=None) -> list[Unit]:
    units = []
    for c in cells:
        for r in c.ok:
            f = run_facets(c, r)
            if mode_of is not None:
                f["mode"] = mode_of(c)
            units.append(Unit(f, str(r.seed), r.data, _examples(r), r.zeroshot()))
    return units


# ----------------------------------------------------------------------------- table
METHOD = ("95% intervals: `m ± h` is the mean over seeds with its t-interval (h = t₀.₉₇₅,ₙ₋₁·s/√n, n seeds; "
          "a single seed has none); accuracies also show the Wilson interval over the test examples of one run at "
          "the seed-mean accuracy; paired differences (findings, Δ columns) are A − B per seed, same seed in both "
          "arms, with the t-interval over those differences, for accuracies widened by the examples' sampling "
          "noise (half-widths added in quadrature)")


@dataclass
class Table:
    spec: TableSpec
    scale: str
    columns: list[str]
    rows: list[dict[str, Any]]  # values: str, int, float or Stat
    missing: list[str] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    verdicts: list[Verdict] = field(default_factory=list)
    seeds: list[int] | None = None  # the seeds every configuration should have (None: whatever ran)
    sizes: str = ""  # the held-out evaluation size per run
    method: str = METHOD

    @property
    def stem(self) -> str:
        return f"table{self.spec.number}" + ("" if self.scale == "tiny" else f"-{self.scale}")

    def setting(self) -> str:
        parts = [self.spec.notes.get(self.scale, "")]
        if self.spec.kind != "decode":
            parts.append("seeds: " + (", ".join(map(str, self.seeds)) + " per configuration" if self.seeds
                                      else "the runs found (`seeds` column)"))
        if self.sizes:
            parts.append(f"held-out evaluation per run: {self.sizes}")
        parts.append(self.method)
        return ". ".join(p[0].upper() + p[1:].rstrip(".") for p in parts if p) + "."

    def markdown(self) -> str:
        out = [f"# Table {self.spec.number} — {self.spec.title} ({self.scale} scale)", "", f"Setting: {self.setting()}", ""]
        out += [f"_{n}_" for n in self.notes] + ([""] if self.notes else [])
        if self.rows:
            out.append("| " + " | ".join(self.columns) + " |")
            out.append("|" + "|".join("---" for _ in self.columns) + "|")
            for row in self.rows:
                out.append("| " + " | ".join(_cell(row.get(c)) for c in self.columns) + " |")
        else:
            out.append("(no completed runs)")
        if self.summary:
            out += ["", "Summary:", ""] + [f"- {k}: {_cell(v)}" for k, v in self.summary.items()]
        out += ["", f"Missing runs ({len(self.missing)}): " + ("none" if not self.missing else "")]
        out += [f"- {m}" for m in self.missing]
        out += ["", f"Failed runs ({len(self.failed)}): " + ("none" if not self.failed else "")]
        out += [f"- {f['config']} — {f['error']} ({f['path']})" for f in self.failed]
        judged = sum(v.family is not None for v in self.verdicts)
        out += ["", "## Findings", "", "The papers' claims (experiments/README.md), each checked as a paired difference "
                "A − B with its 95% interval (arms with common random numbers: the same initial values of every shared "
                "parameter and the same batches). Sign claims: **reproduced** = the interval excludes 0 on the paper's "
                "side, **contradicted** = on the other side, **inconclusive** = it contains 0 (or could not be computed); "
                "claims of a size are judged against it (at most X: the whole interval ≤ X; about X ± δ: inside the band); "
                "**not tested** = an arm missed the finding's precondition (named with its figure). Holm: the verdict "
                f"after Holm's adjustment over this table's {judged} judged line(s).", ""]
        out += [v.line() for v in self.verdicts] or ["(this table checks no finding)"]
        return "\n".join(out) + "\n"

    def csv(self) -> str:
        cols: list[str] = []
        wilson = set()
        for c in self.columns:
            cols.append(c)
            if any(isinstance(r.get(c), Stat) for r in self.rows):
                cols += [f"{c} lo", f"{c} hi", f"{c} std", f"{c} n"]
                if any(isinstance(r.get(c), Stat) and r[c].examples for r in self.rows):
                    cols += [f"{c} wilson lo", f"{c} wilson hi", f"{c} examples"]
                    wilson.add(c)
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(cols)
        for r in self.rows:
            line = []
            for c in self.columns:
                v = r.get(c)
                has_stat = f"{c} std" in cols
                if isinstance(v, Stat):
                    ci = v.interval or (None, None)
                    line += [_num(v.mean), _num(ci[0]), _num(ci[1]), _num(v.std), v.n]
                    if c in wilson:
                        wi = v.wilson or (None, None)
                        line += [_num(wi[0]), _num(wi[1]), v.examples or ""]
                else:
                    line.append("" if v is None else v)
                    if has_stat:
                        line += ["", "", "", ""] + (["", "", ""] if c in wilson else [])
            w.writerow(line)
        return buf.getvalue()

    def value(self, row: dict[str, Any], column: str) -> float | None:
        v = row.get(column)
        return v.mean if isinstance(v, Stat) else v if isinstance(v, (int, float)) else None

    def findings_json(self) -> dict[str, Any]:
        return {"table": self.spec.number, "title": self.spec.title, "scale": self.scale, "stem": self.stem,
                "seeds": self.seeds, "sizes": self.sizes, "missing": len(self.missing), "failed": len(self.failed),
                "findings": [v.as_dict() for v in self.verdicts]}


def _num(v):
    return "" if v is None else f"{v:.6g}"


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, Stat):
        return v.fmt()
    if isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, float) for x in v):
        return f"[{v[0]:.3f}, {v[1]:.3f}]"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v)


def _sizes(cells: list["Cell"]) -> str:
    found: dict[str, set[int]] = {}
    unknown = False
    for c in cells:
        for r in c.ok:
            n, unit = held_out_size(r.data)
            if n is None:
                unknown = True
            else:
                found.setdefault(unit, set()).add(n)
    parts = []
    for unit, ns in sorted(found.items()):
        lo, hi = min(ns), max(ns)
        parts.append(f"{lo:,} {unit}" if lo == hi else f"{lo:,}–{hi:,} {unit}")
    if unknown:
        parts.append("unknown for runs whose results.json records no dataset config")
    what = {"examples": " (test examples; accuracy is scored at each one's answer)",
            "tokens": " (held-out target tokens)"}
    return "; ".join(p + what.get(p.split()[-1], "") for p in parts)


# ----------------------------------------------------------------------------- grouping
@dataclass
class Cell:
    """One configuration of a sweep: its expected combo and the runs found for it."""

    sweep: Sweep
    combo: dict[str, str]
    ok: list[Run]
    failed: list[Run]
    expected: bool = True

    def label(self) -> str:
        return self.sweep.folder + (" " + " ".join(f"{k}={v}" for k, v in self.combo.items()) if self.combo else "")


def cells_for(sweep: Sweep, folder: Path) -> list[Cell]:
    """The sweep's expected configurations (seed folded in) with their runs, then any extra runs."""
    runs = load_runs(folder)
    grid = sweep.grid()
    used: set[int] = set()
    cells = []
    for combo in grid:
        mine = [r for r in runs if all(r.swept.get(k) == v for k, v in combo.items())]
        used |= {id(r) for r in mine}
        cells.append(Cell(sweep, combo, [r for r in mine if r.ok], [r for r in mine if not r.ok]))
    keys = list(grid[0]) if grid else []
    extra: dict[tuple, list[Run]] = {}
    for r in runs:
        if id(r) not in used:
            extra.setdefault(tuple((k, r.swept.get(k, "?")) for k in keys), []).append(r)
    for key, rs in extra.items():
        cells.append(Cell(sweep, dict(key), [r for r in rs if r.ok], [r for r in rs if not r.ok], expected=False))
    return cells


def _nxr(cell: Cell) -> str:
    for r in cell.ok:
        m = r.data.get("model") or {}
        if m.get("layers"):
            return f"{m['layers']}⊗{m['loops']}"
    ld = cell.combo.get("loop_depth")
    return ld.replace("x", "⊗") if ld else "?"


def _first(cell: Cell, *path, default=None):
    for r in cell.ok:
        v: Any = r.data
        try:
            for p in path:
                v = v[p]
        except (KeyError, TypeError, IndexError):
            continue
        if v is not None:
            return v
    return default


def _base_row(cell: Cell) -> dict[str, Any]:
    row = {
        "experiment": cell.sweep.folder + ("" if cell.expected else " (extra)"),
        "backbone": _first(cell, "model", "backbone", default="?"),
        "N⊗R": _nxr(cell),
        "state": _first(cell, "model", "state_mode", default=cell.combo.get("arm", "?")),
        "seeds": len(cell.ok),
        "params": _first(cell, "params", "total"),
        "FLOPs/token": _first(cell, "flops_per_token", "forward"),
        "steps": _first(cell, "global_step"),
    }
    if cell.combo.get("arm"):
        row["arm"] = cell.combo["arm"]
    if cell.combo.get("backbone"):
        row["size"] = cell.combo["backbone"]
    return row


def _bookkeeping(cells: list[Cell], table: Table) -> None:
    for c in cells:
        if c.expected and table.seeds:
            have = {str(r.seed) for r in c.ok} | {str(r.seed) for r in c.failed}
            table.missing += [f"{c.label()} seed={s}" for s in table.seeds if str(s) not in have]
        elif not c.ok and not c.failed:
            table.missing.append(c.label())
        for r in c.failed:
            seed = f" seed={r.seed}" if r.seed is not None else ""
            table.failed.append({"config": c.label() + seed,
                                 "error": str(r.data.get("error", "unknown error")).splitlines()[0][:300],
                                 "path": str(r.path)})


def _per_depth(cell: Cell) -> str:
    R = _first(cell, "model", "loops") or 0
    parts = []
    for k in range(R):
        s = stat(cell.ok, lambda d, k=k: d["per_depth"]["acc"][k])
        parts.append("—" if s.mean is None else f"{s.mean:.2f}")
    return " / ".join(parts) if parts else "—"


def _causal(d: dict[str, Any], what: str) -> float | None:
    """Table 12: a run's perplexity / accuracy / mean depth with each token's depth chosen causally, as decoding
    chooses it: a depth router's inference routing (results.json routing.causal_*), the exit gate's exit at
    q = EXIT_Q (exit.<q>), every loop for a fixed-depth model."""
    from looplab.targets import EXIT_Q

    routing, gate = d.get("routing"), (d.get("exit") or {}).get(str(EXIT_Q))
    if routing:
        v = routing.get(f"causal_{what}" if what != "depth" else "causal_mean_depth")
    elif gate and gate.get("loss") is not None:
        v = {"perplexity": math.exp(min(gate["loss"], 50.0)), "accuracy": gate.get("acc"), "depth": gate.get("mean_step")}[what]
    else:
        v = {"perplexity": d.get("perplexity"), "accuracy": d.get("accuracy"), "depth": d["model"]["loops"]}[what]
    return v * d["model"]["layers"] if what == "depth" and v is not None else v  # depth: layers run per token


def _training_flops_per_token(run: Run) -> float | None:
    """Analytic training FLOPs per token of the run's model (LoopedLM.flops_per_token, a depth router's loops
    at its capacities), from its checkpoint's config; results.json's figure when there is no checkpoint."""
    ckpt = run.path / "checkpoints" / "last.ckpt"
    seq = _value(lambda d: d["flops_per_token"]["seq_len"], run.data)
    if ckpt.exists() and seq:
        try:
            from looplab.checkpoint import load_model

            model, _ = load_model(ckpt, map_location="cpu")
            return float(model.flops_per_token(int(seq), training=True))
        except Exception:  # noqa: BLE001 — an unreadable checkpoint falls back to what the run recorded
            pass
    return _value(lambda d: d["flops_per_token"]["training"], run.data)


# ----------------------------------------------------------------------------- builders per kind
def _build_runs(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None) -> tuple[Table, list[Cell]]:
    table = Table(spec, scale, [], [], seeds=seeds)
    cells: list[Cell] = []
    for sw in spec.sweeps_for(scale):
        cells += cells_for(sw, Path(out_root) / f"table{spec.number}" / scale / sw.folder)
    _bookkeeping(cells, table)
    table.sizes = _sizes(cells)
    return table, cells


def _wilson_cell(s: Stat):
    return s.wilson if isinstance(s, Stat) else None


def build_lm(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    return _lm(spec, scale, out_root, seeds)[0]


def _lm(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None) -> tuple[Table, list[Cell]]:
    table, cells = _build_runs(spec, scale, out_root, seeds)
    zs_any = False
    for c in cells:
        if not c.ok:
            continue
        row = _base_row(c)
        row["perplexity"] = stat(c.ok, lambda d: d["perplexity"])
        row["loss"] = stat(c.ok, lambda d: d["loss"])
        zs = [(z, _zeroshot_items(z)) for z in (r.zeroshot() for r in c.ok) if z and z.get("average_acc") is not None]
        if zs:
            ns = [n for _, n in zs if n]
            row["zero-shot avg"] = Stat([float(z["average_acc"]) for z, _ in zs], min(ns) if ns else None)
            row["zero-shot Wilson 95%"] = _wilson_cell(row["zero-shot avg"])
        else:
            row["zero-shot avg"] = "n/a"
        zs_any |= bool(zs)
        row["state overhead"] = _first(c, "state_branch_overhead")
        table.rows.append(row)
    base = ["experiment", "backbone", "N⊗R", "state", "seeds", "perplexity", "loss", "zero-shot avg", "zero-shot Wilson 95%",
            "params", "state overhead", "FLOPs/token", "steps"]
    if not zs_any:
        base.remove("zero-shot Wilson 95%")
    if any("size" in r for r in table.rows):
        base.insert(1, "size")
    table.columns = ["experiment", "arm"] + base[1:] if any("arm" in r for r in table.rows) else base
    if not zs_any:
        table.notes.append("zero-shot avg: n/a — " + (f"run `python -m looplab.tables zeroshot {spec.number} --scale {scale}"
                           + (" --tasks looplab_tiny" if scale == "tiny" else "") + "` to fill it"))
    else:
        table.notes.append("zero-shot avg: mean accuracy over the suite's tasks (zeroshot.json of each run); "
                           "Wilson interval over the suite's items of one run")
    table.verdicts = evaluate_findings(spec, units_for(cells), scale)
    return table, cells


def build_task(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    table, cells = _build_runs(spec, scale, out_root, seeds)
    for c in cells:
        if not c.ok:
            continue
        row = _base_row(c)
        row["accuracy"] = stat(c.ok, lambda d: d["accuracy"], _examples)
        row["Wilson 95% (examples)"] = _wilson_cell(row["accuracy"])
        row["acc per loop depth (1..R)"] = _per_depth(c)
        table.rows.append(row)
    table.columns = ["experiment", "backbone", "N⊗R", "seeds", "accuracy", "Wilson 95% (examples)", "acc per loop depth (1..R)",
                     "params", "FLOPs/token", "steps"]
    table.notes.append("accuracy: exact match of the answer token on the held-out test split; "
                       "acc per loop depth: the same model read out after loop 1, 2, … R (shared final norm + head), seed means")
    table.verdicts = evaluate_findings(spec, units_for(cells), scale)
    return table


def build_extrapolation(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    """Table 9: per training recipe × injection, the metric of the final model at each test-time depth R′."""
    table, cells = _build_runs(spec, scale, out_root, seeds)
    depths: list[int] = sorted({int(k) for c in cells for r in c.ok
                                for k in ((r.data.get("per_depth") or {}).get("eval_loops") or {})})
    metric = "accuracy" if any(_first(c, "accuracy") is not None for c in cells if c.ok) else "perplexity"
    for c in cells:
        if not c.ok:
            continue
        row = _base_row(c)
        row["injection"] = c.combo.get("loop_depth.injection") or _first(c, "config", "loop_depth", "injection", default="none")
        row["trained R"] = _first(c, "model", "loops")
        for k in depths:
            get = (lambda d, k=k: d["per_depth"]["eval_loops"][str(k)][metric])
            row[f"R′ = {k}"] = stat(c.ok, get, _examples if metric == "accuracy" else None)
        table.rows.append(row)
    table.rows.sort(key=lambda r: (r.get("arm") or "", r["injection"]))
    table.columns = ["arm", "injection", "N⊗R", "trained R", "seeds"] + [f"R′ = {k}" for k in depths] + ["steps"]
    table.notes.append(f"R′ = k: test {metric} of the final model run with k loops (`model(ids, n_loops=k)`), mean ± 95% t "
                       "over seeds; the model was trained at R (fixed) or at a depth drawn per step around R (randomized)")
    table.verdicts = evaluate_findings(spec, units_for(cells), scale)
    return table


def _paired_column(table: Table, cells: list[Cell], name: str, ref_arm, note: str) -> None:
    """Δ column: this row's perplexity minus the reference arm's at the same N⊗R, paired by seed."""
    by_key = {(_nxr(c), c.sweep.folder, c.combo.get("backbone"), c.combo.get("arm")): c for c in cells if c.ok and c.expected}
    for row in table.rows:
        ref = by_key.get((row["N⊗R"], row["experiment"], row.get("size"), ref_arm))
        mine = by_key.get((row["N⊗R"], row["experiment"], row.get("size"), row.get("arm")))
        row[name] = (paired_stat(mine.ok, ref.ok, lambda d: d["perplexity"])
                     if ref is not None and mine is not None and mine is not ref else None)
    table.columns.insert(table.columns.index("perplexity") + 1, name)
    table.notes.append(note)


def build_depth(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    table, cells = _lm(spec, scale, out_root, seeds)
    _paired_column(table, cells, "Δ vs looped (paired)", "looped",
                   "Δ vs looped: perplexity of this arm minus Vanilla Looped's at the same N⊗R, paired by seed, "
                   "mean ± 95% t-interval (negative = StateLoop better)")
    return table


def build_reset(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    table, cells = _lm(spec, scale, out_root, seeds)
    _paired_column(table, cells, "Δ vs carry (paired)", "stateloop",
                   "Δ vs carry: perplexity of this arm minus the carrying StateLoop's, paired by seed, mean ± 95% "
                   "t-interval (positive = resetting the state hurts)")
    return table


def _exit_step(d: dict[str, Any], q: str) -> float | None:
    """Mean exit step at the scored positions: the answers (tasks) or every target token (LM)."""
    e = (d.get("exit") or {}).get(q) or {}
    return e.get("answer_step") if e.get("answer_step") is not None else e.get("mean_step")


def _exit_rows(cell: Cell, mode: str) -> list[dict[str, Any]]:
    base = {"experiment": cell.sweep.experiment, "backbone": _first(cell, "model", "backbone", default="?"),
            "N⊗R": _nxr(cell), "state": _first(cell, "model", "state_mode", default="?"), "mode": mode,
            "seeds": len(cell.ok), "steps": _first(cell, "global_step")}
    rows = []
    if mode == "fixed loops":
        R = _first(cell, "model", "loops") or 0
        for k in range(R):
            acc = stat(cell.ok, lambda d, k=k: d["per_depth"]["acc"][k], _examples)
            rows.append({**base, "setting": f"exit at step {k + 1}", "accuracy": acc, "Wilson 95% (examples)": _wilson_cell(acc),
                         "mean exit step": float(k + 1),
                         "loss": stat(cell.ok, lambda d, k=k: d["per_depth"]["loss"][k])})
        return rows
    qs = sorted({q for r in cell.ok for q in (r.data.get("exit") or {})}, key=float)
    for q in qs:
        acc = stat(cell.ok, lambda d, q=q: d["exit"][q]["acc"], _examples)
        rows.append({**base, "setting": f"q = {q}", "accuracy": acc, "Wilson 95% (examples)": _wilson_cell(acc),
                     "mean exit step": stat(cell.ok, lambda d, q=q: _exit_step(d, q)),
                     "loss": stat(cell.ok, lambda d, q=q: d["exit"][q]["loss"])})
    return rows


def _exit_mode(c: Cell) -> str:
    if c.sweep.init_from is not None:
        return "stage 2"
    gate = c.combo.get("exit_gate") or _first(c, "model", "exit_gate", default="?")
    return "fixed loops" if gate == "none" else "stage 1"


def build_exit(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    table, cells = _build_runs(spec, scale, out_root, seeds)
    for c in cells:
        if c.ok:
            table.rows += _exit_rows(c, _exit_mode(c))
    order = {"fixed loops": 0, "stage 1": 1, "stage 2": 2}
    table.rows.sort(key=lambda r: (r["experiment"], order.get(r["mode"], 3)))
    table.columns = ["experiment", "backbone", "N⊗R", "state", "mode", "setting", "seeds", "accuracy", "Wilson 95% (examples)",
                     "mean exit step", "loss", "steps"]
    table.notes.append("fixed loops: the exit_gate=none model read out at depth k; stage 1: joint gate training (Ouro); "
                       "stage 2: gate only, backbone frozen and loaded from the fixed-loop run of the same seed (steps: "
                       "the gate's own training steps); q: exit at "
                       "the first depth whose cumulative exit probability reaches q (q > 1 never exits early); mean exit "
                       "step: at the answer positions (tasks) or over all target tokens (LM), mean ± 95% t over seeds")
    table.verdicts = evaluate_findings(spec, units_for(cells, _exit_mode), scale)
    return table


def build_decode(spec: TableSpec, scale: str, out_root: Path, decode_json: Path = DEFAULT_DECODE_JSON,
                 seeds: list[int] | None = None) -> Table:
    table = Table(spec, scale, [], [])
    table.method = ("findings: StateLoop's latency relative to a Vanilla Looped model per context length, paired over "
                    "repeated timings in one process (each the median of a block of consecutive tokens, every model "
                    "timed round-robin), with the 95% t-interval over those repeats")
    data = None
    path = Path(decode_json)
    if path.exists():
        data = json.loads(path.read_text())
    else:
        alt = path.parent / "results.json"  # `make bench` keeps the decode part in bench/results.json
        if alt.exists():
            d = json.loads(alt.read_text()).get("decode")
            if isinstance(d, dict) and d.get("per_token_ms"):
                data, path = d, alt
    if not data or not data.get("per_token_ms"):
        table.missing.append(f"{decode_json}: not found — run `python -m looplab.tables run 4` (or `python -m looplab.bench.decode`)")
        table.verdicts = evaluate_findings(spec, [])
        return table
    contexts = list(data["per_token_ms"])
    models = list(next(iter(data["per_token_ms"].values())))
    for name in models:
        row: dict[str, Any] = {"model": name, "params": (data.get("params") or {}).get(name),
                               "FLOPs/token @512": (data.get("flops_per_token_512") or {}).get(name)}
        for ctx in contexts:
            row[f"ms/token @{ctx}"] = data["per_token_ms"][ctx].get(name)
        table.rows.append(row)
    if data.get("recompute_per_token_ms"):
        row = {"model": "vanilla_R, no cache (recompute)"}
        for ctx, v in data["recompute_per_token_ms"].items():
            row[f"ms/token @{ctx}"] = v
        table.rows.append(row)
    table.columns = ["model", "params", "FLOPs/token @512"] + [f"ms/token @{c}" for c in contexts]
    for key in ("state_overhead", "state_overhead_flops", "ratio_vs_vanilla_r_plus_1", "ratio_vs_vanilla_r_plus_1_flops",
                "state_overhead_attn_mixer", "state_overhead_mamba2_mixer", "cached_speedup_512"):
        if data.get(key) is not None:
            table.summary[key] = data[key]
    _exit_decoding_summary(table, data.get("skip_compute") or {})
    table.notes.append(f"from {path}: dims {data.get('dims')}, {data.get('threads')} thread(s), {data.get('dtype')}, "
                       "medians after warm-up, models timed round-robin")
    rounds = data.get("rounds_ms") or {}
    table.sizes = (f"{len(contexts)} context length(s) ({', '.join(contexts)}), {data.get('repeats', '?')} timed tokens each"
                   + (f" in {data.get('rounds')} repeated timings" if rounds else ""))
    if rounds:
        units = [Unit({"model": name, "context": ctx}, str(i), {"latency": ms}) for ctx, per in rounds.items()
                 for name, series in per.items() for i, ms in enumerate(series)]
    else:  # a decode.json from before repeated timings: one figure per context, no interval
        table.notes.append(f"{path} has no repeated timings (rounds_ms): rerun `make table4` for the findings' intervals")
        units = [Unit({"model": name, "context": ctx}, "0", {"latency": ms}) for ctx, per in data["per_token_ms"].items()
                 for name, ms in per.items()]
    table.verdicts = evaluate_findings(spec, units)
    return table


def _exit_decoding_summary(table: Table, sc: dict[str, Any]) -> None:
    """Table 4's exit columns: trained, gated checkpoints decoding their task (bench/exit_decode.py),
    mean ± 95% t over the checkpoints (seeds) of each state mode; accuracies carry the Wilson
    interval over the answers of one run."""
    if sc.get("skipped") or not sc.get("groups"):
        table.missing.append("exit columns (skip_compute): " + (sc.get("skipped") or "no trained gated checkpoint in "
                                                                "the benchmark JSON; run `make table8`, then `make table4`"))
        return
    q = sc.get("q")
    for mode, g in sc["groups"].items():
        rs = g["runs"]
        answers = rs[0].get("answers")
        where = f"skip_compute, {mode} 1⊗{rs[0].get('n_loops')} stage 2 on {rs[0].get('task')}, q = {q}"
        table.summary[f"{where}: answer accuracy, all loops"] = Stat([r["accuracy"]["all_loops"] for r in rs], answers)
        table.summary[f"{where}: answer accuracy, exit depth (all loops computed)"] = Stat(
            [r["accuracy"]["exact_exit"] for r in rs], answers)
        table.summary[f"{where}: answer accuracy, skip_compute"] = Stat([r["accuracy"]["skip"] for r in rs], answers)
        table.summary[f"{where}: top-1 agreement with the exit depth computed in full"] = Stat(
            [r["top1_agreement_vs_exact_exit"] for r in rs])
        table.summary[f"{where}: mean exit step"] = Stat([r["mean_exit_step"] for r in rs])
        table.summary[f"{where}: speed-up vs all loops (per-token latency)"] = Stat([r["speedup_vs_all_loops"] for r in rs])
    n = {m: len(g["runs"]) for m, g in sc["groups"].items()}
    table.notes.append(f"exit columns: {', '.join(f'{v} {k} checkpoint(s)' for k, v in n.items())} (table 8 stage 2), "
                       f"{sc.get('sequences_per_checkpoint')} test sequences each, decoded token by token")


def build_exitgrid(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None,
                   exits_json: Path | None = None) -> Table:
    """Table 10 from bench/exit_grid.py's JSON: one row per backbone × rule × threshold × handling, mean ± 95% t over
    the checkpoints (seeds); the target line says which configurations reach it."""
    from looplab.targets import EXIT_LOSS_TARGET as TARGET_LOSS, EXIT_SPEEDUP_TARGET as TARGET_SPEEDUP, EXIT_TARGET_TASK as TARGET_TASK

    table, _ = _build_runs(spec, scale, out_root, seeds)  # table 10's own sweeps (the hybrid gates): missing/failed
    table.method = ("rows: mean ± 95% t over the checkpoints (one per seed) of each backbone; accuracies also show the "
                    "Wilson interval over one run's answers; speed-up = median ms/token of all-loops (or exact-exit) "
                    "decoding / skip decoding, the three decoders timed round-robin token by token")
    path = Path(exits_json or DEFAULT_EXITS_JSON)
    if not path.exists():
        table.missing.append(f"{path}: not found — run `make table8` (the gated llama / StateLoop / Mamba-2 runs), then "
                             "`make table10`")
        return table
    data = json.loads(path.read_text())
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for run in data.get("runs", []):
        for row in run["rows"]:
            key = (run.get("task") or "phop", run["backbone"], run["state_mode"], f"{run['n_layers']}⊗{run['n_loops']}",
                   run.get("training", "standard"), row["rule"], row["threshold"], row["handling"])
            groups.setdefault(key, []).append((run, row))
    met = []
    for (task, bb, sm, nr, training, rule, th, h), items in groups.items():
        rows = [r for _, r in items]
        answers = min(r["answers"] for r in rows)
        lost = Stat([r["accuracy"]["all_loops"] - r["accuracy"]["skip"] for r in rows])
        speed = Stat([r["speedup_vs_all_loops"] for r in rows])
        row = {"task": task, "backbone": bb, "state": sm, "N⊗R": nr, "training": training, "rule": rule, "threshold": th,
               "handling": h, "seeds": len(rows), "mean exit step (skip)": Stat([r["mean_exit_step"]["skip"] for r in rows])}
        if task == "lm":  # a language model: perplexity of every next token (accuracy would be top-1 next-token)
            row.update({"perplexity, all loops": Stat([r["perplexity"]["all_loops"] for r in rows]),
                        "perplexity, exact exit": Stat([r["perplexity"]["exact_exit"] for r in rows]),
                        "perplexity, skip": Stat([r["perplexity"]["skip"] for r in rows]),
                        "perplexity added (skip − all loops)": Stat([r["perplexity"]["skip"] - r["perplexity"]["all_loops"]
                                                                      for r in rows])})
        else:
            row.update({"accuracy, all loops": Stat([r["accuracy"]["all_loops"] for r in rows], answers),
                        "accuracy, exact exit": Stat([r["accuracy"]["exact_exit"] for r in rows], answers),
                        "accuracy, skip": Stat([r["accuracy"]["skip"] for r in rows], answers),
                        "accuracy lost (all loops − skip)": lost})
        row.update({
            "speed-up vs all loops": speed,
            "speed-up vs exact exit": Stat([r["speedup_vs_exact_exit"] for r in rows]),
            "ms/token, skip": Stat([r["per_token_ms"]["skip"] for r in rows])})
        on_target_task = task == TARGET_TASK
        row["target"] = "met" if on_target_task and speed.mean >= TARGET_SPEEDUP and lost.mean <= TARGET_LOSS else ""
        if row["target"]:
            met.append(f"{bb} {sm} {training} {rule} {th:g} {h}")
        table.rows.append(row)
    order = {TARGET_TASK: 0, "mano": 1, "lm": 2}
    table.rows.sort(key=lambda r: (order.get(r["task"], 3), r["backbone"], r["state"], r["training"], r["rule"],
                                   r["threshold"], r["handling"]))
    _exit_aware_training(table, {k[1:]: v for k, v in groups.items() if k[0] == TARGET_TASK})
    ppl = ["perplexity, all loops", "perplexity, exact exit", "perplexity, skip", "perplexity added (skip − all loops)"]
    table.columns = ["task", "backbone", "state", "N⊗R", "training", "rule", "threshold", "handling", "seeds",
                     "accuracy, all loops", "accuracy, exact exit", "accuracy, skip", "accuracy lost (all loops − skip)",
                     *(ppl if any(r["task"] == "lm" for r in table.rows) else []), "mean exit step (skip)",
                     "speed-up vs all loops", "speed-up vs exact exit", "ms/token, skip", "target"]
    ssm = [m for m in met if not m.split()[-1] == "kv_copy"]
    table.summary[f"target (issue 16): skip decoding ≥ {TARGET_SPEEDUP}× faster than all loops, ≤ {100 * TARGET_LOSS:g} "
                  f"point of accuracy lost, on {TARGET_TASK}, on some Mamba-2 or hybrid configuration (seed means)"] = (
        "**met** by " + "; ".join(ssm) if ssm else "**not met** by any Mamba-2 or hybrid configuration")
    within = [r for r in table.rows if r["task"] == TARGET_TASK and r["handling"] != "kv_copy"
              and r["accuracy lost (all loops − skip)"].mean <= TARGET_LOSS]
    if within:  # the fastest configuration that keeps the accuracy, whether or not it is fast enough
        b = max(within, key=lambda r: r["speed-up vs all loops"].mean)
        table.summary[f"fastest Mamba-2 / hybrid configuration on {TARGET_TASK} within {100 * TARGET_LOSS:g} point of "
                      f"all-loops accuracy: {b['backbone']} {b['N⊗R']} {b['training']}, {b['rule']} {b['threshold']:g}, "
                      f"{b['handling']} (mean exit step {b['mean exit step (skip)'].mean:.2f}, accuracy lost "
                      f"{b['accuracy lost (all loops − skip)'].mean:+.3f}); speed-up vs all loops"] = b["speed-up vs all loops"]
    table.notes.append(f"from {path}: {data.get('n_quality')} test sequences scored per configuration (batched; skip via "
                       f"the online reference, equal to skip decoding), {data.get('n_time')} decoded token by token for the "
                       f"timing, {data.get('threads')} thread(s); thresholds per rule: {data.get('grid')}; language "
                       f"models: {data.get('lm_sequences')} test windows, every next token scored, thresholds "
                       f"{data.get('grid_lm')}")
    table.sizes = (f"{data.get('n_quality')} test sequences (one answer each) per configuration; language models: "
                   f"{data.get('lm_sequences')} test windows, every next token scored")
    return table


def _exit_aware_training(table: Table, groups: dict[tuple, list[tuple[dict, dict]]]) -> None:
    """Issue 16 item 3: exit-aware training − standard training of the same backbone, paired by seed, on skip
    decoding's accuracy at every rule × threshold, with the handling the exit-aware body was trained with."""
    by_key: dict[tuple, dict[str, dict[int, dict]]] = {}
    trained_with = set()
    for (bb, sm, nr, training, rule, th, h), items in groups.items():
        arm = "standard" if training == "standard" else "exit-aware"
        if arm == "exit-aware":  # "exit-aware (ssm_skip, p=0.5)"
            trained_with.add(training.split("(", 1)[-1].split(",", 1)[0])
        by_key.setdefault((bb, sm, nr, rule, th, h), {}).setdefault(arm, {}).update({run.get("seed"): row for run, row in items})
    for (bb, sm, nr, rule, th, h), arms in sorted(by_key.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if len(arms) < 2 or h not in trained_with:
            continue
        seeds = sorted(set(arms["standard"]) & set(arms["exit-aware"]))
        if len(seeds) < 2:
            continue
        diff = Stat([arms["exit-aware"][k]["accuracy"]["skip"] - arms["standard"][k]["accuracy"]["skip"] for k in seeds])
        exits = Stat([arms["exit-aware"][k]["mean_exit_step"]["skip"] - arms["standard"][k]["mean_exit_step"]["skip"]
                      for k in seeds])
        lo, hi = diff.interval
        verdict = "better" if lo > 0 else "worse" if hi < 0 else "inconclusive"
        table.summary[f"{bb} {nr}, {h}, {rule} {th:g}: exit-aware − standard training, skip accuracy "
                      f"(paired over {len(seeds)} seeds; mean exit step {exits.mean:+.2f}) — **{verdict}**"] = diff


def _model_label(run: dict[str, Any]) -> str:
    """'llama vanilla 2⊗4 d 128' (+ 'P1 C1' with a prelude / coda)."""
    pc = " ".join(f"{k}{run.get(f'{n}_layers')}" for k, n in (("P", "prelude"), ("C", "coda")) if run.get(f"{n}_layers"))
    return (f"{run['backbone']} {run['state_mode']} {run['n_layers']}⊗{run['n_loops']}" + (f" {pc}" if pc else "")
            + f" d {run['d_model']}" + (" (retrofitted)" if run.get("init_from") else ""))


def build_speculation(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None,
                      speculation_json: Path | None = None) -> Table:
    """Table 11 from bench/speculative.py's JSON: one row per trained model × batch × k × γ; the target
    (≥ 1.5× at batch 1, identical output) is judged on the best cell, and exit-aware training's effect on
    acceptance is read off the pairs of models trained both ways."""
    table, _ = _build_runs(spec, scale, out_root, seeds)  # the training sweeps: missing / failed runs
    table.method = ("each cell: speed-up = the median over timed rounds of plain cached greedy decoding's time ÷ "
                    "speculative decoding's time for the same prompts in the same round (every configuration timed "
                    "round-robin in one process, prefill included), with the range over rounds; every timed "
                    "speculative call gave plain decoding's tokens exactly (checked); acceptance = kept draft tokens / "
                    "drafted; draft cost = plain decoding at depth k ÷ at depth R, per token, paired the same way")
    path = Path(speculation_json or DEFAULT_SPECULATION_JSON)
    if not path.exists():
        table.missing.append(f"{path}: not found — `make table11` trains the models and measures them")
        return table
    data = json.loads(path.read_text())
    runs = data.get("runs", [])
    for run in runs:
        for b, res in sorted(run["batches"].items(), key=lambda kv: int(kv[0])):
            for c in res["cells"]:
                table.rows.append({
                    "model": _model_label(run), "training": run.get("training") or "—", "seed": run.get("seed"),
                    "perplexity": run.get("perplexity"), "batch": int(b), "k": c["k"], "γ": c["gamma"],
                    "plain tokens/s": res["plain_tokens_per_s"], "speculative tokens/s": c["tokens_per_s"],
                    "speed-up": c["speedup"],
                    "range over rounds": "–".join(f"{v:.2f}" for v in c["speedup_range"]) if c.get("speedup_range") else None,
                    "acceptance": c["acceptance"], "draft cost": c.get("draft_cost"),
                    "target": "met" if int(b) == 1 and c["speedup"] >= data.get("target_speedup", 1.5) else ""})
    table.columns = ["model", "training", "seed", "perplexity", "batch", "k", "γ", "plain tokens/s",
                     "speculative tokens/s", "speed-up", "range over rounds", "acceptance", "draft cost", "target"]
    target = data.get("target_speedup", 1.5)
    best = data.get("best_batch1")
    if best:
        label = next((_model_label(r) for r in runs if r["checkpoint"] == best["checkpoint"]), best["checkpoint"])
        table.summary[f"target (issue 27): ≥ {target}× tokens/s at identical output at batch 1 on some trained model"] = (
            f"**{'met' if best['speedup'] >= target else 'not met'}**: best cell {label} ({best.get('training')}), "
            f"k = {best['k']}, γ = {best['gamma']}: {best['speedup']:.2f}× plain"
            + (" (rounds {:.2f}–{:.2f})".format(*best["speedup_range"]) if best.get("speedup_range") else "")
            + f", acceptance {best['acceptance']:.2f}, draft cost {best.get('draft_cost', float('nan')):.2f}")
    for run in runs:
        for b, res in sorted(run["batches"].items(), key=lambda kv: int(kv[0])):
            if not res["cells"]:
                continue
            c = max(res["cells"], key=lambda c: c["speedup"])
            acc = {k: statistics.fmean(x["acceptance"] for x in res["cells"] if x["k"] == k)
                   for k in sorted({x["k"] for x in res["cells"]})}
            table.summary[f"{_model_label(run)} ({run.get('training')}), batch {b}: best k = {c['k']}, γ = {c['gamma']} "
                          f"at {c['speedup']:.2f}× ({res['plain_tokens_per_s']:.0f} plain tokens/s); acceptance by k "
                          f"(mean over γ)"] = ", ".join(f"k {k}: {a:.2f}" for k, a in acc.items())
    _exit_aware_acceptance(table, runs)
    table.notes.append(f"from {path}: {data.get('new_tokens')} new tokens after {data.get('prompt')}-token held-out "
                       f"prompts, batches {data.get('batches')}, γ in {data.get('gammas')}, {data.get('repeats')} timed "
                       f"repeats, {data.get('threads')} thread(s)")
    table.sizes = f"{data.get('new_tokens')} greedy tokens per prompt row, batch 1 and 8"
    return table


def _exit_aware_acceptance(table: Table, runs: list[dict[str, Any]]) -> None:
    """Exit-aware − standard training of the same backbone and shape: acceptance per k (mean over γ, batch 1).
    One model per arm: a measurement, not a paired finding across seeds."""
    def key(r):
        return (r["backbone"], r["state_mode"], r["n_layers"], r["n_loops"], r["d_model"], r.get("seed"))

    by = {}
    for r in runs:
        by.setdefault(key(r), {})["standard" if (r.get("training") or "standard") == "standard" else "exit-aware"] = r
    for k_, arms in by.items():
        if len(arms) < 2 or "1" not in arms["standard"]["batches"] or "1" not in arms["exit-aware"]["batches"]:
            continue
        def acc(r, k):
            cells = [c for c in r["batches"]["1"]["cells"] if c["k"] == k]
            return statistics.fmean(c["acceptance"] for c in cells) if cells else float("nan")
        ks = sorted({c["k"] for c in arms["standard"]["batches"]["1"]["cells"]})
        table.summary[f"{_model_label(arms['standard'])}: acceptance, exit-aware − standard training (batch 1, mean "
                      f"over γ; one model each, seed {k_[-1]})"] = ", ".join(
            f"k {k}: {acc(arms['exit-aware'], k) - acc(arms['standard'], k):+.2f}" for k in ks)


def build_routing(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None,
                  routing_json: Path | None = None) -> Table:
    """Table 12: one row per experiment × arm (seed means with intervals): quality as trained and with each
    token's depth chosen causally, the depth it spends, parameters, training FLOPs and tokens/s, and for the
    language models decoding tokens/s and KV-cache bytes from bench/routed_decode.py's JSON."""
    table, cells = _build_runs(spec, scale, out_root, seeds)
    path = Path(routing_json or DEFAULT_ROUTING_JSON)
    decode = {}
    if path.exists():
        for r in json.loads(path.read_text()).get("runs", []):
            decode[str(Path(r["run_dir"]).resolve())] = r
    elif any(c.ok for c in cells if "lm" in c.sweep.experiment):
        table.missing.append(f"{path}: not found — `make table12` measures decoding after training")
    for c in cells:
        for r in c.ok:  # decoding figures ride on the run's data, for the rows and the findings alike
            if str(r.path.resolve()) in decode:
                r.data["decode"] = decode[str(r.path.resolve())]
            r.data["training_flops_per_token"] = _training_flops_per_token(r)
    for c in cells:
        if not c.ok:
            continue
        row = _base_row(c)
        row["experiment"] = _base_experiment(c.sweep.experiment)
        row["arm"] = c.combo.get("arm", "?")
        if "_lm_" in c.sweep.experiment:
            row["perplexity"] = stat(c.ok, lambda d: d["perplexity"])
            row["causal perplexity"] = stat(c.ok, lambda d: _causal(d, "perplexity"))
        else:
            row["accuracy"] = stat(c.ok, lambda d: d["accuracy"], _examples)
            row["causal accuracy"] = stat(c.ok, lambda d: _causal(d, "accuracy"), _examples)
        row["layers/token"] = stat(c.ok, lambda d: d["routing"]["mean_depth"] * d["model"]["layers"] if d.get("routing")
                                   else d["model"]["layers"] * d["model"]["loops"])
        row["causal layers/token"] = stat(c.ok, lambda d: _causal(d, "depth"))
        row["train MFLOPs/token"] = stat(c.ok, lambda d: d["training_flops_per_token"] / 1e6)
        row["train TFLOPs"] = stat(c.ok, lambda d: d["training_flops_per_token"] * d["throughput"]["tokens"] / 1e12)
        row["train tokens/s"] = stat(c.ok, lambda d: d["throughput"]["tokens_per_s"])
        row["decode tokens/s"] = stat(c.ok, lambda d: d["decode"]["tokens_per_s"])
        row["KV KiB"] = stat(c.ok, lambda d: d["decode"]["kv_bytes"] / 1024)
        table.rows.append(row)
    table.rows.sort(key=lambda r: (r["experiment"], ARM_ORDER.index(r["arm"]) if r["arm"] in ARM_ORDER else 99))
    table.columns = ["experiment", "arm", "N⊗R", "seeds", "perplexity", "causal perplexity", "accuracy", "causal accuracy",
                     "layers/token", "causal layers/token", "params", "train MFLOPs/token", "train TFLOPs", "steps", "train tokens/s",
                     "decode tokens/s", "KV KiB"]
    table.notes += [
        "perplexity / accuracy: the test split scored as the model trains — expert choice picks each loop's top-k over "
        "the whole sequence (MoR's evaluation: a later token can decide an earlier token's depth), the exit gate's arm "
        "runs every loop; causal: each token's depth chosen from its own past, as decoding does (a router's inference "
        "rule, the gate's exit at q = 0.5); layers/token: the block layers each token runs (loops × N), as "
        "trained and causal (the exit gate's arm trains every loop)",
        "train MFLOPs/token: analytic (LoopedLM.flops_per_token: a router's loops counted at its capacities, backward "
        "2× forward); train TFLOPs: that × the tokens trained; train tokens/s: the whole training loop, two runs "
        "sharing the 2 cores",
        f"decoding (LM only, {path}): 64 greedy tokens after a 32-token held-out prompt at batch 1, one thread, the "
        "arms of a seed timed round-robin; KV KiB: the cache after decoding (a router's per-depth caches hold only the "
        "tokens that reached their depth)",
    ]
    table.verdicts = evaluate_findings(spec, units_for(cells), scale)
    return table


ARM_ORDER = ["looped", "mor_expert", "mor_token", "ouro_gate", "vanilla"]  # table 12's rows


BUILDERS = {"routing": build_routing, "speculation": build_speculation, "exitgrid": build_exitgrid, "extrapolation": build_extrapolation, "lm": build_lm, "task": build_task, "depth": build_depth, "reset": build_reset, "exit": build_exit,
            "decode": build_decode}


def build(number: int, scale: str = "tiny", out_root: Path = DEFAULT_OUT_ROOT, seeds: list[int] | None = None,
          **kwargs) -> Table:
    """Table `number` at `scale` from the results.json files under out_root/tableN/<scale>/.

    seeds: the seeds every configuration should have (default: spec.DEFAULT_SEEDS of the scale); the
    seeds missing from a configuration are listed as missing runs.
    """
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is unknown; choose one of {SCALES}")
    spec = get(number)
    seeds = list(seeds) if seeds else default_seeds(scale, number)
    return BUILDERS[spec.kind](spec, scale, Path(out_root), seeds=seeds, **kwargs)


def write(table: Table, table_dir: Path = DEFAULT_TABLE_DIR, plot: bool = True) -> list[Path]:
    """experiments/tables/tableN.md, .csv and .findings.json (tableN-paper.* at paper scale), the PNG where
    the table has a plot, and the verdict summary README.md of the folder (regenerated from every
    tableN*.findings.json there)."""
    table_dir = Path(table_dir)
    table_dir.mkdir(parents=True, exist_ok=True)
    md, cs, fj = table_dir / f"{table.stem}.md", table_dir / f"{table.stem}.csv", table_dir / f"{table.stem}.findings.json"
    md.write_text(table.markdown())
    cs.write_text(table.csv())
    fj.write_text(json.dumps(table.findings_json(), indent=2) + "\n")
    paths = [md, cs]
    if plot and table.rows:
        from looplab.tables.plots import plot_table

        png = plot_table(table, table_dir / f"{table.stem}.png")
        if png:
            paths.append(png)
    paths += [fj, write_summary(table_dir)]
    return paths


def _holm_of_file(findings: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(Holm verdict, its cell) of each finding of one findings.json: as stored, or, for a file written before
    the Holm column existed, recomputed from its stored intervals under the sign rule it was judged by."""
    from looplab.stats import Rule

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


def write_summary(table_dir: Path = DEFAULT_TABLE_DIR) -> Path:
    """README.md of the tables folder: every table's verdicts, from the tableN*.findings.json files the reports wrote."""
    from looplab.tables.spec import TABLES

    table_dir = Path(table_dir)
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for p in sorted(table_dir.glob("table*.findings.json")):
        try:
            d = json.loads(p.read_text())
            found[(d["scale"], int(d["table"]))] = d
        except (OSError, ValueError, KeyError, TypeError):
            continue
    out = ["# Paper findings: verdicts of every table", "",
           "Generated by `python -m looplab.tables report N` (every report rewrites this file from the "
           "`tableN.findings.json` files next to it; `python -m looplab.tables summary` does it alone): do not edit by hand.",
           "", "Each finding is a paired difference A − B across seeds (same seed and, with common random numbers, the "
           "same initial values of every shared parameter and the same batches in both arms; table 4: across repeated "
           "timings in one process) with its 95% interval. Verdict kinds:", "",
           "- **reproduced** — sign claims: the interval excludes 0 on the paper's side; *at most X*: the whole "
           "interval is ≤ X; *about X ± δ*: the whole interval lies inside the band.",
           "- **contradicted** — sign: the interval excludes 0 on the other side; at most X: it lies wholly above X; "
           "about X ± δ: it lies wholly outside the band.",
           "- **inconclusive** — anything else, or no interval could be computed.",
           "- **not tested** — an arm missed the finding's precondition (e.g. a language model above its unigram "
           "perplexity, a table-9 arm below 0.9 at its trained depth); the row names the arm and its figure, and "
           "no comparison is judged.", "",
           "The **Holm** column adjusts each table's judged verdicts for multiple comparisons: the family is every "
           "judged line of that table (its size is shown), each line's decisive p-value (the test its plain verdict "
           "rests on: p < 0.05 exactly when the plain rule decides) is Holm step-down adjusted, and a decisive verdict "
           "whose adjusted p is ≥ 0.05 becomes inconclusive. Tables built before a finding's rule or precondition "
           "existed keep the verdict they were built with until they are rebuilt (their Holm column is computed from "
           "the stored intervals under the sign rule). Methods and the findings per table: `experiments/README.md`.", ""]
    scales = [s for s in SCALES if any(k[0] == s for k in found)] or ["tiny"]
    for scale in scales:
        counts: dict[str, int] = {}
        holm_counts: dict[str, int] = {}
        rows = []
        for n in sorted(TABLES):
            d = found.get((scale, n))
            name = f"table{n}" + ("" if scale == "tiny" else f"-{scale}")
            if d is None:  # the findings it will check, until `report N` writes its tableN.findings.json
                for f in TABLES[n].findings or ():
                    rows.append(f"| [{n}]({name}.md) | {f.label}, {f.metric} | {f.claim} | — | not built yet | — |")
                if not TABLES[n].findings:
                    rows.append(f"| [{n}]({name}.md) | {TABLES[n].title} | — | — | not built yet | — |")
                continue
            if not d["findings"]:
                rows.append(f"| [{n}]({name}.md) | {d['title']} | — | — | no finding | — |")
            for f, (hv, htxt) in zip(d["findings"], _holm_of_file(d["findings"])):
                counts[f["verdict"]] = counts.get(f["verdict"], 0) + 1
                holm_counts[hv] = holm_counts.get(hv, 0) + 1
                rows.append(f"| [{n}]({name}.md) | {f['title']} | {f['claim']} | {f['measured']} | **{f['verdict']}** | {htxt} |")
        kinds = ("reproduced", "contradicted", "inconclusive", "not tested")
        tally = ", ".join(f"{counts.get(v, 0)} {v}" for v in kinds)
        htally = ", ".join(f"{holm_counts.get(v, 0)} {v}" for v in kinds)
        out += [f"## {scale} scale — {tally}", "", f"Holm-adjusted: {htally}.", "",
                "| table | finding (A − B) | paper | measured: mean [95% interval] | verdict | Holm-adjusted |",
                "|---|---|---|---|---|---|"] + rows + [""]
    path = table_dir / "README.md"
    path.write_text("\n".join(out))
    return path
