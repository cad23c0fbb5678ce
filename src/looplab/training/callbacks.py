"""Callbacks and plugins: atomic checkpoints, the throughput record that goes into results.json, and
the plain progress lines for logs that are not a terminal."""

from __future__ import annotations

import logging
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


class PlainProgress(L.Callback):
    """One plain line every `every` optimizer steps on rank 0: step, loss, tokens/s, elapsed, ETA.

    For output that is not a terminal (SLURM logs, CI, `> file`): a Rich or tqdm bar there prints
    nothing for minutes, then control characters. The lines go through logging, so Hydra's
    `train.log` in the run folder has them too. Tokens/s counts every rank's tokens since the
    previous line and excludes validation; the ETA extrapolates the recent step rate.
    """

    def __init__(self, every: int = 25, logger: logging.Logger | None = None) -> None:
        self.every = max(1, int(every))
        self.out = logger or logging.getLogger("looplab")
        self._start: float | None = None
        self._mark: tuple[float, int, int] | None = None  # (time, step, tokens) at the previous line
        self._tokens = 0
        self._paused = 0.0
        self._val_t0: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()
        self._mark = (self._start, trainer.global_step, 0)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val_t0 is not None:
            self._paused += time.perf_counter() - self._val_t0
            self._val_t0 = None
        if trainer.is_global_zero and trainer.state.fn == "fit":
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/") and k.count("/") == 1
                       and k.split("/")[1] in ("loss", "acc", "ppl")}
            if metrics:
                self.out.info("validation at step %d: %s", trainer.global_step,
                              " · ".join(f"{k.split('/')[1]} {v:.4g}" for k, v in sorted(metrics.items())))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._tokens += int(batch["input_ids"].numel()) * trainer.world_size
        step = trainer.global_step
        if not trainer.is_global_zero or step % self.every or self._mark is None or step == self._mark[1]:
            return
        now = time.perf_counter()
        t0, step0, tok0 = self._mark
        busy = max(now - t0 - self._paused, 1e-9)
        rate = (step - step0) / busy
        loss = trainer.callback_metrics.get("train/loss")
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        eta = format_seconds((total - step) / rate) if total and rate > 0 else "?"
        self.out.info("step %d%s · loss %s · %s tokens/s · elapsed %s · eta %s", step, f"/{total}" if total else "",
                      f"{float(loss):.4f}" if loss is not None else "-", f"{(self._tokens - tok0) / busy:,.0f}",
                      format_seconds(now - (self._start or now)), eta)
        self._mark, self._paused = (now, step, self._tokens), 0.0


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"
