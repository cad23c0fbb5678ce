"""Scale-out on the CPU (gloo): DDP and FSDP give the single-process gradients of a looped model.

The block of a looped model is applied R times in one forward, so a sharded layer is
gathered R times and its gradient accumulates R contributions before the reduction;
these tests check that on 2 CPU processes against one process on the same global batch.
One spawn runs every strategy (process start-up dominates on a loaded CPU); a strategy
fails is recorded with its error and its test fails with the traceback.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exits import ExitPolicy

pytestmark = pytest.mark.slow
WORLD, B, T, V = 2, 4, 12, 37
STRATEGIES = ("ddp", "fsdp2", "fsdp2_exit_aware")


def make_model(seed: int = 0) -> LoopedLM:
    """A looped StateLoop model (2⊗3) whose every parameter gets a gradient (W_o is zero at init)."""
    torch.manual_seed(seed)
    cfg = LoopedLMConfig(vocab_size=V, d_model=32, n_heads=2, ffn_hidden=64, n_layers=2, n_loops=3, state_mode="stateloop_attn")
    model = LoopedLM(cfg)
    with torch.no_grad():
        model.state.state_out.weight.normal_(0, 0.05)
    return model


def global_batch() -> torch.Tensor:
    return torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(1))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))


def exit_steps() -> torch.Tensor:
    """(B, T) exit steps of the global batch for the exit-aware forward (1..R, every depth present)."""
    return torch.randint(1, 4, (B, T), generator=torch.Generator().manual_seed(2))


def exit_aware_loss_of(model, ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1], exits=ExitPolicy(skip="kv_copy", steps=steps)).logits
    return F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))


def _clean(name: str) -> str:
    for junk in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(junk, "")
    return name


def _grads_ddp(rank: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    loss_of(model, ids).backward()
    return {_clean(n): p.grad.detach().clone() for n, p in model.named_parameters()}


def _grads_fsdp2(rank: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    from looplab.training.distributed import shard_looped_model

    model = make_model()
    shard_looped_model(model)  # what hardware=fsdp applies: one unit per backbone layer, then the root
    loss_of(model, ids).backward()
    return {_clean(n): p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _grads_fsdp2_exit_aware(rank: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Exit-aware fine-tuning's forward (forward_with_exits through LoopedLM.forward) on the sharded model."""
    from looplab.training.distributed import shard_looped_model

    model = make_model()
    shard_looped_model(model)
    steps = exit_steps()[rank * B // WORLD:(rank + 1) * B // WORLD]
    exit_aware_loss_of(model, ids, steps).backward()
    return {_clean(n): p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    ids = global_batch()
    local = ids[rank * B // WORLD:(rank + 1) * B // WORLD]  # each rank its half of the same global batch
    for name, fn in (("ddp", _grads_ddp), ("fsdp2", _grads_fsdp2), ("fsdp2_exit_aware", _grads_fsdp2_exit_aware)):
        try:
            res = {"grads": fn(rank, local)}
        except Exception as e:  # recorded: the test fails with it
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        dist.barrier()
        if rank == 0:
            torch.save(res, os.path.join(out_dir, f"{name}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed_grads(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    model = make_model()
    loss_of(model, global_batch()).backward()
    reference = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model = make_model()
    exit_aware_loss_of(model, global_batch(), exit_steps()).backward()
    reference_exit = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return reference, reference_exit, {s: torch.load(out / f"{s}.pt", weights_only=False) for s in STRATEGIES}


def _compare(reference, res, strategy):
    grads = res["grads"]
    assert set(grads) == set(reference), set(grads) ^ set(reference)
    for n, g in reference.items():
        assert g.abs().sum() > 0, f"{n} has no gradient in the reference"  # every branch is exercised
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{strategy} {n}: {m}")


def test_ddp_two_processes_equal_one_process(distributed_grads):
    reference, _, results = distributed_grads
    assert "error" not in results["ddp"], results["ddp"].get("traceback")
    _compare(reference, results["ddp"], "ddp")


def test_fsdp2_fully_shard_looped_block_equals_one_process(distributed_grads):
    """FSDP2 (fully_shard per backbone layer; the block gathered once per step, tests/test_fsdp_traffic.py)."""
    reference, _, results = distributed_grads
    assert "error" not in results["fsdp2"], results["fsdp2"].get("traceback")
    _compare(reference, results["fsdp2"], "FSDP2 fully_shard")


def test_fsdp2_exit_aware_forward_equals_one_process(distributed_grads):
    """The exit-aware forward (skip_compute with per-token exit steps) under FSDP2: it goes through the sharded
    root's forward, so the embedding, norms and head are gathered, and its gradients are one process's."""
    _, reference_exit, results = distributed_grads
    assert "error" not in results["fsdp2_exit_aware"], results["fsdp2_exit_aware"].get("traceback")
    _compare(reference_exit, results["fsdp2_exit_aware"], "FSDP2 exit-aware")


def test_exit_aware_model_forward_is_the_reference_bit_for_bit():
    """model(ids, exits=ExitPolicy(skip=H, steps=S)) is exit_compute.forward_with_exits, bit for bit, gradients too."""
    from looplab.models.exit_compute import forward_with_exits

    ids, steps = global_batch()[:, :-1], exit_steps()
    a, b = make_model(), make_model()
    want, got = forward_with_exits(a, ids, steps, "kv_copy"), b(ids, exits=ExitPolicy(skip="kv_copy", steps=steps))
    assert torch.equal(want.logits, got.logits) and torch.equal(want.loop_logits, got.loop_logits)
    want.logits.sum().backward()
    got.logits.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="needs skip_compute"):
        ExitPolicy(steps=steps)
    with pytest.raises(ValueError, match="backprop_loops"):
        b(ids, exits=ExitPolicy(skip="kv_copy", steps=steps), backprop_loops=1)


# ----------------------------------------------------------------------------- Hydra multirun + DDP
def test_hydra_multirun_ddp_children_run_only_their_job(tmp_path):
    """-m with hardware=ddp on 2 CPU processes: each job's rank-1 child runs that job alone, in the job's folder.

    Stock Lightning relaunches children with the original argv (`-m` + the sweep), so each child
    re-expands the sweep (one extra "Launching 2 jobs" per child); looplab.train wraps each job in
    looplab.training.hydra_ddp.per_job_ddp, which rebuilds the child command from the job's own overrides.
    """
    import json
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT / "tests")}
    args = ["-m", "hardware=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true", "logger=none",
            "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "dataset.batch_size=8",
            "dataset.val_size=8", "dataset.test_size=8", "backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64",
            "loop_depth=1x1,1x2", f"hydra.sweep.dir={tmp_path}/sweep"]
    proc = subprocess.run([sys.executable, "-m", "looplab.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("Launching 2 jobs") == 1, "a DDP child re-expanded the -m sweep"
    for job, loops in ((0, 1), (1, 2)):
        folder = tmp_path / "sweep" / str(job)
        res = json.loads((folder / "results.json").read_text())
        assert res["status"] == "ok" and res["model"]["loops"] == loops and res["global_step"] == 4
        assert res["throughput"]["tokens"] == 4 * 8 * 33  # rank 0's half of every global batch of 8
        child_log = (folder / "train_ddp_process_1.log").read_text()
        assert f"1x{loops}" in child_log and "Launching" not in child_log
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]


# ----------------------------------------------------------------------------- SLURM sweeps, executed locally
def test_submitit_local_sweep_writes_every_job(tmp_path):
    """The -m sweep through hydra-submitit-launcher's local executor (what hardware=slurm submits to SLURM)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT / "tests")}
    args = ["-m", "+experiment=phop_tiny", "hydra/launcher=submitit_local", "loop_depth=1x1,1x2", "trainer.max_steps=10",
            "logger=none", "trainer.val_check_interval=5", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "dataset.val_size=64",
            "dataset.test_size=64", "backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64",
            f"hydra.sweep.dir={tmp_path}/sweep"]
    proc = subprocess.run([sys.executable, "-m", "looplab.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Submitit 'local' sweep output dir" in out
    for job, loops in ((0, 1), (1, 2)):
        res = json.loads((tmp_path / "sweep" / str(job) / "results.json").read_text())
        assert res["status"] == "ok" and res["model"]["loops"] == loops and res["global_step"] == 10
    assert len(list((tmp_path / "sweep" / ".submitit").iterdir())) >= 2  # submitit's own job folders: it really ran them


def test_paper_table_on_slurm_dry_run_composes(tmp_path):
    """`python -m looplab.tables run N --scale paper --hardware slurm --dry-run` prints commands that compose,
    with FSDP2 as the strategy for the LM tables."""
    import shlex
    import subprocess
    import sys

    from conftest import compose

    proc = subprocess.run([sys.executable, "-m", "looplab.tables", "run", "1", "--scale", "paper", "--hardware", "slurm",
                           "--dry-run", "--out-root", str(tmp_path)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    commands = [shlex.split(line) for line in proc.stdout.splitlines() if "looplab.train" in line]
    assert commands, proc.stdout
    for argv in commands:
        overrides = [a for a in argv[argv.index("looplab.train") + 1:] if a != "-m"]
        assert "hardware=slurm" in overrides
        single = [o.split("=", 1)[0] + "=" + o.split("=", 1)[1].split(",")[0] if "," in o and "[" not in o else o for o in overrides]
        single = [o for o in single if not o.startswith("hydra.")]
        cfg = compose(single)
        assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
        assert cfg.trainer.strategy == "fsdp" and cfg.trainer.num_nodes == cfg.hardware.nodes
