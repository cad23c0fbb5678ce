"""SLURM preemption without a cluster: a run in this process with a SLURM job's environment, a stand-in
`scontrol` on PATH, and SIGUSR1 sent to itself at step 4 (tests/test_slurm.py does it on a real cluster).

The bug this pins down (seen on a real cluster): Lightning's own SIGUSR1 handler saved `hpc_ckpt_1.ckpt`
and requeued; the next attempt resumed from last.ckpt, ignoring it, and the final `trainer.test()` restored
it — results.json paired the final global_step with an older model's test metrics.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import lightning as L
import pytest
import torch

from looplab.checkpoint import model_state_dict, read_checkpoint
from test_train import run_train


class SignalAtStep(L.Callback):
    """SIGUSR1 to this process once `step` optimizer steps are done, as SLURM's `--signal=USR1@T` would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.fixture
def slurm_job_env(tmp_path, monkeypatch):
    """A one-task SLURM job's variables and an `scontrol` that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for k, v in {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "looplab", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
                 "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    return calls


def test_sigusr1_saves_last_ckpt_requeues_and_the_resumed_run_tests_its_final_weights(tiny_overrides, tmp_path,
                                                                                         slurm_job_env, monkeypatch):
    from looplab.eval.__main__ import main as eval_main

    common = tiny_overrides + ["checkpoint_every_n_steps=3"]
    usr1_before = signal.getsignal(signal.SIGUSR1)
    straight = run_train(common, tmp_path / "straight")
    run = tmp_path / "preempted"

    first = run_train(common + ["+callbacks.usr1={_target_: test_slurm_requeue.SignalAtStep, step: 4}"], run)
    assert first["status"] == "requeued" and first["global_step"] == 4
    assert slurm_job_env.read_text().split() == ["requeue", "4242"]
    assert read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 4  # saved at the signal's step
    assert not list(run.rglob("*hpc_ckpt*")) and not (run / "results.json").exists()
    assert signal.getsignal(signal.SIGUSR1) == usr1_before  # the handler is put back

    # what Lightning's handler used to leave behind: the newest hpc checkpoint, which the test stage restored
    shutil.copy(run / "checkpoints" / "last.ckpt", run / "hpc_ckpt_1.ckpt")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    res = run_train(common, run)
    assert res["status"] == "ok" and res["global_step"] == 6
    assert not (run / "hpc_ckpt_1.ckpt").exists() and (run / "checkpoints" / "ignored-hpc_ckpt_1.ckpt").exists()

    report = eval_main([str(run / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "eval")])
    assert report["agreement"]["compared"] >= 3 and report["agreement"]["max_rel_diff"] < 1e-6, report["agreement"]
    assert res["metrics"]["test/loss"] == pytest.approx(straight["metrics"]["test/loss"], rel=1e-5)
    a = model_state_dict(read_checkpoint(tmp_path / "straight" / "checkpoints" / "last.ckpt"))
    b = model_state_dict(read_checkpoint(run / "checkpoints" / "last.ckpt"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7, msg=k)

    attempts = json.loads((run / "attempts.json").read_text())["attempts"]
    assert [(a["slurm_restart_count"], a["global_step"], a["ended"]) for a in attempts] == [(0, 4, "Requeued"), (1, 6, "ok")]
    assert res["wall_time_total_s"] == pytest.approx(attempts[0]["wall_time_s"] + res["wall_time_s"])
    assert res["wall_time_total_s"] > res["wall_time_s"]
    assert res["throughput"]["tokens_per_s"] < 1e6  # timed from the resumed attempt's first step
