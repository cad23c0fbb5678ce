"""looplab on a real SLURM cluster: slurmctld + two slurmds on this machine (the `slurm_cluster` fixture,
looplab/testing/slurm_cluster.py), jobs submitted with sbatch as a user submits them.

* a 2-rank FSDP2 job under `srun --ntasks-per-node=2` (Lightning refuses a plain `--ntasks=2`), and one on
  two nodes (the cluster's two slurmds) of one task each;
* preemption while training, both ways a cluster does it — `scancel --signal=USR1` (what `#SBATCH
  --signal=USR1@T` sends before the time limit; looplab saves last.ckpt at a step boundary on every rank and
  requeues) and `scontrol requeue` (SIGTERM, then SIGKILL; the job restarts from the periodic last.ckpt) —
  for the 2-rank FSDP2 job and for a one-process job; each must end with the uninterrupted run's weights,
  results.json test metrics equal to `python -m looplab.eval` on the final last.ckpt, no hpc_ckpt anywhere,
  and the wall time of both attempts;
* preemption in the middle of a save of last.ckpt (slurm_helpers.HoldInCheckpointSave holds it after the
  temporary copy is written, before the rename): the FSDP2 job killed by `scontrol requeue` with its
  sharded folder half-written must resume from the previous complete checkpoint; a one-process job
  given SIGUSR1 there saves at the next step boundary;
* `-m hardware=slurm` through hydra-submitit-launcher: every job of the sweep submitted with sbatch, one
  of them preempted by `scontrol requeue` and the other by submitit's own preemption signal (SIGUSR2);
  each resumes from its own sweep folder's last.ckpt and the sweep ends once both are done.

Every job is submitted at once (the `slurm_jobs` fixture; the sweep's launcher runs beside them) and
preempted from a thread as soon as it is held at its step, so that their start-up costs overlap on a
2-core machine.
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
SAVE_STEP = 6  # preempted in the middle of the periodic save at step 6: the complete last.ckpt holds step 3
SWEEP_HOLD_STEP = 3  # the sweep's jobs: 4 steps, a checkpoint every 2
TIMEOUT_S = 1500  # for the whole fixture: ~2.5 min on an idle 2-core machine, over 20 min when starved at nice 19

# name: (tasks, nodes, how it is preempted, where it is held); "fsdp" names start with no "one_"
JOBS = {
    "straight": (2, 1, None, None),
    "usr1": (2, 1, "usr1", "step"),
    "requeue": (2, 1, "requeue", "step"),
    "two_nodes": (2, 2, None, None),
    "save_killed": (2, 1, "requeue", "save"),  # FSDP2 killed with its sharded folder half-written
    # one process: compared with the one-process uninterrupted job (one_straight), not with the FSDP2 one:
    # FSDP2 equals one process only to ~1e-5 (test_fsdp_two_nodes_one_task_each, tests/test_fsdp_train.py),
    # too loose to tell a resume off by a step, while one process against one process agrees to 1e-7
    "one_straight": (1, 1, None, None),
    "one_usr1": (1, 1, "usr1", "step"),
    "one_requeue": (1, 1, "requeue", "step"),
    "one_save_usr1": (1, 1, "usr1", "save"),
}
ACTIONS = {"usr1": ["scancel", "--signal=USR1", "JOB"], "usr2": ["scancel", "--signal=USR2", "JOB"],
           "requeue": ["scontrol", "requeue", "JOB"]}


def job_env() -> dict[str, str]:
    """What every job (and the sweep's launcher, whose jobs inherit it) gets besides the cluster's SLURM_CONF.

    MASTER_ADDR: Lightning takes the rendezvous address from the first node of SLURM_NODELIST, and only this
    cluster's first node name resolves (looplab/testing/slurm_cluster.py node_names); a job that SLURM places on
    the second node alone (seen: the requeued attempt of a one-node job) waits forever for its rank 0
    on `vm-2`. Every node here is 127.0.0.1."""
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    return {"WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "MASTER_ADDR": "127.0.0.1"}


def submit(cluster, folder: Path, args: list[str], tasks: int = 2, nodes: int = 1) -> str:
    """sbatch a training job (requeueable) of `tasks` ranks: one node with `--ntasks-per-node=tasks`, or
    `nodes` nodes sharing them → its job id."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "job.sh"
    script.write_text("\n".join([
        "#!/bin/bash",
        f"#SBATCH --requeue --open-mode=append --nodes={nodes} --ntasks-per-node={tasks // nodes} --cpus-per-task=1",
        'echo "attempt ${SLURM_RESTART_COUNT:-0}"',
        f"exec srun {sys.executable} -m looplab.train " + " ".join(f"'{a}'" for a in args),
    ]) + "\n")
    proc = cluster.run("sbatch", "--parsable", f"--output={folder}/slurm.out", f"--chdir={folder}", str(script),
                       env=job_env())
    return proc.stdout.strip().split(";")[0]


def preempt_when_held(cluster, job: str | None, folder: Path, action: list[str], errors: list[str], release: bool = True,
                      running=None) -> None:
    """Once the job has written `folder/held`, run `action` (JOB: the job id, or the one the marker names when
    `job` is None); then touch `folder/release` a second later (the signal lands while the job is held), or
    with release=False leave it held until SLURM kills it. Problems go to `errors`."""
    marker, release_file = folder / "held", folder / "release"
    running = running or (lambda: cluster.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"))
    deadline = time.monotonic() + TIMEOUT_S  # as long as the fixture waits: on a starved machine a job can take minutes
    while not marker.exists():
        if time.monotonic() > deadline or not running():
            errors.append(f"job {job or folder.name} never held: {cluster.job(job) if job else ''}")
            release_file.touch()
            return
        time.sleep(0.5)
    time.sleep(0.2)  # the marker is written, not necessarily flushed, when it appears
    # a sweep's job: a task of a job array, named ARRAY_TASK (`scontrol requeue 10` for task 10_1, whose
    # SLURM_JOB_ID is 10, requeued every task of array 10 — seen here)
    job = job or json.loads(marker.read_text())["job"]
    proc = cluster.run(*[a.replace("JOB", job) for a in action], check=False)
    if proc.returncode:
        errors.append(f"{action}: {proc.stderr}")
    if release:
        time.sleep(1)
        release_file.touch()


def hold_args(where: str, folder: Path, step: int | None = None, key: str = "hold", job_num: int | None = None) -> list[str]:
    """Overrides adding slurm_helpers.HoldAtStep ("step") or HoldInCheckpointSave ("save") as callbacks.KEY."""
    target = {"step": "HoldAtStep", "save": "HoldInCheckpointSave"}[where]
    step = {"step": HOLD_STEP, "save": SAVE_STEP}[where] if step is None else step
    return [f"+callbacks.{key}._target_=slurm_helpers.{target}", f"+callbacks.{key}.step={step}",
            f"+callbacks.{key}.marker={folder}/held", f"+callbacks.{key}.release={folder}/release",
            *([f"+callbacks.{key}.job_num={job_num}"] if job_num is not None else [])]


SWEEP = ["-m", "+experiment=phop_tiny", "loop_depth=1x1,1x2", "hardware=slurm", "hardware.gpus_per_node=1",
         "trainer.accelerator=cpu", "trainer.precision=32-true", "hydra.launcher.gpus_per_node=null",
         "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=20",
         "logger=none", "trainer.max_steps=4", "trainer.val_check_interval=2", "checkpoint_every_n_steps=2",
         "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "trainer.enable_model_summary=false",
         "dataset.batch_size=8", "dataset.val_size=8", "dataset.test_size=8",
         "backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64"]
SWEEP_PREEMPT = {0: "usr2", 1: "requeue"}  # job number: how it is preempted at SWEEP_HOLD_STEP


@pytest.fixture(scope="module")
def slurm_jobs(slurm_cluster, tmp_path_factory):
    """The jobs of JOBS (one config: FSDP2 or one process, uninterrupted or preempted) and a `-m hardware=slurm`
    sweep of 2 jobs whose both jobs are preempted, all submitted at once."""
    root = tmp_path_factory.mktemp("slurm_jobs")
    runs = {name: root / name for name in JOBS}
    jobs = {}
    for name, (tasks, nodes, _, where) in JOBS.items():
        extra = [*(FSDP if tasks > 1 else []), *(hold_args(where, runs[name]) if where else [])]
        if nodes > 1:
            extra += ["trainer.devices=1", f"trainer.num_nodes={nodes}"]
        jobs[name] = submit(slurm_cluster, runs[name], [*TINY, *extra, f"hydra.run.dir={runs[name]}/run"], tasks, nodes)

    sweep_dir, holds = root / "sweep", {n: root / f"sweep_hold{n}" for n in SWEEP_PREEMPT}
    for d in holds.values():
        d.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "looplab.train", *SWEEP, f"hydra.sweep.dir={sweep_dir}",
         *[a for n, d in holds.items() for a in hold_args("step", d, SWEEP_HOLD_STEP, f"hold{n}", job_num=n)]],
        cwd=root, env={**slurm_cluster.env, **job_env()}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    errors: dict[str, list[str]] = {name: [] for name in [*runs, *holds]}  # per preempted job
    threads = [threading.Thread(target=preempt_when_held, daemon=True, args=(
        slurm_cluster, jobs[n], runs[n], ACTIONS[how], errors[n]), kwargs={"release": not (how == "requeue" and where == "save")})
        for n, (_, _, how, where) in JOBS.items() if how]
    threads += [threading.Thread(target=preempt_when_held, daemon=True, args=(slurm_cluster, None, d, ACTIONS[SWEEP_PREEMPT[n]],
                                                                               errors[n]), kwargs={"running": lambda: launcher.poll() is None})
                for n, d in holds.items()]
    for t in threads:
        t.start()
    try:
        launcher_out, _ = launcher.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher_out = launcher.communicate()[0]
    infos = {name: slurm_cluster.wait_job(job, timeout=TIMEOUT_S) for name, job in jobs.items()}
    for t in threads:
        t.join(5)
    out = {name: {"job": jobs[name], "dir": runs[name], "run": runs[name] / "run", "info": infos[name],
                  "log": (runs[name] / "slurm.out").read_text(errors="replace"), "errors": errors[name]} for name in runs}
    out["sweep"] = {"dir": sweep_dir, "returncode": launcher.returncode, "log": launcher_out, "holds": holds,
                    "errors": [e for n in holds for e in errors[n]]}
    return out


def weights(run: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(run / "checkpoints" / "last.ckpt")
    return model.state_dict()


def assert_same_weights(run: Path, reference: Path, what: str, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    ref, got = weights(reference), weights(run)
    assert set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {k}: {m}")


def assert_results_are_the_final_weights(run: Path, tmp_path: Path, steps: int = 8) -> dict:
    """results.json's test metrics equal `python -m looplab.eval` on the final checkpoints/last.ckpt."""
    from looplab.eval.__main__ import main as eval_main

    res = json.loads((run / "results.json").read_text())
    assert res["status"] == "ok" and res["global_step"] == steps
    report = eval_main([str(run / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / f"eval-{run.name}")])
    agree = report["agreement"]
    assert agree["compared"] >= 5 and not agree["missing"], agree
    assert agree["max_rel_diff"] < 1e-6, agree
    return res


def assert_one_resume_source(run: Path) -> None:
    hpc = sorted(str(p.relative_to(run)) for p in run.rglob("*hpc_ckpt*"))
    assert not hpc, f"hpc checkpoints written: {hpc}"
    # no temporary file or folder (.last.ckpt.tmp*, .last.ckpt.old) left beside it either
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name != "last.ckpt"]


def assert_attempts(run: Path, res: dict, job_id: str | None = None) -> list[dict]:
    """Two attempts of one SLURM job in attempts.json; results.json's wall time counts both."""
    attempts = json.loads((run / "attempts.json").read_text())["attempts"]
    assert [a["slurm_restart_count"] for a in attempts] == [0, 1], attempts
    assert len({a["slurm_job_id"] for a in attempts}) == 1 and (job_id is None or attempts[0]["slurm_job_id"] == job_id)
    assert attempts[0]["wall_time_s"] > 0 and attempts[-1]["ended"] == "ok"
    assert res["wall_time_total_s"] == pytest.approx(sum(a["wall_time_s"] for a in attempts))
    assert res["wall_time_total_s"] > res["wall_time_s"] + 0.5 * attempts[0]["wall_time_s"]
    return attempts


def assert_resumed_at(res: dict, straight: dict, step: int, steps: int = 8) -> None:
    """The resumed attempt trained steps `step`+1..`steps` (ThroughputRecord counts the tokens of this attempt's
    steps), against the uninterrupted run's tokens for all of them: which checkpoint the attempt started from."""
    per_step = straight["throughput"]["tokens"] / steps
    assert res["throughput"]["tokens"] == pytest.approx(per_step * (steps - step)), (res["throughput"], step)


def test_fsdp_two_ranks_under_srun(slurm_jobs, tmp_path):
    job = slurm_jobs["straight"]
    assert job["info"]["JobState"] == "COMPLETED" and job["info"]["Restarts"] == "0", job["log"][-3000:]
    run = job["run"]
    assert_results_are_the_final_weights(run, tmp_path)
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2  # FSDP2: one shard per rank
    log = (run / "train.log").read_text()
    assert "MEMBER: 2/2" in job["log"] + log and "SLURM auto-requeueing enabled" not in job["log"] + log
    attempts = json.loads((run / "attempts.json").read_text())["attempts"]
    assert [a["slurm_job_id"] for a in attempts] == [job["job"]]


def test_fsdp_two_nodes_one_task_each(slurm_jobs, tmp_path):
    """The second slurmd as a second node: 2 nodes x 1 task train like 1 node x 2 tasks."""
    job = slurm_jobs["two_nodes"]
    assert job["info"]["JobState"] == "COMPLETED" and job["info"]["NodeList"] != slurm_jobs["straight"]["info"]["NodeList"]
    assert job["info"]["NumNodes"] == "2", job["info"]
    run = job["run"]
    assert_results_are_the_final_weights(run, tmp_path)
    assert_same_weights(run, slurm_jobs["straight"]["run"], "2 nodes vs 1", rtol=1e-5, atol=1e-6)


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


def preempted(slurm_jobs, name: str) -> tuple[dict, Path, str, dict]:
    """A preempted job that completed on its second attempt → (job, run folder, its logs, its reference)."""
    job = slurm_jobs[name]
    assert not job["errors"], job["errors"]
    assert job["info"]["JobState"] == "COMPLETED" and job["info"]["Restarts"] == "1", job["log"][-3000:]
    assert "attempt 0" in job["log"] and "attempt 1" in job["log"]
    run = job["run"]
    log = job["log"] + (run / "train.log").read_text()
    assert "resuming from" in log and "Restoring states from the checkpoint path at" in log
    assert "hpc_ckpt" not in log
    return job, run, log, slurm_jobs["straight" if JOBS[name][0] > 1 else "one_straight"]


@pytest.mark.parametrize("name", ["usr1", "requeue", "one_usr1", "one_requeue"])
def test_preempted_job_ends_like_the_uninterrupted_one(slurm_jobs, name, tmp_path):
    """FSDP2 (2 ranks) and one process, preempted at step 4 by SIGUSR1 or by `scontrol requeue`."""
    job, run, log, straight = preempted(slurm_jobs, name)
    if JOBS[name][2] == "usr1":  # saved at the signal's step boundary (on every rank), then requeued by looplab
        assert f"SIGUSR1 at step {HOLD_STEP}: saving" in log and "requeueing SLURM job" in log
        resumed_at = HOLD_STEP
    else:  # killed (SIGTERM, SIGKILL): the next attempt starts from the periodic checkpoint
        assert "DUE TO JOB REQUEUE" in job["log"] and "SIGUSR1" not in log
        resumed_at = 3
    res = assert_results_are_the_final_weights(run, tmp_path)
    assert_one_resume_source(run)
    assert_same_weights(run, straight["run"], f"{name} vs uninterrupted")
    attempts = assert_attempts(run, res, job["job"])
    assert attempts[0]["global_step"] >= resumed_at
    assert_resumed_at(res, json.loads((straight["run"] / "results.json").read_text()), resumed_at)


def test_fsdp_killed_mid_save_resumes_from_the_last_complete_checkpoint(slurm_jobs, tmp_path):
    """`scontrol requeue` while both ranks are inside the step-6 save of last.ckpt, its sharded folder
    half-written (shards and DCP's .metadata, no meta.pt) and not swapped in; SLURM kills the job there (SIGTERM,
    then SIGKILL after KillWait). The next attempt resumes from the step-3 last.ckpt, which the save left
    intact, and the next save clears the half-written folder."""
    job, run, log, straight = preempted(slurm_jobs, "save_killed")
    held = json.loads((job["dir"] / "held").read_text())
    assert held["step"] == SAVE_STEP and Path(held["tmp"]).name == ".last.ckpt.tmp", held
    assert sum(f.endswith(".distcp") for f in held["files"]) == 2 and ".metadata" in held["files"], held
    assert "meta.pt" not in held["files"] and held["last_ckpt_exists"], held  # mid-write, the old one in place
    assert not (job["dir"] / "release").exists()  # never released: the attempt ended inside the save
    assert "DUE TO JOB REQUEUE" in job["log"] and "SIGUSR1" not in log
    res = assert_results_are_the_final_weights(run, tmp_path)
    assert_one_resume_source(run)  # the half-written .last.ckpt.tmp is gone
    assert_same_weights(run, straight["run"], "killed mid-save vs uninterrupted")
    assert_attempts(run, res, job["job"])
    assert_resumed_at(res, json.loads((straight["run"] / "results.json").read_text()), 3)


def test_usr1_during_a_save_is_honoured_at_the_next_step(slurm_jobs, tmp_path):
    """SIGUSR1 while a one-process job is inside the step-6 save of last.ckpt (`.last.ckpt.tmp-PID` written, not
    renamed): the handler only sets a flag, the save completes, and at the next step boundary (7) last.ckpt is
    saved again and the job requeued; the next attempt resumes at step 7."""
    job, run, log, straight = preempted(slurm_jobs, "one_save_usr1")
    held = json.loads((job["dir"] / "held").read_text())
    assert held["step"] == SAVE_STEP and Path(held["tmp"]).name.startswith(".last.ckpt.tmp-") and held["last_ckpt_exists"]
    assert f"SIGUSR1 at step {SAVE_STEP + 1}: saving" in log and "requeueing SLURM job" in log
    res = assert_results_are_the_final_weights(run, tmp_path)
    assert_one_resume_source(run)
    assert_same_weights(run, straight["run"], "SIGUSR1 mid-save vs uninterrupted")
    attempts = assert_attempts(run, res, job["job"])
    assert attempts[0]["global_step"] == SAVE_STEP + 1 and attempts[0]["ended"] == "Requeued"
    assert_resumed_at(res, json.loads((straight["run"] / "results.json").read_text()), SAVE_STEP + 1)


def sweep_results(slurm_jobs) -> dict[int, dict]:
    sweep = slurm_jobs["sweep"]
    assert sweep["returncode"] == 0, sweep["log"][-4000:]
    results = {int(f.parent.name): json.loads(f.read_text()) for f in sorted(sweep["dir"].glob("*/results.json"))}
    assert sorted(results) == [0, 1], sweep["log"][-3000:]
    return results


def test_hardware_slurm_multirun_submits_each_job_with_sbatch(slurm_jobs, slurm_cluster):
    """`-m hardware=slurm` (hydra-submitit-launcher) on CPU nodes: one sbatch job per configuration."""
    job_ids = set()
    for num, res in sweep_results(slurm_jobs).items():
        assert res["status"] == "ok" and res["global_step"] == 4 and res["config"]["hardware"]["name"] == "slurm"
        assert res["model"]["loops"] == num + 1  # loop_depth=1x1,1x2
        job_ids |= {a["slurm_job_id"] for a in json.loads((slurm_jobs["sweep"]["dir"] / str(num) / "attempts.json").read_text())["attempts"]}
    assert len(job_ids) == 2 and None not in job_ids  # two SLURM jobs, one per configuration
    # submitit returns once the result files exist, which can be before SLURM records the jobs as done
    assert all(slurm_cluster.wait_job(j, timeout=1800)["JobState"] == "COMPLETED" for j in job_ids)
    done = (slurm_cluster.root / "log" / "jobcomp.txt").read_text()
    assert all(f"JobId={j} " in done for j in job_ids)


def test_hardware_slurm_multirun_preempted_jobs_resume_in_their_own_folders(slurm_jobs, tmp_path):
    """Both jobs of the submitit sweep preempted at step 3 (a checkpoint every 2 steps): job 0 by SIGUSR2 — the
    signal submitit asks SLURM for before the time limit, which looplab handles at a step boundary instead of
    submitit's handler — and job 1 by `scontrol requeue` (submitit ignores SIGTERM; Lightning stops at the next
    step, SLURM kills and restarts the job). Each restarts the same submitit job (same pickle, same sweep
    folder), resumes from its own last.ckpt, and the launcher returns only once both second attempts are done:
    a requeued attempt leaves no submitit result behind."""
    sweep = slurm_jobs["sweep"]
    assert not sweep["errors"], sweep["errors"]
    results = sweep_results(slurm_jobs)
    per_step = json.loads((slurm_jobs["one_straight"]["run"] / "results.json").read_text())["throughput"]["tokens"] / 8
    for num, how in SWEEP_PREEMPT.items():
        run = sweep["dir"] / str(num)
        held = json.loads((sweep["holds"][num] / "held").read_text())
        assert held["step"] == SWEEP_HOLD_STEP
        # this job's logs: looplab's (Hydra's train.log, when written) and submitit's (its folder %A_%a, all attempts)
        logs = "".join(f.read_text(errors="replace") for f in [run / "train.log", *sweep["dir"].glob(f".submitit/*_{num}/*")]
                       if f.is_file() and f.suffix in (".log", ".out", ".err"))
        assert f"resuming from {run / 'checkpoints' / 'last.ckpt'}" in logs, logs[-3000:]
        if how == "usr2":
            assert f"SIGUSR2 at step {SWEEP_HOLD_STEP}: saving" in logs
            assert "ending this attempt without a result" in logs
            resumed_at = SWEEP_HOLD_STEP
        else:
            assert "Bypassing signal SIGTERM" in logs and "SIGUSR" not in logs  # submitit's handler; Lightning's stops the fit
            resumed_at = 2
        res = results[num]
        assert res["status"] == "ok" and res["global_step"] == 4
        assert_results_are_the_final_weights(run, tmp_path, steps=4)
        assert_one_resume_source(run)
        assert_attempts(run, res, held["slurm_job_id"])
        assert res["throughput"]["tokens"] == pytest.approx(per_step * (4 - resumed_at)), (num, res["throughput"])
