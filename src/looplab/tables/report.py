"""Aggregate a table from its runs' results.json files (never imports the model or trainer, nor loads a checkpoint).

For every sweep of the table the expected jobs come from the sweep grid (spec.py);
each expected configuration becomes one row, its seeds pooled: mean with a 95% t-interval
over seeds (`m ± h`), accuracies also with a 95% Wilson interval over one run's test
examples. Configurations (and seeds) without a results.json are listed as missing,
failed runs as failed (with their error), runs outside the grid as extra rows: nothing
is silently dropped. The report ends with the paper's findings (spec.FINDINGS), each a
paired difference across seeds with its interval and a verdict computed from it;
`write` also regenerates the verdict summary `README.md` next to the tables.

The parts: load.py (runs, cells and the metrics a finding reads), findings.py (verdicts, Holm),
render.py (Markdown, CSV, findings.json, the summary), builders/ (each kind's rows), plots.py (its figure).
This module keeps the entry points and the names tests and scripts import from it.
"""

from __future__ import annotations

import json
from pathlib import Path

from looplab.runs import Run, load_runs, parse_overrides  # noqa: F401  (part of the report's surface)
from looplab.stats import (  # noqa: F401  (part of the report's surface)
    Stat, t_interval, t_quantile, wilson_interval, z_quantile,
)
from looplab.tables.builders import BUILDERS
from looplab.tables.builders.measured import build_decode, build_exitgrid, build_speculation  # noqa: F401
from looplab.tables.builders.trained import (  # noqa: F401
    build_depth, build_exit, build_extrapolation, build_lm, build_reset, build_routing, build_task,
)
from looplab.tables.findings import Verdict, comparisons, decide, evaluate_findings  # noqa: F401
from looplab.tables.load import Cell, Unit, held_out_size, run_facets, units_for  # noqa: F401
from looplab.tables.load import sweep_protocol as _protocol  # noqa: F401  (tests read a sweep's protocol here)
from looplab.tables.plots import plot_table
from looplab.tables.render import DEFAULT_TABLE_DIR, Table, write_summary
from looplab.tables.spec import DEFAULT_DECODE_JSON, DEFAULT_OUT_ROOT, SCALES, default_seeds, get  # noqa: F401


def build(number: int, scale: str = "tiny", out_root: Path = DEFAULT_OUT_ROOT, seeds: list[int] | None = None, *,
          sequential: bool | None = None, state=None, **kwargs) -> Table:
    """Table `number` at `scale` from the results.json files under out_root/tableN/<scale>/.

    seeds: the seeds every configuration should have (default: spec.DEFAULT_SEEDS of the scale); the
    seeds missing from a configuration are listed as missing runs.
    sequential: judge the findings as the sequential build recorded in out_root/tableN/<scale>/sequential.json
    did (tables/sequential.py: its rounds, design and stop); None (default): when that file exists and no seeds
    are given; False: never (fixed seeds). state: that build's state, when the caller holds it already.
    """
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is unknown; choose one of {SCALES}")
    spec = get(number)
    if state is None and sequential is not False and (sequential or not seeds):
        from looplab.tables.sequential_state import SequentialState, state_path

        state = SequentialState.load(state_path(out_root, number, scale))
        if sequential and state is None:
            raise FileNotFoundError(f"{state_path(out_root, number, scale)}: no sequential build of table {number} here "
                                    f"(`python -m looplab.tables run {number} --seeds auto` makes one)")
    seeds = state.all_seeds() if state is not None else list(seeds) if seeds else default_seeds(scale, number)
    table = BUILDERS[spec.kind](spec, scale, Path(out_root), seeds=seeds, **kwargs)
    if state is not None:
        from looplab.tables.sequential_state import judge_sequential

        table.verdicts = judge_sequential(spec, table.units, scale, state)
        table.sequential = state.summary()
    return table


def write(table: Table, table_dir: Path = DEFAULT_TABLE_DIR, plot: bool = True) -> list[Path]:
    """experiments/tables/tableN.md, .csv and .findings.json (tableN-paper.* at paper scale), the PNG where
    the table has a plot, and the verdict summary README.md of the folder (regenerated from every
    tableN*.findings.json there)."""
    table_dir = Path(table_dir)
    table_dir.mkdir(parents=True, exist_ok=True)
    md, cs, fj = table_dir / f"{table.stem}.md", table_dir / f"{table.stem}.csv", table_dir / f"{table.stem}.findings.json"
    md.write_text(table.markdown())
    cs.write_text(table.csv())
    fj.write_text(json.dumps(table.findings_json(), indent=2) + "\n")
    paths = [md, cs]
    if plot and table.rows:
        png = plot_table(table, table_dir / f"{table.stem}.png")
        if png:
            paths.append(png)
    paths += [fj, write_summary(table_dir)]
    return paths
