"""looplab on a real SLURM cluster: slurmctld + two slurmds on this machine (the `slurm_cluster` fixture,
looplab/testing/slurm_cluster.py), jobs submitted with sbatch as a user submits them.

* a 2-rank FSDP2 job under `srun --ntasks-per-node=2` (Lightning refuses a plain `--ntasks=2`), and one on
  two nodes (the cluster's two slurmds) of one task each;
* preemption while training, both ways a cluster does it — `scancel --signal=USR1` (what `#SBATCH
  --signal=USR1@T` sends before the time limit; looplab saves last.ckpt at a step boundary on every rank and
  requeues) and `scontrol requeue` (SIGTERM, then SIGKILL; the job restarts from the periodic last.ckpt) —
  each must end with the uninterrupted run's weights, results.json test metrics equal to
  `python -m looplab.eval` on the final last.ckpt, no hpc_ckpt anywhere, and the wall time of both attempts;
* `-m hardware=slurm` through hydra-submitit-launcher: every job of the sweep submitted with sbatch.

The FSDP jobs are submitted at once (the `fsdp_jobs` fixture) and preempted from a thread as soon as
they reach step 4, so that their start-up costs overlap on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from looplab.checkpoint import load_model

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TINY = ["+experiment=phop_tiny", "loop_depth=2x2", "dataset.batch_size=8", "dataset.val_size=16", "dataset.test_size=16",
        "logger=csv", "trainer.log_every_n_steps=1", "trainer.max_steps=8", "trainer.val_check_interval=4",
        "trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "checkpoint_every_n_steps=3",
        "backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64"]
FSDP = ["hardware=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"]
HOLD_STEP = 4  # preempted after step 4: the periodic last.ckpt holds step 3


def job_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    return {"WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def submit(cluster, folder: Path, args: list[str], nodes: int = 1) -> str:
    """sbatch a 2-rank FSDP training job (requeueable; one node with `--ntasks-per-node=2`, or two nodes with one
    task each) → its job id."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "job.sh"
    script.write_text("\n".join([
        "#!/bin/bash",
        f"#SBATCH --requeue --open-mode=append --nodes={nodes} --ntasks-per-node={2 // nodes} --cpus-per-task=1",
        # the second node's name does not resolve here (looplab/testing/slurm_cluster.py node_names)
        *(["export MASTER_ADDR=127.0.0.1"] if nodes > 1 else []),
        'echo "attempt ${SLURM_RESTART_COUNT:-0}"',
        f"exec srun {sys.executable} -m looplab.train " + " ".join(f"'{a}'" for a in args),
    ]) + "\n")
    proc = cluster.run("sbatch", "--parsable", f"--output={folder}/slurm.out", f"--chdir={folder}", str(script),
                       env=job_env())
    return proc.stdout.strip().split(";")[0]


def preempt_when_held(cluster, job: str, folder: Path, action: list[str], errors: list[str]) -> None:
    marker, release = folder / "held", folder / "release"
    deadline = time.monotonic() + 600
    while not marker.exists():
        if time.monotonic() > deadline or cluster.job(job).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            errors.append(f"job {job} never reached step {HOLD_STEP}: {cluster.job(job)}")
            release.touch()
            return
        time.sleep(0.5)
    proc = cluster.run(*[a.replace("JOB", job) for a in action], check=False)
    if proc.returncode:
        errors.append(f"{action}: {proc.stderr}")
    time.sleep(1)  # the signal lands while the job is held at the step boundary
    release.touch()


