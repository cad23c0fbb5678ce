"""Run a table: its multirun commands in order, then the report.

Each sweep is one `python -m looplab.train -m +experiment=X ...` subprocess with the
table's W&B group and tags and its own sweep folder, so `report` finds the runs
again. A sweep that fails (non-zero exit, a crashed job) is logged and the next
one still runs: the report lists what is missing or failed. Stage-2 sweeps (table 8)
warm-start from an earlier sweep's checkpoint, resolved from its results.json.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from looplab.tables.spec import (DEFAULT_DECODE_JSON, DEFAULT_EXITS_JSON, DEFAULT_OUT_ROOT, DEFAULT_PLT_JSON, DEFAULT_ROUTING_JSON, DEFAULT_SERVING_JSON, DEFAULT_SPECULATION_JSON, RETROFIT_FOLDER, ZEROSHOT_TASKS, Sweep,
                                 TableSpec, default_seeds, get)
from looplab.tables.spec import argument as table_argument

EXIT_GRID_TIMED = 2  # table 10: test sequences decoded token by token per configuration and decoder (p-hop: ≈ 70 tokens; LM windows: 256)


@dataclass
class Command:
    argv: list[str]
    sweep: Sweep | None = None
    note: str = ""
    seed: int | None = None
    parallel: int = 1  # one-seed commands (stage 2, per_seed sweeps): this many of the consecutive ones run at once

    def __str__(self) -> str:
        return shlex.join(self.argv)


def sweep_dir(out_root: Path, number: int, scale: str, sweep: Sweep) -> Path:
    return Path(out_root) / f"table{number}" / scale / sweep.folder


def default_logger(scale: str) -> str:
    # tiny runs log to CSV (no W&B service process on a small CPU box); paper runs to W&B
    # (offline without WANDB_API_KEY; `make sync-wandb` uploads)
    return "csv" if scale == "tiny" else "wandb"


def default_jobs(scale: str) -> int:
    """Jobs of a sweep run at once: tiny runs are small enough that one thread each on several
    processes beats one process on every core (p-hop 1⊗4: 8k tokens/s on one thread, barely more on
    two); paper runs use their hardware's launcher."""
    return max(1, min(os.cpu_count() or 1, 4)) if scale == "tiny" else 1


def _override_list(key: str, values) -> str:
    return f"{key}={','.join(str(v) for v in values)}"


def train_command(spec: TableSpec, scale: str, sw: Sweep, out_root: Path, *, logger: str, extra: list[str],
                  seeds: list[int] | None, hardware: str | None, init_from: str | None = None,
                  seed: int | None = None, jobs: int = 1) -> Command:
    tags = list(dict.fromkeys([f"table{spec.number}", scale, sw.experiment, *sw.experiment_tags()]))
    argv = [sys.executable, "-m", "looplab.train", "-m", f"+experiment={sw.experiment}",
            f"group=table{spec.number}-{scale}", f"tags=[{','.join(tags)}]",
            f"hydra.sweep.dir={sweep_dir(out_root, spec.number, scale, sw)}", f"logger={logger}"]
    if jobs > 1 and not hardware and not sw.one_command_per_seed:
        # hydra-joblib-launcher: the sweep's jobs in `jobs` processes, the cores split between them
        threads = max(1, (os.cpu_count() or 1) // jobs)
        argv += ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}", f"hardware.num_threads={threads}"]
    if hardware:
        argv.append(f"hardware={hardware}")
        if hardware != "fsdp" and _experiment_hardware(sw) == "fsdp":
            argv.append("trainer.strategy=fsdp")  # e.g. hardware=slurm keeps the experiment's FSDP2 sharding
    argv += [_override_list(k, v) for k, v in sw.params]
    argv += [a.replace("{out_root}", str(out_root)) for a in sw.fixed]  # table 11's retrofitted folder
    if sw.one_command_per_seed:  # the runner starts `jobs` of them at once
        if jobs > 1 and not hardware:  # split the cores between the commands running together
            argv.append(f"hardware.num_threads={max(1, (os.cpu_count() or 1) // jobs)}")
        if init_from is not None:
            argv.append(f"exit_gate.init_from={init_from}")
        if seed is not None:
            # a command of several jobs (table 12: two arms per seed) gives each its own folder
            several = len(sw.grid()) > 1
            argv += [f"seed={seed}", f"hydra.sweep.subdir=seed{seed}" + ("_${hydra.job.num}" if several else "")]
    elif seeds:
        argv.append(_override_list("seed", seeds))
    argv += list(extra)
    return Command(argv, sw, seed=seed, parallel=jobs if sw.one_command_per_seed and not hardware else 1)


