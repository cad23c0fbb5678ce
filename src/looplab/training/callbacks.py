"""Callbacks and plugins: atomic checkpoints, the throughput record that goes into results.json, the
plain progress lines for logs that are not a terminal, the wall clock of every attempt of a run, and
SLURM's preemption signal handled at a step boundary.

None of them waits for the device in a training step (docs/performance.md#host-syncs-in-a-training-step;
tests/test_training_syncs.py counts them): what they read from it — the loss on a progress line, a throughput
reading — they read at the logging steps only (every `trainer.log_every_n_steps`), and the ranks agree on a
preemption signal on the host."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from looplab.training.run_utils import write_json_atomic

log = logging.getLogger("looplab")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the same folder, fsync, then rename: a killed run never leaves a
    half-written last.ckpt behind (os.replace is atomic on POSIX).

    A save that fails (a full disk: ENOSPC) removes its partial temporary file before the error goes on, and
    calls `on_failure(message)` for an OSError (train.py: AttemptClock.record_failure, into attempts.json). One
    killed outright (kill -9) leaves it for the next attempt's sweep (run_folder.sweep_orphans)."""

    def __init__(self, on_failure: Any = None) -> None:
        super().__init__()
        self.on_failure = on_failure

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            if "://" in str(path):  # object storage: Lightning's fsspec transaction
                super().save_checkpoint(checkpoint, tmp, storage_options)
            else:
                if storage_options is not None:
                    raise TypeError(f"storage_options={storage_options!r}: a local checkpoint takes none")
                self.write_temporary(checkpoint, tmp)
            os.replace(tmp, path)
        except BaseException as e:
            freed = tmp.stat().st_size if tmp.exists() else 0
            try:
                tmp.unlink(missing_ok=True)
                removed = f"its partial temporary file {tmp.name} ({freed / 2**20:.1f} MB) was removed"
            except OSError as e2:
                removed = f"its partial temporary file {tmp} could not be removed ({e2})"
            if isinstance(e, OSError) and self.on_failure is not None:
                self.on_failure(f"saving {path} failed: {e}; {removed}")
            raise

    @staticmethod
    def write_temporary(checkpoint: dict[str, Any], tmp: Path) -> None:
        """torch.save straight into the temporary file beside the checkpoint, then fsync. Lightning's `_atomic_save`
        would first copy the whole checkpoint into memory (a second copy of weights and optimizer state on the host)
        and then write it through an fsspec transaction whose own temporary file lies in the system's temp folder,
        where a kill -9 leaves it and no sweep of the run folder can tell whose it is."""
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())


class ThroughputRecord(L.Callback):
    """Training tokens/s over the whole fit, excluding validation time (for results.json).

    Lightning's ThroughputMonitor logs the running figures; this keeps the run's total.
    """

    def __init__(self) -> None:
        self.tokens = 0
        self.train_time = 0.0
        self._t0: float | None = None
        self._val_t0: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        # from the first step on: timed from the epoch start alone, an attempt resumed mid-epoch (SLURM
        # requeue) reported 0.003 s of training for its 4 steps — 320k tokens/s instead of ~1k
        self._t0 = time.perf_counter()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._t0 is None:
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


