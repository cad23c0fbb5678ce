"""Hydra multirun + Lightning DDP: relaunch each rank with *its job's* overrides, once per job.

The pitfall (Lightning 2.6, lightning/pytorch/strategies/launchers/subprocess_script.py and
lightning/fabric/strategies/launchers/subprocess_script.py `_hydra_subprocess_cmd`): the DDP
launcher starts ranks 1..n-1 as `python -m looplab.train <sys.argv[1:]> hydra.run.dir=...`,
i.e. with the *original* command line, `-m` and the comma-separated sweep included. In a
multirun `hydra.run.dir` has no effect, so every child re-expands the whole sweep. It only
stays in step by accident: the launcher also leaves LOCAL_RANK/WORLD_SIZE/MASTER_* in the
parent's environment, so for job 2, 3, ... the parent spawns no new child and the first
child, walking the same sweep, serves as rank 1 for each job. A job that fails on one rank
only, or any sweeper that orders jobs differently, leaves the ranks on different jobs (hang
or mixed configurations).

`per_job_ddp()` wraps one Hydra job: while it is active the child command is built from the
job's own task overrides (no `-m`) with `hydra.run.dir` pinned to the job's output folder, so a
child runs exactly that job in that folder; on exit the launcher's environment variables are
restored and the process group destroyed, so the next job spawns fresh children on a new port.

Under SLURM (hardware=slurm, srun or submitit) it is *not* a no-op, but nothing it patches is
used. srun gives each task SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS, not LOCAL_RANK (only
torchrun or Lightning's own launcher set that), so the `LOCAL_RANK` early exit below is not
taken: every task patches `_hydra_subprocess_cmd` and saves the launcher variables. Lightning
then picks SLURMEnvironment, which reads the ranks from SLURM_* and creates_processes_externally,
so the subprocess launcher spawns no child and the patched command is never built; what remains
is the exit: MASTER_ADDR / MASTER_PORT (set by Lightning from the SLURM node list) are put back
and the process group is destroyed, each job (one SLURM job per configuration) starting afresh.
Tasks started by `torchrun` inside an allocation do have LOCAL_RANK and skip all of this.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Sequence

_LAUNCHER_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def job_subprocess_cmd(local_rank: int) -> tuple[Sequence[str], str]:
    """The command of DDP rank `local_rank` for the current Hydra job: its task overrides, its folder."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hc = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += [o for o in hc.overrides.task]
    command += [f'hydra.run.dir="{hc.runtime.output_dir}"', f"hydra.job.name=train_ddp_process_{local_rank}",
                "hydra.output_subdir=null"]
    return command, get_original_cwd()


@contextlib.contextmanager
def per_job_ddp() -> Iterator[None]:
    """Run one Hydra job so that Lightning's DDP children run exactly this job (see the module docstring)."""
    if "LOCAL_RANK" in os.environ:  # a child rank, or torchrun's task (not a plain srun task): nothing to relaunch
        yield
        return
    saved = {k: os.environ.get(k) for k in _LAUNCHER_ENV}
    patched = []
    for mod_name in ("lightning.pytorch.strategies.launchers.subprocess_script",
                     "lightning.fabric.strategies.launchers.subprocess_script"):
        try:
            mod = __import__(mod_name, fromlist=["_hydra_subprocess_cmd"])
        except ImportError:
            continue
        if hasattr(mod, "_hydra_subprocess_cmd"):
            patched.append((mod, mod._hydra_subprocess_cmd))
            mod._hydra_subprocess_cmd = job_subprocess_cmd
    try:
        yield
    finally:
        for mod, original in patched:
            mod._hydra_subprocess_cmd = original
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # cleaning up must never mask the job's own result or error
            pass