def job_folder(sw: Sweep, index: int, seed: int) -> str:
    """The folder of one (configuration, seed) job as a sequential round writes it: seed<S> for a sweep of one
    configuration, seed<S>_<i> for the i-th of its grid, the names a per-seed sweep's jobs get (Hydra numbers a
    command's jobs in grid order), so fixed and sequential builds of tables 8, 12 and 13 share their folders."""
    return f"seed{seed}" if len(sw.grid()) == 1 else f"seed{seed}_{index}"


def job_command(spec: TableSpec, scale: str, sw: Sweep, index: int, seed: int, out_root: Path, *, logger: str,
                extra: list[str], hardware: str | None, jobs: int = 1) -> Command:
    """One (configuration, seed) job of a sweep as a command of its own, in the folder job_folder names: the unit
    of a sequential round (tables/sequential.py), which trains only the jobs it lacks. Its overrides are the
    grid entry's, so the job composes the configuration the sweep's multirun gives it."""
    combo = sw.grid()[index]
    tags = list(dict.fromkeys([f"table{spec.number}", scale, sw.experiment, *sw.experiment_tags()]))
    argv = [sys.executable, "-m", "looplab.train", "-m", *sw.combo_overrides(combo), f"+experiment={sw.experiment}",
            f"group=table{spec.number}-{scale}", f"tags=[{','.join(tags)}]",
            f"hydra.sweep.dir={sweep_dir(out_root, spec.number, scale, sw)}", f"logger={logger}"]
    if hardware:
        argv.append(f"hardware={hardware}")
        if hardware != "fsdp" and _experiment_hardware(sw) == "fsdp":
            argv.append("trainer.strategy=fsdp")
    argv += [a.replace("{out_root}", str(out_root)) for a in sw.fixed]
    if jobs > 1 and not hardware:  # `jobs` of these run at once: split the cores between them
        argv.append(f"hardware.num_threads={max(1, (os.cpu_count() or 1) // jobs)}")
    if sw.init_from is not None:  # stage 2: the predicted path; execute() takes the real one when the run has finished
        argv.append(f"exit_gate.init_from={resolve_init_from(spec, scale, sw, out_root, seed, [seed], dry_run=True)}")
    argv += [f"seed={seed}", f"hydra.sweep.subdir={job_folder(sw, index, seed)}", *extra]
    return Command(argv, sw, seed=seed, parallel=jobs if not hardware else 1)


def _experiment_hardware(sw: Sweep) -> str | None:
    """The `override /hardware: X` of the experiment's defaults list."""
    for entry in sw.experiment_config().get("defaults") or []:
        if isinstance(entry, dict):
            for k, v in entry.items():
                if k.split()[-1].strip("/") == "hardware":
                    return v
    return None


def _parse(overrides: list[str]) -> dict[str, str]:
    out = {}
    for o in overrides or []:
        if "=" in o:
            k, v = o.split("=", 1)
            out[k.lstrip("+~")] = v
    return out


def resolve_init_from(spec: TableSpec, scale: str, sw: Sweep, out_root: Path, seed: int | None,
                      seeds: list[int] | None, dry_run: bool) -> str | None:
    """Checkpoint of the earlier sweep's job that this stage-2 sweep starts from.

    Real runs read it from the job's results.json (status ok); a dry run predicts the
    job folder from Hydra's job numbering (jobs are numbered in grid order).
    """
    src_name, match = sw.init_from
    src = next(s for s in spec.sweeps_for(scale) if s.folder == src_name)
    want = dict(match)
    if seed is not None:
        want["seed"] = str(seed)
    src_dir = sweep_dir(out_root, spec.number, scale, src)
    if not dry_run:
        for path in sorted(src_dir.glob("*/results.json")):
            try:
                r = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if r.get("status") == "ok" and all(_parse(r.get("overrides")).get(k) == v for k, v in want.items()):
                return r.get("checkpoint") or str(path.parent / "checkpoints" / "last.ckpt")
        return None
    if src.per_seed and seed is not None:
        return str(src_dir / f"seed{seed}" / "checkpoints" / "last.ckpt")
    for i, combo in enumerate(src.grid(seeds)):
        if all(combo.get(k) == v for k, v in want.items()):
            return str(src_dir / str(i) / "checkpoints" / "last.ckpt")
    return str(src_dir / "<job with " + ",".join(f"{k}={v}" for k, v in want.items()) + ">" / "checkpoints" / "last.ckpt")


