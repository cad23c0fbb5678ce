"""Sequential seeds for a table of one's own: `python -m looplab.tables run SPEC.yaml --seeds auto`.

    python -m looplab.tables run spec.yaml --seeds auto [--max-seeds 20] [--round-seeds 2] [--restart] [--jobs N]

The paper tables' sequential build (tables/sequential.py), for a spec (tables/own.py):

* Round 1 trains the spec's seeds (default 1, 2, 3), every later round the next R seeds (`--round-seeds`,
  default 2) after the largest so far, never more than the cap (`--max-seeds`, default 20) in all.
* After each round every comparison line is judged at that look with the design's repeated confidence interval
  (looplab.stats.SequentialDesign: Pocock's boundary over the looks at 3..cap paired seeds, the same design as
  the paper tables') and the spec's claim and δ (tables/compare.py: the same rules, with the negligible verdict).
  A line is final at the first look that decides it; later rounds, run for other lines, do not change it. Holm
  adjusts the lines' repeated p-values as the fixed build adjusts its p-values.
* A line without a claim sign is two-sided: decided when its repeated interval excludes 0 on either side (A > B or
  A < B) or lies inside (−δ, +δ). The repeated intervals are two-sided and hold together at every look, so such a
  line is wrong with probability at most α too; it costs nothing over a signed claim but the sign's promise.
* The build stops when no line is open (each decided, not tested because an arm missed a precondition, or
  without any paired seed), or at the cap. A line waiting for seeds (fewer than 3 pair up: a failed run) is open.
* The rounds live in `<out-root>/<name>/sequential.json` beside the runs. A build run again resumes: the rounds
  keep their seeds, the jobs any round lacks (an interrupted round, or a run that was removed) are trained, and the
  looks are judged again from the runs on disk. A larger cap needs a new design: `--restart` calibrates it at the
  α the earlier one left, recorded in `alpha_ledger.json` beside it (tables/alpha_ledger.py), which moving
  sequential.json away does not reset; without `--restart` such a build is refused.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from looplab.stats import DECISIVE, SequentialDesign
from looplab.tables import own
from looplab.tables.alpha_ledger import LEDGER_FILE, AlphaLedger
from looplab.tables.sequential import _design_text, open_design
from looplab.tables.sequential_state import STATE_FILE, Round, SequentialState, _now

SCALE = "own"  # the state's and the ledger's `scale`; their `table` is the spec's name


class OwnState(SequentialState):
    """sequential.json of a spec: the paper tables' state (rounds, design, stop) named by the spec, not a number."""

    table_key = staticmethod(str)


class OwnLedger(AlphaLedger):
    """alpha_ledger.json of a spec, named by the spec."""

    table_key = staticmethod(str)


def status(line, design: SequentialDesign) -> str:
    """decided | not tested | no interval | open (more seeds may decide it: it holds the build open)."""
    if line.plain in DECISIVE:
        return "decided"
    if line.interval is not None:
        return "open"
    if 0 < len(line.seeds) < design.first_look:
        return "open"  # waiting for seeds (a failed run): later rounds pair more
    return "no interval" if not line.seeds else "not tested"


def judge(spec: own.OwnSpec, out_root: Path, state: OwnState) -> dict:
    """Every line judged at each look (the finished rounds' seeds so far) with the design that made it; each line
    frozen at the first look that decides it, else read at the last; Holm across the lines' repeated p-values."""
    from looplab.tables import compare

    looks = state.looks()
    per_look = []
    for rnd, seeds in looks:
        res = own.judge(spec, out_root, at_seeds=seeds, design=state.design_at(rnd))
        per_look.append((rnd, {(x.stratum, x.a): x for x in res["lines"]}, res))
    last_round, _, res = per_look[-1]
    lines = []
    for x in res["lines"]:
        key = (x.stratum, x.a)
        rnd, line = next(((r, by[key]) for r, by, _ in per_look if key in by and by[key].plain in DECISIVE),
                         (last_round, x))
        line.look, line.status = rnd, status(line, state.design_at(rnd))
        lines.append(line)
    compare.adjust(lines, spec.sign)
    res["lines"] = lines
    res["sequential"] = {"design": _design_text(state), "rounds": [{"number": r.number, "seeds": r.seeds}
                                                                   for r in state.rounds],
                         "stop": state.stop_text()}
    return res


def _next_seeds(spec: own.OwnSpec, state: OwnState) -> list[int]:
    used = state.all_seeds()
    if not used:
        return list(spec.seeds)
    n = min(state.round_seeds, state.max_seeds - len(used))
    return list(range(max(used) + 1, max(used) + 1 + max(0, n)))


def _open_design(spec: own.OwnSpec, path: Path, lpath: Path, max_seeds: int | None, round_seeds: int | None,
                 restart: bool) -> tuple[OwnState, OwnLedger | None]:
    """The state to go on with: tables/sequential.py's open_design, for a spec of one's own."""
    state, ledger = OwnState.load(path), OwnLedger.load(lpath)
    if state is not None and state.table != spec.name:
        raise ValueError(f"{path} belongs to the spec named {state.table!r}, not {spec.name!r}")
    state = open_design(state, ledger, path, lpath, what=spec.name, first=spec.seeds, max_seeds=max_seeds,
                        round_seeds=round_seeds, restart=restart,
                        new_state=lambda design, cap, rs: OwnState(spec.name, SCALE, design, cap, rs),
                        warn=lambda: _warn_unaccounted_runs(spec, path))
    return state, ledger


