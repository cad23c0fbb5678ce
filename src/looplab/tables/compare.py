"""Judge the arms of a researcher's own `-m` sweep, paired by seed, without rerunning it.

    python -m looplab.tables compare MULTIRUN_DIR --pair state_mode --metric perplexity \
        [--baseline vanilla] [--sign -1] [--delta 0.5] [--require "perplexity<unigram_perplexity"]

The sweep's runs (their results.json) are grouped by the value of the `--pair` override (the arms); every other
override but the seed names a stratum (e.g. `loop_depth.loops=4`). In each stratum every arm is compared with the
baseline arm as the paper tables compare theirs: the difference A − B per seed over the seeds both arms finished
(common random numbers: a looplab run's seed fixes the shared parameters' initial values, and with `dataset.seed`
following it the batches too, so the seed's noise cancels in the difference), its 95% t-interval, and a verdict
from looplab.stats:

- with `--sign` (the direction you expect A − B to have): **confirmed** / **contradicted** when the interval
  excludes 0, **negligible** when it lies inside (−δ, +δ) (`--delta`, fixed before looking), else inconclusive;
- without it: **A > B** / **A < B** when the interval excludes 0 (two-sided), negligible as above, else inconclusive;
- **not tested** (with the reason) when fewer than 3 seeds pair up, or an arm misses a `--require` precondition
  (each arm's mean metric against a number or another results.json figure, e.g. `perplexity<unigram_perplexity`:
  an arm that did not beat the unigram model learned nothing, and a difference between such arms tests nothing).

Every decisive line is then Holm-adjusted across the comparison's lines (family-wise error 0.05; Benjamini–Hochberg
q-values beside it), as the paper tables are. The result is printed as markdown and written beside the sweep
(`compare_<metric>.md` and `.csv`, and `.png`: each line's per-seed differences, its mean and interval, or under
`--out`).
"""

from __future__ import annotations

import csv
import io
import math
import operator
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looplab.runs import Run, load_runs
from looplab.stats import (ALPHA, Rule, SequentialDesign, adjusted_verdict, benjamini_hochberg, decisive_p, holm,
                           judge, t_interval)

MIN_SEEDS = 3  # as the paper tables: fewer paired seeds judge nothing
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_REQUIRE = re.compile(r"^\s*([\w./-]+)\s*(<=|>=|<|>)\s*([\w./+-]+)\s*$")
_NO_CLAIM = {"reproduced": "A > B", "contradicted": "A < B"}  # two-sided, Rule(sign=+1)
_CLAIM = {"reproduced": "confirmed"}


@dataclass(frozen=True)
class Requirement:
    """metric op threshold, each arm's mean over its paired seeds; threshold: a number or another figure of the
    same runs (its mean over the same seeds)."""

    metric: str
    op: str
    threshold: float | str

    @classmethod
    def parse(cls, text: str) -> "Requirement":
        m = _REQUIRE.match(text)
        if not m:
            raise ValueError(f"--require {text!r}: write METRIC OP VALUE with OP one of <, <=, >, >= (e.g. "
                             "'perplexity<unigram_perplexity' or 'accuracy>=0.6')")
        try:
            threshold: float | str = float(m.group(3))
        except ValueError:
            threshold = m.group(3)
        return cls(m.group(1), m.group(2), threshold)

    def __str__(self) -> str:
        t = self.threshold if isinstance(self.threshold, str) else f"{self.threshold:g}"
        return f"{self.metric} {self.op} {t}"


@dataclass
class Line:
    stratum: str
    a: str
    b: str
    seeds: list = field(default_factory=list)
    diffs: list = field(default_factory=list)
    mean_a: float | None = None
    mean_b: float | None = None
    interval: tuple[float, float] | None = None
    plain: str = "inconclusive"
    p: float | None = None
    p_holm: float | None = None
    q_bh: float | None = None
    verdict: str = "inconclusive"
    reason: str = ""
    look: int | None = None  # a sequential build (tables/own_sequential.py): the round whose look gave this line
    status: str | None = None  # ... and whether it is decided, open, not tested or without an interval

    @property
    def mean_diff(self) -> float | None:
        return sum(self.diffs) / len(self.diffs) if self.diffs else None


def metric_value(data: dict[str, Any], path: str) -> float | None:
    """A figure of a results.json: a top-level key (`perplexity`, `accuracy`), a dotted path into nested mappings
    (`per_depth.2.perplexity`), or a logged metric by its own name (`test/ppl`, under `metrics`)."""
    node: Any = data
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            break
    if node is None and isinstance(data.get("metrics"), dict):
        node = data["metrics"].get(path)
    if isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node):
        return float(node)
    return None