def synchronize(device: torch.device) -> None:
    """Wait for the kernels queued on `device` (CUDA); nothing on the CPU, where nothing is queued. A throughput
    reading's one host sync: its clock must cover the steps' kernels, not only their launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ThroughputMonitor(LightningThroughputMonitor):
    """Lightning's ThroughputMonitor (train/ and validate/ samples, tokens, FLOPs per second and MFU, from the
    module's `flops_per_batch`) without a host sync in every training step.

    Lightning's calls `torch.cuda.synchronize()` after every training batch, so that its clock covers the batch's
    kernels, although it logs only every `log_every_n_steps`: a GPU then idles while the host queues the next step.
    This one counts batches, samples and tokens on the host each step and takes a reading — one synchronize, the
    clock, the FLOPs of the batches since the previous reading — only at the steps it logs (and before a
    validation, which Lightning's accounting subtracts from the training time). The rolling window is kept in
    steps: `window_steps` (Lightning's 100) / log_every_n_steps readings, at least 2.
    """

    def __init__(self, batch_size_fn, length_fn=None, window_steps: int = 100, **kwargs) -> None:
        super().__init__(batch_size_fn, length_fn, **kwargs)
        self.window_steps = int(window_steps)
        self._pending = [0, 0, 0]  # training batches, samples, tokens since the last reading

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if RunningStage.TRAINING in self._throughputs:
            readings = max(2, -(-self.window_steps // max(1, int(trainer.log_every_n_steps or 1))))
            kwargs = {**self.kwargs, "window_size": readings}
            self._throughputs[RunningStage.TRAINING] = Throughput(available_flops=self.available_flops,
                                                                  world_size=trainer.world_size, **kwargs)

    def _start(self, trainer) -> None:
        super()._start(trainer)
        if trainer.state.stage == RunningStage.TRAINING:
            self._pending = [0, 0, 0]

    def _read(self, trainer, pl_module) -> None:
        """A training reading: the batches since the last one, their FLOPs, and the clock after a synchronize."""
        batches, samples, tokens = self._pending
        if not batches:
            return
        stage = RunningStage.TRAINING
        synchronize(trainer.strategy.root_device)
        elapsed = time.perf_counter() - self._t0s[stage]
        self._batches[stage] += batches
        self._samples[stage] += samples
        if self.length_fn is not None:
            self._lengths[stage] += tokens
        if self._module_has_flops is None:
            self._module_has_flops = hasattr(pl_module, "flops_per_batch")
        flops = pl_module.flops_per_batch * batches if self._module_has_flops else None
        self._throughputs[stage].update(time=elapsed, batches=self._batches[stage], samples=self._samples[stage],
                                        lengths=None if self.length_fn is None else self._lengths[stage], flops=flops)
        self._pending = [0, 0, 0]

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, *_) -> None:
        self._pending[0] += 1
        self._pending[1] += self.batch_size_fn(batch)
        if self.length_fn is not None:
            self._pending[2] += self.length_fn(batch)
        if not trainer.fit_loop._should_accumulate() and trainer._logger_connector.should_update_logs:
            self._read(trainer, pl_module)
            self._compute(trainer)

    @rank_zero_only
    def on_validation_start(self, trainer, *args) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit" and RunningStage.TRAINING in self._t0s:
            self._read(trainer, trainer.lightning_module)  # the training time ends here (Lightning subtracts the rest)
        super().on_validation_start(trainer, *args)


class LoggedLoss:
    """The training loss a progress display shows, read from the device only at the logging steps (every
    `every` optimizer steps): a loss logged with prog_bar=True is read (`.item()`) at every step by Lightning."""

    def __init__(self, every: int) -> None:
        self.every = max(1, int(every))
        self.value: float | None = None
        self._step = -1

    def read(self, trainer) -> float | None:
        step = trainer.global_step
        if step != self._step and (step % self.every == 0 or self.value is None):
            loss = trainer.callback_metrics.get("train/loss")
            if loss is not None:
                self.value, self._step = float(loss), step
        return self.value


class RichProgress(RichProgressBar):
    """Lightning's rich progress bar with the training loss as read at the logging steps (LoggedLoss)."""

    def __init__(self, every: int = 25, **kwargs) -> None:
        super().__init__(**kwargs)
        self.loss = LoggedLoss(every)

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        if trainer.training:
            loss = self.loss.read(trainer)
            if loss is not None:
                items["train/loss"] = loss
        return items


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


class AttemptClock(L.Callback):
    """The wall time of every attempt of one run — a crash, a preemption, a requeue, a re-run of a finished
    job — in `<run>/attempts.json`, so that results.json's `wall_time_total_s` counts them all.

    An attempt that ends without writing results.json (killed, requeued) is known only from this file:
    rank 0 rewrites its own entry every `every_s` seconds of training, on an exception (Lightning raises
    one on SIGTERM, which is how SLURM ends a requeued or cancelled job) and at a requeue, so at most
    `every_s` seconds of a hard-killed attempt go uncounted. A run folder from before this file keeps
    its results.json total as the first entry.

    Each save reads the file again and replaces only this attempt's own entry (its `attempt` id) before the
    atomic rename, so no writer erases another's entries; train.py holds the run folder's lock
    (run_folder.claim_run_folder) while it writes. The entry records the attempt's command-line `overrides`
    (the record a resume=auto is checked against), and an `error` when the attempt failed.
    """

    def __init__(self, path: str | os.PathLike, start: float, every_s: float = 10.0,
                 overrides: list[str] | None = None) -> None:
        import uuid

        self.path = Path(path)
        self.start = start
        self.every_s = every_s
        self.earlier = self._read_earlier()
        self.entry = {"attempt": uuid.uuid4().hex[:12], "pid": os.getpid(),
                      "started": datetime.fromtimestamp(start, timezone.utc).isoformat(timespec="seconds"),
                      "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                      "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0), "wall_time_s": 0.0}
        if overrides is not None:
            self.entry["overrides"] = list(overrides)
        self._saved_at = 0.0
        self._at: int | None = None  # this entry's index in the file

    def _read_earlier(self) -> list[dict[str, Any]]:
        """Every attempt in the file but this one (a folder from before attempts.json: its results.json total)."""
        mine = getattr(self, "entry", {}).get("attempt")
        try:
            return [a for a in json.loads(self.path.read_text())["attempts"] if not (mine and a.get("attempt") == mine)]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return list(getattr(self, "earlier", []))  # unreadable now: what was read before
        try:  # a run folder from before attempts.json
            prev = json.loads((self.path.parent / "results.json").read_text())
        except (OSError, ValueError):
            return []
        before = prev.get("wall_time_total_s", prev.get("wall_time_s"))
        return [{"started": None, "from": "results.json", "wall_time_s": float(before)}] if before else []

    def save(self, wall: float | None = None, **extra: Any) -> float:
        """Record this attempt's wall time (now, or `wall`); returns the total over every attempt. Rank 0 calls it."""
        self.entry.update(extra, wall_time_s=time.time() - self.start if wall is None else wall)
        self.earlier = self._read_earlier()
        attempts = [*self.earlier, self.entry]
        if self._at is not None and self._at < len(attempts):  # in the place it was first written (attempts in order)
            attempts.insert(self._at, attempts.pop())
        self._at = attempts.index(self.entry)
        write_json_atomic(self.path, {"attempts": attempts})
        self._saved_at = time.monotonic()
        return self.total(self.entry["wall_time_s"])

    def record_failure(self, message: str) -> None:
        """A failure record in this attempt's entry (AtomicCheckpointIO's on_failure: a save that failed, ENOSPC
        included); where even that cannot be written, one line on stderr says why."""
        try:
            self.save(ended="failed", error=message)
        except OSError as e:
            import sys

            print(f"looplab: {message}; could not record it in {self.path}: {e}", file=sys.stderr, flush=True)

    def total(self, wall: float) -> float:
        return sum(float(a.get("wall_time_s") or 0.0) for a in self.earlier) + wall

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero and time.monotonic() - self._saved_at >= self.every_s:
            self.save(global_step=trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # the step of every checkpoint, so that an attempt killed hard (SIGKILL after a slow SIGTERM, an OOM kill)
        # still says how far it got: at least to the checkpoint the next attempt resumes from
        if trainer.is_global_zero:
            self.save(global_step=trainer.global_step)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if trainer.is_global_zero:
            failed = "error" not in self.entry and not isinstance(exception, Requeued)  # a requeue is no failure
            extra = {"error": f"{type(exception).__name__}: {exception}"[:2000]} if failed else {}
            try:
                self.save(global_step=trainer.global_step, ended=type(exception).__name__, **extra)
            except OSError as e:  # a full disk: the exception being handled is the one to report
                log.warning("could not record the failed attempt in %s: %s", self.path, e)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


_HOST_GROUPS: dict[int, Any] = {}  # id(default process group) → its host (gloo) group; None: the default one is gloo


def host_group():
    """The process group over which ranks agree on a host value without touching a GPU: the default group when it
    runs gloo (CPU training), else a gloo group over the same ranks, made once per default group (a collective
    call: every rank calls it, in the same order; the callbacks do at train start). NCCL reduces device tensors
    only: a host flag reduced over it is a copy to the GPU, a wait for the queued kernels and a copy back."""
    import torch.distributed as dist

    default = dist.group.WORLD
    if "gloo" in str(dist.get_backend()):
        return None
    key = id(default)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_group(backend="gloo")
    return _HOST_GROUPS[key]


class HostSigtermFlag(L.Callback):
    """Lightning's SIGTERM agreement without a host wait for the GPU.

    With several ranks Lightning 2.6 broadcasts rank 0's SIGTERM flag before every training batch, micro-batches
    included (`_TrainingEpochLoop._broadcast_sigterm_tensor`): a tensor made on the GPU, an NCCL broadcast, then
    `.item()`, which waits for every kernel queued before it. This makes the same broadcast, with the same meaning
    (rank 0 received SIGTERM → every rank raises SIGTERMException after a barrier), over the host group
    (`host_group`) on a host buffer: nothing is queued on or read from the device."""

    def __init__(self) -> None:
        self._flag = np.zeros(1, dtype=np.int64)  # Lightning's flag is an int64 tensor: the same 8 bytes

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.world_size == 1 or not _distributed():
            return
        try:
            group = host_group()
        except Exception as e:  # no gloo: Lightning's own broadcast stays
            log.warning("no gloo process group for Lightning's SIGTERM flag (%s): it is read from the device", e)
            return
        loop = trainer.fit_loop.epoch_loop
        if not hasattr(loop, "_broadcast_sigterm_tensor"):  # another Lightning: nothing to replace
            return

        def broadcast_sigterm_on_host() -> None:
            import torch.distributed as dist
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            self._flag[0] = 1 if getattr(trainer, "received_sigterm", False) else 0
            dist.broadcast(torch.from_numpy(self._flag), src=0, group=group)
            if self._flag[0] == 1:
                dist.barrier(group=group)  # every rank raises together, as Lightning's does
                raise SIGTERMException()

        loop._broadcast_sigterm_tensor = broadcast_sigterm_on_host


class Requeued(Exception):
    """Raised on every rank after a preemption signal was handled: last.ckpt is saved and the job requeued."""


class SlurmRequeue(L.Callback):
    """SLURM preemption: on one of `signums` (SIGUSR1 — `#SBATCH --signal=USR1@SECONDS` before the time limit, or
    `scancel --signal=USR1 JOB`; under submitit also the signal it asks SLURM for, see `preemption_signals`),
    save `last.ckpt`, requeue the job with `scontrol requeue`, and stop.

    Replaces Lightning's auto-requeue (the Trainer gets `self.environment`, auto_requeue=False), which
    (1) saved `hpc_ckpt_N.ckpt` beside last.ckpt — a second resume source that the next attempt ignored
    (it resumes from last.ckpt) but the final `trainer.test()` restored, so results.json paired the final
    step with stale weights' metrics; and (2) saved from inside the signal handler, at whatever point each
    rank was interrupted — under FSDP2 one rank's save ran into the other's collectives and crashed
    (`setStorage: sizes ... out of bounds`). Here the handler only sets a flag; at the next batch end the
    ranks agree on it (an all-reduce: SLURM may signal only some of them), all save last.ckpt through the
    project's checkpoint path (atomic; sharded under FSDP2) at the same step, then rank 0 requeues and
    every rank raises `Requeued`, which train.py turns into a quiet exit without testing.

    The ranks agree without touching the device: one process reads its own flag; several all-reduce it on the
    host, over a CPU (gloo) process group — a copy of the flag to the GPU and back made every step wait for its
    queued kernels. Should no gloo group be available, they agree on the device every `fallback_every` steps.
    """

    def __init__(self, last_ckpt: str | os.PathLike, clock: AttemptClock | None = None,
                 signums: int | tuple[int, ...] = signal.SIGUSR1, fallback_every: int = 10) -> None:
        self.last_ckpt = Path(last_ckpt)
        self.fallback_every = max(1, int(fallback_every))
        self._group: Any = None  # the host process group the ranks agree over (None: the default one, or one rank)
        self._on_host = True  # False: no gloo group could be made; agree on the device every fallback_every steps
        self._flag = np.zeros(1, dtype=np.int32)  # the host buffer the all-reduce runs in (read without torch)
        self.clock = clock
        self.signums = tuple(dict.fromkeys((signums,) if isinstance(signums, int) else signums))
        self.signalled: int | None = None  # the signal this rank received
        self._previous: dict[int, Any] = {}
        # the cluster environment to pass to the Trainer: Lightning's without its own SIGUSR1 handler
        self.environment = SLURMEnvironment(auto_requeue=False)

    def _handler(self, signum, frame) -> None:
        self.signalled = signum  # nothing else here: the save happens at a step boundary, on every rank

    def on_train_start(self, trainer, pl_module) -> None:
        self._make_group(trainer)
        # not in setup(): Lightning snapshots every handler after setup and puts the snapshot back at its teardown
        if threading.current_thread() is threading.main_thread():
            for signum in self.signums:  # under submitit this replaces its own handler for the fit (put back after)
                self._previous[signum] = signal.signal(signum, self._handler)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()  # Lightning calls no teardown hook when fit raises (Requeued included)

    def _restore(self) -> None:
        if self._previous and threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            self._previous = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % max(1, trainer.accumulate_grad_batches):
            return  # mid-accumulation: a checkpoint cannot hold the partial gradients; wait for the optimizer step
        if not self.any_rank_signalled(trainer):
            return
        step = trainer.global_step
        job = job_id()
        if trainer.is_global_zero:
            log.info("%s at step %d: saving %s, then requeueing SLURM job %s",
                     signal.Signals(self.signalled).name if self.signalled else "a preemption signal (on another rank)",
                     step, self.last_ckpt, job)
        trainer.save_checkpoint(self.last_ckpt)  # every rank: a collective under FSDP2
        trainer.strategy.barrier("looplab_requeue_saved")
        if trainer.is_global_zero:
            if self.clock is not None:
                self.clock.save(global_step=step, ended="requeued")
            proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            if proc.returncode:
                log.warning("`scontrol requeue %s` failed (%s): the run stops here; resubmit it to continue from %s",
                            job, (proc.stderr or proc.stdout).strip(), self.last_ckpt)
        raise Requeued(f"step {step} saved to {self.last_ckpt}; SLURM job {job} requeued")

    def _make_group(self, trainer) -> None:
        """Every rank, at train start: the process group of CPU tensors the flag is reduced over (host_group)."""
        self._group, self._on_host = None, True
        if trainer.world_size == 1 or not _distributed():
            return
        try:
            self._group = host_group()
        except Exception as e:  # no gloo here: the device, every fallback_every steps
            self._on_host = False
            log.warning("no gloo process group for the preemption flag (%s): the ranks agree on it every %d steps",
                        e, self.fallback_every)

    def any_rank_signalled(self, trainer) -> bool:
        """Whether a preemption signal reached any rank: the same answer on every rank, at the same step, and no
        host-device sync (one process: its own flag; several: a sum over the host group, read from its numpy
        buffer)."""
        import torch.distributed as dist

        mine = 1 if self.signalled else 0
        if trainer.world_size == 1 or not _distributed():
            return bool(mine)
        if not self._on_host:
            if trainer.global_step % self.fallback_every:
                return False
            flag = torch.tensor(float(mine), device=trainer.strategy.root_device)
            return float(trainer.strategy.reduce(flag, reduce_op="sum")) > 0
        self._flag[0] = mine
        dist.all_reduce(torch.from_numpy(self._flag), op=dist.ReduceOp.SUM, group=self._group)
        return bool(self._flag[0])


def under_submitit() -> bool:
    """Whether this process is a job that submitit started on SLURM (`hardware=slurm`, hydra-submitit-launcher):
    its sbatch script exports SUBMITIT_EXECUTOR=slurm."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm"


def preemption_signals() -> tuple[int, ...]:
    """The signals SlurmRequeue handles: SIGUSR1, and under submitit also the one submitit asks SLURM to send
    before the time limit (`--signal=USR2@signal_delay_s`; SUBMITIT_PREEMPT_SIGNAL, read as submitit reads it).
    Left to submitit, that signal checkpoints the *launcher* and calls sys.exit() from inside the handler,
    wherever training is (under FSDP2 on rank 0 alone), losing every step since the last periodic save; and
    when submitit counts the job as timed out too often (hydra-submitit's default max_num_timeout=0) it
    raises an error there instead of requeueing. docs/distributed.md#slurm describes the one behaviour looplab keeps."""
    sigs = [signal.SIGUSR1]
    if under_submitit():
        sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
        if isinstance(sig, signal.Signals):
            sigs.append(sig)
    return tuple(dict.fromkeys(sigs))


def job_id() -> str:
    """This SLURM job's id as scontrol names it (`ARRAYJOB_TASK` for an array task)."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        raise RuntimeError(f"SLURM job id {job!r} is not one (SLURM_JOB_ID / SLURM_ARRAY_JOB_ID unset?)")
    return job