@pytest.fixture(scope="module")
def fsdp_jobs(slurm_cluster, tmp_path_factory):
    """Four 2-rank FSDP jobs of one config: uninterrupted, preempted by SIGUSR1, preempted by scontrol requeue,
    and uninterrupted on two nodes of one task each."""
    root = tmp_path_factory.mktemp("slurm_jobs")
    hold = lambda d: ["+callbacks.hold._target_=slurm_helpers.HoldAtStep", f"+callbacks.hold.step={HOLD_STEP}",
                      f"+callbacks.hold.marker={d}/held", f"+callbacks.hold.release={d}/release"]
    runs = {name: root / name for name in ("straight", "usr1", "requeue", "two_nodes")}
    extra = {"usr1": hold(runs["usr1"]), "requeue": hold(runs["requeue"]),
             "two_nodes": ["trainer.devices=1", "trainer.num_nodes=2"]}
    jobs = {name: submit(slurm_cluster, d, [*TINY, *FSDP, f"hydra.run.dir={d}/run", *extra.get(name, [])],
                         nodes=2 if name == "two_nodes" else 1) for name, d in runs.items()}
    errors: list[str] = []
    actions = {"usr1": ["scancel", "--signal=USR1", "JOB"], "requeue": ["scontrol", "requeue", "JOB"]}
    threads = [threading.Thread(target=preempt_when_held, args=(slurm_cluster, jobs[n], runs[n], a, errors), daemon=True)
               for n, a in actions.items()]
    for t in threads:
        t.start()
    infos = {name: slurm_cluster.wait_job(job, timeout=900) for name, job in jobs.items()}
    for t in threads:
        t.join(5)
    return {name: {"job": jobs[name], "dir": runs[name], "run": runs[name] / "run", "info": infos[name],
                   "log": (runs[name] / "slurm.out").read_text(errors="replace"), "errors": errors} for name in runs}


def weights(run: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(run / "checkpoints" / "last.ckpt")
    return model.state_dict()


def assert_results_are_the_final_weights(run: Path, tmp_path: Path) -> dict:
    """results.json's test metrics equal `python -m looplab.eval` on the final checkpoints/last.ckpt."""
    from looplab.eval.__main__ import main as eval_main

    res = json.loads((run / "results.json").read_text())
    assert res["status"] == "ok" and res["global_step"] == 8
    report = eval_main([str(run / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "eval")])
    agree = report["agreement"]
    assert agree["compared"] >= 5 and not agree["missing"], agree
    assert agree["max_rel_diff"] < 1e-6, agree
    return res


def assert_one_resume_source(run: Path) -> None:
    hpc = sorted(str(p.relative_to(run)) for p in run.rglob("*hpc_ckpt*"))
    assert not hpc, f"hpc checkpoints written: {hpc}"
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name != "last.ckpt"]


def test_fsdp_two_ranks_under_srun(fsdp_jobs, tmp_path):
    job = fsdp_jobs["straight"]
    assert job["info"]["JobState"] == "COMPLETED" and job["info"]["Restarts"] == "0", job["log"][-3000:]
    run = job["run"]
    assert_results_are_the_final_weights(run, tmp_path)
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2  # FSDP2: one shard per rank
    log = (run / "train.log").read_text()
    assert "MEMBER: 2/2" in job["log"] + log and "SLURM auto-requeueing enabled" not in job["log"] + log
    attempts = json.loads((run / "attempts.json").read_text())["attempts"]
    assert [a["slurm_job_id"] for a in attempts] == [job["job"]]


def test_fsdp_two_nodes_one_task_each(fsdp_jobs, tmp_path):
    """The second slurmd as a second node: 2 nodes x 1 task train like 1 node x 2 tasks."""
    job = fsdp_jobs["two_nodes"]
    assert job["info"]["JobState"] == "COMPLETED" and job["info"]["NodeList"] != fsdp_jobs["straight"]["info"]["NodeList"]
    assert job["info"]["NumNodes"] == "2", job["info"]
    run = job["run"]
    assert_results_are_the_final_weights(run, tmp_path)
    ref, got = weights(fsdp_jobs["straight"]["run"]), weights(run)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"2 nodes vs 1: {k}: {m}")


