"""Tables built from a benchmark's JSON: decoding latency (4), the exit grid (10), self-speculative decoding
(11) and depth under load in the serving engine (14). The training runs these tables also have only feed their missing / failed lists."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from looplab.stats import Stat
from looplab.targets import EXIT_LOSS_TARGET as TARGET_LOSS, EXIT_SPEEDUP_TARGET as TARGET_SPEEDUP, EXIT_TARGET_TASK as TARGET_TASK
from looplab.tables.builders.rows import runs_table
from looplab.tables.findings import evaluate_findings
from looplab.tables.load import Unit
from looplab.tables.render import Table
from looplab.tables.spec import DEFAULT_DECODE_JSON, DEFAULT_EXITS_JSON, DEFAULT_SPECULATION_JSON, TableSpec


def build_decode(spec: TableSpec, scale: str, out_root: Path, decode_json: Path = DEFAULT_DECODE_JSON,
                 seeds: list[int] | None = None) -> Table:
    table = Table(spec, scale, [], [])
    table.method = ("findings: StateLoop's latency relative to a Vanilla Looped model per context length, paired over "
                    "repeated timings in one process (each the median of a block of consecutive tokens, every model "
                    "timed round-robin), with the 95% t-interval over those repeats")
    data = None
    path = Path(decode_json)
    if path.exists():
        data = json.loads(path.read_text())
    else:
        alt = path.parent / "results.json"  # `make bench` keeps the decode part in bench/results.json
        if alt.exists():
            d = json.loads(alt.read_text()).get("decode")
            if isinstance(d, dict) and d.get("per_token_ms"):
                data, path = d, alt
    if not data or not data.get("per_token_ms"):
        table.missing.append(f"{decode_json}: not found — run `python -m looplab.tables run 4` (or `python -m looplab.bench.decode`)")
        table.verdicts = evaluate_findings(spec, [])
        return table
    contexts = list(data["per_token_ms"])
    models = list(next(iter(data["per_token_ms"].values())))
    for name in models:
        row: dict[str, Any] = {"model": name, "params": (data.get("params") or {}).get(name),
                               "FLOPs/token @512": (data.get("flops_per_token_512") or {}).get(name)}
        for ctx in contexts:
            row[f"ms/token @{ctx}"] = data["per_token_ms"][ctx].get(name)
        table.rows.append(row)
    if data.get("recompute_per_token_ms"):
        row = {"model": "vanilla_R, no cache (recompute)"}
        for ctx, v in data["recompute_per_token_ms"].items():
            row[f"ms/token @{ctx}"] = v
        table.rows.append(row)
    table.columns = ["model", "params", "FLOPs/token @512"] + [f"ms/token @{c}" for c in contexts]
    for key in ("state_overhead", "state_overhead_flops", "ratio_vs_vanilla_r_plus_1", "ratio_vs_vanilla_r_plus_1_flops",
                "state_overhead_attn_mixer", "state_overhead_mamba2_mixer", "cached_speedup_512"):
        if data.get(key) is not None:
            table.summary[key] = data[key]
    _exit_decoding_summary(table, data.get("skip_compute") or {})
    table.notes.append(f"from {path}: dims {data.get('dims')}, {data.get('threads')} thread(s), {data.get('dtype')}, "
                       "medians after warm-up, models timed round-robin")
    rounds = data.get("rounds_ms") or {}
    table.sizes = (f"{len(contexts)} context length(s) ({', '.join(contexts)}), {data.get('repeats', '?')} timed tokens each"
                   + (f" in {data.get('rounds')} repeated timings" if rounds else ""))
    if rounds:
        units = [Unit({"model": name, "context": ctx}, str(i), {"latency": ms}) for ctx, per in rounds.items()
                 for name, series in per.items() for i, ms in enumerate(series)]
    else:  # a decode.json from before repeated timings: one figure per context, no interval
        table.notes.append(f"{path} has no repeated timings (rounds_ms): rerun `make table4` for the findings' intervals")
        units = [Unit({"model": name, "context": ctx}, "0", {"latency": ms}) for ctx, per in data["per_token_ms"].items()
                 for name, ms in per.items()]
    table.verdicts = evaluate_findings(spec, units)
    return table


def _exit_decoding_summary(table: Table, sc: dict[str, Any]) -> None:
    """Table 4's exit columns: trained, gated checkpoints decoding their task (bench/decode.py's skip_compute part),
    mean ± 95% t over the checkpoints (seeds) of each state mode; accuracies carry the Wilson
    interval over the answers of one run."""
    if sc.get("skipped") or not sc.get("groups"):
        table.missing.append("exit columns (skip_compute): " + (sc.get("skipped") or "no trained gated checkpoint in "
                                                                "the benchmark JSON; run `make table8`, then `make table4`"))
        return
    q = sc.get("q")
    for mode, g in sc["groups"].items():
        rs = g["runs"]
        answers = rs[0].get("answers")
        where = f"skip_compute, {mode} 1⊗{rs[0].get('n_loops')} stage 2 on {rs[0].get('task')}, q = {q}"
        table.summary[f"{where}: answer accuracy, all loops"] = Stat([r["accuracy"]["all_loops"] for r in rs], answers)
        table.summary[f"{where}: answer accuracy, exit depth (all loops computed)"] = Stat(
            [r["accuracy"]["exact_exit"] for r in rs], answers)
        table.summary[f"{where}: answer accuracy, skip_compute"] = Stat([r["accuracy"]["skip"] for r in rs], answers)
        table.summary[f"{where}: top-1 agreement with the exit depth computed in full"] = Stat(
            [r["top1_agreement_vs_exact_exit"] for r in rs])
        table.summary[f"{where}: mean exit step"] = Stat([r["mean_exit_step"] for r in rs])
        table.summary[f"{where}: speed-up vs all loops (per-token latency)"] = Stat([r["speedup_vs_all_loops"] for r in rs])
    n = {m: len(g["runs"]) for m, g in sc["groups"].items()}
    table.notes.append(f"exit columns: {', '.join(f'{v} {k} checkpoint(s)' for k, v in n.items())} (table 8 stage 2), "
                       f"{sc.get('sequences_per_checkpoint')} test sequences each, decoded token by token")


def build_exitgrid(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None,
                   exits_json: Path | None = None) -> Table:
    """Table 10 from bench/exit_grid.py's JSON: one row per backbone × rule × threshold × handling, mean ± 95% t over
    the checkpoints (seeds); the target line says which configurations reach it."""
    table, _ = runs_table(spec, scale, out_root, seeds)  # table 10's own sweeps (the hybrid gates): missing/failed
    table.method = ("rows: mean ± 95% t over the checkpoints (one per seed) of each backbone; accuracies also show the "
                    "Wilson interval over one run's answers; speed-up = median ms/token of all-loops (or exact-exit) "
                    "decoding / skip decoding, the three decoders timed round-robin token by token")
    path = Path(exits_json or DEFAULT_EXITS_JSON)
    if not path.exists():
        table.missing.append(f"{path}: not found — run `make table8` (the gated llama / StateLoop / Mamba-2 runs), then "
                             "`make table10`")
        return table
    data = json.loads(path.read_text())
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for run in data.get("runs", []):
        for row in run["rows"]:
            key = (run.get("task") or "phop", run["backbone"], run["state_mode"], f"{run['n_layers']}⊗{run['n_loops']}",
                   run.get("training", "standard"), row["rule"], row["threshold"], row["handling"])
            groups.setdefault(key, []).append((run, row))
    met = []
    for (task, bb, sm, nr, training, rule, th, h), items in groups.items():
        rows = [r for _, r in items]
        answers = min(r["answers"] for r in rows)
        lost = Stat([r["accuracy"]["all_loops"] - r["accuracy"]["skip"] for r in rows])
        speed = Stat([r["speedup_vs_all_loops"] for r in rows])
        row = {"task": task, "backbone": bb, "state": sm, "N⊗R": nr, "training": training, "rule": rule, "threshold": th,
               "handling": h, "seeds": len(rows), "mean exit step (skip)": Stat([r["mean_exit_step"]["skip"] for r in rows])}
        if task == "lm":  # a language model: perplexity of every next token (accuracy would be top-1 next-token)
            row.update({"perplexity, all loops": Stat([r["perplexity"]["all_loops"] for r in rows]),
                        "perplexity, exact exit": Stat([r["perplexity"]["exact_exit"] for r in rows]),
                        "perplexity, skip": Stat([r["perplexity"]["skip"] for r in rows]),
                        "perplexity added (skip − all loops)": Stat([r["perplexity"]["skip"] - r["perplexity"]["all_loops"]
                                                                      for r in rows])})
        else:
            row.update({"accuracy, all loops": Stat([r["accuracy"]["all_loops"] for r in rows], answers),
                        "accuracy, exact exit": Stat([r["accuracy"]["exact_exit"] for r in rows], answers),
                        "accuracy, skip": Stat([r["accuracy"]["skip"] for r in rows], answers),
                        "accuracy lost (all loops − skip)": lost})
        row.update({
            "speed-up vs all loops": speed,
            "speed-up vs exact exit": Stat([r["speedup_vs_exact_exit"] for r in rows]),
            "ms/token, skip": Stat([r["per_token_ms"]["skip"] for r in rows])})
        on_target_task = task == TARGET_TASK
        row["target"] = "met" if on_target_task and speed.mean >= TARGET_SPEEDUP and lost.mean <= TARGET_LOSS else ""
        if row["target"]:
            met.append(f"{bb} {sm} {training} {rule} {th:g} {h}")
        table.rows.append(row)
    order = {TARGET_TASK: 0, "mano": 1, "lm": 2}
    table.rows.sort(key=lambda r: (order.get(r["task"], 3), r["backbone"], r["state"], r["training"], r["rule"],
                                   r["threshold"], r["handling"]))
    _exit_aware_training(table, {k[1:]: v for k, v in groups.items() if k[0] == TARGET_TASK})
    ppl = ["perplexity, all loops", "perplexity, exact exit", "perplexity, skip", "perplexity added (skip − all loops)"]
    table.columns = ["task", "backbone", "state", "N⊗R", "training", "rule", "threshold", "handling", "seeds",
                     "accuracy, all loops", "accuracy, exact exit", "accuracy, skip", "accuracy lost (all loops − skip)",
                     *(ppl if any(r["task"] == "lm" for r in table.rows) else []), "mean exit step (skip)",
                     "speed-up vs all loops", "speed-up vs exact exit", "ms/token, skip", "target"]
    ssm = [m for m in met if not m.split()[-1] == "kv_copy"]
    table.summary[f"target: skip decoding ≥ {TARGET_SPEEDUP}× faster than all loops, ≤ {100 * TARGET_LOSS:g} "
                  f"point of accuracy lost, on {TARGET_TASK}, on some Mamba-2 or hybrid configuration (seed means)"] = (
        "**met** by " + "; ".join(ssm) if ssm else "**not met** by any Mamba-2 or hybrid configuration")
    within = [r for r in table.rows if r["task"] == TARGET_TASK and r["handling"] != "kv_copy"
              and r["accuracy lost (all loops − skip)"].mean <= TARGET_LOSS]
    if within:  # the fastest configuration that keeps the accuracy, whether or not it is fast enough
        b = max(within, key=lambda r: r["speed-up vs all loops"].mean)
        table.summary[f"fastest Mamba-2 / hybrid configuration on {TARGET_TASK} within {100 * TARGET_LOSS:g} point of "
                      f"all-loops accuracy: {b['backbone']} {b['N⊗R']} {b['training']}, {b['rule']} {b['threshold']:g}, "
                      f"{b['handling']} (mean exit step {b['mean exit step (skip)'].mean:.2f}, accuracy lost "
                      f"{b['accuracy lost (all loops − skip)'].mean:+.3f}); speed-up vs all loops"] = b["speed-up vs all loops"]
    table.notes.append(f"from {path}: {data.get('n_quality')} test sequences scored per configuration (batched; skip via "
                       f"the online reference, equal to skip decoding), {data.get('n_time')} decoded token by token for the "
                       f"timing, {data.get('threads')} thread(s); thresholds per rule: {data.get('grid')}; language "
                       f"models: {data.get('lm_sequences')} test windows, every next token scored, thresholds "
                       f"{data.get('grid_lm')}")
    table.sizes = (f"{data.get('n_quality')} test sequences (one answer each) per configuration; language models: "
                   f"{data.get('lm_sequences')} test windows, every next token scored")
    return table


def _exit_aware_training(table: Table, groups: dict[tuple, list[tuple[dict, dict]]]) -> None:
    """Exit-aware training − standard training of the same backbone, paired by seed, on skip
    decoding's accuracy at every rule × threshold, with the handling the exit-aware body was trained with."""
    by_key: dict[tuple, dict[str, dict[int, dict]]] = {}
    trained_with = set()
    for (bb, sm, nr, training, rule, th, h), items in groups.items():
        arm = "standard" if training == "standard" else "exit-aware"
        if arm == "exit-aware":  # "exit-aware (ssm_skip, p=0.5)"
            trained_with.add(training.split("(", 1)[-1].split(",", 1)[0])
        by_key.setdefault((bb, sm, nr, rule, th, h), {}).setdefault(arm, {}).update({run.get("seed"): row for run, row in items})
    for (bb, sm, nr, rule, th, h), arms in sorted(by_key.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if len(arms) < 2 or h not in trained_with:
            continue
        seeds = sorted(set(arms["standard"]) & set(arms["exit-aware"]))
        if len(seeds) < 2:
            continue
        diff = Stat([arms["exit-aware"][k]["accuracy"]["skip"] - arms["standard"][k]["accuracy"]["skip"] for k in seeds])
        exits = Stat([arms["exit-aware"][k]["mean_exit_step"]["skip"] - arms["standard"][k]["mean_exit_step"]["skip"]
                      for k in seeds])
        lo, hi = diff.interval
        verdict = "better" if lo > 0 else "worse" if hi < 0 else "inconclusive"
        table.summary[f"{bb} {nr}, {h}, {rule} {th:g}: exit-aware − standard training, skip accuracy "
                      f"(paired over {len(seeds)} seeds; mean exit step {exits.mean:+.2f}) — **{verdict}**"] = diff


def _measured_json(table: Table, path: Path) -> dict[str, Any] | None:
    """The benchmark JSON a table reads, or None with the file listed as missing (the table's make target makes it)."""
    if not path.exists():
        table.missing.append(f"{path}: not found — `make table{table.spec.number}` trains the models and measures them")
        return None
    return json.loads(path.read_text())


def _model_label(run: dict[str, Any]) -> str:
    """'llama vanilla 2⊗4 d 128' (+ 'P1 C1' with a prelude / coda)."""
    pc = " ".join(f"{k}{run.get(f'{n}_layers')}" for k, n in (("P", "prelude"), ("C", "coda")) if run.get(f"{n}_layers"))
    return (f"{run['backbone']} {run['state_mode']} {run['n_layers']}⊗{run['n_loops']}" + (f" {pc}" if pc else "")
            + f" d {run['d_model']}" + (" (retrofitted)" if run.get("init_from") else ""))


def build_speculation(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None,
                      speculation_json: Path | None = None) -> Table:
    """Table 11 from bench/speculative.py's JSON: one row per trained model × batch × k × γ; the target
    (≥ 1.5× at batch 1, identical output) is judged on the best cell, and exit-aware training's effect on
    acceptance is read off the pairs of models trained both ways."""
    table, _ = runs_table(spec, scale, out_root, seeds)  # the training sweeps: missing / failed runs
    table.method = ("each cell: speed-up = the median over timed rounds of plain cached greedy decoding's time ÷ "
                    "speculative decoding's time for the same prompts in the same round (every configuration timed "
                    "round-robin in one process, prefill included), with the range over rounds; every timed "
                    "speculative call gave plain decoding's tokens exactly (checked); acceptance = kept draft tokens / "
                    "drafted; draft cost = plain decoding at depth k ÷ at depth R, per token, paired the same way")
    path = Path(speculation_json or DEFAULT_SPECULATION_JSON)
    data = _measured_json(table, path)
    if data is None:
        return table
    runs = data.get("runs", [])
    for run in runs:
        for b, res in sorted(run["batches"].items(), key=lambda kv: int(kv[0])):
            for c in res["cells"]:
                table.rows.append({
                    "model": _model_label(run), "training": run.get("training") or "—", "seed": run.get("seed"),
                    "perplexity": run.get("perplexity"), "batch": int(b), "k": c["k"], "γ": c["gamma"],
                    "plain tokens/s": res["plain_tokens_per_s"], "speculative tokens/s": c["tokens_per_s"],
                    "speed-up": c["speedup"],
                    "range over rounds": "–".join(f"{v:.2f}" for v in c["speedup_range"]) if c.get("speedup_range") else None,
                    "acceptance": c["acceptance"], "draft cost": c.get("draft_cost"),
                    "target": "met" if int(b) == 1 and c["speedup"] >= data.get("target_speedup", 1.5) else ""})
    table.columns = ["model", "training", "seed", "perplexity", "batch", "k", "γ", "plain tokens/s",
                     "speculative tokens/s", "speed-up", "range over rounds", "acceptance", "draft cost", "target"]
    target = data.get("target_speedup", 1.5)
    best = data.get("best_batch1")
    if best:
        label = next((_model_label(r) for r in runs if r["checkpoint"] == best["checkpoint"]), best["checkpoint"])
        table.summary[f"target: ≥ {target}× tokens/s at identical output at batch 1 on some trained model"] = (
            f"**{'met' if best['speedup'] >= target else 'not met'}**: best cell {label} ({best.get('training')}), "
            f"k = {best['k']}, γ = {best['gamma']}: {best['speedup']:.2f}× plain"
            + (" (rounds {:.2f}–{:.2f})".format(*best["speedup_range"]) if best.get("speedup_range") else "")
            + f", acceptance {best['acceptance']:.2f}, draft cost {best.get('draft_cost', float('nan')):.2f}")
    for run in runs:
        for b, res in sorted(run["batches"].items(), key=lambda kv: int(kv[0])):
            if not res["cells"]:
                continue
            c = max(res["cells"], key=lambda c: c["speedup"])
            acc = {k: statistics.fmean(x["acceptance"] for x in res["cells"] if x["k"] == k)
                   for k in sorted({x["k"] for x in res["cells"]})}
            table.summary[f"{_model_label(run)} ({run.get('training')}), batch {b}: best k = {c['k']}, γ = {c['gamma']} "
                          f"at {c['speedup']:.2f}× ({res['plain_tokens_per_s']:.0f} plain tokens/s); acceptance by k "
                          f"(mean over γ)"] = ", ".join(f"k {k}: {a:.2f}" for k, a in acc.items())
    _exit_aware_acceptance(table, runs)
    table.notes.append(f"from {path}: {data.get('new_tokens')} new tokens after {data.get('prompt')}-token held-out "
                       f"prompts, batches {data.get('batches')}, γ in {data.get('gammas')}, {data.get('repeats')} timed "
                       f"repeats, {data.get('threads')} thread(s)")
    table.sizes = f"{data.get('new_tokens')} greedy tokens per prompt row, batch 1 and 8"
    return table


def _exit_aware_acceptance(table: Table, runs: list[dict[str, Any]]) -> None:
    """Exit-aware − standard training of the same backbone and shape: acceptance per k (mean over γ, batch 1).
    One model per arm: a measurement, not a paired finding across seeds."""
    def key(r):
        return (r["backbone"], r["state_mode"], r["n_layers"], r["n_loops"], r["d_model"], r.get("seed"))

    by = {}
    for r in runs:
        by.setdefault(key(r), {})["standard" if (r.get("training") or "standard") == "standard" else "exit-aware"] = r
    for k_, arms in by.items():
        if len(arms) < 2 or "1" not in arms["standard"]["batches"] or "1" not in arms["exit-aware"]["batches"]:
            continue
        def acc(r, k):
            cells = [c for c in r["batches"]["1"]["cells"] if c["k"] == k]
            return statistics.fmean(c["acceptance"] for c in cells) if cells else float("nan")
        ks = sorted({c["k"] for c in arms["standard"]["batches"]["1"]["cells"]})
        table.summary[f"{_model_label(arms['standard'])}: acceptance, exit-aware − standard training (batch 1, mean "
                      f"over γ; one model each, seed {k_[-1]})"] = ", ".join(
            f"k {k}: {acc(arms['exit-aware'], k) - acc(arms['standard'], k):+.2f}" for k in ks)


# ----------------------------------------------------------------------------- table 14
def _paired_ratio(runs: list[dict], ref: list[dict], key: str = "output_tokens_per_s") -> dict[str, Any] | None:
    """Runs ÷ reference runs of the same round (repeat): the geometric mean of the paired ratios with a 95% t-interval
    over rounds (computed on the log ratios)."""
    import math

    from looplab.stats import t_interval

    by = {r["repeat"]: r[key] for r in ref}
    logs = [math.log(r[key] / by[r["repeat"]]) for r in runs if r["repeat"] in by and r[key] > 0 and by[r["repeat"]] > 0]
    if not logs:
        return None
    ci = t_interval(logs)
    return {"ratio": math.exp(statistics.fmean(logs)), "interval": None if ci is None else [math.exp(ci[0]), math.exp(ci[1])],
            "rounds": len(logs)}


def _fmt_ratio(r: dict[str, Any] | None) -> str:
    if r is None:
        return "—"
    return f"{r['ratio']:.2f}×" + (" [{:.2f}, {:.2f}]".format(*r["interval"]) if r["interval"] else "")


def _serving_label(m: dict[str, Any]) -> str:
    router = f" {m['depth_router']}" if m.get("depth_router", "none") != "none" else ""
    return f"{m['backbone']} {m['n_layers']}⊗{m['n_loops']} d {m['d_model']}{router}"


def _runs_of(m: dict[str, Any], arm: str, c: int) -> list[dict]:
    """A measured model's runs of one arm at concurrency c (one per round)."""
    return [r for r in m["runs"] if r["arm"] == arm and r["concurrency"] == c]


def _fixed_for(m: dict[str, Any], fixed: list[dict]) -> dict[str, Any] | None:
    """The fixed-depth model a routed one is compared with: same loops and width."""
    return next((f for f in fixed if f["n_loops"] == m["n_loops"] and f["d_model"] == m["d_model"]), None)


def serving_target(ideal: float) -> float:
    """The issue's target at one concurrency: 1.5× plain, or 80% of the ideal R / mean depth where that is below 1.9."""
    from looplab.tables.spec import SERVING_TARGET, SERVING_TARGET_IDEAL

    below, share = SERVING_TARGET_IDEAL
    return SERVING_TARGET if ideal >= below else share * ideal


def _judge_at_least(r: dict[str, Any] | None, bound: float) -> str:
    if r is None or r["interval"] is None:
        return "not tested"
    lo, hi = r["interval"]
    return "met" if lo >= bound else "not met" if hi < bound else "inconclusive"


def build_serving(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None,
                  serving_json: Path | None = None) -> Table:
    """Table 14 from bench/depth_under_load.py's JSON: one row per trained model × arm × concurrency; verdicts on the
    issue's targets computed from the paired ratios (over rounds) and the perplexities."""
    from looplab.tables.spec import DEFAULT_SERVING_JSON, SERVING_QUALITY_BOUND

    table, _ = runs_table(spec, scale, out_root, seeds)
    table.method = ("each cell: output tokens/s = a request trace's generated tokens over its wall time, prefill "
                    "included, mean over rounds ± a 95% t-interval; × ref = the geometric mean over rounds of the "
                    "ratio to the reference arm measured in the same round (exit arms: the same model's plain "
                    "continuous batching; MoR: the fixed 1⊗R model's), with a 95% t-interval on the log ratios; "
                    "perplexities teacher-forced on held-out windows, served = with the engine's exit rule and skip "
                    "handling (exit-aware) or causal routing (MoR; its all-loops column: the routing it was trained "
                    "with, top-k over the window for expert choice); solo = requests equal / tied / different from "
                    "decoding each alone")
    path = Path(serving_json or DEFAULT_SERVING_JSON)
    data = _measured_json(table, path)
    if data is None:
        return table
    models = data.get("models", [])
    fixed = [m for m in models if m["kind"] == "fixed"]
    table.columns = ["model", "kind", "training", "exit rule", "perplexity (all loops)", "perplexity (served)",
                     "Δ perplexity", "concurrency", "arm", "output tokens/s", "× ref", "decoding tokens/s", "mean depth",
                     "TTFT p50 ms", "token p50 / p99 ms", "peak cache KiB", "solo"]
    for m in models:
        op = m.get("operating_point")
        served = (m.get("exits") or m.get("routed") or {}).get("perplexity")
        full = m["all_loops"]["perplexity"]
        ref_model = _fixed_for(m, fixed)
        for c in data.get("concurrency", []):
            for arm in m["arms"]:
                runs = _runs_of(m, arm, c)
                if not runs:
                    continue
                if arm in ("exits_lockstep", "exits_depthwise"):
                    ref = _runs_of(m, "plain", c)
                elif arm.startswith("routed") and ref_model is not None:
                    ref = _runs_of(ref_model, "plain", c)
                else:
                    ref = []
                first = next((r for r in runs if "solo_check" in r), None)
                chk = first["solo_check"] if first else None
                table.rows.append({
                    "model": _serving_label(m), "kind": m["kind"], "training": m.get("training") or "—",
                    "exit rule": f"{op['rule']} q={op['threshold']:g} ({op['handling']})" if op and arm != "plain" else "—",
                    "perplexity (all loops)": full, "perplexity (served)": served if arm != "plain" else full,
                    "Δ perplexity": f"{served / full - 1:+.2%}" if served and arm != "plain" else "—",
                    "concurrency": c, "arm": arm,
                    "output tokens/s": Stat([r["output_tokens_per_s"] for r in runs]),
                    "× ref": _fmt_ratio(_paired_ratio(runs, ref)) if ref else "—",
                    "decoding tokens/s": Stat([r["decode_tokens_per_s"] for r in runs]),
                    "mean depth": runs[0]["mean_depth"],
                    "TTFT p50 ms": 1e3 * statistics.median(r["ttft_p50_s"] for r in runs),
                    "token p50 / p99 ms": "{:.1f} / {:.1f}".format(
                        1e3 * statistics.median(r["token_latency_p50_s"] or 0 for r in runs),
                        1e3 * statistics.median(r["token_latency_p99_s"] or 0 for r in runs)),
                    "peak cache KiB": runs[0]["peak_cache_bytes"] / 1024,
                    "solo": f"{chk['equal']} / {chk['ties']} / {chk['different']}" if chk else "—"})
    _serving_verdicts(table, data, models, fixed, SERVING_QUALITY_BOUND)
    table.notes.append(
        f"from {path}: {data.get('requests')} requests per run (prompts {data['trace']['prompt_len']} tokens of held-out "
        f"windows, outputs {data['trace']['new_tokens']} tokens, no eos), concurrencies {data.get('concurrency')}, "
        f"{data.get('repeats')} rounds, {data.get('threads')} thread(s); operating point: rule {data.get('rule')}, the "
        f"largest threshold of {data.get('grid')} within {data.get('quality_bound', SERVING_QUALITY_BOUND):.0%} of "
        f"all-loops perplexity on {data.get('select_windows')} held-out windows; perplexities on the "
        f"{data.get('windows')} windows after them; measured in {data.get('seconds', 0) / 60:.1f} min")
    table.sizes = f"{data.get('windows')} held-out windows (perplexity), {data.get('requests')} requests per engine run"
    return table


def _serving_verdicts(table: Table, data: dict, models: list[dict], fixed: list[dict], bound: float) -> None:
    loaded = [c for c in data.get("concurrency", []) if c > 1]
    for m in models:
        label = f"{_serving_label(m)} ({m.get('training')})"
        if m["kind"] == "exit-aware":
            served, full = m["exits"]["perplexity"], m["all_loops"]["perplexity"]
            quality_ok = served / full - 1 <= bound
            solo = _runs_of(m, "exits_depthwise", 1)
            if solo and _runs_of(m, "plain", 1):
                table.summary[f"{label}: one request at a time (c 1), exits ÷ plain"] = (
                    f"depth-wise {_fmt_ratio(_paired_ratio(solo, _runs_of(m, 'plain', 1)))}, lockstep "
                    f"{_fmt_ratio(_paired_ratio(_runs_of(m, 'exits_lockstep', 1), _runs_of(m, 'plain', 1)))}; mean depth "
                    f"{solo[0]['mean_depth']:.2f} of {m['n_loops']}; perplexity {served:.2f} vs {full:.2f} all loops "
                    f"({served / full - 1:+.2%})")
            for c in loaded:
                deep, plain = _runs_of(m, "exits_depthwise", c), _runs_of(m, "plain", c)
                if not deep or not plain:
                    continue
                r = _paired_ratio(deep, plain)
                ideal = m["n_loops"] / deep[0]["mean_depth"]
                target = serving_target(ideal)
                speed = _judge_at_least(r, target)
                verdict = "not met" if not quality_ok else speed
                gain = _judge_at_least(r, 1.0)
                lock = _paired_ratio(_runs_of(m, "exits_lockstep", c), plain)
                table.summary[f"target at c {c}: {label}, depth-wise exits ≥ {target:.2f}× plain output tokens/s "
                              f"(ideal {ideal:.2f}×) with perplexity within {bound:.0%}"] = (
                    f"**{verdict}**: {_fmt_ratio(r)} (lockstep exits {_fmt_ratio(lock)}); perplexity "
                    f"{served / full - 1:+.2%}; depth-wise batching turns the exits into throughput: "
                    f"{'yes' if gain == 'met' else 'no' if gain == 'not met' else 'not shown'} (gain > 1× {gain})")
        elif m["kind"] == "routed":
            ref = _fixed_for(m, fixed)
            if ref is None:
                table.summary[f"{label}: MoR ≥ the fixed-depth model's throughput"] = "**not tested**: no fixed model measured"
                continue
            for c in loaded:
                arms = {a: _paired_ratio(_runs_of(m, a, c), _runs_of(ref, "plain", c)) for a in m["arms"]}
                best = max((a for a in arms if arms[a] is not None), key=lambda a: arms[a]["ratio"], default=None)
                table.summary[f"target at c {c}: {label} routed ≥ the fixed 1⊗{m['n_loops']} model's output tokens/s"] = (
                    f"**{_judge_at_least(arms.get(best), 1.0)}** (its faster schedule, {best}): "
                    + ", ".join(f"{a} {_fmt_ratio(r)}" for a, r in arms.items())
                    + f"; causal perplexity {m['routed']['perplexity']:.2f} (mean depth {m['routed']['mean_depth']:.2f}) "
                      f"vs the fixed model's {ref['all_loops']['perplexity']:.2f}")
    if not any(m["kind"] == "exit-aware" for m in models):
        table.summary["exit-aware models in the engine"] = "**not tested**: none measured"
    different = sum(r["solo_check"]["different"] for m in models for r in m["runs"] if "solo_check" in r)
    ties = sum(r["solo_check"]["ties"] for m in models for r in m["runs"] if "solo_check" in r)
    table.summary["every checked request against decoding it alone"] = f"{different} different, {ties} ties"
