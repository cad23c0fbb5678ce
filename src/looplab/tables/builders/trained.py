"""Tables built from training runs' results.json: language models (1, 2, 3, 7), tasks (5, 6), test-time
depth (9), the exit gate (8), depth routing (12) and parallel loops (13). One row per expected configuration, its seeds pooled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from looplab.stats import Stat
from looplab.tables.builders.rows import base_row, runs_table, wilson_cell
from looplab.tables.findings import evaluate_findings
from looplab.tables.load import (Cell, base_experiment, causal, examples_of, first_value, nxr, paired_stat, stat, units_for,
                                 zeroshot_items)
from looplab.tables.render import Table
from looplab.tables.spec import DEFAULT_PLT_JSON, DEFAULT_ROUTING_JSON, TableSpec


def build_lm(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    return _lm(spec, scale, out_root, seeds)[0]


def _lm(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None) -> tuple[Table, list[Cell]]:
    table, cells = runs_table(spec, scale, out_root, seeds)
    zs_any = False
    for c in cells:
        if not c.ok:
            continue
        row = base_row(c)
        row["perplexity"] = stat(c.ok, lambda d: d["perplexity"])
        row["loss"] = stat(c.ok, lambda d: d["loss"])
        zs = [(z, zeroshot_items(z)) for z in (r.zeroshot() for r in c.ok) if z and z.get("average_acc") is not None]
        if zs:
            ns = [n for _, n in zs if n]
            row["zero-shot avg"] = Stat([float(z["average_acc"]) for z, _ in zs], min(ns) if ns else None)
            row["zero-shot Wilson 95%"] = wilson_cell(row["zero-shot avg"])
        else:
            row["zero-shot avg"] = "n/a"
        zs_any |= bool(zs)
        row["state overhead"] = first_value(c, "state_branch_overhead")
        table.rows.append(row)
    base = ["experiment", "backbone", "N⊗R", "state", "seeds", "perplexity", "loss", "zero-shot avg", "zero-shot Wilson 95%",
            "params", "state overhead", "FLOPs/token", "steps"]
    if not zs_any:
        base.remove("zero-shot Wilson 95%")
    if any("size" in r for r in table.rows):
        base.insert(1, "size")
    table.columns = ["experiment", "arm"] + base[1:] if any("arm" in r for r in table.rows) else base
    if not zs_any:
        table.notes.append("zero-shot avg: n/a — " + (f"run `python -m looplab.tables zeroshot {spec.number} --scale {scale}"
                           + (" --tasks looplab_tiny" if scale == "tiny" else "") + "` to fill it"))
    else:
        table.notes.append("zero-shot avg: mean accuracy over the suite's tasks (zeroshot.json of each run); "
                           "Wilson interval over the suite's items of one run")
    table.units = units_for(cells)
    table.verdicts = evaluate_findings(spec, table.units, scale)
    return table, cells


def _per_depth(cell: Cell) -> str:
    R = first_value(cell, "model", "loops") or 0
    parts = []
    for k in range(R):
        s = stat(cell.ok, lambda d, k=k: d["per_depth"]["acc"][k])
        parts.append("—" if s.mean is None else f"{s.mean:.2f}")
    return " / ".join(parts) if parts else "—"


def build_task(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    table, cells = runs_table(spec, scale, out_root, seeds)
    for c in cells:
        if not c.ok:
            continue
        row = base_row(c)
        row["accuracy"] = stat(c.ok, lambda d: d["accuracy"], examples_of)
        row["Wilson 95% (examples)"] = wilson_cell(row["accuracy"])
        row["acc per loop depth (1..R)"] = _per_depth(c)
        table.rows.append(row)
    table.columns = ["experiment", "backbone", "N⊗R", "seeds", "accuracy", "Wilson 95% (examples)", "acc per loop depth (1..R)",
                     "params", "FLOPs/token", "steps"]
    table.notes.append("accuracy: exact match of the answer token on the held-out test split; "
                       "acc per loop depth: the same model read out after loop 1, 2, … R (shared final norm + head), seed means")
    table.units = units_for(cells)
    table.verdicts = evaluate_findings(spec, table.units, scale)
    return table


def build_extrapolation(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    """Table 9: per training recipe × injection, the metric of the final model at each test-time depth R′."""
    table, cells = runs_table(spec, scale, out_root, seeds)
    depths: list[int] = sorted({int(k) for c in cells for r in c.ok
                                for k in ((r.data.get("per_depth") or {}).get("eval_loops") or {})})
    metric = "accuracy" if any(first_value(c, "accuracy") is not None for c in cells if c.ok) else "perplexity"
    for c in cells:
        if not c.ok:
            continue
        row = base_row(c)
        row["injection"] = c.combo.get("loop_depth.injection") or first_value(c, "config", "loop_depth", "injection", default="none")
        row["trained R"] = first_value(c, "model", "loops")
        for k in depths:
            get = (lambda d, k=k: d["per_depth"]["eval_loops"][str(k)][metric])
            row[f"R′ = {k}"] = stat(c.ok, get, examples_of if metric == "accuracy" else None)
        table.rows.append(row)
    table.rows.sort(key=lambda r: (r.get("arm") or "", r["injection"]))
    table.columns = ["arm", "injection", "N⊗R", "trained R", "seeds"] + [f"R′ = {k}" for k in depths] + ["steps"]
    table.notes.append(f"R′ = k: test {metric} of the final model run with k loops (`model(ids, n_loops=k)`), mean ± 95% t "
                       "over seeds; the model was trained at R (fixed) or at a depth drawn per step around R (randomized)")
    table.units = units_for(cells)
    table.verdicts = evaluate_findings(spec, table.units, scale)
    return table


def _paired_column(table: Table, cells: list[Cell], name: str, ref_arm, note: str) -> None:
    """Δ column: this row's perplexity minus the reference arm's at the same N⊗R, paired by seed."""
    by_key = {(nxr(c), c.sweep.folder, c.combo.get("backbone"), c.combo.get("arm")): c for c in cells if c.ok and c.expected}
    for row in table.rows:
        ref = by_key.get((row["N⊗R"], row["experiment"], row.get("size"), ref_arm))
        mine = by_key.get((row["N⊗R"], row["experiment"], row.get("size"), row.get("arm")))
        row[name] = (paired_stat(mine.ok, ref.ok, lambda d: d["perplexity"])
                     if ref is not None and mine is not None and mine is not ref else None)
    table.columns.insert(table.columns.index("perplexity") + 1, name)
    table.notes.append(note)


def build_depth(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    table, cells = _lm(spec, scale, out_root, seeds)
    _paired_column(table, cells, "Δ vs looped (paired)", "looped",
                   "Δ vs looped: perplexity of this arm minus Vanilla Looped's at the same N⊗R, paired by seed, "
                   "mean ± 95% t-interval (negative = StateLoop better)")
    return table


def build_reset(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    table, cells = _lm(spec, scale, out_root, seeds)
    _paired_column(table, cells, "Δ vs carry (paired)", "stateloop",
                   "Δ vs carry: perplexity of this arm minus the carrying StateLoop's, paired by seed, mean ± 95% "
                   "t-interval (positive = resetting the state hurts)")
    return table


def _exit_step(d: dict[str, Any], q: str) -> float | None:
    """Mean exit step at the scored positions: the answers (tasks) or every target token (LM)."""
    e = (d.get("exit") or {}).get(q) or {}
    return e.get("answer_step") if e.get("answer_step") is not None else e.get("mean_step")


def _exit_rows(cell: Cell, mode: str) -> list[dict[str, Any]]:
    base = {"experiment": cell.sweep.experiment, "backbone": first_value(cell, "model", "backbone", default="?"),
            "N⊗R": nxr(cell), "state": first_value(cell, "model", "state_mode", default="?"), "mode": mode,
            "seeds": len(cell.ok), "steps": first_value(cell, "global_step")}
    rows = []
    if mode == "fixed loops":
        R = first_value(cell, "model", "loops") or 0
        for k in range(R):
            acc = stat(cell.ok, lambda d, k=k: d["per_depth"]["acc"][k], examples_of)
            rows.append({**base, "setting": f"exit at step {k + 1}", "accuracy": acc, "Wilson 95% (examples)": wilson_cell(acc),
                         "mean exit step": float(k + 1),
                         "loss": stat(cell.ok, lambda d, k=k: d["per_depth"]["loss"][k])})
        return rows
    qs = sorted({q for r in cell.ok for q in (r.data.get("exit") or {})}, key=float)
    for q in qs:
        acc = stat(cell.ok, lambda d, q=q: d["exit"][q]["acc"], examples_of)
        rows.append({**base, "setting": f"q = {q}", "accuracy": acc, "Wilson 95% (examples)": wilson_cell(acc),
                     "mean exit step": stat(cell.ok, lambda d, q=q: _exit_step(d, q)),
                     "loss": stat(cell.ok, lambda d, q=q: d["exit"][q]["loss"])})
    return rows


def _exit_mode(c: Cell) -> str:
    if c.sweep.init_from is not None:
        return "stage 2"
    gate = c.combo.get("exit_gate") or first_value(c, "model", "exit_gate", default="?")
    return "fixed loops" if gate == "none" else "stage 1"


def build_exit(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None) -> Table:
    table, cells = runs_table(spec, scale, out_root, seeds)
    for c in cells:
        if c.ok:
            table.rows += _exit_rows(c, _exit_mode(c))
    order = {"fixed loops": 0, "stage 1": 1, "stage 2": 2}
    table.rows.sort(key=lambda r: (r["experiment"], order.get(r["mode"], 3)))
    table.columns = ["experiment", "backbone", "N⊗R", "state", "mode", "setting", "seeds", "accuracy", "Wilson 95% (examples)",
                     "mean exit step", "loss", "steps"]
    table.notes.append("fixed loops: the exit_gate=none model read out at depth k; stage 1: joint gate training (Ouro); "
                       "stage 2: gate only, backbone frozen and loaded from the fixed-loop run of the same seed (steps: "
                       "the gate's own training steps); q: exit at "
                       "the first depth whose cumulative exit probability reaches q (q > 1 never exits early); mean exit "
                       "step: at the answer positions (tasks) or over all target tokens (LM), mean ± 95% t over seeds")
    table.units = units_for(cells, _exit_mode)
    table.verdicts = evaluate_findings(spec, table.units, scale)
    return table


def build_routing(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None,
                  routing_json: Path | None = None) -> Table:
    """Table 12: one row per experiment × arm (seed means with intervals): quality as trained and with each
    token's depth chosen causally, the depth it spends, parameters, training FLOPs and tokens/s, and for the
    language models decoding tokens/s and KV-cache bytes from bench/routed_decode.py's JSON."""
    table, cells = runs_table(spec, scale, out_root, seeds)
    path = Path(routing_json or DEFAULT_ROUTING_JSON)
    decode = {}
    if path.exists():
        for r in json.loads(path.read_text()).get("runs", []):
            decode[str(Path(r["run_dir"]).resolve())] = r
    elif any(c.ok for c in cells if "lm" in c.sweep.experiment):
        table.missing.append(f"{path}: not found — `make table12` measures decoding after training")
    for c in cells:
        for r in c.ok:  # decoding figures ride on the run's data, for the rows and the findings alike
            if str(r.path.resolve()) in decode:
                r.data["decode"] = decode[str(r.path.resolve())]
    for c in cells:
        if not c.ok:
            continue
        row = base_row(c)
        row["experiment"] = base_experiment(c.sweep.experiment)
        row["arm"] = c.combo.get("arm", "?")
        if "_lm_" in c.sweep.experiment:
            row["perplexity"] = stat(c.ok, lambda d: d["perplexity"])
            row["causal perplexity"] = stat(c.ok, lambda d: causal(d, "perplexity"))
        else:
            row["accuracy"] = stat(c.ok, lambda d: d["accuracy"], examples_of)
            row["causal accuracy"] = stat(c.ok, lambda d: causal(d, "accuracy"), examples_of)
        row["layers/token"] = stat(c.ok, lambda d: d["routing"]["mean_depth"] * d["model"]["layers"] if d.get("routing")
                                   else d["model"]["layers"] * d["model"]["loops"])
        row["causal layers/token"] = stat(c.ok, lambda d: causal(d, "depth"))
        row["train MFLOPs/token"] = stat(c.ok, lambda d: d["flops_per_token"]["training"] / 1e6)
        row["train TFLOPs"] = stat(c.ok, lambda d: d["flops_per_token"]["training"] * d["throughput"]["tokens"] / 1e12)
        row["train tokens/s"] = stat(c.ok, lambda d: d["throughput"]["tokens_per_s"])
        row["decode tokens/s"] = stat(c.ok, lambda d: d["decode"]["tokens_per_s"])
        row["KV KiB"] = stat(c.ok, lambda d: d["decode"]["kv_bytes"] / 1024)
        table.rows.append(row)
    table.rows.sort(key=lambda r: (r["experiment"], ARM_ORDER.index(r["arm"]) if r["arm"] in ARM_ORDER else 99))
    table.columns = ["experiment", "arm", "N⊗R", "seeds", "perplexity", "causal perplexity", "accuracy", "causal accuracy",
                     "layers/token", "causal layers/token", "params", "train MFLOPs/token", "train TFLOPs", "steps", "train tokens/s",
                     "decode tokens/s", "KV KiB"]
    table.notes += [
        "perplexity / accuracy: the test split scored as the model trains — expert choice picks each loop's top-k over "
        "the whole sequence (MoR's evaluation: a later token can decide an earlier token's depth), the exit gate's arm "
        "runs every loop; causal: each token's depth chosen from its own past, as decoding does (a router's inference "
        "rule, the gate's exit at q = 0.5); layers/token: the block layers each token runs (loops × N), as "
        "trained and causal (the exit gate's arm trains every loop)",
        "train MFLOPs/token: analytic (LoopedLM.flops_per_token: a router's loops counted at its capacities, backward "
        "2× forward); train TFLOPs: that × the tokens trained; train tokens/s: the whole training loop, two runs "
        "sharing the 2 cores",
        f"decoding (LM only, {path}): 64 greedy tokens after a 32-token held-out prompt at batch 1, one thread, the "
        "arms of a seed timed round-robin; KV KiB: the cache after decoding (a router's per-depth caches hold only the "
        "tokens that reached their depth)",
    ]
    table.units = units_for(cells)
    table.verdicts = evaluate_findings(spec, table.units, scale)
    return table


