"""Callbacks that the distributed tests pass to `python -m looplab.train` (PYTHONPATH=tests)."""

from __future__ import annotations

import os

import lightning as L


class ExitAtStep(L.Callback):
    """A hard kill on every rank once `step` optimizer steps are done: no exception handling, no
    teardown, no final checkpoint (os._exit), as when a job is killed or its node dies."""

    def __init__(self, step: int, code: int = 17):
        self.step, self.code = step, code

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            os._exit(self.code)
