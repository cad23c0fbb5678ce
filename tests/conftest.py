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


# ----------------------------------------------------------------------------- xdist: the longest files first
# `make test` gives each of its two workers whole files (--dist loadfile). xdist hands them out by number of tests, so
# a file of a few long tests (test_extending.py, test_slurm.py) came last and one worker ran it alone at the end
# (65 s of one idle core in 722 s). Longest first (LPT) balances the two to within the shortest files. The seconds
# are a file's wall time in `make test`: tests/file_seconds.json as committed, refreshed by every run that has
# pytest's cache (.pytest_cache); a file in neither counts 0.1 s a test. Stale numbers change the order, not a result.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
CACHE_KEY = "looplab/file_seconds"


def _file_seconds(config) -> dict[str, float]:
    import json

    seconds = json.loads(FILE_SECONDS.read_text())
    cache = getattr(config, "cache", None)
    return {**seconds, **(cache.get(CACHE_KEY, {}) if cache is not None else {})}


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    seconds = _file_seconds(config)

    class LongestFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            def cost(scope):
                return seconds.get(Path(scope).name, 0.1 * len(self.workqueue[scope]))

            self.workqueue.move_to_end(max(self.workqueue, key=cost), last=False)
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)


_ran: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or a run without xdist) sees every phase
        name = Path(report.nodeid.split("::")[0]).name
        _ran[name] = _ran.get(name, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    cache = getattr(session.config, "cache", None)
    opt = session.config.option  # a run that picks some tests of a file (-k, -m, --lf) would record a part as the whole
    whole = not (opt.keyword or opt.markexpr or getattr(opt, "lf", False))
    if _ran and whole and cache is not None and session.config.getvalue("dist") == "loadfile" and exitstatus == 0:
        cache.set(CACHE_KEY, {**cache.get(CACHE_KEY, {}), **{k: round(v, 1) for k, v in _ran.items()}})


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