def exit_decode_dirs(scale: str, out_root: Path) -> list[Path]:
    """Table 4's exit columns: table 8's stage-2 sweeps of the attention-only backbones (skip_compute needs one)."""
    return [sweep_dir(out_root, 8, scale, sw) for sw in get(8).sweeps_for(scale)
            if sw.init_from is not None and "mamba" not in sw.experiment]


def decode_command(scale: str, decode_json: Path, extra: list[str], out_root: Path = DEFAULT_OUT_ROOT) -> Command:
    argv = [sys.executable, "-m", "looplab.bench.decode", "--out", str(decode_json)]
    # tiny: quick mode, one thread (two OpenMP threads on a loaded 2-core box spin-wait, see bench/decode.py)
    argv += ["--quick", "--threads", "1"] if scale == "tiny" else []
    if scale == "tiny":  # trained gates decode p-hop test sequences (paper-scale exits: table 8's LM metrics)
        argv += ["--exit-runs", *map(str, exit_decode_dirs(scale, out_root))]
    return Command(argv + list(extra), note="decoding benchmark")


def exit_grid_dirs(scale: str, out_root: Path) -> list[Path]:
    """Table 10's checkpoints: the stage-2 (trained gate) sweeps of table 8 and of table 10 itself (p-hop), and the
    looped Mano and language models of tables 5 and 7 (zero-shot rules only; exit_grid skips their N⊗1 runs)."""
    gated = [sweep_dir(out_root, n, scale, sw) for n in (8, 10) for sw in get(n).sweeps_for(scale) if sw.init_from is not None]
    return gated + [sweep_dir(out_root, n, scale, sw) for n in (5, 7) for sw in get(n).sweeps_for(scale)]


def exit_grid_command(scale: str, out_root: Path, exits_json: Path = DEFAULT_EXITS_JSON, jobs: int = 1) -> Command:
    argv = [sys.executable, "-m", "looplab.bench.exit_grid", *map(str, exit_grid_dirs(scale, out_root)), "--out", str(exits_json),
            "--threads", "1", "--jobs", str(jobs), "--n-time", str(EXIT_GRID_TIMED)]
    return Command(argv, note="exit rules x thresholds x handlings on the trained gates (bench/exit_grid.py)")


def retrofit_command(out_root: Path) -> Command:
    folder = Path(RETROFIT_FOLDER.format(out_root=out_root)).parent
    return Command([sys.executable, "-m", "looplab.tables.retrofit", str(folder)],
                   note="a d 512 transformers Llama retrofitted into a looped model (tables/retrofit.py)")


def speculation_command(spec: TableSpec, scale: str, out_root: Path, out: Path = DEFAULT_SPECULATION_JSON) -> Command:
    # the retrofitted d 512 model (the last sweep) is the slowest to measure: first, so two processes end together
    dirs = [str(sweep_dir(out_root, spec.number, scale, sw)) for sw in spec.sweeps_for(scale)][::-1]
    argv = [sys.executable, "-m", "looplab.bench.speculative", *dirs, "--batch", "1", "8", "--batch-gamma", "2", "4",
            "8", "--repeats", "5", "--threads", "1", "--jobs", "2", "--out", str(out)]
    return Command(argv, note="plain vs self-speculative decoding of every trained model (bench/speculative.py)")


def routed_decode_command(spec: TableSpec, scale: str, out_root: Path, out: Path = DEFAULT_ROUTING_JSON) -> Command:
    dirs = [str(sweep_dir(out_root, spec.number, scale, sw)) for sw in spec.sweeps_for(scale) if "_lm_" in sw.experiment]
    argv = [sys.executable, "-m", "looplab.bench.routed_decode", *dirs, "--repeats", "5", "--threads", "1", "--out", str(out)]
    return Command(argv, note="decoding tokens/s and KV bytes of every trained language model (bench/routed_decode.py)")


def plt_decode_command(spec: TableSpec, scale: str, out_root: Path, out: Path = DEFAULT_PLT_JSON) -> Command:
    dirs = [str(sweep_dir(out_root, spec.number, scale, sw)) for sw in spec.sweeps_for(scale) if "_lm_" in sw.experiment]
    argv = [sys.executable, "-m", "looplab.bench.routed_decode", *dirs, "--batch", "1", "8", "--repeats", "5",
            "--threads", "1", "--diagnostics", "--out", str(out)]
    return Command(argv, note="decoding tokens/s at batch 1 and 8, KV bytes and per-loop diagnostics of every trained "
                              "language model (bench/routed_decode.py)")


