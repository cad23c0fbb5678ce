"""What every table built from training runs shares: its cells and bookkeeping (missing and failed runs, the
held-out evaluation size) and the first columns of a row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from looplab.stats import Stat
from looplab.tables.load import Cell, cells_for, first_value, held_out_size, nxr
from looplab.tables.render import Table
from looplab.tables.spec import TableSpec


def runs_table(spec: TableSpec, scale: str, out_root: Path, seeds: list[int] | None) -> tuple[Table, list[Cell]]:
    table = Table(spec, scale, [], [], seeds=seeds)
    cells: list[Cell] = []
    for sw in spec.sweeps_for(scale):
        cells += cells_for(sw, Path(out_root) / f"table{spec.number}" / scale / sw.folder)
    _bookkeeping(cells, table)
    table.sizes = _sizes(cells)
    return table, cells


def _sizes(cells: list["Cell"]) -> str:
    found: dict[str, set[int]] = {}
    unknown = False
    for c in cells:
        for r in c.ok:
            n, unit = held_out_size(r.data)
            if n is None:
                unknown = True
            else:
                found.setdefault(unit, set()).add(n)
    parts = []
    for unit, ns in sorted(found.items()):
        lo, hi = min(ns), max(ns)
        parts.append(f"{lo:,} {unit}" if lo == hi else f"{lo:,}–{hi:,} {unit}")
    if unknown:
        parts.append("unknown for runs whose results.json records no dataset config")
    what = {"examples": " (test examples; accuracy is scored at each one's answer)",
            "tokens": " (held-out target tokens)"}
    return "; ".join(p + what.get(p.split()[-1], "") for p in parts)


def _bookkeeping(cells: list[Cell], table: Table) -> None:
    for c in cells:
        if c.expected and table.seeds:
            have = {str(r.seed) for r in c.ok} | {str(r.seed) for r in c.failed}
            table.missing += [f"{c.label()} seed={s}" for s in table.seeds if str(s) not in have]
        elif not c.ok and not c.failed:
            table.missing.append(c.label())
        for r in c.failed:
            seed = f" seed={r.seed}" if r.seed is not None else ""
            table.failed.append({"config": c.label() + seed,
                                 "error": str(r.data.get("error", "unknown error")).splitlines()[0][:300],
                                 "path": str(r.path)})


def base_row(cell: Cell) -> dict[str, Any]:
    row = {
        "experiment": cell.sweep.folder + ("" if cell.expected else " (extra)"),
        "backbone": first_value(cell, "model", "backbone", default="?"),
        "N⊗R": nxr(cell),
        "state": first_value(cell, "model", "state_mode", default=cell.combo.get("arm", "?")),
        "seeds": len(cell.ok),
        "params": first_value(cell, "params", "total"),
        "FLOPs/token": first_value(cell, "flops_per_token", "forward"),
        "steps": first_value(cell, "global_step"),
    }
    if cell.combo.get("arm"):
        row["arm"] = cell.combo["arm"]
    if cell.combo.get("backbone"):
        row["size"] = cell.combo["backbone"]
    return row


def wilson_cell(s: Stat):
    return s.wilson if isinstance(s, Stat) else None
