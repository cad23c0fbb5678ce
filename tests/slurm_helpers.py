"""Callbacks that tests/test_slurm.py passes to `python -m looplab.train` jobs (PYTHONPATH=tests)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L


class HoldAtStep(L.Callback):
    """In a job's first attempt only (SLURM_RESTART_COUNT unset or 0): once `step` optimizer steps are done,
    rank 0 touches `marker` and every rank waits (at most `timeout` s) for the file `release` — so that a
    test preempts training at a known step. A signal that arrives meanwhile is handled as usual."""

    def __init__(self, step: int, marker: str, release: str, timeout: float = 300.0):
        self.step, self.marker, self.release, self.timeout = step, Path(marker), Path(release), timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
            return
        if trainer.is_global_zero:
            self.marker.write_text(str(trainer.global_step))
        deadline = time.monotonic() + self.timeout
        while not self.release.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
