"""A sequential build's state and its judgement (tables/sequential.py runs the rounds): the rounds recorded in
`sequential.json`, and each finding judged at each look with the design's repeated confidence interval — what
`report` reads back to rebuild a table as the build judged it."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from looplab.stats import DECISIVE, SequentialDesign, judge, seeds_to_decide
from looplab.tables.findings import Verdict, adjust_family, evaluate_findings
from looplab.tables.spec import TableSpec

STATE_FILE = "sequential.json"
DEFAULT_ROUND_SEEDS = 2
PROJECTION_LIMIT = 1000  # seeds up to which an undecided finding's projection looks


def state_path(out_root: Path, number: int, scale: str) -> Path:
    return Path(out_root) / f"table{number}" / scale / STATE_FILE


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


@dataclass
class Round:
    """One round: its seeds, when it ran, what it trained, and (once finished) the counts of its look."""

    number: int
    seeds: list[int]
    started: str = ""
    finished: str | None = None
    seconds: float = 0.0
    jobs_run: int = 0  # the round's jobs that were not on disk when it started (trained by it, over every attempt)
    jobs_reused: int = 0  # the round's jobs on disk when it started (an earlier build's, or another round's)
    failed_commands: int = 0
    attempts: int = 0
    look: dict[str, int] = field(default_factory=dict)


@dataclass
class SequentialState:
    """The persistent state of a sequential build (sequential.json)."""

    table: int
    scale: str
    design: SequentialDesign
    max_seeds: int
    round_seeds: int = DEFAULT_ROUND_SEEDS
    budget_min: float | None = None
    rounds: list[Round] = field(default_factory=list)
    stop: dict[str, Any] | None = None
    elapsed_s: float = 0.0

    # ------------------------------------------------------------------ persistence
    table_key = staticmethod(int)  # what `table` is read back as: a paper table's number (own_sequential: a name)

    @classmethod
    def load(cls, path: Path) -> SequentialState | None:
        path = Path(path)
        if not path.exists():
            return None
        d = json.loads(path.read_text())
        return cls(table=cls.table_key(d["table"]), scale=d["scale"], design=SequentialDesign.from_dict(d["design"]),
                   max_seeds=int(d["max_seeds"]), round_seeds=int(d.get("round_seeds", DEFAULT_ROUND_SEEDS)),
                   budget_min=d.get("budget_min"), rounds=[Round(**r) for r in d.get("rounds", [])], stop=d.get("stop"),
                   elapsed_s=float(d.get("elapsed_s", 0.0)))

    def as_dict(self) -> dict[str, Any]:
        return {"table": self.table, "scale": self.scale, "design": self.design.as_dict(), "max_seeds": self.max_seeds,
                "round_seeds": self.round_seeds, "budget_min": self.budget_min, "elapsed_s": round(self.elapsed_s, 1),
                "rounds": [asdict(r) for r in self.rounds], "stop": self.stop}

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        os.replace(tmp, path)  # atomic: an interrupted write leaves the previous state

    # ------------------------------------------------------------------ rounds and looks
    @property
    def finished(self) -> list[Round]:
        return [r for r in self.rounds if r.finished]

    def all_seeds(self) -> list[int]:
        return [s for r in self.rounds for s in r.seeds]

    def looks(self) -> list[tuple[int, set[str]]]:
        """(round number, the seeds of every finished round up to it) of each look."""
        out, seen = [], set()
        for r in self.finished:
            seen |= {str(s) for s in r.seeds}
            out.append((r.number, set(seen)))
        return out

    # ------------------------------------------------------------------ α-spending across restarts
    def _restarted_after(self) -> int:
        """The last round judged by an earlier design of this state (`--restart` keeps the rounds; 0: none)."""
        return max((int(h["last_round"]) for h in self.design.history if h.get("last_round") is not None), default=0)

    def design_at(self, round_number: int) -> SequentialDesign:
        """The design that judged the look after round `round_number`: an earlier one for the rounds before a restart."""
        for h in self.design.history:
            if h.get("last_round") is not None and round_number <= int(h["last_round"]):
                return SequentialDesign.from_dict(h)
        return self.design

    def design_looks(self) -> list[int]:
        """The looks the current design has made: the seeds in all at each finished round after its restart."""
        start = self._restarted_after()
        return [len(seeds) for rnd, seeds in self.looks() if rnd > start]

    def alpha_spent(self) -> float:
        """α spent on these runs so far: by the earlier designs and by the current one at its looks."""
        return self.design.spent + self.design.alpha_spent(self.design_looks())

    def restart(self, cap: int) -> None:
        """`--restart`: a new design capped at `cap` on the same rounds, calibrated at the α the current one left
        (stats.SequentialDesign.restarted); the rounds so far keep the verdicts their design gave them."""
        last = self.finished[-1].number if self.finished else 0
        self.design = self.design.restarted(cap, self.design_looks(), last_round=last, closed=_now())
        self.max_seeds, self.stop = cap, None

    def stop_text(self) -> str:
        if self.stop:
            return self.stop["reason"]
        if self.rounds and not self.rounds[-1].finished:
            return f"interrupted during round {self.rounds[-1].number}: run the same command again to resume"
        return "not stopped yet: run the same command again to go on"

    def summary(self) -> dict[str, Any]:
        """What the report renders: the design, the rounds and why the build stopped."""
        return {**self.as_dict(), "stop_text": self.stop_text()}


# ----------------------------------------------------------------------------- judging
def _key(spec: TableSpec, v: Verdict) -> tuple:
    return (spec.findings.index(v.finding), v.stratum, v.arms)


def _futile(v: Verdict) -> bool:
    """No number of seeds decides it at its current mean: the test examples' half-width alone keeps the interval
    undecided (accuracy findings whose examples' noise exceeds their margin)."""
    if v.h_ex <= 0 or v.mean is None:
        return False
    return judge(v.rule, v.mean - v.h_ex, v.mean + v.h_ex) not in DECISIVE


def classify(v: Verdict) -> str:
    """decided | not tested | no interval | futile | open (more seeds may decide it: it holds the build open)."""
    if v.verdict in DECISIVE:
        return "decided"
    if v.not_tested:
        return "not tested"
    if v.lo is None:
        waiting = v.design is not None and 0 < len(v.diffs) < v.design.first_look
        return "open" if waiting else "no interval"
    return "futile" if _futile(v) else "open"


def judge_sequential(spec: TableSpec, units: list, scale: str | None, state: SequentialState) -> list[Verdict]:
    """Every finding judged at each look (the finished rounds' seeds so far) with the state's design; each line is
    frozen at the first look that decides it, else taken from the last look. Holm adjusts the lines' repeated
    p-values; each line says where its seeds stopped and why."""
    design = state.design
    looks = state.looks()
    if not looks:
        vs = evaluate_findings(spec, [], scale, design)
        for v in vs:
            v.status, v.stop = "open", "no finished round yet"
        adjust_family(vs)
        return vs
    per_look = []
    for rnd, seeds in looks:  # each look with the design that made it (an earlier one before a --restart)
        vs = evaluate_findings(spec, [u for u in units if u.rep in seeds], scale, state.design_at(rnd))
        per_look.append((rnd, {_key(spec, v): v for v in vs}, vs))
    final = []
    last_round, _, last = per_look[-1]
    for v_last in last:
        key = _key(spec, v_last)
        chosen = next(((rnd, by[key]) for rnd, by, _ in per_look if key in by and by[key].verdict in DECISIVE), None)
        rnd, v = chosen if chosen else (last_round, v_last)
        v.look, v.status = rnd, classify(v)
        final.append(v)
    adjust_family(final)
    for v in final:
        v.stop = _stop_text(v, state)
    return final


def _stop_text(v: Verdict, state: SequentialState) -> str:
    n = len(v.diffs)
    at = f"round {v.look}, {n} paired seed{'s' if n != 1 else ''}"
    if v.status == "decided":
        return f"decided at {at}"
    if v.status == "not tested":
        return f"not tested at {at}: an arm missed the precondition, which does not hold the build open"
    if v.status == "no interval":
        return f"no interval at {at} ({v.reason})"
    if v.status == "futile":
        return (f"undecided at {at}: the test examples' noise alone (±{v._fmt(v.h_ex).lstrip('+')}) keeps its interval "
                "undecided at this mean, so more seeds cannot decide it and it did not hold the build open")
    text = f"undecided at {at}; the build: {state.stop_text()}"
    if v.lo is not None and n >= 2:
        need = seeds_to_decide(v.rule, v.diffs, state.design, v.h_ex, limit=PROJECTION_LIMIT)
        v.more_seeds = None if need is None else need - n
        text += (f"; at its observed mean and sd at least {need - n} more seed{'s' if need - n != 1 else ''} ({need} in "
                 "all, at this design's α′; a design capped there has a smaller α′) would decide it" if need is not None else
                 f"; at its observed mean and sd no number of seeds up to {PROJECTION_LIMIT:,} would decide it")
    return text


def look_counts(verdicts: list[Verdict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in verdicts:
        out[v.status] = out.get(v.status, 0) + 1
    return out


# ----------------------------------------------------------------------------- the build
