"""A table as the report writes it: the `Table` its builder fills, rendered as Markdown, CSV and findings.json,
and the verdict summary README.md of the tables folder (plots: plots.py)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looplab.stats import Stat, adjusted_verdict, benjamini_hochberg
from looplab.tables.findings import Verdict, holm_of_file, p_of_file
from looplab.tables.paper_specs import NUMBERS as PAPER_NUMBERS
from looplab.tables.spec import SCALES, TABLES, TableSpec

DEFAULT_TABLE_DIR = Path("experiments/tables")


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
    units: list = field(default_factory=list, repr=False)  # the runs the findings were judged on (load.Unit)
    sequential: dict[str, Any] | None = None  # a sequential build's design, rounds and stop (tables/sequential.py)

    @property
    def stem(self) -> str:
        return f"table{self.spec.number}" + ("" if self.scale == "tiny" else f"-{self.scale}")

    def setting(self) -> str:
        parts = [self.spec.notes.get(self.scale, "")]
        if self.sequential:
            parts.append("seeds: " + sequential_seeds(self.sequential))
        elif self.spec.kind != "decode":
            parts.append("seeds: " + (", ".join(map(str, self.seeds)) + " per configuration" if self.seeds
                                      else "the runs found (`seeds` column)"))
        if self.sizes:
            parts.append(f"held-out evaluation per run: {self.sizes}")
        parts.append(self.method)
        if self.sequential:
            parts.append(sequential_method(self.sequential))
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
        if self.sequential:
            intro = ("The papers' claims (experiments/README.md), each checked as a paired difference A − B (arms with common "
                     "random numbers) with its repeated confidence interval at the look that decided it, or at the last "
                     "look (see Sequential seeds below). Sign claims: **reproduced** = the interval excludes 0 on the "
                     "paper's side, **contradicted** = on the other side, **negligible** = it contains 0 but lies inside "
                     "(−δ, +δ), δ the claim's smallest effect of interest, **smaller than claimed** = it contains 0 but "
                     "excludes the paper's effect carried to this setting's units (the scaling δ uses), **inconclusive** = "
                     "none of these; claims of a "
                     "size are judged against it (at most X: the whole interval ≤ X; about X ± δ: inside the band); **not "
                     "tested** = an arm missed the finding's precondition; **by construction** = an accounting identity, "
                     "computed rather than measured. A decision is final at the look that made it. "
                     f"Holm: the verdict after Holm's adjustment of the repeated p-values over this table's {judged} judged "
                     "line(s).")
        else:
            intro = ("The papers' claims (experiments/README.md), each checked as a paired difference "
                     "A − B with its 95% interval (arms with common random numbers: the same initial values of every shared "
                     "parameter and the same batches). Sign claims: **reproduced** = the interval excludes 0 on the paper's "
                     "side, **contradicted** = on the other side, **smaller than claimed** = it contains 0 but excludes the "
                     "paper's effect carried to this setting's units (the scaling δ uses), **inconclusive** = otherwise "
                     "(or no interval); "
                     "claims of a size are judged against it (at most X: the whole interval ≤ X; about X ± δ: inside the band); "
                     "**not tested** = an arm missed the finding's precondition (named with its figure); **by construction** "
                     "= an accounting identity, computed rather than measured. Holm: the verdict "
                     f"after Holm's adjustment over this table's {judged} judged line(s).")
        out += ["", "## Findings", "", intro, ""]
        out += [v.line() for v in self.verdicts] or ["(this table checks no finding)"]
        if self.sequential:
            out += ["", *sequential_section(self.sequential, self.verdicts)]
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
                "findings": [v.as_dict() for v in self.verdicts],
                **({"sequential": self.sequential} if self.sequential else {})}


def _ranges(seeds: list[int]) -> str:
    return f"{seeds[0]}–{seeds[-1]}" if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[-1] + 1)) else ", ".join(map(str, seeds))


def sequential_seeds(seq: dict[str, Any]) -> str:
    """The setting line's seeds of a sequential build: its rounds, its cap and why it stopped."""
    rounds = seq.get("rounds") or []
    shown = "; ".join(_ranges(r["seeds"]) + ("" if r.get("finished") else " (unfinished)") for r in rounds) or "none yet"
    cap = seq["design"]["cap"]
    return (f"sequential (`--seeds auto`), {len(rounds)} round(s) of seeds {shown}, cap {seq['max_seeds']}"
            + ("" if seq["max_seeds"] == cap else f" (the design's: {cap})") + f"; {seq['stop_text']}")


