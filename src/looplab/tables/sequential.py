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
choices; the design's cap is not: a build may stop before it, never continue past it. A larger cap needs a new
design, and a new design on runs an earlier one looked at is charged the α that one spent (α-spending across
restarts): `--restart` calibrates it at the α left, recorded with each design's looks in `alpha_ledger.json`
beside the state file (tables/alpha_ledger.py), which moving sequential.json away does not reset; without
`--restart` such a build is refused.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from looplab.stats import SequentialDesign
from looplab.tables.alpha_ledger import LEDGER_FILE, AlphaLedger, ledger_path  # noqa: F401 (LEDGER_FILE re-exported)
from looplab.tables.findings import Verdict
from looplab.tables.sequential_state import (  # noqa: F401 (re-exported: the state and the judgement)
    DEFAULT_ROUND_SEEDS, PROJECTION_LIMIT, STATE_FILE, Round, SequentialState, _now, classify, judge_sequential,
    look_counts, state_path)
from looplab.tables.spec import DEFAULT_OUT_ROOT, TableSpec, default_seeds, get

DEFAULT_MAX_SEEDS = 20
# Table kinds whose findings come from the training runs alone (no benchmark after training that would have to be
# re-measured at every look): tables 1, 2, 3, 5, 6, 7, 8, 9.
SEQUENTIAL_KINDS = ("lm", "depth", "reset", "task", "exit", "extrapolation")


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


def open_design(state, ledger, path: Path, lpath: Path, *, what: str, first: list, max_seeds: int | None,
                round_seeds: int | None, restart: bool, new_state, warn, where: str = ""):
    """The state a build goes on with (a paper table's or a spec's of one's own, tables/own_sequential.py): `state`
    (its sequential.json, or None) resumed, restarted when asked, or a new design — new_state(design, cap,
    round_seeds) builds one, and `warn` is called for runs no design has accounted for. The refusals keep the α
    that the looks on these runs spent spent (alpha_ledger.json: `ledger`). what: "table 2" / "mine", as named in
    the messages; where: what follows it where the build's scale matters (" at tiny scale")."""
    if state is None:
        cap = max_seeds or DEFAULT_MAX_SEEDS
        if cap < len(first):
            raise ValueError(f"--max-seeds {cap} is below the first round's {len(first)} seeds ({first})")
        if ledger is not None and ledger.designs:  # sequential.json was moved away: the α its looks spent stays spent
            if not restart:
                raise ValueError(f"{lpath}: earlier sequential designs of {what} looked at these runs and spent "
                                 f"α = {ledger.spent:.4f} of {ledger.overall:.2f} ({ledger.looks_text()}); {path.name} is "
                                 f"gone, but a new design would not reset that. Pass --restart to start a new design on the "
                                 f"same runs at the α left ({ledger.left:.4f})")
            design = ledger.restarted(cap)
        else:
            if restart:
                raise ValueError(f"--restart: no earlier design of {what}{where} to restart from (neither {path} nor "
                                 f"{lpath})")
            design = SequentialDesign(cap)
            warn()
        return new_state(design, cap, round_seeds or DEFAULT_ROUND_SEEDS)
    if restart:
        cap = max_seeds or state.design.cap
        if cap <= len(state.all_seeds()):
            raise ValueError(f"--restart --max-seeds {cap}: the new design needs a cap above the {len(state.all_seeds())} "
                             "seeds its rounds already hold")
        state.restart(cap)
    elif max_seeds and max_seeds > state.design.cap:
        spent = state.alpha_spent()
        raise ValueError(f"{path}: this build's design is capped at {state.design.cap} seeds; its intervals do not cover "
                         f"--max-seeds {max_seeds}. Stop at {state.design.cap}, or pass --restart: a new design capped at "
                         f"{max_seeds} goes on with these rounds at the α left — the looks so far (n = "
                         f"{', '.join(map(str, state.design_looks())) or 'none'}) spent α = {spent:.4f} of "
                         f"{state.design.overall:.2f}, leaving {state.design.overall - spent:.4f}. Moving {path.name} "
                         f"away does not reset it: {lpath.name} keeps the account")
    state.max_seeds = max_seeds or state.max_seeds
    state.round_seeds = round_seeds or state.round_seeds
    state.stop = None  # resuming: the stop is decided again
    return state


