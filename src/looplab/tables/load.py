"""Runs and cells of a table as the report reads them: results.json figures, never a checkpoint or torch.

A `Cell` is one expected configuration of a sweep with the runs found for it (seeds pooled); a `Unit` is
one run (table 4: one model at one context and repeated timing) as the findings see it, its facets
(experiment, arm, N, R, ...) what a finding's arms filter on and `METRICS` what its metric reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looplab.runs import Run, load_runs
from looplab.stats import Stat, eval_batches
from looplab.targets import EXIT_Q
from looplab.tables.spec import Sweep


def stat(runs: list[Run], get_value, examples=None) -> Stat:
    """Stat of get_value(results) over runs; examples(run) → that run's test examples (accuracy)."""
    vals = []
    for r in runs:
        v = finite_value(get_value, r.data)
        if v is not None:
            vals.append(v)
    ns = [examples(r) for r in runs] if examples else []
    ns = [x for x in ns if x]
    return Stat(vals, min(ns) if ns else None)


def finite_value(get_value, data) -> float | None:
    try:
        v = get_value(data)
    except (KeyError, TypeError, IndexError, AttributeError):
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def paired_stat(runs_a: list[Run], runs_b: list[Run], get_value) -> Stat:
    """A − B over the seeds both arms have (paired: same seed in both)."""
    b = {str(r.seed): finite_value(get_value, r.data) for r in runs_b}
    diffs = []
    for r in runs_a:
        va, vb = finite_value(get_value, r.data), b.get(str(r.seed))
        if va is not None and vb is not None:
            diffs.append(va - vb)
    return Stat(diffs)


def held_out_size(data: dict[str, Any]) -> tuple[int | None, str]:
    """(scored test items, unit) of one run, from the config its results.json records.

    Synthetic tasks: answer positions = examples of the test split (`dataset.test_size`, cut by
    `trainer.limit_test_batches`). Language modelling: target tokens = windows of `dataset.seq_len`
    among the first `dataset.val_tokens` held-out tokens (cut by limit_test_batches); this assumes
    the held-out split has at least val_tokens tokens (lm_tiny: 142,881; the Pile: 16.8M prepared).
    """
    cfg = data.get("config") or {}
    ds, tr = cfg.get("dataset") or {}, cfg.get("trainer") or {}
    split = data.get("final_split") or "test"
    limit = tr.get("limit_test_batches" if split == "test" else "limit_val_batches")
    try:
        if "task" in ds:
            size, batch = ds.get("test_size" if split == "test" else "val_size"), ds.get("batch_size")
            if not size or not batch:
                return None, "examples"
            return min(int(size), eval_batches(limit, math.ceil(size / batch)) * int(batch)), "examples"
        T, vt = ds.get("seq_len"), ds.get("val_tokens")
        batch = ds.get("val_batch_size") or ds.get("batch_size")
        if not T or not vt or not batch:
            return None, "tokens"
        windows = int(vt) // int(T)
        return min(windows, eval_batches(limit, math.ceil(windows / batch)) * int(batch)) * int(T), "tokens"
    except (TypeError, ValueError):
        return None, "examples" if "task" in ds else "tokens"


def examples_of(run: Run) -> int | None:
    return held_out_size(run.data)[0]


def zeroshot_items(z: dict[str, Any]) -> int | None:
    ns = [v for v in (z.get("n_samples") or {}).values() if isinstance(v, int)]
    return sum(ns) or None


def zeroshot_outcomes(z: dict[str, Any] | None) -> dict[str, tuple[tuple[int, ...], list[int]]] | None:
    """Per task of the zero-shot average (each task with an 'acc'): (document ids, each document's 0/1 acc) from
    zeroshot.json's 'items' (looplab.eval.item_outcomes); None when the file predates them or any such task lacks them."""
    items, tasks = (z or {}).get("items"), [t for t, r in ((z or {}).get("results") or {}).items() if "acc" in (r or {})]
    if not isinstance(items, dict) or not tasks:
        return None
    out = {}
    for t in tasks:
        it = items.get(t) or {}
        acc, ids = it.get("acc"), it.get("doc_ids")
        if not isinstance(acc, str) or set(acc) - {"0", "1"} or not acc:
            return None
        if isinstance(ids, str) and ":" in ids:
            start, stop = (int(x) for x in ids.split(":"))
            ids = tuple(range(start, stop))
        elif isinstance(ids, list):
            ids = tuple(int(x) for x in ids)
        else:
            return None
        if len(ids) != len(acc):
            return None
        out[t] = (ids, [int(c) for c in acc])
    return out


def sweep_protocol(sw) -> str | None:
    """Table 7's comparison protocol(s) of a sweep: 'isoparam', 'isoflop', or 'isoparam+isoflop' for a sweep
    that holds both (the tiny ones: the shared looped arm is trained once), from the experiment's tags or,
    failing that, its name."""
    tags = set(sw.experiment_tags()) | {p for p in ("isoparam", "isoflop") if p in sw.experiment}
    found = [p for p in ("isoparam", "isoflop") if p in tags]
    return "+".join(found) or None


