"""`python -m looplab.bench [--quick] [--threads N] [--only train,mamba2,decode,overhead,batched,data,router,parallel,serve] [--device cpu|cuda] [--out PATH]`
`python -m looplab.bench serve CKPT|random [--concurrency 1,8,32] [--rate R] [--requests N] [--repeats K] [--out FILE.json]`

Runs the benchmarks (fp32, CPU unless a part says otherwise), writes `bench/results.json`
and prints a short table. Parts written by other modules (`mamba2`, `decode`) are imported
lazily: one that has not landed is recorded as pending, one that fails as an error, and the
other parts still run. With `--only`, the other parts already in the output file are kept.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import math
import os
import sys
import time
import traceback

from looplab.bench import common

PARTS = ("train", "mamba2", "decode", "overhead", "batched", "data", "router", "parallel", "serve")
MODULES = {"overhead": "decode_overhead", "batched": "batched_decode"}  # part → module, where they differ
HEADLINE = {  # per part, its headline figures (docs/performance.md#results-json) in print order
    "train": ("tokens_per_s", "ratio_vs_transformers", "ratio_vs_transformers_cpu_time", "ratio_vs_unlooped", "mfu",
              "transformers_mfu", "matmul_gflops", "matmul_gflops_range", "peak_memory_mb", "peak_memory_ratio_vs_transformers"),
    "mamba2": ("tokens_per_s", "ratio_vs_transformers", "ratio_vs_transformers_compiled"),
    "decode": ("state_overhead", "ratio_vs_vanilla_r_plus_1", "cached_speedup_512"),
    "overhead": ("ratio_vs_transformers", "skip_overhead", "outside_loops_share"),
    # batch 8 against plain decoding of the same weights: best speculation cell, skip, routed; static step vs eager
    "batched": ("batch8_speculation_speedup", "batch8_skip_speedup", "batch8_routed_speedup", "static_eager_speedup"),
    "data": ("min_ratio_vs_train_step", "train_steps_per_s"),
    # depth routing: routed / fixed-depth training tokens/s and analytic training FLOPs (bench/router.py)
    "router": ("fixed_tokens_per_s", "ec_tokens_per_s_ratio", "ec_flops_ratio", "tc_tokens_per_s_ratio", "tc_flops_ratio",
               "tc_flops_ratio_measured", "ec_tokens_per_s_ratio_wall", "tc_tokens_per_s_ratio_wall",
               "fixed_decode_tokens_per_s", "ec_decode_tokens_per_s_ratio", "ec_decode_mean_depth",
               "tc_decode_tokens_per_s_ratio", "tc_decode_mean_depth"),
    # parallel loops (bench/parallel.py): parallel 1⊗4 G-SWA decoding against 1⊗1 and sequential 1⊗4, KV bytes
    "parallel": ("gswa_vs_1x1_batch1", "gswa_vs_seq_batch1", "gswa_vs_1x1_batch8", "gswa_vs_seq_batch8",
                 "seq_vs_1x1_batch1", "gswa_kv_ratio_vs_1x1", "targets_met"),
    # serving under load (bench/serve.py): exit-gated 2⊗4 in looplab.serve.Engine against plain continuous batching
    "serve": ("depthwise_vs_plain_c8", "depthwise_vs_plain_c8_range", "depthwise_vs_plain_c32",
              "depthwise_vs_plain_c32_range", "depthwise_decode_vs_plain_c8", "depthwise_decode_vs_plain_c8_range",
              "depthwise_decode_vs_plain_c32", "depthwise_decode_vs_plain_c32_range", "lockstep_exits_vs_plain_c8",
              "lockstep_exits_vs_plain_c32", "ideal_c8", "ideal_c32", "plain_c8_vs_one_at_a_time", "solo_differences"),
}


def _finite(obj):
    """JSON without NaN/inf (not valid JSON): such values become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def run_part(name: str, threads: int, quick: bool, results: dict, train_opts: dict) -> dict:
    try:
        mod = importlib.import_module(f"looplab.bench.{MODULES.get(name, name)}")
    except ImportError as e:
        if getattr(e, "name", None) == f"looplab.bench.{MODULES.get(name, name)}":
            return {"status": "pending", "reason": f"looplab.bench.{name} has not landed yet"}
        return {"status": "error", "error": f"{type(e).__name__}: {e}"}
    t0 = time.perf_counter()
    try:
        if name == "train":
            res = mod.run(threads, quick, **train_opts)
        elif name == "data":
            rate = None
            tr = results.get("train", {})
            if "step_s" in tr and tr.get("quick") == quick:
                rate = 1.0 / common.median(tr["step_s"]["looplab"])
            res = mod.run(threads, quick, train_steps_per_s=rate)
        else:
            res = mod.run(threads, quick)
    except Exception as e:  # noqa: BLE001 — one failing part must not lose the others' figures
        traceback.print_exc()
        return {"status": "error", "error": f"{type(e).__name__}: {e}"}
    res = dict(res)
    res.setdefault("status", "ok")
    res["quick"] = quick
    res["threads"] = threads
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["measured_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return res


def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    if isinstance(v, (list, tuple)):
        return " – ".join(_fmt(x) for x in v)
    return str(v)


def table(results: dict) -> str:
    m = results.get("machine", {})
    lines = [f"looplab bench — {m.get('cpu')} · {m.get('threads')} threads · torch {m.get('torch')} · "
             f"transformers {m.get('transformers')} · {m.get('date')}"]
    for part in PARTS:
        r = results.get(part)
        if r is None:
            continue
        if r.get("status") != "ok":
            lines.append(f"  {part:<8} {r.get('status')}: {r.get('reason') or r.get('error', '')}"[:160])
            continue
        for k in HEADLINE[part]:
            if k in r:
                lines.append(f"  {part:<8} {k:<36} {_fmt(r[k])}")
        if isinstance(r.get("best"), dict):
            b = r["best"]
            lines.append(f"  {part:<8} {'best: ' + b['config']:<36} {_fmt(b['tokens_per_s'])} tok/s · "
                         f"{b['ratio_vs_transformers']:.3f}× transformers · MFU {b['mfu']:.3f}")
        for opt, o in r.get("options", {}).items():
            fig = (f"{o['speedup_vs_default']:.3f}× {o.get('baseline', 'default')}" if "speedup_vs_default" in o
                   else o.get("error", ""))
            lines.append(f"  {part:<8} {'option ' + opt:<36} {fig}"[:160])
        for k, o in r.get("memory_mb", {}).items():
            if "peak_mb" in o:
                lines.append(f"  {part:<8} {'peak MB ' + k:<36} {o['peak_mb']:,.0f}")
        for w, o in r.get("widths", {}).items():
            lines.append(f"  {part:<8} {'d ' + w + ' tokens/s (× transformers)':<36} {_fmt(o['tokens_per_s'])} "
                         f"({_fmt(o.get('ratio_vs_transformers'))}×) · skip, no exit {o['skip_overhead']:+.1%} · "
                         f"outside loops {o['outside_loops_share']:.0%}")
        for k in ("lm", "tasks"):
            if isinstance(r.get(k), dict) and "batches_per_s" in r[k]:
                lines.append(f"  {part:<8} {k + ' batches/s (× train step)':<36} "
                             f"{r[k]['batches_per_s']:,.1f} ({r[k]['ratio_vs_train_step']:,.0f}×)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # the load benchmark on a checkpoint: its own command line
        from looplab.bench import serve

        return serve.main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m looplab.bench", description=__doc__.split("\n\n")[1])
    ap.add_argument("--quick", action="store_true", help="tiny dims and few repeats (smoke test, figures meaningless)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--out", default=os.path.join("bench", "results.json"))
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per candidate (median reported)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile option (slow to compile on CPU)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the training-step part runs (cuda: bf16 autocast, GPU-sized dims); the others stay on CPU")
    ap.add_argument("--no-options", action="store_true", help="skip the speed options (foreach AdamW, SDPA math, ...)")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = sorted(set(parts) - set(PARTS))
    if bad:
        ap.error(f"--only {bad} unknown; choose from {','.join(PARTS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device on this machine")

    common.set_threads(args.threads)
    results: dict = {}
    if os.path.exists(args.out) and set(parts) != set(PARTS):
        with open(args.out) as f:
            results = json.load(f)  # keep parts not rerun
    results["machine"] = common.machine_info(args.threads)
    train_opts = {"repeats": args.repeats, "options": not args.no_options, "memory": not args.no_memory,
                  "device": args.device}
    if args.no_compile:
        train_opts["compile"] = False
    for part in PARTS:
        if part in parts:
            print(f"[bench] {part} …", file=sys.stderr, flush=True)
            results[part] = run_part(part, args.threads, args.quick, results, train_opts)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(_finite(results), f, indent=1)
    print(table(results))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    from looplab.cli_errors import run_cli

    run_cli(main, "python -m looplab.bench")  # bad input (an unknown --exit-rule, ...): one line (looplab/cli_errors.py)
