"""Sequential seeds: a table trained in rounds of seeds until each of its findings is decided.

`python -m looplab.tables run N --seeds auto [--max-seeds K] [--budget-min M] [--round-seeds R]`:

* Round 1 trains the table's default seeds (1, 2, 3; table 2: 1..5), every later round the next R seeds; every
  arm of a round shares its seed's common random numbers, as in a fixed build. Each (configuration, seed) job
  is its own command (runner.job_command), and a job whose ok results.json is already on disk — from an earlier
  round, an interrupted build or a fixed build of the same seeds — is not trained again.
* After each round every finding is judged at that look with the design's repeated confidence interval
  (looplab.stats.SequentialDesign: Pocock's boundary for looks at 3..K paired seeds, K the cap), with the
  negligible verdict for sign claims (their δ, tables/claims.py). A finding is final at the first look that
  decides it (reproduced, contradicted or negligible); later rounds, run for other findings, do not change it.
* The build stops when no finding is open — each is decided, not tested (an arm missed its precondition), has
  no comparison, or cannot be decided by more seeds because its test examples' noise alone exceeds its margin
  at its mean — or at the seed cap, or when the time budget would not hold the next round.
* The rounds live in `outputs/tables/tableN/<scale>/sequential.json` (the design, each round's seeds, times and
  jobs, the stop). An interrupted build resumes from it: finished rounds stay as they were, the unfinished one
  is run again and trains only its missing jobs. `report N` rebuilds the table from the same file.

Stopping without a decision never raises an error rate, so the cap, the budget and the futility rule are free
choices; the design's cap is not: a build may stop before it, never continue past it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from looplab.stats import DECISIVE, SequentialDesign, judge, seeds_to_decide
from looplab.tables.findings import Verdict, adjust_family, evaluate_findings
from looplab.tables.spec import DEFAULT_OUT_ROOT, TableSpec, default_seeds, get

STATE_FILE = "sequential.json"
DEFAULT_MAX_SEEDS = 20
DEFAULT_ROUND_SEEDS = 2
# Table kinds whose findings come from the training runs alone (no benchmark after training that would have to be
# re-measured at every look): tables 1, 2, 3, 5, 6, 7, 8, 9.
SEQUENTIAL_KINDS = ("lm", "depth", "reset", "task", "exit", "extrapolation")
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
    @classmethod
    def load(cls, path: Path) -> SequentialState | None:
        path = Path(path)
        if not path.exists():
            return None
        d = json.loads(path.read_text())
        return cls(table=int(d["table"]), scale=d["scale"], design=SequentialDesign.from_dict(d["design"]),
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
    for rnd, seeds in looks:
        vs = evaluate_findings(spec, [u for u in units if u.rep in seeds], scale, design)
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
def _check_supported(spec: TableSpec) -> None:
    if spec.kind not in SEQUENTIAL_KINDS:
        raise ValueError(f"table {spec.number} ({spec.kind}) cannot run --seeds auto: its findings "
                         + ("are read off a benchmark measured after training" if spec.findings else "do not exist")
                         + "; sequential seeds cover the tables judged from training runs alone (1, 2, 3, 5, 6, 7, 8, 9)")


def _done(out_root: Path, spec: TableSpec, scale: str, sw, seed: int) -> set[int]:
    """Grid indices of the sweep whose (configuration, seed) already has an ok results.json anywhere in its folder."""
    from looplab.runs import load_runs
    from looplab.tables.runner import sweep_dir

    runs = [r for r in load_runs(sweep_dir(out_root, spec.number, scale, sw)) if r.ok and str(r.seed) == str(seed)]
    return {i for i, combo in enumerate(sw.grid()) if any(all(r.swept.get(k) == v for k, v in combo.items()) for r in runs)}


def round_commands(spec: TableSpec, scale: str, out_root: Path, seeds: list[int], *, logger: str, extra: list[str],
                   hardware: str | None, jobs: int, zeroshot: bool) -> tuple[list, int]:
    """The jobs a round still lacks, one command each, in the table's sweep order (stage 2 after the runs it starts
    from), then table 1's zero-shot evaluation; and how many of the round's jobs are on disk already."""
    from looplab.tables.runner import job_command, zeroshot_command

    cmds, reused = [], 0
    for sw in spec.sweeps_for(scale):
        for seed in seeds:
            done = _done(out_root, spec, scale, sw, seed)
            reused += len(done)
            cmds += [job_command(spec, scale, sw, i, seed, out_root, logger=logger, extra=extra, hardware=hardware, jobs=jobs)
                     for i in range(len(sw.grid())) if i not in done]
    if zeroshot and (cmds or _zeroshot_missing(out_root, spec, scale, seeds)):
        cmds.append(zeroshot_command(spec, scale, out_root))  # it evaluates only the checkpoints without a zeroshot.json
    return cmds, reused


def _zeroshot_missing(out_root: Path, spec: TableSpec, scale: str, seeds: list[int]) -> bool:
    """Some ok run of these seeds has no zeroshot.json (a round interrupted during table 1's zero-shot evaluation)."""
    from looplab.runs import load_runs
    from looplab.tables.runner import sweep_dir

    want = {str(s) for s in seeds}
    return any(r.ok and str(r.seed) in want and r.zeroshot() is None
               for sw in spec.sweeps_for(scale) for r in load_runs(sweep_dir(out_root, spec.number, scale, sw)))


def run(number: int, scale: str = "tiny", out_root: Path = DEFAULT_OUT_ROOT, *, max_seeds: int | None = None,
        budget_min: float | None = None, round_seeds: int | None = None, logger: str | None = None,
        extra: list[str] | None = None, hardware: str | None = None, jobs: int | None = None,
        zeroshot: bool | None = None, table_dir: Path | None = None, env: dict[str, str] | None = None,
        dry_run: bool = False, clock=time.time) -> SequentialState:
    """Run table `number` in rounds of seeds until its findings are decided (see the module docstring); then write
    its report. Resumes from sequential.json when there is one. Returns the final state."""
    from looplab.tables import runner
    from looplab.tables.report import build, write

    spec = get(number)
    _check_supported(spec)
    path = state_path(out_root, number, scale)
    state = SequentialState.load(path)
    first = default_seeds(scale, number) or [1, 2, 3]
    if state is None:
        cap = max_seeds or DEFAULT_MAX_SEEDS
        if cap < len(first):
            raise ValueError(f"--max-seeds {cap} is below the first round's {len(first)} seeds ({first})")
        state = SequentialState(number, scale, SequentialDesign(cap), cap, round_seeds or DEFAULT_ROUND_SEEDS, budget_min)
    else:
        if (state.table, state.scale) != (number, scale):
            raise ValueError(f"{path} belongs to table {state.table} at {state.scale} scale")
        if max_seeds and max_seeds > state.design.cap:
            raise ValueError(f"{path}: this build's design is capped at {state.design.cap} seeds; its intervals do not cover "
                             f"--max-seeds {max_seeds}. Stop earlier, or start a new design (move {path.name} away: the runs "
                             "are reused, the looks start again)")
        state.max_seeds = max_seeds or state.max_seeds
        state.round_seeds = round_seeds or state.round_seeds
        state.budget_min = budget_min if budget_min is not None else state.budget_min
        state.stop = None  # resuming: the stop is decided again below
    jobs = (runner.default_jobs(scale) if jobs is None else jobs) if scale == "tiny" else 1
    logger = logger or runner.default_logger(scale)
    zeroshot = zeroshot if zeroshot is not None else number == 1
    run_env = {**os.environ, **(env or {})}
    kw = dict(logger=logger, extra=list(extra or []), hardware=hardware, jobs=jobs, zeroshot=zeroshot)
    tag = f"[table{number}]"
    print(f"{tag} sequential seeds: {_design_text(state)}", flush=True)
    while True:
        if state.rounds and not state.rounds[-1].finished:
            rnd = state.rounds[-1]  # an interrupted round: run what it lacks
            if dry_run:
                cmds, _ = round_commands(spec, scale, out_root, rnd.seeds, **kw)
                print(f"{tag} round {rnd.number} (unfinished): seeds {', '.join(map(str, rnd.seeds))}", flush=True)
                for c in cmds:
                    print(f"{tag} {c}", flush=True)
                return state
        else:
            if state.finished:
                verdicts = _look(spec, scale, out_root, state)
                state.finished[-1].look = look_counts(verdicts)
                if not any(v.status == "open" for v in verdicts):
                    state.stop = {"code": "decided", "reason": "no finding left open (each decided, not tested, without a "
                                  "comparison or beyond what seeds can decide)", "after_round": state.rounds[-1].number}
                    break
            used = state.all_seeds()
            nxt = first if not used else list(range(max(used) + 1, min(max(used) + state.round_seeds, state.max_seeds) + 1))
            if not nxt:
                state.stop = {"code": "cap", "reason": f"the seed cap ({state.max_seeds}) was reached",
                              "after_round": state.rounds[-1].number}
                break
            rnd = Round(len(state.rounds) + 1, nxt)
            cmds, _ = round_commands(spec, scale, out_root, rnd.seeds, **kw)
            estimate = _estimate(state, cmds)
            if state.budget_min is not None and state.finished and state.elapsed_s + estimate > 60 * state.budget_min:
                state.stop = {"code": "budget", "reason": f"the time budget ({state.budget_min:g} min) would not hold round "
                              f"{rnd.number} (≈ {estimate / 60:.0f} min more after {state.elapsed_s / 60:.0f})",
                              "after_round": state.rounds[-1].number}
                break
            if dry_run:
                print(f"{tag} round {rnd.number}: seeds {', '.join(map(str, rnd.seeds))}", flush=True)
                for c in cmds:
                    print(f"{tag} {c}", flush=True)
                return state
            rnd.started = _now()
            state.rounds.append(rnd)
            state.save(path)
        cmds, reused = round_commands(spec, scale, out_root, rnd.seeds, **kw)
        print(f"{tag} round {rnd.number}: seeds {', '.join(map(str, rnd.seeds))} — {len(cmds)} command(s), "
              f"{reused} job(s) already on disk", flush=True)
        rnd.attempts += 1
        if rnd.attempts == 1:
            rnd.jobs_reused, rnd.jobs_run = reused, sum(1 for c in cmds if c.sweep is not None)
        t0 = clock()
        try:
            records = runner.execute(cmds, spec, scale, out_root, rnd.seeds, run_env)
            rnd.failed_commands += sum(1 for r in records if r.get("returncode") not in (0, None))
            rnd.finished = _now()
        finally:  # an interrupted round keeps its time; it stays unfinished and runs again on resume
            dt = clock() - t0
            rnd.seconds += dt
            state.elapsed_s += dt
            state.save(path)
    if dry_run:
        print(f"{tag} would stop after round {state.stop['after_round']}: {state.stop['reason']}", flush=True)
        return state
    state.stop["at"] = _now()
    state.save(path)
    print(f"{tag} stopped after round {state.stop['after_round']}: {state.stop['reason']}", flush=True)
    table = build(number, scale, out_root, sequential=True)
    paths = write(table, table_dir) if table_dir else write(table)
    print(table.markdown(), flush=True)
    print(f"{tag} wrote " + ", ".join(str(p) for p in paths), flush=True)
    return state


def _look(spec: TableSpec, scale: str, out_root: Path, state: SequentialState) -> list[Verdict]:
    from looplab.tables.report import build

    table = build(spec.number, scale, out_root, sequential=True, state=state)
    counts = look_counts(table.verdicts)
    print(f"[table{spec.number}] look after round {state.finished[-1].number} ({len(state.all_seeds())} seeds): "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), flush=True)
    return table.verdicts


def _estimate(state: SequentialState, cmds: list) -> float:
    """Seconds the next round should take: the last round's wall time per job it trained, times the jobs to train."""
    timed = [r for r in state.finished if r.jobs_run]
    if not timed:
        return 0.0
    per_job = statistics.fmean(r.seconds / r.jobs_run for r in timed[-2:])
    return per_job * sum(1 for c in cmds if c.sweep is not None)


def _design_text(state: SequentialState) -> str:
    d = state.design
    return (f"repeated confidence intervals (Pocock), looks at {d.first_look}..{d.cap} paired seeds, α = {d.alpha:.2f} "
            f"overall, nominal α′ = {d.nominal:.4f} per look; rounds of {state.round_seeds} seeds after the first; "
            f"cap {state.max_seeds} seeds" + (f", budget {state.budget_min:g} min" if state.budget_min is not None else ""))