def facet_is(key: str, value: Any, want: str) -> bool:
    """A facet equals a filter value; a sweep holding both protocols matches either."""
    if key == "protocol" and value is not None:
        return want in str(value).split("+")
    return str(value) == want


def base_experiment(name: str) -> str:
    for suffix in ("_tiny", "_paper"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@dataclass
class Cell:
    """One configuration of a sweep: its expected combo and the runs found for it."""

    sweep: Sweep
    combo: dict[str, str]
    ok: list[Run]
    failed: list[Run]
    expected: bool = True

    def label(self) -> str:
        return self.sweep.folder + (" " + " ".join(f"{k}={v}" for k, v in self.combo.items()) if self.combo else "")


def cells_for(sweep: Sweep, folder: Path) -> list[Cell]:
    """The sweep's expected configurations (seed folded in) with their runs, then any extra runs."""
    runs = load_runs(folder)
    grid = sweep.grid()
    used: set[int] = set()
    cells = []
    for combo in grid:
        mine = [r for r in runs if all(r.swept.get(k) == v for k, v in combo.items())]
        used |= {id(r) for r in mine}
        cells.append(Cell(sweep, combo, [r for r in mine if r.ok], [r for r in mine if not r.ok]))
    keys = list(grid[0]) if grid else []
    extra: dict[tuple, list[Run]] = {}
    for r in runs:
        if id(r) not in used:
            extra.setdefault(tuple((k, r.swept.get(k, "?")) for k in keys), []).append(r)
    for key, rs in extra.items():
        cells.append(Cell(sweep, dict(key), [r for r in rs if r.ok], [r for r in rs if not r.ok], expected=False))
    return cells


def nxr(cell: Cell) -> str:
    for r in cell.ok:
        m = r.data.get("model") or {}
        if m.get("layers"):
            return f"{m['layers']}⊗{m['loops']}"
    ld = cell.combo.get("loop_depth")
    return ld.replace("x", "⊗") if ld else "?"


def first_value(cell: Cell, *path, default=None):
    for r in cell.ok:
        v: Any = r.data
        try:
            for p in path:
                v = v[p]
        except (KeyError, TypeError, IndexError):
            continue
        if v is not None:
            return v
    return default


def causal(d: dict[str, Any], what: str) -> float | None:
    """Table 12: a run's perplexity / accuracy / mean depth with each token's depth chosen causally, as decoding
    chooses it: a depth router's inference routing (results.json routing.causal_*), the exit gate's exit at
    q = EXIT_Q (exit.<q>), every loop for a fixed-depth model."""
    routing, gate = d.get("routing"), (d.get("exit") or {}).get(str(EXIT_Q))
    if routing:
        v = routing.get(f"causal_{what}" if what != "depth" else "causal_mean_depth")
    elif gate and gate.get("loss") is not None:
        v = {"perplexity": math.exp(min(gate["loss"], 50.0)), "accuracy": gate.get("acc"), "depth": gate.get("mean_step")}[what]
    else:
        v = {"perplexity": d.get("perplexity"), "accuracy": d.get("accuracy"), "depth": d["model"]["loops"]}[what]
    return v * d["model"]["layers"] if what == "depth" and v is not None else v  # depth: layers run per token


@dataclass
class Unit:
    """One run (or, for table 4, one model at one context) as the findings see it."""

    facets: dict[str, Any]
    rep: str  # what pairs A with B: the seed (table 4: the repeated timing)
    data: dict[str, Any]
    examples: int | None = None  # test examples of the run (accuracy)
    zeroshot: dict[str, Any] | None = None

    def value(self, metric: str, q: str | None = None) -> float | None:
        """The unit's figure of a finding metric (METRICS); q: the exit threshold whose readout it takes."""
        try:
            read = METRICS[metric]
        except KeyError:
            raise ValueError(f"unknown finding metric {metric!r}") from None
        return read(self, q)

    def n_examples(self, metric: str) -> int | None:
        if metric in ("accuracy", "accuracy at 2R"):
            return self.examples
        if metric == "zero-shot" and self.zeroshot:
            return zeroshot_items(self.zeroshot)
        return None

    def config(self) -> tuple:
        return tuple(sorted((k, str(v)) for k, v in self.facets.items()))

    def label(self) -> str:
        f = self.facets
        parts = [str(f[k]) for k in ("model", "mode", "arm") if f.get(k) is not None]
        if f.get("schedule") == "parallel":
            parts.append(f"parallel {f.get('kv')}")
        if f.get("N") is not None and f.get("model") is None:
            parts.append(f"{f['N']}⊗{f['R']}")
        if f.get("size"):
            parts.append(str(f["size"]))
        return " ".join(parts) or "?"


def _results(get_value):
    """A metric read from the unit's results.json, the same at every exit threshold."""
    return lambda u, q: finite_value(get_value, u.data)


def _exit_step(u: Unit, q: str | None) -> float | None:
    """The loops the unit's model uses: its mean exit step at q (at the answers, else over every target
    token), all R loops for a fixed-loop model (no q)."""
    if not q:
        return finite_value(lambda d: d["model"]["loops"], u.data)
    step = finite_value(lambda d: d["exit"][q]["answer_step"], u.data)
    return step if step is not None else finite_value(lambda d: d["exit"][q]["mean_step"], u.data)


def _exit_fraction(u: Unit, q: str | None) -> float | None:
    step, R = _exit_step(u, q), finite_value(lambda d: d["model"]["loops"], u.data)
    return None if step is None or not R else step / R


def _best_shallower_loop(u: Unit, q: str | None) -> float | None:
    """Table 8's GATE_CAN_ACT: the fixed-loop body's best accuracy read at a loop r < R (per_depth.acc[r − 1])."""
    R = finite_value(lambda d: d["model"]["loops"], u.data)
    accs = [finite_value(lambda d, r=r: d["per_depth"]["acc"][r], u.data) for r in range(int(R or 1) - 1)]
    accs = [a for a in accs if a is not None]
    return max(accs) if accs else None


def _accuracy_at_trained_depth(u: Unit, q: str | None) -> float | None:
    """Table 9's precondition: the final model at its trained depth (its test accuracy when no depth sweep ran)."""
    v = finite_value(lambda d: d["per_depth"]["eval_loops"][str(d["model"]["loops"])]["accuracy"], u.data)
    return v if v is not None else finite_value(lambda d: d["accuracy"], u.data)


# What a finding's metric reads (spec.Finding.metric, spec.Precondition.metric): name → f(unit, q), None when
# the unit did not record it. Every metric but zero-shot is a figure of the run's results.json.
METRICS: dict[str, Callable[[Unit, str | None], float | None]] = {
    "perplexity": _results(lambda d: d["perplexity"]),
    "accuracy": lambda u, q: finite_value((lambda d: d["exit"][q]["acc"]) if q else (lambda d: d["accuracy"]), u.data),
    "exit step": _exit_step,
    "exit fraction": _exit_fraction,
    "zero-shot": lambda u, q: finite_value(lambda z: z["average_acc"], u.zeroshot) if u.zeroshot else None,
    "latency": _results(lambda d: d["latency"]),  # table 4: one repeated timing
    # table 9: the final model tested at twice its trained depth
    "accuracy at 2R": _results(lambda d: d["per_depth"]["eval_loops"][str(2 * d["model"]["loops"])]["accuracy"]),
    "accuracy at R": _accuracy_at_trained_depth,
    "best shallower loop accuracy": _best_shallower_loop,
    # table 12: each token's depth chosen causally, as decoding chooses it
    "causal perplexity": _results(lambda d: causal(d, "perplexity")),
    "causal accuracy": _results(lambda d: causal(d, "accuracy")),
    "training tokens/s": _results(lambda d: d["throughput"]["tokens_per_s"]),
    # table 12: the routed-decoding benchmark's figures, merged into the run's data by build_routing
    "decode tokens/s": _results(lambda d: d["decode"]["tokens_per_s"]),
    "KV bytes": _results(lambda d: d["decode"]["kv_bytes"]),
    # table 13: the same benchmark at batch 8 (routed_decode --batch 1 8)
    "decode tokens/s @8": _results(lambda d: d["decode"]["batches"]["8"]["tokens_per_s"]),
    # recorded by LM runs (train.py): the bar of the LM_LEARNED precondition
    "unigram perplexity": _results(lambda d: d["unigram_perplexity"]),
}


def run_facets(cell: "Cell", run: Run) -> dict[str, Any]:
    m = run.data.get("model") or {}
    N, R = m.get("layers"), m.get("loops")
    if (N is None or R is None) and cell.combo.get("loop_depth"):
        N, R = (int(x) for x in cell.combo["loop_depth"].split("x"))
    exp = base_experiment(cell.sweep.experiment)
    return {
        "experiment": exp,
        "protocol": sweep_protocol(cell.sweep),
        "arm": cell.combo.get("arm"),
        "injection": cell.combo.get("loop_depth.injection"),
        "size": cell.combo.get("backbone"),
        "backbone": m.get("backbone"),
        "state": m.get("state_mode"),
        "N": N, "R": R, "NR": N * R if N and R else None,
        # table 13: the loop schedule and, under the parallel one, which keys/values loops >= 2 read
        "schedule": m.get("loop_schedule", "sequential"),
        "kv": m.get("loop_kv"),
    }


def units_for(cells: list["Cell"], mode_of=None) -> list[Unit]:
    units = []
    for c in cells:
        for r in c.ok:
            f = run_facets(c, r)
            if mode_of is not None:
                f["mode"] = mode_of(c)
            units.append(Unit(f, str(r.seed), r.data, examples_of(r), r.zeroshot()))
    return units
