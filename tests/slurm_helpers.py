"""Callbacks that tests/test_slurm.py passes to `python -m looplab.train` jobs (PYTHONPATH=tests)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning as L

from looplab.training.callbacks import job_id  # the name scontrol takes (ARRAYJOB_TASK in a sweep)


def first_attempt() -> bool:
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0


def hydra_job_num() -> int | None:
    """This job's number in a Hydra multirun (`hydra.job.num`), None outside one."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return int(HydraConfig.get().job.num)
    except Exception:  # no Hydra, or a single run (job.num unset)
        return None


def _wait(release: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.2)


class HoldAtStep(L.Callback):
    """In a job's first attempt only (SLURM_RESTART_COUNT unset or 0): once `step` optimizer steps are done,
    rank 0 writes `marker` (the step, SLURM_JOB_ID and the job's name for scontrol, as JSON) and every rank
    waits (at most `timeout` s) for the file `release` — so that a test preempts training at a known step. A signal that arrives meanwhile is
    handled as usual. `job_num`: in a Hydra multirun, only the job of that number holds."""

    def __init__(self, step: int, marker: str, release: str, timeout: float = 300.0, job_num: int | None = None):
        self.step, self.marker, self.release, self.timeout = step, Path(marker), Path(release), timeout
        self.job_num = job_num

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or not first_attempt():
            return
        if self.job_num is not None and hydra_job_num() != self.job_num:
            return
        if trainer.is_global_zero:
            self.marker.write_text(json.dumps({"step": trainer.global_step, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                                               "job": job_id()}))
        _wait(self.release, self.timeout)


class HoldInCheckpointSave(L.Callback):
    """In a job's first attempt only: the save of checkpoints/last.ckpt at `step` stops half-way until the file
    `release` exists (at most `timeout` s) — its temporary copy written, the rename that makes it last.ckpt
    not done:

    * one process (looplab's AtomicCheckpointIO): `.last.ckpt.tmp-PID` is written, not yet fsynced nor renamed;
    * FSDP2 (looplab's LoopedFSDPStrategy): in `.last.ckpt.tmp/` every rank's shard and DCP's `.metadata`
      are written, Lightning's `meta.pt` (epoch, loops, the `looplab` entry) not yet — a folder that no
      reader accepts — and rank 0 has not swapped it in.

    Rank 0 writes `marker` (JSON: the step, the temporary path, the files in it, and whether last.ckpt held a
    checkpoint meanwhile) once it is held. Done by wrapping, in the job's process, the two writes that the
    project's save paths call (AtomicCheckpointIO.write_temporary, Lightning's `_distributed_checkpoint_save`)."""

    def __init__(self, step: int, marker: str, release: str, timeout: float = 300.0):
        self.step, self.marker, self.release, self.timeout = step, Path(marker), Path(release), timeout
        self._trainer = None
        self._undo: list = []
        self.held = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or not first_attempt() or self._undo:
            return
        import lightning.pytorch.strategies.model_parallel as model_parallel
        from looplab.training.callbacks import AtomicCheckpointIO

        self._trainer = trainer
        dcp_save, io_save = model_parallel._distributed_checkpoint_save, AtomicCheckpointIO.write_temporary

        def held_dcp_save(state, path):
            dcp_save(state, path)
            self._hold(Path(path))

        def held_io_save(checkpoint, path):
            io_save(checkpoint, path)
            self._hold(Path(path))

        model_parallel._distributed_checkpoint_save = held_dcp_save
        AtomicCheckpointIO.write_temporary = staticmethod(held_io_save)
        self._undo = [lambda: setattr(model_parallel, "_distributed_checkpoint_save", dcp_save),
                      lambda: setattr(AtomicCheckpointIO, "write_temporary", staticmethod(io_save))]

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for undo in self._undo:
            undo()
        self._undo = []

    def _hold(self, tmp: Path) -> None:
        trainer = self._trainer
        if self.held or trainer is None or trainer.global_step != self.step or not tmp.name.startswith(".last.ckpt.tmp"):
            return
        self.held = True
        if trainer.is_global_zero:
            files = sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else [tmp.name]
            last = tmp.with_name("last.ckpt")
            self.marker.write_text(json.dumps({"step": trainer.global_step, "tmp": str(tmp), "files": files,
                                               "last_ckpt_exists": last.exists(), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}))
        _wait(self.release, self.timeout)
