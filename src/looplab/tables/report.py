"""Aggregate a table from its runs' results.json files (never imports the model or trainer).

For every sweep of the table the expected jobs come from the sweep grid (spec.py);
each expected configuration becomes one row, seeds averaged (mean ± sample std, n)
when several ran. Configurations without any results.json are listed as missing,
failed runs as failed (with their error), runs outside the grid as extra rows:
nothing is silently dropped.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looplab.tables.spec import SCALES, Sweep, TableSpec, get

DEFAULT_OUT_ROOT = Path("outputs/tables")
DEFAULT_TABLE_DIR = Path("experiments/tables")
DEFAULT_DECODE_JSON = Path("bench/decode.json")


# ----------------------------------------------------------------------------- runs
@dataclass
class Run:
    path: Path  # the run folder
    data: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.data.get("status") == "ok"

    @property
    def swept(self) -> dict[str, str]:
        return parse_overrides(self.data.get("overrides") or [])

    @property
    def seed(self):
        return self.data.get("seed", self.swept.get("seed"))

    def zeroshot(self) -> dict[str, Any] | None:
        p = self.path / "zeroshot.json"
        try:
            return json.loads(p.read_text()) if p.exists() else None
        except (OSError, json.JSONDecodeError):
            return None


def parse_overrides(overrides: list[str]) -> dict[str, str]:
    """Hydra task overrides ['+arm=looped', 'loop_depth=1x4'] → {'arm': 'looped', 'loop_depth': '1x4'}."""
    out = {}
    for o in overrides:
        if "=" in o:
            k, v = o.split("=", 1)
            out[k.lstrip("+~")] = v
    return out


def load_runs(folder: Path) -> list[Run]:
    """Every results.json below `folder` (a sweep folder); unreadable files become failed runs."""
    runs = []
    for p in sorted(Path(folder).rglob("results.json")):
        if ".submitit" in p.parts:
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            data = {"status": "failed", "error": f"unreadable results.json: {e}", "overrides": []}
        runs.append(Run(p.parent, data))
    return runs


# ----------------------------------------------------------------------------- stats
@dataclass
class Stat:
    """mean ± sample std over seeds (std None with one value)."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    def fmt(self, digits: int = 3) -> str:
        if not self.values:
            return "n/a"
        s = f"{self.mean:.{digits}f}"
        return s + (f" ± {self.std:.{digits}f}" if self.std is not None else "")


def stat(runs: list[Run], get_value) -> Stat:
    vals = []
    for r in runs:
        try:
            v = get_value(r.data)
        except (KeyError, TypeError, IndexError, AttributeError):
            v = None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            vals.append(float(v))
    return Stat(vals)


# ----------------------------------------------------------------------------- table
@dataclass
class Table:
    spec: TableSpec
    scale: str
    columns: list[str]
    rows: list[dict[str, Any]]  # values: str, int, float or Stat
    missing: list[str] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def stem(self) -> str:
        return f"table{self.spec.number}" + ("" if self.scale == "tiny" else f"-{self.scale}")

    def markdown(self) -> str:
        out = [f"# Table {self.spec.number} — {self.spec.title} ({self.scale} scale)", ""]
        if self.spec.notes.get(self.scale):
            out += [f"Setting: {self.spec.notes[self.scale]}.", ""]
        out += [f"_{n}_" for n in self.notes] + ([""] if self.notes else [])
        if self.rows:
            out.append("| " + " | ".join(self.columns) + " |")
            out.append("|" + "|".join("---" for _ in self.columns) + "|")
            for row in self.rows:
                out.append("| " + " | ".join(_cell(row.get(c)) for c in self.columns) + " |")
        else:
            out.append("(no completed runs)")
        if self.summary:
            out += ["", "Summary:", ""] + [f"- {k}: {_cell(v)}" for k, v in self.summary.items()]
        out += ["", f"Missing runs ({len(self.missing)}): " + ("none" if not self.missing else "")]
        out += [f"- {m}" for m in self.missing]
        out += ["", f"Failed runs ({len(self.failed)}): " + ("none" if not self.failed else "")]
        out += [f"- {f['config']} — {f['error']} ({f['path']})" for f in self.failed]
        return "\n".join(out) + "\n"

    def csv(self) -> str:
        cols: list[str] = []
        for c in self.columns:
            cols.append(c)
            if any(isinstance(r.get(c), Stat) for r in self.rows):
                cols += [f"{c} std", f"{c} n"]
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(cols)
        for r in self.rows:
            line = []
            for c in self.columns:
                v = r.get(c)
                if isinstance(v, Stat):
                    line += [_num(v.mean), _num(v.std), v.n]
                else:
                    line.append("" if v is None else v)
                    if f"{c} std" in cols:
                        line += ["", ""]
            w.writerow(line)
        return buf.getvalue()

    def value(self, row: dict[str, Any], column: str) -> float | None:
        v = row.get(column)
        return v.mean if isinstance(v, Stat) else v if isinstance(v, (int, float)) else None


def _num(v):
    return "" if v is None else f"{v:.6g}"


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, Stat):
        return v.fmt()
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v)