def test_lightning_refuses_plain_ntasks(slurm_cluster, tmp_path, monkeypatch):
    """Why the jobs say --ntasks-per-node: Lightning's SLURM environment refuses the variables that
    `srun --ntasks=2` alone sets (no SLURM_NTASKS_PER_NODE); README says so."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    def task_env(*srun_args: str) -> dict[str, str]:
        out = slurm_cluster.run("srun", *srun_args, f"--chdir={tmp_path}", "bash", "-c",
                                '[ "$SLURM_PROCID" != 0 ] || env -0').stdout  # task 0's environment
        return dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)

    plain, per_node = task_env("--ntasks=2"), task_env("--nodes=1", "--ntasks-per-node=2")
    monkeypatch.setattr(os, "environ", plain)
    with pytest.raises(RuntimeError, match="Use `--ntasks-per-node=2` instead"):
        SLURMEnvironment._validate_srun_variables()
    monkeypatch.setattr(os, "environ", per_node)
    SLURMEnvironment._validate_srun_variables()


@pytest.mark.parametrize("how", ["usr1", "requeue"])
def test_preempted_job_ends_like_the_uninterrupted_one(fsdp_jobs, how, tmp_path):
    job, straight = fsdp_jobs[how], fsdp_jobs["straight"]
    assert not job["errors"], job["errors"]
    assert job["info"]["JobState"] == "COMPLETED" and job["info"]["Restarts"] == "1", job["log"][-3000:]
    run = job["run"]
    log = job["log"] + (run / "train.log").read_text()
    assert "attempt 0" in job["log"] and "attempt 1" in job["log"]
    if how == "usr1":  # saved at the signal's step boundary, on both ranks, then requeued by looplab
        assert f"SIGUSR1 at step {HOLD_STEP}: saving" in log and "requeueing SLURM job" in log
        resumed_at = HOLD_STEP
    else:  # killed (SIGTERM, SIGKILL): the next attempt starts from the periodic checkpoint
        assert "DUE TO JOB REQUEUE" in job["log"]
        resumed_at = 3
    assert "resuming from" in log and "Restoring states from the checkpoint path at" in log
    assert "hpc_ckpt" not in log
    res = assert_results_are_the_final_weights(run, tmp_path)
    assert_one_resume_source(run)
    ref, got = weights(straight["run"]), weights(run)
    assert set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-7, msg=lambda m: f"{how} vs uninterrupted: {k}: {m}")
    attempts = json.loads((run / "attempts.json").read_text())["attempts"]
    assert [a["slurm_restart_count"] for a in attempts] == [0, 1]
    assert attempts[0]["global_step"] >= resumed_at and attempts[0]["wall_time_s"] > 0
    assert res["wall_time_total_s"] == pytest.approx(sum(a["wall_time_s"] for a in attempts))
    assert res["wall_time_total_s"] > res["wall_time_s"] + 0.5 * attempts[0]["wall_time_s"]


def test_hardware_slurm_multirun_submits_each_job_with_sbatch(slurm_cluster, tmp_path):
    """`-m hardware=slurm` (hydra-submitit-launcher) on CPU nodes: one sbatch job per configuration."""
    sweep = tmp_path / "sweep"
    args = ["-m", "+experiment=phop_tiny", "loop_depth=1x1,1x2", "hardware=slurm", "hardware.gpus_per_node=1",
            "trainer.accelerator=cpu", "trainer.precision=32-true", "hydra.launcher.gpus_per_node=null",
            "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=20",
            f"hydra.sweep.dir={sweep}", "logger=none", "trainer.max_steps=4", "trainer.val_check_interval=2",
            "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "trainer.enable_model_summary=false",
            "dataset.batch_size=8", "dataset.val_size=8", "dataset.test_size=8",
            "backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64"]
    env = {**slurm_cluster.env, **job_env()}
    proc = subprocess.run([sys.executable, "-m", "looplab.train", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = sorted(sweep.glob("*/results.json"))
    assert len(results) == 2, (proc.stdout + proc.stderr)[-3000:]
    job_ids = set()
    for f in results:
        res = json.loads(f.read_text())
        assert res["status"] == "ok" and res["global_step"] == 4 and res["config"]["hardware"]["name"] == "slurm"
        job_ids |= {a["slurm_job_id"] for a in json.loads((f.parent / "attempts.json").read_text())["attempts"]}
    assert len(job_ids) == 2 and None not in job_ids  # two SLURM jobs, one per configuration
    # submitit returns once the result files exist, which can be before SLURM records the jobs as done
    assert all(slurm_cluster.wait_job(j, timeout=60)["JobState"] == "COMPLETED" for j in job_ids)
    done = (slurm_cluster.root / "log" / "jobcomp.txt").read_text()
    assert all(f"JobId={j} " in done for j in job_ids)