ARM_ORDER = ["looped", "mor_expert", "mor_token", "ouro_gate", "vanilla"]  # table 12's rows


# Table 13's diagnostic columns: (column, measure, which loop's value: "R" the last, "mean" over the loops where defined)
PLT_DIAGNOSTICS = (("step_rel @R", "step_rel", "R"), ("Ω_rel @R", "offset_cost_rel", "R"), ("KL lens @R", "logit_lens_kl", "R"),
                   ("eff. rank @R", "effective_rank", "R"), ("gate g", "loop_gate", "mean"))


def _diag(d: dict[str, Any], measure: str, at: str) -> float | None:
    vals = (((d.get("decode") or {}).get("diagnostics") or {}).get(measure)) or []
    if at == "R":
        return vals[-1] if vals else None
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


def plt_arm(d: dict[str, Any]) -> str:
    """A run's arm as table 13 names it: 'parallel <kv>', 'unrolled' (N⊗1, N > 1), else 'sequential'."""
    m = d.get("model") or {}
    if m.get("loop_schedule") == "parallel":
        return f"parallel {m.get('loop_kv')}"
    return "unrolled" if m.get("loops") == 1 and (m.get("layers") or 1) > 1 else "sequential"


PLT_ARM_ORDER = ["sequential", "unrolled", "parallel own", "parallel share_first", "parallel gswa"]


