"""Paper tables as sweeps: spec (which experiments), runner (the multiruns), report (results.json → md/csv/png).

`python -m looplab.tables run N --scale tiny|paper` / `report N`; see experiments/README.md.
The report side reads results.json files only; it never imports the model or the trainer.
"""

from looplab.tables.report import Stat, Table, build, load_runs, write
from looplab.tables.spec import SCALES, TABLES, Sweep, TableSpec, get

__all__ = ["SCALES", "TABLES", "Stat", "Sweep", "Table", "TableSpec", "build", "get", "load_runs", "write"]
