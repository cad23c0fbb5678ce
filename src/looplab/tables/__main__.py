"""python -m looplab.tables {run,report,list,isoflop,zeroshot} ...

  run TABLE.yaml [any option of `run N`]   a table of your own in the paper tables' format (number above 14, sweeps,
      findings: docs/extending.md), run as table N is; its report goes to <out-root>/table<number>/ (report and
      zeroshot take the file too)
  run SPEC.yaml [--dry-run] [--out-root outputs/own] [--jobs N] [--logger wandb]   a table of your own: the spec's
      arms trained per seed (finished runs are not trained again), then judged by `compare` (looplab/tables/own.py,
      docs/extending.md); --seeds auto [--max-seeds 20] [--round-seeds 2] [--restart]: in rounds of seeds until every
      line is decided (looplab/tables/own_sequential.py); --logger wandb: the verdicts as a W&B run
  run N [--scale tiny|paper] [--dry-run] [--extra KEY=VALUE ...] [--seeds 1,2,3] [--logger csv|wandb|none]
        [--hardware fsdp|slurm|...] [--out-root outputs/tables] [--table-dir experiments/tables]
      every multirun of table N in order (stage-2 sweeps after the runs they start from), then the report;
      seeds default to 1,2,3 at tiny scale (table 2: 1..5; the experiment's own seed at paper scale)
  run N --seeds auto [--max-seeds 20] [--budget-min M] [--round-seeds 2] [--restart]
      sequential seeds: the default seeds, then rounds of more until every finding is decided (intervals valid
      under that stopping), the cap or the budget; resumes from outputs/tables/tableN/<scale>/sequential.json;
      --restart: a new design (e.g. a larger --max-seeds) on the runs an earlier one looked at, calibrated at the
      α it left (alpha_ledger.json keeps the account; without the flag such a build is refused)
  report N [--scale ...] [--seeds 1,2,3]   only aggregate the existing results.json files into
      experiments/tables/tableN.{md,csv,png,findings.json} and regenerate the verdict summary README.md
      (a sequential build's table when its sequential.json is there and --seeds is not given)
  summary [--table-dir ...] [--rebuild [--scale ...]]   regenerate experiments/tables/README.md (all tables'
      verdicts) from the tableN.findings.json files; --rebuild first re-aggregates all eight tables
  rejudge N [N ...] [--table-dir experiments/tables] [--scale tiny]   re-judge committed tables from their stored
      intervals and seed means under today's rules (smaller than claimed, by construction, new preconditions), without
      their runs; rewrites tableN.findings.json, the Findings of tableN.md and the summary README.md
  confirm c2|c1|z1|z2|p|r2|t8l [--out-root outputs/confirm] [--apply]   a pre-registered confirmatory analysis
      (docs/tables.md#confirmatory-runs); --apply: its final verdicts beside the committed lines they decide
  compare MULTIRUN_DIR --pair KEY --metric M [--baseline V] [--sign +1|-1] [--delta D] [--require 'M<X' ...]
        [--out DIR]   judge the arms of your own -m sweep (the values of override KEY) against the baseline arm,
      paired by seed, with intervals, Holm and preconditions, without rerunning it (docs/extending.md#compare-your-arms)
  list                        the tables and their experiments at both scales
  isoflop (--target-flops F | --like NxR) [--backbone llama_410m] [--state-mode vanilla] [--seq-len T] [--tolerance 0.01]
  zeroshot N [--scale paper] [--tasks a,b] [--limit K]   zero-shot suite on every trained checkpoint of table N
  plan N [--scale paper] [--gpu h100|h200|a100] [--nodes 1] [--devices 8] [--hardware ...] [--extra KEY=VALUE ...]
        [--no-propose] [--out FILE.json]   python -m looplab.plan for every run of table N: fits or not, before booking
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from looplab.tables import report, runner, spec


def _seeds(s: str | None) -> list[int] | None:
    if s == "auto":
        raise SystemExit("--seeds auto: only `run` builds sequentially (`report` reads its sequential.json by itself)")
    return [int(x) for x in s.split(",")] if s else None


def _table_or_spec(s: str):
    """A paper table's number, or the path of a table spec of one's own: the short form (tables/own.py) or a table
    in the paper tables' format (spec.load_file)."""
    if s.isdigit():
        return int(s)
    if s.endswith((".yaml", ".yml")) or os.path.exists(s):
        return Path(s)
    raise argparse.ArgumentTypeError(f"{s!r} is neither a table number (1-14) nor a spec file (.yaml)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m looplab.tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    # `make tableN-report` passes no scale: take it from the environment (make exports SCALE=... given on its command line)
    default_scale = os.environ.get("SCALE", "tiny")

    def common(sp, number=int):
        sp.add_argument("number", type=number)
        sp.add_argument("--scale", default=default_scale, choices=spec.SCALES)
        sp.add_argument("--out-root", type=Path, default=runner.DEFAULT_OUT_ROOT, help="where the sweeps write their runs")
        sp.add_argument("--table-dir", type=Path, default=report.DEFAULT_TABLE_DIR, help="where tableN.{md,csv,png} go")
        sp.add_argument("--decode-json", type=Path, default=runner.DEFAULT_DECODE_JSON, help="table 4's benchmark output")

    r = sub.add_parser("run", help="run the table's sweeps, then the report (N, or a spec of your own: SPEC.yaml)")
    common(r, number=_table_or_spec)
    r.add_argument("--dry-run", action="store_true", help="print the exact commands, run nothing")
    r.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE", help="overrides appended to every command")
    r.add_argument("--seeds", default=None, help="comma-separated seeds (default: 1,2,3 at tiny scale (table 2: 1..5), the experiment's "
                   "seed at paper scale); rows show mean ± 95%% t-interval over them; `auto`: sequential seeds (rounds until "
                   "every finding is decided, docs/tables.md#sequential-seeds)")
    r.add_argument("--max-seeds", type=int, default=None, help="--seeds auto: the seed cap, fixed in the design at the "
                   "first round (default 20)")
    r.add_argument("--budget-min", type=float, default=None, help="--seeds auto: wall-clock minutes of training; no round "
                   "starts that the last rounds' pace says would pass it")
    r.add_argument("--round-seeds", type=int, default=None, help="--seeds auto: seeds per round after the first (default 2)")
    r.add_argument("--restart", action="store_true", help="--seeds auto: start a new design (capped at --max-seeds) on the "
                   "runs an earlier design looked at, at the α it left (alpha_ledger.json; docs/tables.md#sequential-seeds)")
    r.add_argument("--logger", default=None, help="csv (tiny default), wandb (paper default) or none")
    r.add_argument("--hardware", default=None, help="e.g. slurm on a cluster (default: the experiment's own)")
    r.add_argument("--jobs", type=int, default=None, help="tiny scale: jobs of a sweep run at once (hydra-joblib-launcher), "
                   "the cores split between them (default: the cores, at most 4; 1 = one job after another)")
    r.add_argument("--zeroshot", action=argparse.BooleanOptionalAction, default=None,
                   help="evaluate the zero-shot suite after training (default: when a finding reads zero-shot accuracy, as table 1's do)")

    rep = sub.add_parser("report", help="aggregate existing results.json files (N, or your table's TABLE.yaml)")
    common(rep, number=_table_or_spec)
    rep.add_argument("--no-plot", action="store_true")
    rep.add_argument("--seeds", default=None, help="the seeds every configuration should have (default as for run)")

    sm = sub.add_parser("summary", help="regenerate the verdict summary README.md of the tables folder")
    sm.add_argument("--table-dir", type=Path, default=report.DEFAULT_TABLE_DIR)
    sm.add_argument("--rebuild", action="store_true", help="first re-aggregate all eight tables from --out-root")
    sm.add_argument("--scale", default=default_scale, choices=spec.SCALES)
    sm.add_argument("--out-root", type=Path, default=runner.DEFAULT_OUT_ROOT)
    sm.add_argument("--decode-json", type=Path, default=runner.DEFAULT_DECODE_JSON)

    rj = sub.add_parser("rejudge", help="re-judge committed tables under today's rules, from their stored intervals")
    rj.add_argument("numbers", type=int, nargs="+")
    rj.add_argument("--table-dir", type=Path, default=report.DEFAULT_TABLE_DIR)
    rj.add_argument("--scale", default=default_scale, choices=spec.SCALES)

    cf = sub.add_parser("confirm", help="the pre-registered confirmatory analyses (docs/tables.md#confirmatory-runs)")
    cf.add_argument("name", choices=("c2", "c1", "z1", "z2", "p", "r2", "t8l"))
    cf.add_argument("--out-root", type=Path, default=Path("outputs/confirm"))
    cf.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    cf.add_argument("--apply", action="store_true", help="write its final verdicts beside the committed table lines "
                    "they decide (tableN.findings.json, tableN.md, the summary): only a complete look")
    cf.add_argument("--table-dir", type=Path, default=report.DEFAULT_TABLE_DIR)

    cp = sub.add_parser("compare", help="judge the arms of your own -m sweep, paired by seed (looplab/tables/compare.py)")
    cp.add_argument("folder", type=Path, help="the sweep's multirun folder (its runs' results.json files below it)")
    cp.add_argument("--pair", required=True, help="the override whose values are the arms, e.g. state_mode")
    cp.add_argument("--metric", required=True, help="a results.json figure: perplexity, accuracy, a dotted path, or a "
                    "logged metric such as test/ppl")
    cp.add_argument("--baseline", default=None, help="the arm B every other arm is compared with (default: the sweep's "
                    "first value)")
    cp.add_argument("--sign", type=int, default=None, choices=(-1, 1), help="the sign you expect A − B to have "
                    "(default: none, two-sided)")
    cp.add_argument("--delta", type=float, default=None, help="the smallest |A − B| that matters, fixed before looking: "
                    "an interval inside (−δ, +δ) is negligible")
    cp.add_argument("--require", action="append", default=[], metavar="METRIC<X",
                    help="a precondition on each arm's mean (e.g. 'perplexity<unigram_perplexity'); a line whose arm "
                    "misses it is not tested")
    cp.add_argument("--out", type=Path, default=None, help="where compare_<metric>.{md,csv} go (default: the folder)")

    sub.add_parser("list", help="the tables and their experiments")

    iso = sub.add_parser("isoflop", help="N⊗R pairs with matching analytic FLOPs/token")
    g = iso.add_mutually_exclusive_group(required=True)
    g.add_argument("--target-flops", type=float)
    g.add_argument("--like", help="N x R whose FLOPs are the target, e.g. 24x1")
    iso.add_argument("--backbone", default="llama_tiny")
    iso.add_argument("--state-mode", default="vanilla")
    iso.add_argument("--seq-len", type=int, default=None, help="default: the preset's max_seq_len")
    iso.add_argument("--tolerance", type=float, default=0.01)
    iso.add_argument("--max-layers", type=int, default=None)
    iso.add_argument("--max-loops", type=int, default=12)
    iso.add_argument("--vocab-size", type=int, default=None, help="for presets whose vocabulary comes from the dataset")

    zs = sub.add_parser("zeroshot", help="zero-shot suite on every trained checkpoint of a table")
    common(zs, number=_table_or_spec)
    zs.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks (default: looplab_tiny at tiny scale, the paper's 8-task suite at paper scale)")
    zs.add_argument("--limit", type=float, default=None)
    zs.add_argument("--batch-size", type=int, default=8)
    zs.add_argument("--device", default=None)
    zs.add_argument("--overwrite", action="store_true")

    pl = sub.add_parser("plan", help="python -m looplab.plan for every run of the table (docs/scale.md)")
    pl.add_argument("number", type=int)
    pl.add_argument("--scale", default=default_scale, choices=spec.SCALES)
    pl.add_argument("--gpu", default="h100", help="h100, h200 or a100 (looplab/plan/gpus.py)")
    pl.add_argument("--nodes", type=int, default=None, help="trainer.num_nodes (default: the run's own)")
    pl.add_argument("--devices", type=int, default=None, help="trainer.devices, GPUs per node (default: 8 at paper scale, "
                    "else the run's own)")
    pl.add_argument("--hardware", default=None, help="as for run (default: the experiment's own)")
    pl.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE", help="overrides appended to every run")
    pl.add_argument("--no-propose", action="store_true", help="skip the micro-batch / activation-checkpointing search")
    pl.add_argument("--out", type=Path, default=None, help="write every run's plan as JSON")

    a = p.parse_args(argv)
    if isinstance(getattr(a, "number", None), Path) and (spec.is_table_file(a.number) or a.cmd != "run"):
        # a table of one's own in the paper tables' format: from here on it is table a.number, as the fourteen are
        try:
            table = spec.load_file(a.number)
        except (OSError, ValueError) as e:
            raise SystemExit(str(e)) from None
        a.number = table.number
        if getattr(a, "table_dir", None) == report.DEFAULT_TABLE_DIR:  # experiments/tables holds the paper's
            a.table_dir = a.out_root / f"table{table.number}"
    if a.cmd == "plan":
        from looplab.plan.table import plan_table

        devices = a.devices if a.devices is not None else (8 if a.scale == "paper" else None)
        planned = plan_table(a.number, a.scale, gpu=a.gpu, nodes=a.nodes, devices=devices, hardware=a.hardware,
                             extra=a.extra, propose=not a.no_propose, out=a.out)
        return 0 if all("error" not in p for p in planned) else 1
    if a.cmd == "run" and isinstance(a.number, Path):
        from looplab.tables import compare, own, own_sequential

        if a.seeds not in (None, "auto"):
            raise SystemExit(f"--seeds {a.seeds}: a spec of one's own sets its seeds in the file (seeds: [...]); "
                             "--seeds auto adds more in rounds")
        if a.budget_min is not None or (a.seeds is None and (a.max_seeds is not None or a.round_seeds is not None
                                                             or a.restart)):
            raise SystemExit("a spec of one's own takes --max-seeds, --round-seeds and --restart with --seeds auto, "
                             "and no --budget-min")
        if a.logger not in (None, "wandb", "csv", "none"):
            raise SystemExit(f"--logger {a.logger}: choose wandb (the verdicts as a W&B run), csv or none")
        out_root = a.out_root if a.out_root != runner.DEFAULT_OUT_ROOT else own.DEFAULT_OUT_ROOT
        if a.seeds == "auto":
            res = own_sequential.run(a.number, out_root, max_seeds=a.max_seeds, round_seeds=a.round_seeds,
                                     restart=a.restart, jobs=a.jobs or 1, extra=a.extra, logger=a.logger,
                                     dry_run=a.dry_run)
        else:
            res = own.run(a.number, out_root, dry_run=a.dry_run, jobs=a.jobs or 1, extra=a.extra, logger=a.logger)
        if a.dry_run:
            return 0
        print(compare.markdown(res))
        print("wrote " + ", ".join(str(x) for x in res["paths"]))
        return 0 if all(r["returncode"] == 0 for r in res["records"]) else 1
    if a.cmd == "run" and a.seeds == "auto":
        from looplab.tables import sequential

        state = sequential.run(a.number, a.scale, a.out_root, max_seeds=a.max_seeds, budget_min=a.budget_min,
                               round_seeds=a.round_seeds, logger=a.logger, extra=a.extra, hardware=a.hardware, jobs=a.jobs,
                               zeroshot=a.zeroshot, table_dir=a.table_dir, dry_run=a.dry_run, restart=a.restart)
        return 0 if a.dry_run or not any(r.failed_commands for r in state.rounds) else 1
    if a.cmd == "run":
        if a.max_seeds is not None or a.budget_min is not None or a.round_seeds is not None or a.restart:
            raise SystemExit("--max-seeds, --budget-min, --round-seeds and --restart go with --seeds auto")
        records = runner.run(a.number, a.scale, a.out_root, logger=a.logger, extra=a.extra, seeds=_seeds(a.seeds),
                             hardware=a.hardware, decode_json=a.decode_json, dry_run=a.dry_run, zeroshot=a.zeroshot,
                             table_dir=a.table_dir, jobs=a.jobs)
        return 0 if a.dry_run or all(r["returncode"] in (0, None) for r in records) else 1
    if a.cmd == "report":
        kwargs = {"decode_json": a.decode_json} if spec.get(a.number).kind == "decode" else {}
        table = report.build(a.number, a.scale, a.out_root, seeds=_seeds(a.seeds), **kwargs)
        paths = report.write(table, a.table_dir, plot=not a.no_plot)
        print(table.markdown())
        print("wrote " + ", ".join(str(x) for x in paths))
        return 0
    if a.cmd == "summary":
        if a.rebuild:
            for n, t in spec.TABLES.items():
                kwargs = {"decode_json": a.decode_json} if t.kind == "decode" else {}
                report.write(report.build(n, a.scale, a.out_root, **kwargs), a.table_dir)
        path = report.write_summary(a.table_dir)
        print(path.read_text())
        print(f"wrote {path}")
        return 0
    if a.cmd == "rejudge":
        from looplab.tables.rejudge import rejudge

        for n in a.numbers:
            for v in rejudge(n, a.table_dir, a.scale):
                print(f"table {n}: {v.verdict:<20} {v.title()}")
        print(f"wrote {report.write_summary(a.table_dir)}")
        return 0
    if a.cmd == "confirm":
        from looplab.tables import confirm

        analyses = {"c2": confirm.confirm_c2, "c1": confirm.confirm_c1, "z1": confirm.confirm_z1, "z2": confirm.confirm_z2,
                    "p": confirm.confirm_p, "r2": confirm.confirm_r2, "t8l": confirm.confirm_t8l}
        result = analyses[a.name](a.out_root)
        print(result["text"])
        if a.apply:
            try:
                apps = confirm.applications(result, a.out_root)
            except ValueError as e:
                raise SystemExit(str(e)) from None
            for x in apps:
                print(f"table {x['table']}: {x['label']}, {x['metric']}: {x['verdict']} ({x['design']})")
            print("wrote " + ", ".join(str(p) for p in confirm.apply(apps, a.table_dir)))
        if a.out:
            import json

            a.out.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    if a.cmd == "compare":
        from looplab.tables import compare

        res = compare.compare(a.folder, a.pair, a.metric, baseline=a.baseline, sign=a.sign, delta=a.delta,
                              require=a.require)
        print(compare.markdown(res))
        print("wrote " + ", ".join(str(x) for x in compare.write(res, a.out)))
        return 0
    if a.cmd == "list":
        for n, t in spec.TABLES.items():
            print(f"table {n}: {t.title}")
            for scale in spec.SCALES:
                exps = [s.folder for s in t.sweeps_for(scale)] or ["python -m looplab.bench.decode"]
                print(f"  {scale:>5}: {', '.join(exps)}")
        return 0
    if a.cmd == "isoflop":
        from looplab.tables.isoflop import format_pairs, matching_pairs

        target, pairs = matching_pairs(a.target_flops, a.like, backbone=a.backbone, state_mode=a.state_mode, seq_len=a.seq_len,
                                       tolerance=a.tolerance, max_layers=a.max_layers, max_loops=a.max_loops,
                                       vocab_size=a.vocab_size)
        print(format_pairs(target, pairs, a.backbone, a.seq_len))
        return 0
    if a.cmd == "zeroshot":
        from looplab.tables.zeroshot import evaluate_table

        tasks = a.tasks.split(",") if a.tasks else None
        written = evaluate_table(a.number, a.scale, a.out_root, tasks=tasks, limit=a.limit, batch_size=a.batch_size,
                                 device=a.device, overwrite=a.overwrite)
        print(f"wrote {len(written)} zeroshot.json file(s); `python -m looplab.tables report {a.number} --scale {a.scale}` adds them")
        return 0
    return 2


if __name__ == "__main__":
    from looplab.cli_errors import run_cli

    sys.exit(run_cli(main, "python -m looplab.tables"))  # bad input: one line on stderr, exit 1 (looplab/cli_errors.py)
