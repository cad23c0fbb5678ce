"""Only global rank 0 puts back an interrupted sharded checkpoint.

`recover_checkpoint` runs in `python -m looplab.train` on every rank before the process group
exists. When SLURM (or torchrun) starts the ranks, each one sees the same `.last.ckpt.old` left by
a save killed between its two renames; rank 0 renames it back and the others wait until it is
there. Tested with real processes started as srun starts them (SLURM_PROCID and friends).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from looplab.training.distributed import is_global_zero_from_env, recover_checkpoint

# what each rank runs: train.py's call, then what it sees. Rank 0 calls it only once rank 1 is polling inside
# it, so rank 1 is seen to wait for rank 0 rather than rename itself, however slowly either process runs.
RANK_SCRIPT = """
import json, os, sys, time
from pathlib import Path
import looplab.training.distributed as distributed

ckpt = Path(sys.argv[1])
waiting = ckpt.with_name("rank1_waiting")
polls = []
if os.environ["SLURM_PROCID"] == "0":
    deadline = time.monotonic() + 1800  # a hang guard: rank 0 renames only once rank 1 is polling
    while not waiting.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
else:
    def sleep(s, _sleep=time.sleep):  # recover_checkpoint's poll: the first one says rank 1 is waiting, inside it
        polls.append(s)
        waiting.touch()
        _sleep(s)
    distributed.time = type("T", (), {"monotonic": staticmethod(time.monotonic), "sleep": staticmethod(sleep)})
recovered = distributed.recover_checkpoint(ckpt, timeout_s=1800)
print(json.dumps({"rank": int(os.environ["SLURM_PROCID"]), "recovered": recovered, "polls": len(polls),
                  "meta": (ckpt / "meta.pt").read_text(), "old_left": ckpt.with_name(".last.ckpt.old").exists()}))
"""


def _slurm_env(rank: int, ntasks: int = 2) -> dict[str, str]:
    """The variables srun gives task `rank` of a one-node job (and none of torchrun's or Lightning's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE")}
    env.update({"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NTASKS": str(ntasks),
                "SLURM_NTASKS_PER_NODE": str(ntasks), "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242",
                "SLURM_JOB_NAME": "looplab", "SLURM_NODELIST": "localhost", "SLURM_STEP_ID": "0",
                "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"})
    return env


@pytest.mark.slow  # two interpreters importing torch and Lightning: ~30 s on a busy 2-core machine
def test_two_slurm_ranks_recover_once_and_both_see_the_checkpoint(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    old = tmp_path / ".last.ckpt.old"
    old.mkdir()
    (old / "meta.pt").write_text("step 3")
    procs = {r: subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(ckpt)], env=_slurm_env(r),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (1, 0)}
    out = {}
    for r, p in procs.items():
        stdout, stderr = p.communicate(timeout=1800)
        assert p.returncode == 0, f"rank {r}: {stderr[-3000:]}"
        out[r] = json.loads(stdout.strip().splitlines()[-1])
    assert [r for r in (0, 1) if out[r]["recovered"]] == [0]  # exactly one recovery, by rank 0
    assert all(out[r]["meta"] == "step 3" and not out[r]["old_left"] for r in (0, 1))
    assert out[1]["polls"] >= 1  # rank 1 was inside first and waited for rank 0's rename (by events, not by the clock)
    assert (ckpt / "meta.pt").read_text() == "step 3" and not old.exists()


def test_a_rank_whose_rank_0_never_recovers_fails_naming_the_path(tmp_path, monkeypatch):
    (tmp_path / ".last.ckpt.old").mkdir()
    monkeypatch.setenv("SLURM_PROCID", "1")
    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"\.last\.ckpt\.old") as info:
        recover_checkpoint(tmp_path / "last.ckpt", timeout_s=0.5, poll_s=0.05)
    assert str(tmp_path / "last.ckpt") in str(info.value) and time.monotonic() - start < 600  # gave up (a hang guard, not a speed bound)
    assert not (tmp_path / "last.ckpt").exists()  # a non-zero rank never renames


def test_a_non_zero_rank_does_not_wait_without_an_interrupted_save(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert recover_checkpoint(tmp_path / "last.ckpt", timeout_s=0) is False  # a fresh run: nothing to wait for
    (tmp_path / "last.ckpt").mkdir()
    (tmp_path / ".last.ckpt.old").mkdir()  # a stale .old beside a complete checkpoint is left alone
    assert recover_checkpoint(tmp_path / "last.ckpt", timeout_s=0) is False


@pytest.mark.parametrize("env, zero", [
    ({}, True),  # one process, or Lightning's launcher before it starts its children
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, True),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, False),
    ({"RANK": "0", "LOCAL_RANK": "0", "SLURM_PROCID": "3"}, True),  # torchrun inside a SLURM allocation
    ({"RANK": "2", "LOCAL_RANK": "0"}, False),  # torchrun, node 1
    ({"LOCAL_RANK": "1", "NODE_RANK": "0", "SLURM_PROCID": "0"}, False),  # Lightning's child of a one-task SLURM job
    ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False),  # one process per node, second node (not rank 0)
    ({"LOCAL_RANK": "0", "NODE_RANK": "0"}, True),
    ({"JSM_NAMESPACE_RANK": "1"}, False),  # LSF
])
def test_global_rank_zero_is_read_from_the_launchers_environment(env, zero):
    assert is_global_zero_from_env(env) is zero
