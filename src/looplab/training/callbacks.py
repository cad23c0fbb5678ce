"""Callbacks and plugins: atomic checkpoints and the throughput record that goes into results.json."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the same folder, fsync, then rename: a killed run never leaves a
    half-written last.ckpt behind (os.replace is atomic on POSIX)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)


class ThroughputRecord(L.Callback):
    """Training tokens/s over the whole fit, excluding validation time (for results.json).

    Lightning's ThroughputMonitor logs the running figures; this keeps the run's total.
    """

    def __init__(self) -> None:
        self.tokens = 0
        self.train_time = 0.0
        self._t0: float | None = None
        self._val_t0: float | None = None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.tokens += int(batch["input_ids"].numel()) * trainer.world_size

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._t0 is not None:
            self.train_time += time.perf_counter() - self._t0
            self._t0 = None

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":
            self._t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._t0 is not None:
            self.train_time += time.perf_counter() - self._t0
            self._t0 = None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.train_time if self.train_time > 0 else None
