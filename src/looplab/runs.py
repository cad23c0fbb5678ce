"""Finished runs as the tables and benchmarks read them: one results.json per run folder (no torch).

Low in the house like `stats.py`: `tables/` and `bench/` both read sweep folders through this module
and never through each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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

    @property
    def checkpoint(self) -> Path | None:
        """The run's last.ckpt (a file, or a sharded FSDP2 folder), None when it has none."""
        p = self.path / "checkpoints" / "last.ckpt"
        return p if p.exists() else None

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


def load_run(folder: Path) -> Run | None:
    """The run in `folder` from its results.json (an unreadable one is a failed run); None when it has none yet."""
    p = Path(folder) / "results.json"
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        data = {"status": "failed", "error": f"unreadable results.json: {e}", "overrides": []}
    return Run(p.parent, data)


def load_runs(folder: Path) -> list[Run]:
    """Every results.json below `folder` (a sweep folder); unreadable files become failed runs."""
    return [load_run(p.parent) for p in sorted(Path(folder).rglob("results.json")) if ".submitit" not in p.parts]


def finished_checkpoints(folders) -> list[Path]:
    """The last.ckpt of every finished run (status ok) under the sweep folders `folders`."""
    return [r.checkpoint for d in folders for r in load_runs(d) if r.ok and r.checkpoint is not None]