def run(number: int, scale: str = "tiny", out_root: Path = DEFAULT_OUT_ROOT, *, max_seeds: int | None = None,
        budget_min: float | None = None, round_seeds: int | None = None, logger: str | None = None,
        extra: list[str] | None = None, hardware: str | None = None, jobs: int | None = None,
        zeroshot: bool | None = None, table_dir: Path | None = None, env: dict[str, str] | None = None,
        dry_run: bool = False, restart: bool = False, clock=time.time) -> SequentialState:
    """Run table `number` in rounds of seeds until its findings are decided (see the module docstring); then write
    its report. Resumes from sequential.json when there is one. restart: a new design (capped at max_seeds) on the
    runs an earlier design looked at, calibrated at the α it left (alpha_ledger.json keeps the account); without it
    a build that needs a new design is refused. Returns the final state."""
    from looplab.tables import runner
    from looplab.tables.report import build, write

    spec = get(number)
    _check_supported(spec)
    path, lpath = state_path(out_root, number, scale), ledger_path(out_root, number, scale)
    state, ledger = SequentialState.load(path), AlphaLedger.load(lpath)
    first = default_seeds(scale, number) or [1, 2, 3]
    if state is not None and (state.table, state.scale) != (number, scale):
        raise ValueError(f"{path} belongs to table {state.table} at {state.scale} scale")
    state = open_design(state, ledger, path, lpath, what=f"table {number}", where=f" at {scale} scale",
                        first=first, max_seeds=max_seeds,
                        round_seeds=round_seeds, restart=restart,
                        new_state=lambda design, cap, rs: SequentialState(number, scale, design, cap, rs),
                        warn=lambda: _warn_unaccounted_runs(spec, scale, out_root, path, lpath))
    if budget_min is not None:
        state.budget_min = budget_min
    ledger = ledger or AlphaLedger(number, scale)
    if not dry_run:  # the ledger first: a state file that is not its current design is refused before anything trains
        new = not path.exists() or restart
        ledger.record(state)
        ledger.save(lpath)
        if new:
            state.save(path)
    jobs = (runner.default_jobs(scale) if jobs is None else jobs) if scale == "tiny" else 1
    logger = logger or runner.default_logger(scale)
    zeroshot = zeroshot if zeroshot is not None else runner.has_zeroshot(spec)
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
            _save(state, path, ledger, lpath)
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
            _save(state, path, ledger, lpath)
    if dry_run:
        print(f"{tag} would stop after round {state.stop['after_round']}: {state.stop['reason']}", flush=True)
        return state
    state.stop["at"] = _now()
    _save(state, path, ledger, lpath)
    print(f"{tag} stopped after round {state.stop['after_round']}: {state.stop['reason']}", flush=True)
    table = build(number, scale, out_root, sequential=True)
    paths = write(table, table_dir) if table_dir else write(table)
    print(table.markdown(), flush=True)
    print(f"{tag} wrote " + ", ".join(str(p) for p in paths), flush=True)
    return state


def _save(state: SequentialState, path: Path, ledger: AlphaLedger, lpath: Path) -> None:
    """The state, then the α ledger brought up to its looks (each finished round is a look its design made)."""
    state.save(path)
    ledger.record(state)
    ledger.save(lpath)


def _warn_unaccounted_runs(spec: TableSpec, scale: str, out_root: Path, path: Path, lpath: Path) -> None:
    """A first design on runs already on disk: they may be a fixed build's (fine: round 1 reuses them) or the runs of
    an earlier sequential design whose state file was moved away before the α ledger existed — whose α nothing here
    can charge. Said loudly, on stderr, naming the seeds."""
    from looplab.runs import load_runs
    from looplab.tables.runner import sweep_dir

    seeds = sorted({int(r.seed) for sw in spec.sweeps_for(scale) for r in load_runs(sweep_dir(out_root, spec.number, scale, sw))
                    if r.ok and str(r.seed).isdigit()})
    if seeds:
        print(f"[table{spec.number}] WARNING: ok runs of seeds {', '.join(map(str, seeds))} are on disk but neither {path.name} "
              f"nor {lpath.name} is: this design starts at the full α. If an earlier sequential design looked at these runs "
              "(its state file moved away before the α ledger existed), the α it spent is not charged and the overall "
              "error rate exceeds α (simulated: 0.053 instead of 0.040 for a cap-9 design restarted at cap 20); a fixed "
              "build's runs are fine to reuse", file=sys.stderr, flush=True)


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
    alpha = (f"α = {d.alpha:.2f} overall" if not d.spent else f"α = {d.alpha:.4f}: the {d.overall:.2f} overall less the "
             f"{d.spent:.4f} that {len(d.history)} earlier design(s) on these runs spent (α ledger)")
    return (f"repeated confidence intervals (Pocock), looks at {d.first_look}..{d.cap} paired seeds, {alpha}, "
            f"nominal α′ = {d.nominal:.4f} per look; rounds of {state.round_seeds} seeds after the first; "
            f"cap {state.max_seeds} seeds" + (f", budget {state.budget_min:g} min" if state.budget_min is not None else ""))