def serving_command(spec: TableSpec, scale: str, out_root: Path, out: Path = DEFAULT_SERVING_JSON) -> Command:
    dirs = [str(sweep_dir(out_root, spec.number, scale, sw)) for sw in spec.sweeps_for(scale)]
    argv = [sys.executable, "-m", "looplab.bench.depth_under_load", *dirs, "--concurrency", "1,8,32", "--requests", "32",
            "--repeats", "5", "--threads", "1", "--out", str(out)]
    return Command(argv, note="every trained model in the serving engine at concurrency 1, 8, 32 (bench/depth_under_load.py)")


def has_zeroshot(spec: TableSpec) -> bool:
    """Whether a table's findings read zero-shot accuracies (table 1's; the default of `--zeroshot`)."""
    return any(f.metric == "zero-shot" for f in spec.findings)


def zeroshot_command(spec: TableSpec, scale: str, out_root: Path) -> Command:
    tasks = ZEROSHOT_TASKS.get(scale)
    argv = [sys.executable, "-m", "looplab.tables", "zeroshot", table_argument(spec.number), "--scale", scale, "--out-root",
            str(out_root)]
    argv += ["--tasks", tasks] if tasks else []
    return Command(argv, note=f"zero-shot ({tasks or 'the 8-task suite'}) of every trained checkpoint")


def plan(number: int, scale: str, out_root: Path = DEFAULT_OUT_ROOT, *, logger: str | None = None,
         extra: list[str] | None = None, seeds: list[int] | None = None, hardware: str | None = None,
         decode_json: Path = DEFAULT_DECODE_JSON, dry_run: bool = True, zeroshot: bool | None = None,
         jobs: int | None = None) -> list[Command]:
    """The commands of table `number` at `scale` (stage-2 paths predicted when dry_run).

    seeds: None = spec.DEFAULT_SEEDS of the scale (tiny: 1,2,3; paper: the experiment's own seed).
    jobs: processes per sweep at tiny scale (None = default_jobs(scale)); paper scale and `hardware`
        use their own launcher.
    """
    jobs = (default_jobs(scale) if jobs is None else jobs) if scale == "tiny" else 1
    spec = get(number)
    seeds = list(seeds) if seeds else default_seeds(scale, number)
    logger = logger or default_logger(scale)
    extra = list(extra or [])
    if spec.kind == "decode":
        return [decode_command(scale, decode_json, extra, out_root)]
    if spec.kind == "exitgrid" and scale != "tiny":
        raise ValueError(f"table {number} is defined at tiny scale only: {spec.notes.get(scale, '')}")
    if spec.kind in ("speculation", "routing", "plt", "serving") and scale != "tiny":
        raise ValueError(f"table {number} is defined at tiny scale only: {spec.notes.get(scale, '')}")
    cmds: list[Command] = [retrofit_command(out_root)] if spec.kind == "speculation" else []
    for sw in spec.sweeps_for(scale):
        if not sw.one_command_per_seed:
            cmds.append(train_command(spec, scale, sw, out_root, logger=logger, extra=extra, seeds=seeds, hardware=hardware,
                                      jobs=jobs))
        else:
            for seed in seeds or [None]:
                path = None if sw.init_from is None else resolve_init_from(spec, scale, sw, out_root, seed, seeds, dry_run=True)
                cmds.append(train_command(spec, scale, sw, out_root, logger=logger, extra=extra, seeds=seeds,
                                          hardware=hardware, init_from=path, seed=seed, jobs=jobs))
    if spec.kind == "exitgrid":
        cmds.append(exit_grid_command(scale, out_root, jobs=jobs))
    if spec.kind == "speculation":
        cmds.append(speculation_command(spec, scale, out_root))
    if spec.kind == "routing":
        cmds.append(routed_decode_command(spec, scale, out_root))
    if spec.kind == "plt":
        cmds.append(plt_decode_command(spec, scale, out_root))
    if spec.kind == "serving":
        cmds.append(serving_command(spec, scale, out_root))
    if zeroshot if zeroshot is not None else has_zeroshot(spec):
        cmds.append(zeroshot_command(spec, scale, out_root))
    return cmds


