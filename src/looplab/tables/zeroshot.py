"""Zero-shot evaluation of a table's trained checkpoints (table 1 at paper scale).

Writes `zeroshot.json` (run_zeroshot's result) next to each ok run's results.json;
the report reads it from there, so the table itself never imports lm-eval or the model.
"""

from __future__ import annotations

import json
from pathlib import Path

from looplab.tables.report import load_runs
from looplab.tables.spec import get


def evaluate_table(number: int, scale: str, out_root: Path, tasks: list[str] | None = None, limit: float | None = None,
                   batch_size: int = 8, device: str | None = None, overwrite: bool = False) -> list[Path]:
    from looplab.eval import run_zeroshot

    spec = get(number)
    written = []
    for sw in spec.sweeps_for(scale):
        for run in load_runs(Path(out_root) / f"table{number}" / scale / sw.folder):
            out = run.path / "zeroshot.json"
            ckpt = run.data.get("checkpoint")
            if not run.ok or not ckpt or not Path(ckpt).exists() or (out.exists() and not overwrite):
                continue
            print(f"[table{number}] zero-shot {tasks or 'default 8-task suite'} on {ckpt}", flush=True)
            try:
                res = run_zeroshot(ckpt, tasks=tasks, limit=limit, batch_size=batch_size, device=device)
            except Exception as e:  # one bad checkpoint must not stop the others
                print(f"[table{number}] zero-shot failed on {ckpt}: {type(e).__name__}: {e}", flush=True)
                continue
            out.write_text(json.dumps(res, indent=2, default=str))
            written.append(out)
    return written
