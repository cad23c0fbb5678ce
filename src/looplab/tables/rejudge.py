"""Re-judge a committed table under today's rules without its runs: `python -m looplab.tables rejudge N [N ...]`.

A committed table keeps, per finding, its paired differences, their interval at the look that gave the line and
the design that interval came from (tableN.findings.json), and the seed means of every configuration (tableN.csv).
The rules changed since some tables were built (docs/tables.md#verdicts): the paper's effect is compared in this
setting's units, with the **smaller than claimed** verdict; accounting identities say **by construction**; new
preconditions make a line **not tested** (an arm that never cleared p-hop's shortcut; an exit gate that cannot act).
This module applies those rules to the stored intervals — never to new data: no interval, δ or threshold is
recomputed from anything but what the table already held — and rewrites the findings of tableN.findings.json and
the Findings section of tableN.md, each line marked as re-judged. Tables whose runs are on disk are better rebuilt
(`python -m looplab.tables report N`): that recomputes everything from the runs.

The preconditions read each arm's seed mean from the table's CSV rows, turned into one pseudo-run per
configuration (`csv_units`); the comparison and its check are the report's own (`findings.comparisons`,
`findings.check_preconditions`).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from looplab.stats import DECISIVE, SequentialDesign
from looplab.tables.claims import GATE_CAN_ACT, PHOP_CLEARS_SHORTCUT
from looplab.tables.findings import Verdict, adjust_family, check_preconditions, comparisons
from looplab.tables.load import Unit
from looplab.tables.spec import get

# Preconditions added after tables were built: checked on the CSV's seed means. The others were checked when the table
# was built (their figures, e.g. a run's unigram perplexity, are not in the CSV) and their stored result stands.
ADDED_PRECONDITIONS = (GATE_CAN_ACT, PHOP_CLEARS_SHORTCUT)
REJUDGED = "re-judged from the stored interval under the rules of docs/tables.md (2026-12-05)"


def _num(x: str) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _nr(text: str) -> tuple[int | None, int | None]:
    m = re.match(r"(\d+)⊗(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def csv_units(number: int, rows: list[dict[str, str]]) -> list[Unit]:
    """One pseudo-run per configuration of a committed table's CSV, carrying its seed means under the metric names the
    preconditions read (rep 'mean'): enough for `check_preconditions`, which takes each arm's mean over its runs."""
    units: dict[tuple, Unit] = {}
    for row in rows:
        exp = (row.get("experiment") or "").removesuffix("_tiny").removesuffix("_paper")
        N, R = _nr(row.get("N⊗R", ""))
        arm, facets = row.get("arm") or None, {"experiment": exp, "N": N, "R": R, "NR": N * R if N and R else None}
        if arm and arm.startswith("parallel "):
            facets.update(schedule="parallel", kv=arm.split(" ", 1)[1], arm=None)
        elif arm in ("sequential", "unrolled"):
            facets.update(schedule="sequential", kv=None, arm=None)
        else:
            facets.update(arm=arm, schedule="sequential", kv=None)
        if row.get("mode"):
            facets["mode"] = row["mode"]
        key = tuple(sorted((k, str(v)) for k, v in facets.items()))
        u = units.setdefault(key, Unit(facets, "mean", {"model": {"loops": R, "layers": N}, "per_depth": {"acc": []},
                                                        "exit": {}}))
        acc, setting = _num(row.get("accuracy")), row.get("setting") or ""
        ppl = _num(row.get("perplexity"))
        if ppl is not None:
            u.data["perplexity"] = ppl
        step = re.match(r"exit at step (\d+)", setting)
        if step:  # table 8's fixed-loop body read at loop k: per_depth.acc[k − 1]; at k = R it is the model's accuracy
            k = int(step.group(1))
            accs = u.data["per_depth"]["acc"]
            accs.extend([None] * (k - len(accs)))
            accs[k - 1] = acc
            if k == R:
                u.data["accuracy"] = acc
        elif setting.startswith("q = "):
            u.data["exit"][setting[4:]] = {"acc": acc}
        elif acc is not None:
            u.data["accuracy"] = acc
    return list(units.values())


def _design(d: dict[str, Any]) -> SequentialDesign | None:
    seq = d.get("sequential") or {}
    return SequentialDesign.from_dict(seq["design"]) if seq.get("design") else None


