"""Shared test fixtures: Hydra compose of the real conf/ tree, tiny configs, offline environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# `make test` runs two pytest workers (xdist, one file per worker at a time) on the 2 cores: one torch thread each,
# or four threads fight over two cores. Run alone, a test gets both.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="module")
def one_thread_module():
    """One torch thread for a module of tiny-model tests: they gain nothing from the second thread, and
    on a busy machine two OpenMP threads wait on each other (measured: 9 ms per 64-wide linear instead
    of 0.05 ms). Use it through a module's own autouse fixture."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def compose(overrides: list[str] | None = None, config_name: str = "train"):
    """Compose the training config exactly as `python -m looplab.train` would (with hydra.* resolvable)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return hydra_compose(config_name=config_name, overrides=overrides or [], return_hydra_config=True)


@pytest.fixture
def tiny_overrides(tmp_path):
    """Overrides that make a training run take seconds on the CPU."""
    return [
        "logger=none",
        f"hydra.run.dir={tmp_path}/run",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "checkpoint_every_n_steps=3",
        "dataset.batch_size=8",
        "dataset.val_size=16",
        "dataset.test_size=16",
        "backbone.d_model=32",
        "backbone.n_heads=2",
        "backbone.ffn_hidden=64",
    ]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real SLURM cluster on this machine for the whole session (looplab/testing/slurm_cluster.py): munged,
    slurmctld and two slurmds on 127.0.0.1, apt-installed when missing (root only). Skips, saying why, where
    it cannot start (not root, no apt-get, a daemon that does not come up)."""
    from looplab.testing.slurm_cluster import ClusterUnavailable, SlurmCluster

    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=16)
    try:
        cluster.start()
    except ClusterUnavailable as e:
        pytest.skip(f"no SLURM cluster here: {e}")
    print(f"\nSLURM cluster up in {cluster.startup_s:.1f} s ({cluster.root})")
    yield cluster
    cluster.stop()
