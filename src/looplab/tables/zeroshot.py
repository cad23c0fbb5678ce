"""Zero-shot evaluation of a table's trained checkpoints (table 1).

Writes `zeroshot.json` (run_zeroshot's result plus per-task intervals, see `add_intervals`)
next to each ok run's results.json; the report reads it from there, so the table itself never
imports lm-eval or the model. Its 'items' (looplab.eval.item_outcomes: each document's 0/1 acc per task)
let the findings pair the arms' item noise (looplab.stats.paired_item_interval, docs/tables.md#method).

Default suite per scale: the paper's 8 hub tasks at paper scale; at tiny scale the offline
`looplab_tiny` suite (looplab.eval.tiny_suite: 900 items on the held-out plays of lm_tiny), on
which a 300-step Shakespeare model scores above chance where it is at chance on the hub suite.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from looplab.runs import load_runs
from looplab.tables.spec import get

TINY_SUITE = ["looplab_tiny"]  # lm-eval tag of the three looplab_tiny_* tasks
Z95 = 1.959963984540054


def default_tasks(scale: str) -> list[str]:
    if scale == "tiny":
        return list(TINY_SUITE)
    from looplab.eval import DEFAULT_TASKS

    return list(DEFAULT_TASKS)


def _local_only(tasks: list[str]) -> bool:
    """True when every task is one of looplab's shipped tasks (or the looplab_tiny tag): then lm-eval's
    ~10k built-in task configs need not be indexed."""
    from looplab.eval import LOCAL_TASKS_DIR

    local = {p.stem for p in LOCAL_TASKS_DIR.rglob("*.yaml")} | set(TINY_SUITE)
    return all(t in local for t in tasks)


def wilson(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion p observed over n items."""
    if n <= 0:
        return (0.0, 1.0)
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, centre - half), min(1.0, centre + half))


def add_intervals(res: dict[str, Any]) -> dict[str, Any]:
    """Adds to run_zeroshot's result (no field renamed), per task t with an 'acc':
        n_items[t]   documents evaluated        chance[t]  mean 1/#choices (looplab_tiny tasks; else None)
        stderr[t]    sqrt(acc(1-acc)/n)          ci95[t]    Wilson 95% interval over items
    and for the macro average over tasks: average_acc_stderr = sqrt(Σ stderr²)/k, average_acc_ci95
    (normal), average_chance; interval_method says so."""
    from looplab.eval.tiny_suite import chance

    n_samples = res.get("n_samples") or {}
    out = dict(res)
    out["n_items"], out["stderr"], out["ci95"], out["chance"] = {}, {}, {}, {}
    for task, r in res.get("results", {}).items():
        if "acc" not in r:
            continue
        n = n_samples.get(task)
        n = int(n) if n is not None else None
        p = float(r["acc"])
        out["n_items"][task] = n
        out["stderr"][task] = math.sqrt(p * (1 - p) / n) if n else None
        out["ci95"][task] = list(wilson(p, n)) if n else None
        out["chance"][task] = chance(task)
    ses = list(out["stderr"].values())
    k = len(ses)
    avg = res.get("average_acc")
    if avg is not None and k and all(s is not None for s in ses):
        se = math.sqrt(sum(s * s for s in ses)) / k
        out["average_acc_stderr"] = se
        out["average_acc_ci95"] = [avg - Z95 * se, avg + Z95 * se]
    else:
        out["average_acc_stderr"] = out["average_acc_ci95"] = None
    chances = list(out["chance"].values())
    out["average_chance"] = sum(chances) / len(chances) if chances and all(c is not None for c in chances) else None
    out["interval_method"] = ("per task: Wilson score 95% interval over items; average (mean over tasks): "
                              "normal 95% interval, se = sqrt(sum of per-task se^2) / number of tasks")
    return out


def evaluate_table(number: int, scale: str, out_root: Path, tasks: list[str] | None = None, limit: float | None = None,
                   batch_size: int = 8, device: str | None = None, overwrite: bool = False) -> list[Path]:
    from looplab.eval import run_zeroshot

    spec = get(number)
    tasks = list(tasks) if tasks else default_tasks(scale)
    local = _local_only(tasks)
    written = []
    for sw in spec.sweeps_for(scale):
        for run in load_runs(Path(out_root) / f"table{number}" / scale / sw.folder):
            out = run.path / "zeroshot.json"
            ckpt = run.data.get("checkpoint")
            if not run.ok or not ckpt or not Path(ckpt).exists() or (out.exists() and not overwrite):
                continue
            print(f"[table{number}] zero-shot {','.join(tasks)} on {ckpt}", flush=True)
            try:
                res = run_zeroshot(ckpt, tasks=tasks, limit=limit, batch_size=batch_size, device=device,
                                   include_defaults=not local)
            except Exception as e:  # one bad checkpoint must not stop the others
                print(f"[table{number}] zero-shot failed on {ckpt}: {type(e).__name__}: {e}", flush=True)
                continue
            out.write_text(json.dumps(add_intervals(res), indent=2, default=str))
            written.append(out)
    return written