# ----------------------------------------------------------------------------- grouping
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


def _nxr(cell: Cell) -> str:
    for r in cell.ok:
        m = r.data.get("model") or {}
        if m.get("layers"):
            return f"{m['layers']}⊗{m['loops']}"
    ld = cell.combo.get("loop_depth")
    return ld.replace("x", "⊗") if ld else "?"


def _first(cell: Cell, *path, default=None):
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


def _base_row(cell: Cell) -> dict[str, Any]:
    row = {
        "experiment": cell.sweep.folder + ("" if cell.expected else " (extra)"),
        "backbone": _first(cell, "model", "backbone", default="?"),
        "N⊗R": _nxr(cell),
        "state": _first(cell, "model", "state_mode", default=cell.combo.get("arm", "?")),
        "seeds": len(cell.ok),
        "params": _first(cell, "params", "total"),
        "FLOPs/token": _first(cell, "flops_per_token", "forward"),
        "steps": _first(cell, "global_step"),
    }
    if cell.combo.get("arm"):
        row["arm"] = cell.combo["arm"]
    return row


def _bookkeeping(cells: list[Cell], table: Table) -> None:
    for c in cells:
        if not c.ok and not c.failed:
            table.missing.append(c.label())
        for r in c.failed:
            table.failed.append({"config": c.label(), "error": str(r.data.get("error", "unknown error")).splitlines()[0][:300],
                                 "path": str(r.path)})


def _per_depth(cell: Cell) -> str:
    R = _first(cell, "model", "loops") or 0
    parts = []
    for k in range(R):
        s = stat(cell.ok, lambda d, k=k: d["per_depth"]["acc"][k])
        parts.append("—" if s.mean is None else f"{s.mean:.2f}")
    return " / ".join(parts) if parts else "—"


# ----------------------------------------------------------------------------- builders per kind
def _build_runs(spec: TableSpec, scale: str, out_root: Path) -> tuple[Table, list[Cell]]:
    table = Table(spec, scale, [], [])
    cells: list[Cell] = []
    for sw in spec.sweeps_for(scale):
        cells += cells_for(sw, Path(out_root) / f"table{spec.number}" / scale / sw.folder)
    _bookkeeping(cells, table)
    return table, cells


def build_lm(spec: TableSpec, scale: str, out_root: Path) -> Table:
    table, cells = _build_runs(spec, scale, out_root)
    zs_any = False
    for c in cells:
        if not c.ok:
            continue
        row = _base_row(c)
        row["perplexity"] = stat(c.ok, lambda d: d["perplexity"])
        row["loss"] = stat(c.ok, lambda d: d["loss"])
        zs = [z for z in (r.zeroshot() for r in c.ok) if z and z.get("average_acc") is not None]
        row["zero-shot avg"] = Stat([float(z["average_acc"]) for z in zs]) if zs else "n/a"
        zs_any |= bool(zs)
        row["state overhead"] = _first(c, "state_branch_overhead")
        table.rows.append(row)
    base = ["experiment", "backbone", "N⊗R", "state", "seeds", "perplexity", "loss", "zero-shot avg", "params",
            "state overhead", "FLOPs/token", "steps"]
    table.columns = ["experiment", "arm"] + base[1:] if any("arm" in r for r in table.rows) else base
    if not zs_any:
        table.notes.append("zero-shot avg: n/a — " + ("not evaluated at tiny scale (see setting)" if scale == "tiny"
                           else "run `python -m looplab.tables zeroshot N --scale paper` to fill it"))
    return table


def build_task(spec: TableSpec, scale: str, out_root: Path) -> Table:
    table, cells = _build_runs(spec, scale, out_root)
    for c in cells:
        if not c.ok:
            continue
        row = _base_row(c)
        row["accuracy"] = stat(c.ok, lambda d: d["accuracy"])
        row["acc per loop depth (1..R)"] = _per_depth(c)
        table.rows.append(row)
    table.columns = ["experiment", "backbone", "N⊗R", "seeds", "accuracy", "acc per loop depth (1..R)", "params",
                     "FLOPs/token", "steps"]
    table.notes.append("accuracy: exact match of the answer token on the held-out test split; "
                       "acc per loop depth: the same model read out after loop 1, 2, … R (shared final norm + head)")
    return table


def build_depth(spec: TableSpec, scale: str, out_root: Path) -> Table:
    table = build_lm(spec, scale, out_root)
    by_r: dict[tuple[str, str], dict[str, float | None]] = {}
    for row in table.rows:
        by_r.setdefault((row["N⊗R"], row["experiment"]), {})[row.get("arm") or row["state"]] = table.value(row, "perplexity")
    for row in table.rows:
        arms = by_r[(row["N⊗R"], row["experiment"])]
        looped = arms.get("looped", arms.get("vanilla"))
        mine = table.value(row, "perplexity")
        row["gap vs looped"] = (looped - mine) if (row.get("arm", row["state"]) not in ("looped", "vanilla")
                                                   and looped is not None and mine is not None) else None
    table.columns.insert(table.columns.index("perplexity") + 1, "gap vs looped")
    table.notes.append("gap vs looped: perplexity of Vanilla Looped minus StateLoop's at the same N⊗R (positive = StateLoop better)")
    return table