def _figures(runs: list[Run]) -> list[str]:
    names = set()
    for r in runs:
        names.update(k for k, v in r.data.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        names.update((r.data.get("metrics") or {}).keys())
    return sorted(names)


def _varied(runs: list[Run], pair: str) -> list[str]:
    """The overrides other than the arm and the seed whose values differ between runs: they name the strata (an
    override every run shares, such as the experiment or the logger, says nothing)."""
    keys = {k for r in runs for k in r.swept} - {pair, "seed"}
    return sorted(k for k in keys if len({r.swept.get(k) for r in runs}) > 1)


def _stratum(run: Run, keys: list[str]) -> str:
    return ", ".join(f"{k}={run.swept.get(k, '(unset)')}" for k in keys) or "(all)"


def compare(folder: str | Path, pair: str, metric: str, baseline: str | None = None, sign: int | None = None,
            delta: float | None = None, require: list[str] | tuple = (), order: list[str] | None = None,
            at_seeds=None, design: SequentialDesign | None = None) -> dict:
    """The comparison as data: {'lines': [Line], 'failed': [(run folder, error)], 'unpaired': [...], ...}.
    order: the arms' order (a spec's `arms`); default the sweep's own (multirun.yaml), else sorted.
    at_seeds: only the runs of these seeds (one look of a sequential build); design: judge with its repeated
    confidence intervals and repeated p-values (stats.SequentialDesign) instead of the fixed-seed t-interval."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} is not a folder (give the sweep's multirun folder)")
    if sign not in (None, -1, 1):
        raise ValueError(f"--sign {sign!r}: the direction you expect A − B to have, +1 or -1")
    if delta is not None and not delta > 0:
        raise ValueError(f"--delta {delta!r}: the smallest difference that matters, a number > 0")
    reqs = [Requirement.parse(t) for t in require]
    runs = load_runs(folder)
    if at_seeds is not None:
        runs = [r for r in runs if str(r.seed) in {str(x) for x in at_seeds}]
    if not runs:
        raise FileNotFoundError(f"no results.json below {str(folder)!r}: not a looplab sweep, or none of its runs "
                                "has finished")
    failed = [(str(r.path), r.data.get("error", r.data.get("status"))) for r in runs if not r.ok]
    ok = [r for r in runs if r.ok]
    arms_seen = sorted({r.swept[pair] for r in ok if pair in r.swept})
    if not arms_seen:
        swept = sorted({k for r in ok for k in r.swept})
        raise ValueError(f"--pair {pair!r} is not an override of this sweep's runs; its runs override {swept}")
    if len(arms_seen) < 2:
        raise ValueError(f"--pair {pair!r}: the finished runs have one value, {arms_seen[0]!r}; a comparison needs two")
    if all(metric_value(r.data, metric) is None for r in ok):
        raise ValueError(f"--metric {metric!r} is in no finished run's results.json; its figures: {_figures(ok)}")
    for q in reqs:
        for name in (q.metric, q.threshold):
            if isinstance(name, str) and all(metric_value(r.data, name) is None for r in ok):
                raise ValueError(f"--require {str(q)!r}: {name!r} is in no finished run's results.json; its figures: "
                                 f"{_figures(ok)}")
    # the baseline: given, else the first value in the sweep's own order (its multirun.yaml), else sorted
    order = list(order or _sweep_order(folder, pair) or arms_seen)
    order += [a for a in arms_seen if a not in order]
    base = baseline if baseline is not None else next(a for a in order if a in arms_seen)
    if base not in arms_seen:
        raise ValueError(f"--baseline {base!r} is not a value of {pair} among the finished runs: {arms_seen}")

    cells: dict[tuple[str, str], dict[str, Run]] = defaultdict(dict)  # (stratum, arm) → {seed: run}
    armed = [r for r in ok if pair in r.swept]
    keys = _varied(armed, pair)
    for r in armed:
        cells[(_stratum(r, keys), r.swept[pair])][str(r.seed)] = r
    strata = sorted({s for s, _ in cells})
    rule = Rule(kind="sign", sign=sign or 1, delta=delta)
    lines, unpaired = [], []
    for s in strata:
        b_runs = cells.get((s, base), {})
        for a in [x for x in order if x != base and (s, x) in cells]:
            a_runs = cells[(s, a)]
            seeds = sorted(set(a_runs) & set(b_runs), key=_seed_key)
            unpaired += [f"{s}: {pair}={x} seed {k}" for x, runs_x in ((a, a_runs), (base, b_runs))
                         for k in sorted(set(runs_x) - set(seeds), key=_seed_key)]
            va = {k: metric_value(a_runs[k].data, metric) for k in seeds}
            vb = {k: metric_value(b_runs[k].data, metric) for k in seeds}
            seeds = [k for k in seeds if va[k] is not None and vb[k] is not None]
            line = Line(s, a, base, seeds, [va[k] - vb[k] for k in seeds])
            if seeds:
                line.mean_a = sum(va[k] for k in seeds) / len(seeds)
                line.mean_b = sum(vb[k] for k in seeds) / len(seeds)
            missed = [_missed(q, arm, runs_x, seeds) for q in reqs for arm, runs_x in ((a, a_runs), (base, b_runs))]
            missed = [m for m in missed if m]
            if len(seeds) < MIN_SEEDS:
                line.verdict = line.plain = "not tested"
                line.reason = f"{len(seeds)} paired seed(s), fewer than {MIN_SEEDS}"
            elif missed:
                line.verdict = line.plain = "not tested"
                line.reason = "; ".join(missed)
            elif design is not None and design.interval(line.diffs) is None:  # past the cap (the rounds stop there)
                line.reason = f"{len(seeds)} paired seeds: past the design's cap of {design.cap}"
            else:
                n = len(line.diffs)
                line.interval = t_interval(line.diffs) if design is None else design.interval(line.diffs)
                lo, hi = line.interval if line.interval else (None, None)
                line.plain = judge(rule, lo, hi)
                half = (hi - lo) / 2 if lo is not None else None
                if design is None:
                    line.p = decisive_p(rule, line.mean_diff, half, n - 1)
                else:  # the look's nominal p on the design's scale: p < α exactly when the repeated interval decides
                    line.p = design.repeated_p(decisive_p(rule, line.mean_diff, half, n - 1, quantile=design.critical(n)))
            lines.append(line)
    adjust(lines, sign)
    shared_data = _data_seeds_follow(ok)
    return {"folder": str(folder), "pair": pair, "metric": metric, "baseline": base, "sign": sign, "delta": delta,
            "require": [str(q) for q in reqs], "lines": lines, "failed": failed, "unpaired": unpaired,
            "data_seed_follows_seed": shared_data}


def adjust(lines: list[Line], sign: int | None) -> None:
    """Holm (and Benjamini–Hochberg beside it) across the lines' p-values; each judged line's verdict is its plain
    one where its Holm p still decides, in the words of the claim (confirmed) or of no claim (A > B, A < B)."""
    for line, ph, qb in zip(lines, holm([x.p for x in lines]), benjamini_hochberg([x.p for x in lines])):
        line.p_holm, line.q_bh = ph, qb
        if line.plain != "not tested":
            v = adjusted_verdict(line.plain, ph, ALPHA)
            line.verdict = (_CLAIM if sign else _NO_CLAIM).get(v, v)


def _seed_key(k: str):
    return (0, int(k)) if k.lstrip("-").isdigit() else (1, k)


def _missed(q: Requirement, arm: str, runs: dict[str, Run], seeds: list[str]) -> str | None:
    vals = [metric_value(runs[k].data, q.metric) for k in seeds]
    ts = [q.threshold if not isinstance(q.threshold, str) else metric_value(runs[k].data, q.threshold) for k in seeds]
    pairs = [(v, t) for v, t in zip(vals, ts) if v is not None and t is not None]
    if not pairs:
        return f"{arm}: no {q.metric} to check {q}"
    v = sum(p[0] for p in pairs) / len(pairs)
    t = sum(p[1] for p in pairs) / len(pairs)
    return None if _OPS[q.op](v, t) else f"{arm} misses {q} ({v:.4g} against {t:.4g})"


def _sweep_order(folder: Path, pair: str) -> list[str]:
    """The values of `pair` in the order the sweep listed them (hydra's multirun.yaml), when it is there."""
    from omegaconf import OmegaConf

    f = folder / "multirun.yaml"
    if not f.is_file():
        return []
    try:
        hydra = OmegaConf.to_container(OmegaConf.load(f)).get("hydra", {})
        params = hydra.get("sweeper", {}).get("params") or {}
        for o in hydra.get("overrides", {}).get("task") or []:
            k, _, v = str(o).partition("=")
            params.setdefault(k, v)
    except Exception:  # an unreadable multirun.yaml costs only the order
        return []
    for k, v in params.items():
        if k.lstrip("+~") == pair:
            v = re.sub(r"^\w+\((.*)\)$", r"\1", str(v))  # choice(a,b) / range(...) → a,b
            return [x.strip() for x in v.split(",") if x.strip()]
    return []


def _data_seeds_follow(runs: list[Run]) -> bool | None:
    """Whether every run's dataset seed equals its run seed (then the pairs share their batches too); None when the
    runs do not record it."""
    got = [((r.data.get("config") or {}).get("dataset") or {}).get("seed") for r in runs]
    if any(g is None for g in got):
        return None
    return all(str(g) == str(r.seed) for g, r in zip(got, runs))


def _fmt(x: float | None, digits: int = 4) -> str:
    return "–" if x is None else f"{x:.{digits}g}"


def markdown(res: dict) -> str:
    pair, metric = res["pair"], res["metric"]
    claim = (f"expected sign of A − B: {res['sign']:+d}" if res["sign"] else "no expected sign (two-sided)")
    seq = res.get("sequential")
    interval = "repeated 95% confidence interval of the sequential design" if seq else "95% t-interval"
    head = [f"# {metric}: each {pair} against {pair}={res['baseline']}", "",
            f"Sweep `{res['folder']}`. A − B paired by seed, {interval}; {claim}"
            + (f"; negligible band ±{res['delta']:g}" if res["delta"] else "")
            + (f"; preconditions: {', '.join(res['require'])}" if res["require"] else "")
            + ". Holm across the lines below (family-wise 0.05), Benjamini–Hochberg q beside it.", ""]
    follows = res["data_seed_follows_seed"]
    head.append("Common random numbers: the arms of a pair share their initial values (the run seed)"
                + (" and their batches (dataset.seed = the run seed)." if follows else
                   (", not their batches: dataset.seed does not follow the run seed." if follows is False else ".")))
    if seq:
        head += ["", f"Sequential seeds: {seq['design']}. Rounds: "
                 + "; ".join(f"{r['number']}: seeds {', '.join(map(str, r['seeds']))}" for r in seq["rounds"])
                 + f". Stopped: {seq['stop']}. Each line is read at the first look that decided it (p: the design's "
                 "repeated p-value), else at the last."]
    head += ["", f"| stratum | A | B | seeds | A mean | B mean | A − B [95% CI] | p | Holm p | BH q | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in res["lines"]:
        ci = "–"
        if x.interval:
            ci = f"{x.mean_diff:+.4g} [{x.interval[0]:+.4g}, {x.interval[1]:+.4g}]"
        why = [x.reason] if x.reason else []
        if x.look is not None:
            why.append(f"{x.status} at round {x.look}")
        verdict = x.verdict + (f" ({'; '.join(why)})" if why else "")
        head.append(f"| {x.stratum} | {x.a} | {x.b} | {len(x.seeds)} | {_fmt(x.mean_a)} | {_fmt(x.mean_b)} | {ci} | "
                    f"{_fmt(x.p, 3)} | {_fmt(x.p_holm, 3)} | {_fmt(x.q_bh, 3)} | {verdict} |")
    if res["failed"]:
        head += ["", f"Failed runs ({len(res['failed'])}), left out:"] + [f"- {p}: {e}" for p, e in res["failed"]]
    if res["unpaired"]:
        head += ["", f"Runs without a partner ({len(res['unpaired'])}), left out:"] + [f"- {u}" for u in res["unpaired"]]
    return "\n".join(head) + "\n"


def csv_text(res: dict) -> str:
    """One row per line; a sequential build's rows add the look (round) and status before the verdict."""
    seq = bool(res.get("sequential"))
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["stratum", "a", "b", "n_seeds", "mean_a", "mean_b", "mean_diff", "ci_lo", "ci_hi", "p", "p_holm",
                "q_bh", *(["look", "status"] if seq else []), "verdict", "reason"])
    for x in res["lines"]:
        lo, hi = x.interval if x.interval else (None, None)
        w.writerow([x.stratum, x.a, x.b, len(x.seeds), x.mean_a, x.mean_b, x.mean_diff, lo, hi, x.p, x.p_holm, x.q_bh,
                    *([x.look, x.status] if seq else []), x.verdict, x.reason])
    return out.getvalue()


def write(res: dict, out: str | Path | None = None, plot: bool = True) -> list[Path]:
    """compare_<metric>.md, .csv and .png (the per-seed differences, tables/plots.py: plot_compare) in `out`
    (default: the sweep's folder); returns their paths."""
    out = Path(out) if out is not None else Path(res["folder"])
    out.mkdir(parents=True, exist_ok=True)
    stem = "compare_" + re.sub(r"[^\w.-]+", "_", res["metric"])
    md, cs = out / f"{stem}.md", out / f"{stem}.csv"
    md.write_text(markdown(res))
    cs.write_text(csv_text(res))
    paths = [md, cs]
    if plot:
        from looplab.tables.plots import plot_compare

        png = plot_compare(res, out / f"{stem}.png")
        paths += [png] if png else []
    return paths