def sequential_method(seq: dict[str, Any]) -> str:
    d = seq["design"]
    return (f"findings of this sequential build: at each round's look the paired differences' interval is the t-interval "
            f"at the nominal level 1 − α′ with α′ = {d['nominal_alpha']:.4f} (Pocock's repeated confidence intervals for "
            f"looks at {d['first_look']}..{d['cap']} paired seeds, set by simulation so that all the looks together miss "
            f"the true mean with probability {d['alpha']:.2f} for normally distributed paired differences), widened for "
            "accuracies by the examples' noise as above; per-configuration rows keep the plain 95% t-interval over all seeds")


def sequential_section(seq: dict[str, Any], verdicts: list[Verdict]) -> list[str]:
    """The report's Sequential seeds section: the design, each round and its look, and why the build stopped."""
    d = seq["design"]
    out = ["## Sequential seeds", "",
           f"Design: Pocock repeated confidence intervals, looks at {d['first_look']}..{d['cap']} paired seeds, overall "
           + (f"α = {d['alpha']:.2f}" if not d.get("spent_alpha") else f"α = {d['overall_alpha']:.2f} of which earlier "
              f"designs on these runs spent {d['spent_alpha']:.4f} at their looks (α ledger), this one the {d['alpha']:.4f} "
              "left") +
           f", nominal α′ = {d['nominal_alpha']:.4f} per look (calibrated on {d['simulations']:,} "
           f"simulated paths, seed {d['seed']}); rounds of {seq['round_seeds']} seeds after the first; cap "
           f"{seq['max_seeds']} seeds" + (f"; time budget {seq['budget_min']:g} min" if seq.get("budget_min") is not None
                                          else "") + f". Training time so far: {seq['elapsed_s'] / 60:.1f} min.", "",
           "| round | seeds | jobs trained | jobs on disk | minutes | after its look |", "|---|---|---|---|---|---|"]
    for r in seq.get("rounds") or []:
        look = ", ".join(f"{n} {k}" for k, n in sorted((r.get("look") or {}).items())) or ("—" if r.get("finished") else "unfinished")
        out.append(f"| {r['number']} | {_ranges(r['seeds'])} | {r['jobs_run']} | {r['jobs_reused']} | {r['seconds'] / 60:.1f} | {look} |")
    decided = sum(v.status == "decided" for v in verdicts)
    out += ["", f"Stopped: {seq['stop_text']}. {decided} of {len(verdicts)} finding line(s) decided; each line above says "
            "where its seeds stopped and why."]
    return out


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


