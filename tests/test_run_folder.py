"""A run owns its folder (looplab.training.run_folder): a second live run into it is refused naming the first one's
PID, resume=auto with other overrides is refused naming the keys (resume=force: accepted), attempts.json keeps every
writer's entries, and killed or failed saves leave no temporary files behind (checkpoints and the token cache).

A "live run" is a process that holds the folder's lock and waits on its stdin (killed by the test: no timers);
the killed saves are real: forked processes stopped half-way through AtomicCheckpointIO's write, then kill -9."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from test_train import cli, run_train

from looplab.training.run_folder import (
    ResumeOverridesDiffer, RunFolderBusy, RunFolderLock, claim_run_folder, differing_overrides, read_holder,
)

HOLD = """
import sys
from looplab.training.run_folder import RunFolderLock
RunFolderLock.acquire(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()  # holds the lock until killed
"""


@contextlib.contextmanager
def live_run(folder: Path, **env: str):
    """A process holding `folder`'s lock, as a live training run does; killed (-9) on the way out."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env})
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def dead_pid() -> int:
    """The PID of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def temps(run: Path) -> list[str]:
    return sorted(p.name for p in [*run.glob(".*.tmp*"), *run.glob("checkpoints/.*.tmp*")])


def short(tiny_overrides: list[str], *extra: str) -> list[str]:
    return tiny_overrides + ["trainer.max_steps=2", "test_after_fit=false", "checkpoint_every_n_steps=1", *extra]


# ------------------------------------------------------------------------------------------------- the lock
def test_a_second_live_run_is_refused_naming_the_first_ones_pid_and_runs_once_it_died(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    with live_run(run) as first:
        with pytest.raises(RunFolderBusy, match=rf"in use by another live run: PID {first.pid} on"):
            run_train(short(tiny_overrides), run)
        assert sorted(p.name for p in run.iterdir()) == [".lock"]  # it wrote nothing: no attempt, checkpoint, result
        # the other ranks of a multi-rank job take no lock: rank 0's would refuse them
        with claim_run_folder(run, [], "auto", rank_zero=False) as lock:
            assert lock is None
    # the first run was killed (-9): the kernel dropped its lock, and the next run (a re-run, a requeue) takes it
    res = run_train(short(tiny_overrides), run)
    assert res["status"] == "ok" and res["global_step"] == 2
    assert read_holder(run)["pid"] == os.getpid()
    RunFolderLock.acquire(run).release()  # released at the end of the run


def test_the_cli_refuses_in_one_line_and_leaves_the_folder_as_it_was(tmp_path):
    """Hydra writes .hydra/ before any task code runs: the refused run puts back the owner's copy, and writes no
    failed results.json over the owner's."""
    run = tmp_path / "run"
    hydra_dir = run / ".hydra"
    (hydra_dir / ".accepted").mkdir(parents=True)
    for f in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        for where in (hydra_dir, hydra_dir / ".accepted"):
            (where / f).write_text(f"# the owner's {f}\n")
    (run / "results.json").write_text('{"status": "ok", "seed": 1}')
    with live_run(run) as first:
        proc = cli(["logger=none", "seed=2", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and f"PID {first.pid}" in errors[0] and errors[0].startswith("python -m looplab.train: error:")
    assert json.loads((run / "results.json").read_text()) == {"status": "ok", "seed": 1}
    assert (hydra_dir / "overrides.yaml").read_text() == "# the owner's overrides.yaml\n"
    assert not (run / "attempts.json").exists() and not (run / "checkpoints").exists()


def test_a_requeued_attempt_takes_over_the_lock_of_its_earlier_attempt(tmp_path, monkeypatch):
    """SLURM ends an attempt before it starts the requeued one, but on a shared file system a lost node's lock can
    outlive it: the lock of an earlier attempt of the same job is taken over; another job's is not."""
    run = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with live_run(run, SLURM_JOB_ID="4241", SLURM_RESTART_COUNT="0") as other_job:
        with pytest.raises(RunFolderBusy, match=f"PID {other_job.pid}"):
            RunFolderLock.acquire(run)
    with live_run(run, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0"):
        lock = RunFolderLock.acquire(run)
        assert lock.held and read_holder(run)["slurm_restart_count"] == 1
        lock.release()


FORKS_AND_HOLDS = """
import os, sys
from looplab.training.run_folder import RunFolderLock
RunFolderLock.acquire(sys.argv[1])
sys.stdout.flush()
child = os.fork()
if child == 0:  # the fork hooks have run by the time fork() returns here
    os.write(1, b"child ready\\n")
    os.read(0, 1)  # a forked helper (a DataLoader worker) blocked: it outlives its parent
    os._exit(0)
os.write(1, f"forked {child}\\n".encode())
os.read(0, 1)
"""


def test_a_forked_helper_outliving_a_killed_run_does_not_keep_its_folder_locked(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", FORKS_AND_HOLDS, str(run)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    child = None
    try:
        lines = sorted(proc.stdout.readline().split() for _ in range(2))  # either may come first
        assert lines[0] == ["child", "ready"] and lines[1][0] == "forked", lines
        child = lines[1][1]
        with pytest.raises(RunFolderBusy, match=f"PID {proc.pid}"):
            RunFolderLock.acquire(run)
        proc.kill()
        proc.wait()
        os.kill(int(child), 0)  # the helper still runs
        RunFolderLock.acquire(run).release()
    finally:
        proc.kill()
        proc.wait()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), signal.SIGKILL)


# ------------------------------------------------------------------------------------------- the overrides
def test_resume_with_other_overrides_is_refused_naming_the_keys_and_forced_with_resume_force(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    first = run_train(short(tiny_overrides, "seed=1"), run)
    assert first["global_step"] == 2
    before = (run / "attempts.json").read_text()
    with pytest.raises(ResumeOverridesDiffer) as refused:
        run_train(short(tiny_overrides, "seed=2", "optim.lr=0.01"), run)
    msg = str(refused.value)
    assert "seed: 1 -> 2" in msg and "optim.lr: (not set) -> 0.01" in msg and "resume=force" in msg
    assert "trainer.max_steps" not in msg and "\n" not in msg
    assert (run / "attempts.json").read_text() == before  # the refused attempt left no record

    # trainer.max_steps (continuing for longer) is not what the checkpoint was trained with: a plain resume
    longer = run_train(short(tiny_overrides, "seed=1", "trainer.max_steps=3"), run)
    assert longer["global_step"] == 3

    forced = run_train(short(tiny_overrides, "seed=2", "optim.lr=0.01", "trainer.max_steps=4", "resume=force"), run)
    assert forced["status"] == "ok" and forced["global_step"] == 4  # resumed from step 3, not started afresh
    attempts = json.loads((run / "attempts.json").read_text())["attempts"]
    assert len(attempts) == 3 and all(a["ended"] == "ok" for a in attempts)
    assert "seed=2" in attempts[-1]["overrides"] and "seed=1" in attempts[0]["overrides"]
    # the forced overrides are now the folder's record: the same ones resume without force
    assert differing_overrides(attempts[-1]["overrides"], short(tiny_overrides, "seed=2", "optim.lr=0.01")) == {}


def test_the_exempt_keys_and_how_overrides_are_compared():
    old = ["seed=1", "+callbacks.crash={_target_: x}", "logger=csv", "trainer.max_steps=100", "backbone.d_model=32"]
    new = ["backbone.d_model=32", "seed=1", "trainer.max_steps=200", "logger=none", "resume=auto", "tags=[a]"]
    assert differing_overrides(old, new) == {}
    assert differing_overrides(["seed=1", "++optim.lr=1e-3"], ["~seed", "optim.lr=1e-3"]) == {"seed": ("1", "<deleted>")}


# ------------------------------------------------------------------------------------------------ attempts.json
def test_two_writers_of_attempts_json_keep_each_others_entries(tmp_path):
    """Each save re-reads the file and replaces only its own entry (under the run's lock in train.py): two attempts
    whose clocks both started before either wrote used to erase each other's entry."""
    from looplab.training.callbacks import AttemptClock

    path = tmp_path / "attempts.json"
    a = AttemptClock(path, start=1000.0)
    b = AttemptClock(path, start=2000.0)
    a.save(10.0, global_step=3)
    b.save(20.0, global_step=6)
    assert a.save(11.0, global_step=4, ended="ok") == pytest.approx(31.0)
    attempts = json.loads(path.read_text())["attempts"]
    assert [(x["wall_time_s"], x["global_step"]) for x in attempts] == [(11.0, 4), (20.0, 6)]


def test_a_failure_record_that_cannot_be_written_is_one_line_on_stderr(tmp_path, capsys):
    from looplab.training.callbacks import AttemptClock

    (tmp_path / "file").write_text("")
    clock = AttemptClock(tmp_path / "file" / "attempts.json", start=0.0)  # its folder is a file: unwritable
    clock.record_failure("saving last.ckpt failed: [Errno 28] No space left on device")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "could not record it" in err


# ---------------------------------------------------------------------------------------------- temp files
KILLED_SAVES = """
import os, sys
from pathlib import Path
from looplab.training.callbacks import AtomicCheckpointIO

def half_way(checkpoint, path):  # the temp file written, then stopped: fsync and rename not done
    Path(path).write_bytes(b"x" * 2**20)
    os.write(1, f"saving {os.getpid()} {path}\\n".encode())
    os.read(0, 1)  # blocks: stdin is never written

AtomicCheckpointIO.write_temporary = staticmethod(half_way)
ckpt_dir = Path(sys.argv[1])
sys.stdout.flush()
children = []
for i in range(5):
    pid = os.fork()
    if pid == 0:
        AtomicCheckpointIO().save_checkpoint({}, ckpt_dir / ("last.ckpt" if i % 2 else f"step{i}.ckpt"))
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""


def test_five_saves_killed_with_sigkill_leave_no_orphan_once_the_run_finishes(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVES, str(run / "checkpoints")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        saving = [proc.stdout.readline().split() for _ in range(5)]
        assert all(s[0] == "saving" for s in saving), saving
        for _, pid, _ in saving:
            os.kill(int(pid), signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    (run / f".results.json.tmp-{dead_pid()}").write_text("{")  # write_json_atomic killed too
    left = temps(run)
    assert len(left) == 6 and sum(n.startswith(".last.ckpt.tmp-") for n in left) == 2, left
    res = run_train(short(tiny_overrides), run)
    assert res["status"] == "ok"
    assert temps(run) == []
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]


def test_enospc_during_a_save_removes_the_partial_temp_and_records_the_failure(tiny_overrides, tmp_path, monkeypatch):
    from looplab.training.callbacks import AtomicCheckpointIO

    def disk_full(checkpoint, path):
        Path(path).write_bytes(b"x" * 4096)  # part of the checkpoint written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(AtomicCheckpointIO, "write_temporary", staticmethod(disk_full))
    run = tmp_path / "run"
    with pytest.raises(OSError, match="No space left on device"):
        run_train(short(tiny_overrides), run)
    assert temps(run) == [] and not (run / "checkpoints" / "last.ckpt").exists()
    attempt = json.loads((run / "attempts.json").read_text())["attempts"][-1]
    assert "No space left on device" in attempt["error"] and "was removed" in attempt["error"], attempt
    assert attempt["error"].startswith(f"saving {run / 'checkpoints'}") and attempt["ended"] == "OSError"


def test_token_cache_temp_files_of_a_failed_or_dead_writer_are_removed(tmp_path, monkeypatch):
    import looplab.data.prepare as prepare_mod
    from looplab.data import corpus
    from looplab.data.prepare import SourceConfig, prepare

    texts = [corpus.documents()[i][1][2000:3500] for i in range(8)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    src = SourceConfig(source="json", data_files=str(data), val_fraction=0.25)
    cache = tmp_path / "cache"
    real = prepare_mod._token_batches

    def crashes(*args, **kw):  # the tokeniser fails after its first batch
        yield next(iter(real(*args, **kw)))
        raise RuntimeError("tokeniser crashed")

    monkeypatch.setattr(prepare_mod, "_token_batches", crashes)
    with pytest.raises(RuntimeError, match="tokeniser crashed"):
        prepare(src, "shakespeare-bpe-4096", cache, verbose=False)
    (folder,) = cache.iterdir()
    assert [p.name for p in folder.iterdir() if ".tmp" in p.name] == []
    monkeypatch.setattr(prepare_mod, "_token_batches", real)

    here, gone = socket.gethostname(), dead_pid()
    orphans = [f".train.bin.tmp{gone}@{here}", f".validation.bin.tmp{gone}", f".train.json.tmp{gone}@{here}"]
    kept = [f".train.bin.tmp{os.getppid()}@{here}",  # a live writer preparing the same cache now
            f".train.bin.tmp{gone}@another-node"]  # a writer on another host: its PID means nothing here
    for name in orphans + kept:
        (folder / name).write_bytes(b"\0" * 64)
    out = prepare(src, "shakespeare-bpe-4096", cache, verbose=False)
    assert out["train"].num_tokens > 0
    assert sorted(p.name for p in folder.iterdir() if ".tmp" in p.name) == sorted(kept)