def _batches(cmds: list[Command]) -> list[list[Command]]:
    """Consecutive one-seed commands that may run at once (parallel > 1, none starting from another's sweep) form one
    batch, started in order JOBS at a time; every other command is a batch of its own."""
    out: list[list[Command]] = []
    for cmd in cmds:
        last = out[-1] if out else None
        src = cmd.sweep.init_from[0] if cmd.sweep is not None and cmd.sweep.init_from else None
        if cmd.parallel > 1 and last and last[0].parallel > 1 and src not in {c.sweep.folder for c in last}:
            last.append(cmd)
        else:
            out.append([cmd])
    return out


def _execute(cmd: Command, env: dict[str, str], number: int) -> dict:
    t0 = time.time()
    try:
        rc = subprocess.run(cmd.argv, env=env).returncode
    except OSError as e:  # a command that cannot even start must not stop the table
        print(f"[table{number}] could not start: {e}", flush=True)
        rc = -1
    dt = time.time() - t0
    if rc != 0:
        print(f"[table{number}] exited with {rc} after {dt:.0f} s; going on (the report lists missing/failed runs)", flush=True)
    return {"argv": cmd.argv, "returncode": rc, "seconds": dt}


def run(number: int, scale: str, out_root: Path = DEFAULT_OUT_ROOT, *, logger: str | None = None,
        extra: list[str] | None = None, seeds: list[int] | None = None, hardware: str | None = None,
        decode_json: Path = DEFAULT_DECODE_JSON, dry_run: bool = False, zeroshot: bool | None = None,
        table_dir: Path | None = None, env: dict[str, str] | None = None, jobs: int | None = None) -> list[dict]:
    """Run (or with dry_run print) every command of the table, then write the report.

    Returns one record per command: argv, returncode (None when skipped or dry), seconds.
    """
    spec = get(number)
    seeds = list(seeds) if seeds else default_seeds(scale, number)
    cmds = plan(number, scale, out_root, logger=logger, extra=extra, seeds=seeds, hardware=hardware,
                decode_json=decode_json, dry_run=True, zeroshot=zeroshot, jobs=jobs)
    records = execute(cmds, spec, scale, out_root, seeds, {**os.environ, **(env or {})}, dry_run=dry_run)
    if not dry_run:
        log = Path(out_root) / f"table{number}" / scale / "runner.json"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(json.dumps({"table": number, "scale": scale, "commands": records}, indent=2))
        from looplab.tables.report import build, write

        kwargs = {"decode_json": decode_json} if spec.kind == "decode" else {}
        table = build(number, scale, out_root, seeds=seeds, **kwargs)
        paths = write(table, table_dir) if table_dir else write(table)
        print(table.markdown(), flush=True)
        print(f"[table{number}] wrote " + ", ".join(str(p) for p in paths), flush=True)
    return records


def execute(cmds: list[Command], spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None,
            run_env: dict[str, str], dry_run: bool = False) -> list[dict]:
    """Run (or print) the commands in their batches: one-seed commands `parallel` at a time, a stage-2 command
    after taking its earlier run's real checkpoint (skipped when that run has no ok results.json). One record
    per command: argv, returncode (None when skipped or dry), seconds."""
    number = spec.number
    records = []
    for batch in _batches(cmds):
        ready = []
        for cmd in batch:
            if cmd.sweep is not None and cmd.sweep.init_from is not None and not dry_run:
                # stage 2: the earlier sweep has run by now; take its real checkpoint
                path = resolve_init_from(spec, scale, cmd.sweep, out_root, cmd.seed, seeds, dry_run=False)
                if path is None:
                    msg = f"skipped: the run {cmd.sweep.init_from} that stage 2 starts from has no ok results.json"
                    print(f"[table{number}] {msg}\n  {cmd}", flush=True)
                    records.append({"argv": cmd.argv, "returncode": None, "skipped": msg, "seconds": 0.0})
                    continue
                cmd.argv = [a if not a.startswith("exit_gate.init_from=") else f"exit_gate.init_from={path}" for a in cmd.argv]
            print(f"[table{number}] {cmd}", flush=True)
            if dry_run:
                records.append({"argv": cmd.argv, "returncode": None, "seconds": 0.0})
            else:
                ready.append(cmd)
        if len(ready) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(batch[0].parallel) as pool:
                records += list(pool.map(lambda c: _execute(c, run_env, number), ready))
        else:
            records += [_execute(c, run_env, number) for c in ready]
    return records