def write_summary(table_dir: Path = DEFAULT_TABLE_DIR) -> Path:
    """README.md of the tables folder: every table's verdicts, from the tableN*.findings.json files the reports wrote."""
    table_dir = Path(table_dir)
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for p in sorted(table_dir.glob("table*.findings.json")):
        try:
            d = json.loads(p.read_text())
            found[(d["scale"], int(d["table"]))] = d
        except (OSError, ValueError, KeyError, TypeError):
            continue
    confirmatory = any(f.get("confirmatory") for d in found.values() for f in d.get("findings") or [])
    sequential = any("sequential" in d or any(f.get("verdict") == "negligible" for f in d.get("findings") or [])
                     for d in found.values())
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
           *(["- **negligible** — sign claims of a table built with sequential seeds (`--seeds auto`): the interval "
              "contains 0 but lies inside (−δ, +δ), δ the claim's smallest effect of interest, named in advance. Such a "
              "table judges each finding with its repeated confidence interval at the look that decided it."]
             if sequential else []),
           "- **smaller than claimed** — sign claims: the interval contains 0 but lies wholly on 0's side of the paper's "
           "effect carried to this setting's units (the scaling δ uses; one-sided, fixed before any new look): any effect "
           "here is smaller than the paper's.",
           "- **inconclusive** — anything else, or no interval could be computed.",
           "- **by construction** — an accounting identity (KV-cache bytes of a schedule): computed, not measured, and in "
           "no family.",
           "- **not tested** — an arm missed the finding's precondition (e.g. a language model above its unigram "
           "perplexity, a table-9 arm below 0.9 at its trained depth); the row names the arm and its figure, and "
           "no comparison is judged.", "",
           "The **Holm** column adjusts each table's judged verdicts for multiple comparisons: the family is every "
           "judged line of that table (its size is shown), each line's decisive p-value (the test its plain verdict "
           "rests on: p < 0.05 exactly when the plain rule decides) is Holm step-down adjusted, and a decisive verdict "
           "whose adjusted p is ≥ 0.05 becomes inconclusive. Tables built before a finding's rule or precondition "
           "existed keep the verdict they were built with until they are rebuilt (their Holm column is computed from "
           "the stored intervals under the sign rule). The **BH** column is Benjamini–Hochberg over every judged line "
           "of every table of that scale (q < 0.05: a discovery at a 5% false-discovery rate across all tables; a weaker "
           "promise than Holm's, which bounds the chance of any false verdict within a table). Lines re-judged from a "
           "committed table's stored intervals under today's rules (`python -m looplab.tables rejudge N`) say so in "
           "their table. " + ("A line that a pre-registered confirmatory design on fresh seeds decided "
           "(docs/tables.md#confirmatory-runs, `python -m looplab.tables confirm NAME --apply`) shows that design's "
           "verdict and interval, and counts it, with the build's beside it; its Holm and BH cells say confirmatory "
           "(the design's own error control applies). " if confirmatory else "") + "Methods and the findings per "
           "table: `experiments/README.md`.", ""]
    scales = [s for s in SCALES if any(k[0] == s for k in found)] or ["tiny"]
    for scale in scales:
        counts: dict[str, int] = {}
        holm_counts: dict[str, int] = {}
        bh_counts: dict[str, int] = {}
        rows = []
        every = [(n, f) for n in sorted(TABLES) if (scale, n) in found for f in found[(scale, n)]["findings"]]
        bh = dict(zip((id(f) for _, f in every), benjamini_hochberg([p_of_file(f) for _, f in every])))
        paper = any(n in PAPER_NUMBERS for (sc, n) in found if sc == scale) or not found
        for n in sorted(TABLES):
            d = found.get((scale, n))
            if d is None and not (paper and n in PAPER_NUMBERS):
                continue  # a folder of one's own tables lists those, not the paper's unbuilt ones (and vice versa)
            name = f"table{n}" + ("" if scale == "tiny" else f"-{scale}")
            if d is None:  # the findings it will check, until `report N` writes its tableN.findings.json
                for f in TABLES[n].findings or ():
                    rows.append(f"| [{n}]({name}.md) | {f.label}, {f.metric} | {f.claim} | — | not built yet | — | — |")
                if not TABLES[n].findings:
                    rows.append(f"| [{n}]({name}.md) | {TABLES[n].title} | — | — | not built yet | — | — |")
                continue
            if not d["findings"]:
                rows.append(f"| [{n}]({name}.md) | {d['title']} | — | — | no finding | — | — |")
            for f, (hv, htxt) in zip(d["findings"], holm_of_file(d["findings"])):
                q = bh[id(f)]
                bv = adjusted_verdict(f["verdict"], q)
                btxt = "—" if q is None else f"{bv} (q {q:.3g})"
                verdict, measured = f["verdict"], f["measured"]
                conf = f.get("confirmatory")
                if conf:  # decided by a pre-registered design on fresh seeds, with its own error control
                    verdict = hv = bv = conf["verdict"]
                    measured = f"{conf['measured']}; {conf['design']}; this build: {f['measured']}, {f['verdict']}"
                    htxt = btxt = "— (confirmatory)"
                counts[verdict] = counts.get(verdict, 0) + 1
                holm_counts[hv] = holm_counts.get(hv, 0) + 1
                bh_counts[bv] = bh_counts.get(bv, 0) + 1
                rows.append(f"| [{n}]({name}.md) | {f['title']} | {f['claim']} | {measured} | **{verdict}** | {htxt} "
                            f"| {btxt} |")
        kinds = ("reproduced", "contradicted", *(("negligible",) if sequential else ()), "smaller than claimed",
                 "inconclusive", "not tested", "by construction")
        tally = ", ".join(f"{counts.get(v, 0)} {v}" for v in kinds)
        htally = ", ".join(f"{holm_counts.get(v, 0)} {v}" for v in kinds)
        btally = ", ".join(f"{bh_counts.get(v, 0)} {v}" for v in kinds)
        out += [f"## {scale} scale — {tally}", "", f"Holm-adjusted (per table): {htally}.", "",
                f"Benjamini–Hochberg (all tables, {sum(q is not None for q in bh.values())} judged lines): {btally}.", "",
                "| table | finding (A − B) | paper | measured: mean [95% interval] | verdict | Holm-adjusted | BH, all tables |",
                "|---|---|---|---|---|---|---|"] + rows + [""]
    path = table_dir / "README.md"
    path.write_text("\n".join(out))
    return path