def build_reset(spec: TableSpec, scale: str, out_root: Path) -> Table:
    table = build_lm(spec, scale, out_root)
    carry = {row["N⊗R"]: table.value(row, "perplexity") for row in table.rows if row.get("arm", row["state"]) == "stateloop"}
    for row in table.rows:
        c, mine = carry.get(row["N⊗R"]), table.value(row, "perplexity")
        row["Δ vs carry"] = None if (c is None or mine is None) else mine - c
    table.columns.insert(table.columns.index("perplexity") + 1, "Δ vs carry")
    table.notes.append("Δ vs carry: perplexity of this arm minus the carrying StateLoop's (positive = resetting the state hurts)")
    return table


def _exit_rows(cell: Cell, mode: str) -> list[dict[str, Any]]:
    base = {"experiment": cell.sweep.experiment, "backbone": _first(cell, "model", "backbone", default="?"),
            "N⊗R": _nxr(cell), "state": _first(cell, "model", "state_mode", default="?"), "mode": mode,
            "seeds": len(cell.ok)}
    rows = []
    if mode == "fixed loops":
        R = _first(cell, "model", "loops") or 0
        for k in range(R):
            rows.append({**base, "setting": f"exit at step {k + 1}",
                         "accuracy": stat(cell.ok, lambda d, k=k: d["per_depth"]["acc"][k]),
                         "mean exit step": float(k + 1),
                         "loss": stat(cell.ok, lambda d, k=k: d["per_depth"]["loss"][k])})
        return rows
    qs = sorted({q for r in cell.ok for q in (r.data.get("exit") or {})}, key=float)
    for q in qs:
        rows.append({**base, "setting": f"q = {q}",
                     "accuracy": stat(cell.ok, lambda d, q=q: d["exit"][q]["acc"]),
                     "mean exit step": stat(cell.ok, lambda d, q=q: d["exit"][q]["mean_step"]),
                     "loss": stat(cell.ok, lambda d, q=q: d["exit"][q]["loss"])})
    return rows


def build_exit(spec: TableSpec, scale: str, out_root: Path) -> Table:
    table, cells = _build_runs(spec, scale, out_root)
    for c in cells:
        if not c.ok:
            continue
        if c.sweep.init_from is not None:
            mode = "stage 2"
        else:
            gate = c.combo.get("exit_gate") or _first(c, "model", "exit_gate", default="?")
            mode = "fixed loops" if gate == "none" else "stage 1"
        table.rows += _exit_rows(c, mode)
    order = {"fixed loops": 0, "stage 1": 1, "stage 2": 2}
    table.rows.sort(key=lambda r: (r["experiment"], order.get(r["mode"], 3)))
    table.columns = ["experiment", "backbone", "N⊗R", "state", "mode", "setting", "seeds", "accuracy", "mean exit step", "loss"]
    table.notes.append("fixed loops: the exit_gate=none model read out at depth k; stage 1: joint gate training (Ouro); "
                       "stage 2: gate only, backbone frozen and loaded from the fixed-loop run; q: exit at the first depth "
                       "whose cumulative exit probability reaches q (q > 1 never exits early)")
    return table


def build_decode(spec: TableSpec, scale: str, out_root: Path, decode_json: Path = DEFAULT_DECODE_JSON) -> Table:
    table = Table(spec, scale, [], [])
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
    sc = data.get("skip_compute") or {}
    for key in ("speedup_vs_all_loops", "top1_agreement_vs_all_loops", "mean_exit_step"):
        if sc.get(key) is not None:
            table.summary[f"skip_compute.{key}"] = sc[key]
    table.notes.append(f"from {path}: dims {data.get('dims')}, {data.get('threads')} thread(s), {data.get('dtype')}, "
                       "medians after warm-up, models timed round-robin")
    return table


BUILDERS = {"lm": build_lm, "task": build_task, "depth": build_depth, "reset": build_reset, "exit": build_exit,
            "decode": build_decode}


def build(number: int, scale: str = "tiny", out_root: Path = DEFAULT_OUT_ROOT, **kwargs) -> Table:
    """Table `number` at `scale` from the results.json files under out_root/tableN/<scale>/."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is unknown; choose one of {SCALES}")
    spec = get(number)
    return BUILDERS[spec.kind](spec, scale, Path(out_root), **kwargs)


def write(table: Table, table_dir: Path = DEFAULT_TABLE_DIR, plot: bool = True) -> list[Path]:
    """experiments/tables/tableN.md and .csv (tableN-paper.* at paper scale), plus the PNG where the table has a plot."""
    table_dir = Path(table_dir)
    table_dir.mkdir(parents=True, exist_ok=True)
    md, cs = table_dir / f"{table.stem}.md", table_dir / f"{table.stem}.csv"
    md.write_text(table.markdown())
    cs.write_text(table.csv())
    paths = [md, cs]
    if plot and table.rows:
        from looplab.tables.plots import plot_table

        png = plot_table(table, table_dir / f"{table.stem}.png")
        if png:
            paths.append(png)
    return paths