def build_plt(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None = None,
              plt_json: Path | None = None) -> Table:
    """Table 13: one row per experiment × schedule × kv × N⊗R (seed means with intervals): quality, parameters,
    training tokens/s, and for the language models decoding tokens/s at batch 1 and 8, KV-cache bytes and the
    per-loop diagnostics, from bench/routed_decode.py's JSON."""
    table, cells = runs_table(spec, scale, out_root, seeds)
    path = Path(plt_json or DEFAULT_PLT_JSON)
    decode = {}
    if path.exists():
        for r in json.loads(path.read_text()).get("runs", []):
            decode[str(Path(r["run_dir"]).resolve())] = r
    elif any(c.ok for c in cells if "_lm_" in c.sweep.experiment):
        table.missing.append(f"{path}: not found — `make table13` measures decoding after training")
    for c in cells:
        for r in c.ok:
            if str(r.path.resolve()) in decode:
                r.data["decode"] = decode[str(r.path.resolve())]
    for c in cells:
        if not c.ok:
            continue
        row = base_row(c)
        d0 = c.ok[0].data
        row["experiment"] = base_experiment(c.sweep.experiment)
        row["arm"] = plt_arm(d0)
        row["window"] = (d0.get("model") or {}).get("loop_window") if row["arm"] == "parallel gswa" else None
        if "_lm_" in c.sweep.experiment:
            row["perplexity"] = stat(c.ok, lambda d: d["perplexity"])
        else:
            row["accuracy"] = stat(c.ok, lambda d: d["accuracy"], examples_of)
        row["train tokens/s"] = stat(c.ok, lambda d: d["throughput"]["tokens_per_s"])
        row["decode tok/s b1"] = stat(c.ok, lambda d: d["decode"]["batches"]["1"]["tokens_per_s"])
        row["decode tok/s b8"] = stat(c.ok, lambda d: d["decode"]["batches"]["8"]["tokens_per_s"])
        row["KV KiB"] = stat(c.ok, lambda d: d["decode"]["kv_bytes"] / 1024)
        for col, measure, at in PLT_DIAGNOSTICS:
            row[col] = stat(c.ok, lambda d, m=measure, a=at: _diag(d, m, a))
        table.rows.append(row)
    table.rows.sort(key=lambda r: (r["experiment"], PLT_ARM_ORDER.index(r["arm"]) if r["arm"] in PLT_ARM_ORDER else 99,
                                   r["N⊗R"]))
    table.columns = ["experiment", "arm", "N⊗R", "window", "seeds", "perplexity", "accuracy", "params", "steps",
                     "train tokens/s", "decode tok/s b1", "decode tok/s b8", "KV KiB", *(c for c, _, _ in PLT_DIAGNOSTICS)]
    table.notes += [
        "arm: sequential (every loop after the previous one, one cache per loop; 1⊗1 is the block run once), unrolled "
        "(N⊗1: the block's N layers not shared), parallel <kv> (loop_depth.schedule=parallel: loop r + 1 reads loop r's "
        "output one token back; own: every loop its own keys/values, share_first: loops ≥ 2 attend to loop 1's, gswa: "
        "loop 1's gated with a window of the loop's own); window: G-SWA's, in tokens",
        f"decoding (LM only, {path}): 64 greedy tokens after 32-token held-out prompts at batch 1 and 8 (tok/s = the "
        "batch's tokens over wall time, prefill included), one thread, the arms of a seed timed round-robin; KV KiB: "
        "the cache after batch-1 decoding of the 96 tokens (LoopCache.nbytes)",
        "diagnostics (LM only; eval/diagnostics.py, docs/evaluation.md#per-loop-diagnostics) over 4 test batches at the "
        "last loop R: step_rel = ‖h^(R) − h^(R−1)‖ / ‖h^(R−1)‖, Ω_rel = the CLP offset cost ‖h_i^(R−1) − h_(i−1)^(R−1)‖ / "
        "‖h_i^(R−1)‖, KL lens = KL(p^(R) ‖ p^(R−1)), eff. rank of h^(R); gate g: G-SWA's mean weight of loop 1's branch "
        "over loops ≥ 2; every measure at the same position i",
    ]
    table.units = units_for(cells)
    table.verdicts = evaluate_findings(spec, table.units, scale)
    return table
