"""python -m looplab.eval CHECKPOINT [options]

Evaluates a checkpoint on its own dataset's held-out split: metric from every
loop depth, and for gated models the accuracy/perplexity–exit-depth curve over
thresholds q (table + PNG); optionally zero-shot tasks through lm-eval.

It also recomputes the split's metrics exactly as training logs them (eval.json
`metrics`, named like results.json's `metrics`). When the checkpoint sits in a run
folder (<run>/checkpoints/X.ckpt next to <run>/results.json), the run's
`trainer.limit_test_batches` and exit thresholds are applied, and every `test/`
metric of results.json is compared with the recomputed one (`agreement`).

  python -m looplab.eval outputs/.../checkpoints/last.ckpt --thresholds 0.3 0.5 0.7 0.9
  python -m looplab.eval last.ckpt --zeroshot                 # the 8-task suite (needs the hub)
  python -m looplab.eval last.ckpt --zeroshot looplab_tiny_mc # a local task, offline
  python -m looplab.eval last.ckpt --diagnostics              # + per-loop diagnostics (eval.json, loop_diagnostics.png)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m looplab.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--split", choices=["test", "val"], default="test")
    ap.add_argument("--thresholds", type=float, nargs="*", default=[0.3, 0.5, 0.7, 0.9, 1.01], help="exit thresholds q (gated models)")
    ap.add_argument("--exit-rule", default=None,
                    help="add rows for a zero-shot exit rule at --rule-thresholds: a registered rule (kl, entropy, "
                         "hidden_delta, argmax_stable, or a researcher's, e.g. my_pkg.rules.margin; "
                         "models/exit_rules.py); gate = the learned gate's q (--thresholds), the default for gated models")
    ap.add_argument("--rule-thresholds", type=float, nargs="*", default=None,
                    help="thresholds of --exit-rule (kl/entropy: nats; hidden_delta: relative change; argmax_stable: k)")
    ap.add_argument("--min-loops", type=int, default=1, help="no exit before this loop (zero-shot exit rules)")
    ap.add_argument("--loops", type=int, default=None, metavar="R′",
                    help="test-time depth: apply the shared block R′ times instead of the trained R (any R′ ≥ 1, also "
                         "above R; per-loop metrics and exits then run over 1..R′)")
    ap.add_argument("--max-batches", type=int, default=None)
    ap.add_argument("--trust-variants", action="append", default=[], metavar="PKG",
                    help="let variant names in the checkpoint's config import package PKG (not trusted by default: "
                         "docs/training.md#what-looplab-trusts; also LOOPLAB_TRUST_VARIANTS=PKG,...)")
    ap.add_argument("--diagnostics", action="store_true",
                    help="per-loop diagnostics on the split's batches (eval/diagnostics.py: step size, update cosine, "
                         "effective rank, fixed-point gap, logit-lens KL, exit λ, CLP offset cost): eval.json "
                         "`diagnostics` and loop_diagnostics.png")
    ap.add_argument("--zeroshot", nargs="*", default=None, metavar="TASK", help="lm-eval tasks or tags (none given: the paper's 8-task hub suite; offline: looplab_tiny)")
    ap.add_argument("--limit", type=float, default=None, help="lm-eval: documents per task")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="output folder (default: next to the checkpoint's run folder, eval/)")
    ap.add_argument("--results", default=None,
                    help="the run's results.json (default: <run>/results.json of a <run>/checkpoints/X.ckpt, when present)")
    args = ap.parse_args(argv)
    from looplab.models.registry import trust_variants

    trust_variants(*args.trust_variants)
    rule = args.exit_rule if args.exit_rule not in (None, "gate") else None
    if rule is not None:
        from looplab.models.exit_rules import get_rule

        try:
            get_rule(rule)
        except ValueError as e:
            ap.error(f"--exit-rule: {e}")
    if rule is not None and not args.rule_thresholds:
        ap.error(f"--exit-rule {rule} needs --rule-thresholds (e.g. 0.01 0.05 0.2)")
    # each threshold in its rule's range, before the checkpoint loads: one line naming the value (cli_errors)
    from looplab.models.exit_rules import check_rule
    from looplab.models.registry import ConfigError

    if args.min_loops < 1:
        raise ConfigError(f"--min-loops {args.min_loops} must be an integer >= 1 (no exit before that loop)")
    for flag, name, values in (("--thresholds", "gate", args.thresholds),
                               ("--rule-thresholds", rule, args.rule_thresholds if rule is not None else ())):
        for value in values or ():
            try:
                check_rule(name, value, 1, 1)
            except ValueError as e:
                raise ConfigError(f"{flag} {value:g}: {e}") from e

    from looplab.checkpoint import load_model
    from looplab.data.registry import datamodule_from_meta
    from looplab.eval.exit_sweep import exit_sweep, plot_sweep, sweep_markdown
    from looplab.eval.perplexity import split_metrics

    if args.loops is not None and args.loops < 1:
        ap.error(f"--loops must be ≥ 1, got {args.loops}")
    if args.max_batches is not None and args.max_batches < 1:  # 0 batches would report a metric over 0 tokens
        ap.error(f"--max-batches must be ≥ 1, got {args.max_batches}")
    # a test-time depth is a config override: the block is shared, so the same weights run R′ loops
    model, meta = load_model(args.checkpoint, map_location=args.device,
                             **({"n_loops": args.loops} if args.loops is not None else {}))
    ckpt = Path(args.checkpoint)
    out_dir = Path(args.out) if args.out else ckpt.resolve().parent.parent / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)

    dm = datamodule_from_meta(meta["dataset"], source=f"checkpoint {args.checkpoint!r}")
    if hasattr(dm, "prepare_data"):
        dm.prepare_data()
    dm.setup("test" if args.split == "test" else "validate")
    loader = dm.test_dataloader() if args.split == "test" else dm.val_dataloader()
    run = read_run_results(ckpt, args.results)
    max_batches, thresholds = args.max_batches, args.thresholds
    if run is not None:
        # evaluate what the run evaluated: Lightning's limit_{test,val}_batches, the run's thresholds q
        from looplab.stats import eval_batches

        limit = ((run.get("config") or {}).get("trainer") or {}).get(f"limit_{args.split}_batches")
        if max_batches is None and limit is not None:
            max_batches = eval_batches(limit, len(loader))
        if run.get("exit"):
            thresholds = sorted({float(q) for q in run["exit"]} | set(thresholds))
    sweep = exit_sweep(model, loader, thresholds, max_batches=max_batches, device=args.device, rule=rule,
                       rule_thresholds=args.rule_thresholds or (), min_loops=args.min_loops)
    metrics = split_metrics(model, loader, thresholds, max_batches=max_batches, device=args.device)
    is_task = "task" in meta["dataset"]
    metric = "accuracy" if is_task else "perplexity"
    report = {"checkpoint": str(ckpt), "split": args.split, "metric": metric, "max_batches": max_batches,
              "n_loops": model.config.n_loops, "trained_n_loops": meta["model_config"]["n_loops"],
              "scored_tokens": metrics.pop("_scored_tokens"), "scored_answers": metrics.pop("_scored_answers"),
              "metrics": {f"{args.split}/{k}": v for k, v in metrics.items()}, "sweep": sweep}
    if run is not None and args.loops is None:  # at another depth the run's own metrics are not comparable
        report["agreement"] = agreement(run, report["metrics"], args.split)
    table = sweep_markdown(sweep, metric)
    plot_sweep(sweep, metric, out_dir / "exit_curve.png")
    print(table)
    if "agreement" in report:
        a = report["agreement"]
        print(f"results.json {args.split} metrics: {a['compared']} compared, max relative difference "
              f"{a['max_rel_diff']:.2e}" + ("" if not a["missing"] else f", not recomputed: {a['missing']}"))

    if args.zeroshot is not None:
        from looplab.eval import DEFAULT_TASKS, run_zeroshot

        tasks = args.zeroshot or DEFAULT_TASKS
        limit = int(args.limit) if args.limit and args.limit >= 1 else args.limit
        report["zeroshot"] = run_zeroshot(str(ckpt), tasks, limit=limit, batch_size=args.batch_size, device=args.device)
        for task, res in report["zeroshot"]["results"].items():
            print(f"{task}: " + ", ".join(f"{k}={v:.4f}" for k, v in res.items() if k.startswith("acc")))
        if report["zeroshot"]["average_acc"] is not None:
            n = len(report["zeroshot"]["results"])  # a group tag (looplab_tiny) expands to its tasks
            print(f"average acc over {n} task(s): {report['zeroshot']['average_acc']:.4f}")

    written = [out_dir / "eval.json", out_dir / "eval.md", out_dir / "exit_curve.png"]
    if args.diagnostics:
        from looplab.eval.diagnostics import diagnose, plot_diagnostics

        report["diagnostics"] = diagnose(model, loader, max_batches, device=args.device)
        plot_diagnostics(report["diagnostics"], out_dir / "loop_diagnostics.png")
        written.append(out_dir / "loop_diagnostics.png")
        print(f"loop diagnostics ({report['diagnostics']['batches']} batches): {out_dir / 'loop_diagnostics.png'}")

    (out_dir / "eval.json").write_text(json.dumps(report, indent=2))
    (out_dir / "eval.md").write_text(f"# {ckpt}\n\n{args.split} split, {metric}\n\n{table}")
    print("written: " + ", ".join(str(p) for p in written))
    return report


def read_run_results(ckpt: Path, path: str | None = None) -> dict | None:
    """The results.json of the run a checkpoint belongs to (None when there is none, or it failed)."""
    p = Path(path) if path else ckpt.resolve().parent.parent / "results.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        if path:
            raise
        return None
    return data if data.get("status") == "ok" else None


def agreement(run: dict, metrics: dict[str, float], split: str) -> dict:
    """Every `split/` metric of results.json next to the recomputed one, and the largest relative difference.

    Perplexity is compared on the log scale (it is exp(loss): a 1e-7 difference in a float32 loss is a
    1e-7 relative difference of the perplexity whatever its size)."""
    import math

    logged = {k: v for k, v in (run.get("metrics") or {}).items() if k.startswith(f"{split}/") and v is not None}
    pairs, missing, worst = {}, [], 0.0
    for k, v in sorted(logged.items()):
        if k not in metrics:
            missing.append(k)
            continue
        mine = metrics[k]
        pairs[k] = {"results_json": v, "eval": mine}
        if k.endswith("/ppl"):
            rel = abs(math.log(max(mine, 1e-300)) - math.log(max(v, 1e-300)))
        else:
            rel = abs(mine - v) / max(abs(v), 1e-6)
        worst = max(worst, rel)
    return {"compared": len(pairs), "max_rel_diff": worst, "missing": missing, "values": pairs}


if __name__ == "__main__":
    from looplab.cli_errors import run_cli

    run_cli(main, "python -m looplab.eval")  # bad input: one line on stderr, exit 1 (looplab/cli_errors.py)