def _warn_unaccounted_runs(spec: own.OwnSpec, path: Path) -> None:
    from looplab.runs import load_runs

    seeds = sorted({int(r.seed) for r in load_runs(path.parent) if r.ok and str(r.seed).isdigit()})
    if seeds:
        print(f"[{spec.name}] WARNING: ok runs of seeds {', '.join(map(str, seeds))} are on disk but neither {path.name} "
              f"nor {LEDGER_FILE} is: this design starts at the full α (fine for a fixed build's runs; not for runs an "
              "earlier sequential design looked at)", file=sys.stderr, flush=True)


def run(spec_path: str | Path, out_root: Path = own.DEFAULT_OUT_ROOT, *, max_seeds: int | None = None,
        round_seeds: int | None = None, restart: bool = False, jobs: int = 1, extra: list[str] | None = None,
        logger: str | None = None, dry_run: bool = False) -> dict:
    """Train the spec in rounds of seeds until every line is decided or the cap (see the module docstring); then
    write compare_<metric>.{md,csv,png} (and the W&B summary). Returns compare's result with 'state' (the final
    OwnState), 'records' (this call's jobs) and 'paths'."""
    spec = own.load(spec_path)
    folder = Path(out_root) / spec.name
    path, lpath = folder / STATE_FILE, folder / LEDGER_FILE
    state, ledger = _open_design(spec, path, lpath, max_seeds, round_seeds, restart)
    ledger = ledger or OwnLedger(spec.name, SCALE)
    tag = spec.name
    print(f"[{tag}] sequential seeds: {_design_text(state)}", flush=True)
    if dry_run:
        seeds = state.rounds[-1].seeds if state.rounds and not state.rounds[-1].finished else _next_seeds(spec, state)
        todo, done = own.plan(spec, out_root, seeds, extra, jobs)
        print(f"[{tag}] next round: seeds {', '.join(map(str, seeds))}", flush=True)
        for argv in todo:
            print(f"[{tag}] {' '.join(argv[1:])}", flush=True)
        return {"records": done + [{"argv": a, "returncode": None} for a in todo], "state": state}
    ledger.record(state)  # the ledger first: a state file that is not its current design is refused before training
    ledger.save(lpath)
    state.save(path)
    records, res = [], None
    while True:
        rnd = state.rounds[-1] if state.rounds and not state.rounds[-1].finished else None
        if rnd is None:
            if state.finished:
                records += _train(spec, out_root, state, None, jobs, extra)  # the jobs finished rounds lack
                res = judge(spec, out_root, state)
                state.finished[-1].look = _counts(res["lines"])
                print(f"[{tag}] look after round {state.finished[-1].number} ({len(state.all_seeds())} seeds): "
                      + ", ".join(f"{n} {k}" for k, n in sorted(state.finished[-1].look.items())), flush=True)
                if not any(x.status == "open" for x in res["lines"]):
                    state.stop = {"code": "decided", "reason": "no line left open (each decided, not tested or "
                                  "without a paired seed)", "after_round": state.finished[-1].number}
                    break
            seeds = _next_seeds(spec, state)
            if not seeds:
                state.stop = {"code": "cap", "reason": f"the seed cap ({state.max_seeds}) was reached",
                              "after_round": state.finished[-1].number}
                break
            rnd = Round(len(state.rounds) + 1, seeds, started=_now())
            state.rounds.append(rnd)
            _save(state, path, ledger, lpath)
        records += _train(spec, out_root, state, rnd, jobs, extra)
        rnd.finished = _now()
        _save(state, path, ledger, lpath)
    state.stop["at"] = _now()
    _save(state, path, ledger, lpath)
    print(f"[{tag}] stopped after round {state.stop['after_round']}: {state.stop['reason']}", flush=True)
    res["sequential"]["stop"] = state.stop_text()
    res["records"], res["state"] = records, state
    res["paths"] = own.publish(spec, res, logger)
    return res


def _train(spec: own.OwnSpec, out_root: Path, state: OwnState, rnd: Round | None, jobs: int,
           extra: list[str] | None) -> list[dict]:
    """Train what the rounds so far lack (rnd: the round being run, else the finished ones); its time and jobs go
    to rnd, or to the last finished round when a rerun repairs it."""
    seeds = state.all_seeds() if rnd is not None else [s for r in state.finished for s in r.seeds]
    todo, done = own.plan(spec, out_root, seeds, extra, jobs)
    target = rnd or state.finished[-1]
    if rnd is not None:
        print(f"[{spec.name}] round {rnd.number}: seeds {', '.join(map(str, rnd.seeds))} — {len(todo)} job(s) to "
              f"train, {len(done)} on disk", flush=True)
        rnd.attempts += 1
    if rnd is not None and rnd.attempts == 1:
        target.jobs_reused = sum(1 for r in done if _seed_of(r["argv"]) in rnd.seeds)
    if not todo:
        return []
    t0 = time.time()
    try:
        records = own.train(todo, jobs, spec.name)
    finally:  # an interrupted round keeps its time; it stays unfinished and runs again on resume
        dt = time.time() - t0
        target.seconds += dt
        state.elapsed_s += dt
    target.jobs_run += len(todo)
    target.failed_commands += sum(1 for r in records if r["returncode"] != 0)
    return records


def _seed_of(argv: list[str]) -> int | None:
    return next((int(a.split("=", 1)[1]) for a in argv if a.startswith("seed=")), None)


def _counts(lines) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in lines:
        out[x.status] = out.get(x.status, 0) + 1
    return out


def _save(state: OwnState, path: Path, ledger: AlphaLedger, lpath: Path) -> None:
    """The state, then the α ledger brought up to its looks (each finished round is a look its design made)."""
    state.save(path)
    ledger.record(state)
    ledger.save(lpath)
