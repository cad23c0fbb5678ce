"""hardware=fsdp (FSDP2 through Lightning's ModelParallelStrategy), executed on 2 CPU processes (gloo).

Each test runs `python -m looplab.train` as a user would and checks the result against a
single-process run of the same global batch: the logged losses and the final weights agree
within float tolerance, a run killed mid-way resumes from its sharded checkpoint to the
weights of an uninterrupted run, warm starts load into the sharded model, only rank 0 writes
results.json, and two "nodes" of one process each (num_nodes=2) train like one node of two.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from looplab.checkpoint import load_model

pytestmark = pytest.mark.slow

# small enough for seconds per run; gradient clipping at 0.05 so that it really clips under sharding
TINY = ["logger=csv", "trainer.log_every_n_steps=1", "trainer.max_steps=6", "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "trainer.gradient_clip_val=0.05", "checkpoint_every_n_steps=3",
        "backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64"]
PHOP = ["+experiment=phop_tiny", "loop_depth=2x2", "dataset.batch_size=8", "dataset.val_size=16", "dataset.test_size=16", *TINY]
LM = ["+experiment=lm_tiny", "loop_depth=1x2", "state_mode=stateloop", "dataset.batch_size=4", "dataset.seq_len=32",
      "dataset.val_tokens=2048", "backbone.max_seq_len=64", *TINY]
FSDP = ["hardware=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"]
SINGLE = ["hardware=cpu"]


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None, check: bool = True, wait: bool = True):
    # this checkout's src first: an editable install may point at another checkout (a git worktree's tests test the worktree)
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "looplab.train", *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if check:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def run_together(*arg_lists: list[str], cwd: Path) -> None:
    """Start the runs at once and wait for all: their start-up (imports, data, process group) overlaps."""
    procs = [run(args, cwd, wait=False) for args in arg_lists]
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]


def train_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(run_dir / "checkpoints" / "last.ckpt")
    return model.state_dict()


def assert_same_weights(a: dict, b: dict, rtol: float, atol: float, what: str) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {k}: {m}")


@pytest.fixture(scope="module")
def phop_runs(tmp_path_factory):
    """One single-process run and one FSDP run of the same p-hop job, shared by the tests below."""
    root = tmp_path_factory.mktemp("fsdp_phop")
    run_together([*PHOP, *SINGLE, f"hydra.run.dir={root}/single"], [*PHOP, *FSDP, f"hydra.run.dir={root}/fsdp"], cwd=root)
    return root


def test_fsdp_phop_equals_single_process(phop_runs):
    root = phop_runs
    single, fsdp = train_losses(root / "single"), train_losses(root / "fsdp")
    assert sorted(single) == sorted(fsdp) and len(single) == 6
    for step in single:  # the global batch's loss: fsdp logs the mean over its 2 ranks' halves
        assert fsdp[step] == pytest.approx(single[step], rel=1e-4), step
    # fp32 on both sides; the only differences are the order of the sums over ranks
    assert_same_weights(weights(root / "fsdp"), weights(root / "single"), rtol=1e-4, atol=1e-5, what="fsdp vs 1 process")
    res = json.loads((root / "fsdp" / "results.json").read_text())
    ref = json.loads((root / "single" / "results.json").read_text())
    assert res["status"] == "ok" and res["global_step"] == 6 and res["config"]["trainer"]["strategy"] == "fsdp"
    # evaluation over the whole split, reduced across ranks, equals one process's
    for d in range(2):
        assert res["per_depth"]["acc"][d] == pytest.approx(ref["per_depth"]["acc"][d], abs=1e-6)
        assert res["per_depth"]["loss"][d] == pytest.approx(ref["per_depth"]["loss"][d], rel=1e-4)


def test_fsdp_checkpoint_is_sharded_and_only_rank0_writes_results(phop_runs):
    ckpt = phop_runs / "fsdp" / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and (ckpt / ".metadata").is_file() and (ckpt / "meta.pt").is_file()
    assert len(list(ckpt.glob("*.distcp"))) == 2  # one shard file per rank
    leftovers = [p.name for p in ckpt.parent.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"temporary checkpoint folders left behind: {leftovers}"
    written = sorted(str(p.relative_to(phop_runs)) for p in phop_runs.rglob("results.json"))
    assert written == ["fsdp/results.json", "single/results.json"]


def test_fsdp_killed_run_resumes_to_the_uninterrupted_weights(phop_runs, tmp_path):
    """Both ranks die hard at step 4 (checkpoint of step 3 on disk); the re-run resumes there."""
    killed = tmp_path / "killed"
    kill = ["+callbacks.kill._target_=fsdp_helpers.ExitAtStep", "+callbacks.kill.step=4"]
    proc = run([*PHOP, *FSDP, f"hydra.run.dir={killed}", *kill], tmp_path, check=False)
    assert proc.returncode == 17, (proc.stdout + proc.stderr)[-3000:]
    assert not (killed / "results.json").exists()
    proc = run([*PHOP, *FSDP, f"hydra.run.dir={killed}"], tmp_path)
    assert "resuming from" in proc.stdout + proc.stderr
    res = json.loads((killed / "results.json").read_text())
    assert res["global_step"] == 6
    assert_same_weights(weights(killed), weights(phop_runs / "fsdp"), rtol=1e-6, atol=1e-7, what="resumed vs uninterrupted")


def test_fsdp_stage2_warm_start_loads_into_the_sharded_model(phop_runs, tmp_path):
    """exit_gate stage 2 from the single-process checkpoint: the frozen backbone leaves FSDP exactly as it came in."""
    init = phop_runs / "single" / "checkpoints" / "last.ckpt"
    out = tmp_path / "stage2"
    run([*PHOP, *FSDP, "exit_gate=ouro", "exit_gate.stage=stage2", f"exit_gate.init_from={init}",
         "trainer.max_steps=3", f"hydra.run.dir={out}"], tmp_path)
    before, after = weights(phop_runs / "single"), weights(out)
    gate = [k for k in after if k.startswith("exit_gate.")]
    assert gate and all(k not in before for k in gate)
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=lambda m: f"frozen {k} changed: {m}")


def test_fsdp_lm_tiny_equals_single_process(tmp_path):
    """A StateLoop LM on the embedded corpus: FSDP's losses and weights equal one process's."""
    run_together([*LM, *SINGLE, f"hydra.run.dir={tmp_path}/single"], [*LM, *FSDP, f"hydra.run.dir={tmp_path}/fsdp"],
                 cwd=tmp_path)
    single, fsdp = train_losses(tmp_path / "single"), train_losses(tmp_path / "fsdp")
    assert sorted(single) == sorted(fsdp)
    for step in single:
        assert fsdp[step] == pytest.approx(single[step], rel=1e-4), step
    assert_same_weights(weights(tmp_path / "fsdp"), weights(tmp_path / "single"), rtol=1e-4, atol=1e-5, what="lm fsdp")
    res = json.loads((tmp_path / "fsdp" / "results.json").read_text())
    ref = json.loads((tmp_path / "single" / "results.json").read_text())
    assert res["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)


def test_fsdp_exit_aware_fine_tuning_equals_single_process(tmp_path):
    """exit_gate.skip_train_prob under FSDP2: the exit-aware forward runs through the sharded root (its
    embedding, norms and head gathered by the root's hooks), each rank draws its shard of the global
    batch's exits, and losses and weights equal one process's (p-hop, 2⊗3, kv_copy)."""
    aware = ["loop_depth=2x3", "exit_gate.skip_train_prob=0.5", "exit_gate.skip_compute=kv_copy",
             "trainer.max_steps=4", "checkpoint_every_n_steps=4", "trainer.val_check_interval=4"]
    run_together([*PHOP, *aware, *SINGLE, f"hydra.run.dir={tmp_path}/single"],
                 [*PHOP, *aware, *FSDP, f"hydra.run.dir={tmp_path}/fsdp"], cwd=tmp_path)
    single, fsdp = train_losses(tmp_path / "single"), train_losses(tmp_path / "fsdp")
    assert sorted(single) == sorted(fsdp) and len(single) == 4
    for step in single:
        assert fsdp[step] == pytest.approx(single[step], rel=1e-4), step
    assert_same_weights(weights(tmp_path / "fsdp"), weights(tmp_path / "single"), rtol=1e-4, atol=1e-5, what="exit-aware fsdp")
    with open(tmp_path / "fsdp" / "csv" / "metrics.csv") as f:  # tokens really exited early
        early = [float(r["train/exit_early_frac"]) for r in csv.DictReader(f) if r.get("train/exit_early_frac")]
    assert early and 0.2 < min(early) and max(early) < 0.8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_of_one_process_train_like_one_node_of_two(phop_runs, tmp_path):
    """num_nodes=2 with the environment Lightning reads on a cluster without SLURM (one process per node)."""
    port = str(_free_port())
    out = tmp_path / "multinode"
    procs = []
    for node in (0, 1):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node), "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
        procs.append(run([*PHOP, "hardware=fsdp", "trainer.accelerator=cpu", "trainer.devices=1", "trainer.num_nodes=2",
                          f"hydra.run.dir={out}"], tmp_path, env=env, wait=False))
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in logs[1], logs[1][-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "ok" and res["global_step"] == 6
    assert_same_weights(weights(out), weights(phop_runs / "fsdp"), rtol=1e-5, atol=1e-6, what="2 nodes vs 1 node x 2")


def test_recover_checkpoint_puts_back_a_save_killed_between_its_renames(tmp_path):
    """LoopedFSDPStrategy swaps a new sharded folder in by two renames (last → .last.old, .tmp → last);
    killed between them, the next start finds only .last.ckpt.old and must resume from it."""
    from looplab.training.distributed import recover_checkpoint

    path = tmp_path / "last.ckpt"
    old = tmp_path / ".last.ckpt.old"
    old.mkdir()
    (old / "meta.pt").write_bytes(b"x")
    recover_checkpoint(path)
    assert (path / "meta.pt").read_bytes() == b"x" and not old.exists()
    (tmp_path / ".last.ckpt.old").mkdir()  # a stale .old beside a complete checkpoint is left alone
    recover_checkpoint(path)
    assert path.is_dir() and (tmp_path / ".last.ckpt.old").exists()
