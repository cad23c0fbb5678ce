"""The paper tables: which sweeps feed each one, at tiny (CPU) and paper scale, and the findings each checks.

A table is a list of `Sweep`s (one `python -m looplab.train -m +experiment=X ...`
each) plus the way its rows are built (`kind`: builders/). The grid of a sweep is the
product of the experiment file's own `hydra.sweeper.params` and the sweep
parameters the table adds here, so the report knows which runs *should* exist and
can list the missing ones. Nothing here imports the model or the trainer.

The source of each table is its yaml spec, tables/specs/tableN.yaml: its sweeps per scale, metric, notes and
findings (tables/paper_specs.py reads and writes them). The code parts, one concept each: tables/sweeps.py (a sweep,
its grid, the default seeds), tables/catalog.py (`TableSpec` and the per-table constants), tables/claims.py
(`Finding`, the named preconditions a spec's `require` names, the δ constants). This module loads the fourteen
specs into `TABLES` and keeps every name the runner, the builders and the tests import from it.

A researcher's table in the same format (a yaml file with `number` above 14, `sweeps`, `findings`: docs/extending.md
"A table in the paper tables' format") joins `TABLES` through `load_file`, so that `tables run|report|zeroshot
path/to/table.yaml` runs it with the same runner, builders, verdicts and sequential seeds as the fourteen.
"""

from __future__ import annotations

from pathlib import Path

import looplab.tables.retrofit as retrofit  # noqa: F401  (part of this module's surface)
from looplab.tables.catalog import (  # noqa: F401
    DEFAULT_DECODE_JSON, DEFAULT_EXITS_JSON, DEFAULT_PLT_JSON, DEFAULT_ROUTING_JSON, DEFAULT_SERVING_JSON,
    DEFAULT_SPECULATION_JSON, MOR_STEPS_TINY, PLT_KV, PLT_WINDOW_TINY, RETROFIT_FOLDER, SERVING_QUALITY_BOUND,
    SERVING_TARGET, SERVING_TARGET_IDEAL, SKIP_TRAIN_PROB, TABLE8_STEPS_TINY, TableSpec,
)
from looplab.tables.claims import (  # noqa: F401
    FINDINGS, GATE_BODY_LEARNED, LM_LEARNED, MANO_TAUGHT, MOR_PARITY, PHOP_LEARNED_AT_R, PHOP_TAUGHT, PLT_DECODE_BOUND,
    PLT_DECODE_TOKENS, PLT_PARITY, Filter, Finding, Precondition, finding,
)
from looplab.tables.paper_specs import NUMBERS, load, load_all
from looplab.tables.sweeps import (  # noqa: F401
    CONF, DEFAULT_OUT_ROOT, DEFAULT_SEEDS, ROOT, SCALES, TINY_SEEDS_PER_TABLE, ZEROSHOT_TASKS, Sweep, default_seeds, sweep,
)

TABLES: dict[int, TableSpec] = load_all()  # specs/table1.yaml … table14.yaml
FINDINGS.update((n, t.findings) for n, t in TABLES.items() if t.findings)  # claims.FINDINGS: the same findings by table


def get(number: int) -> TableSpec:
    try:
        return TABLES[int(number)]
    except (KeyError, ValueError):
        raise ValueError(f"table {number!r} does not exist; choose one of {sorted(TABLES)}") from None


SOURCES: dict[int, Path] = {}  # a researcher's table number -> its yaml file (load_file), which subprocesses are given


def load_file(path: str | Path) -> TableSpec:
    """A table of one's own in the paper tables' format, checked as they are (paper_specs.load), joined to `TABLES`
    under its number (one above 14) so that every command that takes a table number takes it."""
    path = Path(path).resolve()
    table = load(path)
    if table.number in NUMBERS:
        raise ValueError(f"{path}: number={table.number} is paper table {table.number}; give your table a number "
                         f"above {max(NUMBERS)} (e.g. 101): its runs go to <out-root>/table<number>/")
    if table.number in SOURCES and SOURCES[table.number] != path:
        raise ValueError(f"{path}: number={table.number} is already {SOURCES[table.number]}'s; give each table its own")
    TABLES[table.number] = table
    SOURCES[table.number] = path
    if table.findings:
        FINDINGS[table.number] = table.findings
    return table


def is_table_file(path: str | Path) -> bool:
    """Whether a spec file is in the paper tables' format (it has `sweeps`), not the short one of tables/own.py."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False  # the short form's loader reports it, by name
    return isinstance(raw, dict) and "sweeps" in raw


def argument(number: int) -> str:
    """How a subprocess names table `number`: its number, or its file for a table of one's own."""
    return str(SOURCES.get(number, number))