def _verdict_of(line: dict[str, Any], number: int, scale: str, design: SequentialDesign | None, units: list[Unit]) -> Verdict:
    spec = get(number)
    matches = [f for f in spec.findings if f.label == line["label"] and f.metric == line["metric"]]
    if not matches:
        raise ValueError(f"table {number}: the stored finding {line['label']!r} ({line['metric']}) is not in "
                         "tables/claims.py any more: rebuild the table")
    fd = matches[0]
    v = Verdict(fd, line.get("stratum", ""), line.get("arms", ""), list(line.get("diffs") or []), list(line.get("reps") or []),
                list(line.get("missing") or []), line.get("lo"), line.get("hi"),
                design=design if line.get("look") is not None or line.get("status") else None,
                h_ex=float(line.get("examples_half_width") or 0.0), look=line.get("look"), status=line.get("status", ""),
                stop=line.get("stopped", ""), more_seeds=line.get("more_seeds"), scale=scale)
    reason = line.get("measured", "")
    m = re.search(r"\(([^()]*)\)$", reason) if line.get("mean") is None else None
    v.reason = m.group(1) if m else ""
    # the preconditions, today's: from the stored line, or recomputed on the table's seed means
    v.not_tested = line.get("not_tested", "")
    added = tuple(p for p in fd.requires if p in ADDED_PRECONDITIONS)
    if added and units and not v.not_tested:
        for stratum, arms, terms in comparisons(fd, units):
            if stratum == v.stratum and arms == v.arms and not isinstance(terms, str):
                v.not_tested = check_preconditions(dataclasses.replace(fd, requires=added), terms)
                break
        else:
            raise ValueError(f"table {number}: no configuration of its CSV matches {v.title()!r}: rebuild the table")
    return v


def confirmatory_note(kept: dict | None) -> str:
    """A line's confirmatory verdict as `confirm NAME --apply` appended it (tables/confirm.py), kept on re-judging."""
    if not kept:
        return ""
    c = kept["confirmatory"]
    head = c["design"].split(" (")[0]  # "confirmatory Z1"
    return f" **{head[0].upper()}{head[1:]}: {c['verdict']}** — {c['measured']}."


def rejudge(number: int, table_dir: Path = Path("experiments/tables"), scale: str = "tiny") -> list[Verdict]:
    stem = f"table{number}" + ("" if scale == "tiny" else f"-{scale}")
    jpath, cpath, mpath = (table_dir / f"{stem}.{x}" for x in ("findings.json", "csv", "md"))
    d = json.loads(jpath.read_text())
    rows = list(csv.DictReader(cpath.open())) if cpath.exists() else []
    units = csv_units(number, rows)
    design = _design(d)
    verdicts = [_verdict_of(line, number, scale, design, units) for line in d["findings"]]
    adjust_family(verdicts)
    before = {i: line.get("verdict_before", line["verdict"]) for i, line in enumerate(d["findings"])}
    for i, v in enumerate(verdicts):
        if v.design is not None and v.status != "decided" and v.verdict in DECISIVE:  # decided by today's rules
            v.status, v.more_seeds = "decided", None
            v.stop = (f"decided by today's rules at the stored look ({len(v.diffs)} paired seeds; the build stopped there "
                      f"as {before[i]})")
    kept = {i: {"confirmatory": line["confirmatory"]} for i, line in enumerate(d["findings"]) if line.get("confirmatory")}
    d["findings"] = [{**v.as_dict(), "rejudged": REJUDGED, "verdict_before": before[i], **kept.get(i, {})}
                     for i, v in enumerate(verdicts)]
    jpath.write_text(json.dumps(d, indent=2, default=str) + "\n")
    if mpath.exists():
        text = mpath.read_text()
        lines = [v.line() + f" _{REJUDGED}; built as: {before[i]}._" + confirmatory_note(kept.get(i))
                 for i, v in enumerate(verdicts)]
        head, sep, rest = text.partition("\n## Findings\n")
        if sep:
            body = rest.split("\n")
            first = next((i for i, x in enumerate(body) if x.startswith("- **")), None)
            if first is not None:
                last = first
                while last + 1 < len(body) and body[last + 1].startswith("- **"):
                    last += 1
                body[first:last + 1] = lines
                mpath.write_text(head + sep + "\n".join(body))
    return verdicts
