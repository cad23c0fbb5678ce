"""Run bookkeeping: results.json, the task wrapper that keeps sweeps alive, loggers."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("looplab")


# torch.compile of the looped block, measured here (2 CPU cores, fp32; docs/performance.md#training-step): per training
# step at d_model 512, llama 4x4 +1-14% and Mamba-2 +17-33% (element-wise passes fused into
# each layer's one graph); no gain at d_model 64 (tiny tasks: 24.8k vs 25.0k tokens/s), where
# it only adds compile time. On a GPU the eager step is launch-bound (a dozen element-wise kernels per layer and
# loop, each a launch) and inductor fuses them into a few Triton kernels per layer: compile=auto compiles there at
# every width (docs/training.md#compile).
COMPILE_AUTO_MIN_D_MODEL = 512
GPU_ACCELERATORS = ("cuda", "gpu")


def auto_accelerator() -> str:
    """What Lightning's `accelerator="auto"` picks on this machine (tpu, mps, cuda or cpu)."""
    try:
        from lightning.fabric.utilities.device_parser import _select_auto_accelerator

        return _select_auto_accelerator()
    except ImportError:  # moved in another Lightning version: the same order, TPUs aside
        import torch

        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return "mps"
        return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_compile(value: Any, d_model: int, accelerator: str) -> tuple[bool, str]:
    """`compile: auto|true|false` → (compile?, why). auto = on for GPU training (accelerator gpu or cuda; inductor
    generates Triton kernels, no C++ compiler needed), and on the CPU where it was measured to win: d_model ≥
    COMPILE_AUTO_MIN_D_MODEL with a C++ compiler for inductor. Other accelerators (mps, tpu) train eagerly.
    accelerator=auto is first resolved to the device Lightning will pick."""
    import shutil

    if isinstance(value, bool):
        return value, "compile=" + str(value).lower()
    if value not in ("auto", None):
        from looplab.models.config import ConfigError

        raise ConfigError(f"compile={value!r} is unknown; choose one of true, false, auto")
    if value is None:
        return False, "compile=null"
    where = accelerator
    if accelerator == "auto":
        accelerator = auto_accelerator()
        where = f"auto ({accelerator} on this machine)"
    if accelerator in GPU_ACCELERATORS:
        return True, f"compile=auto: on (accelerator={where}: GPU training compiles each layer once)"
    if accelerator not in ("cpu",):
        return False, f"compile=auto: off on accelerator={where} (not measured there; set compile=true)"
    if d_model < COMPILE_AUTO_MIN_D_MODEL:
        return False, f"compile=auto: off at d_model={d_model} < {COMPILE_AUTO_MIN_D_MODEL} (no gain measured)"
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        return False, "compile=auto: off, no C++ compiler for torch inductor on this machine"
    return True, f"compile=auto: on (accelerator={where}, d_model={d_model} >= {COMPILE_AUTO_MIN_D_MODEL})"


def git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[3]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except Exception:
        return "unknown"


def plain_config(cfg: DictConfig, resolve: bool = True) -> dict[str, Any]:
    """The run's config as plain containers, without the `hydra` node (present when tests compose)."""
    return {
        k: OmegaConf.to_container(cfg[k], resolve=resolve) if OmegaConf.is_config(cfg[k]) else cfg[k]
        for k in cfg
        if k != "hydra"
    }


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2, default=str))
        os.replace(tmp, path)
    except BaseException:  # a full disk: no partial temp file left behind
        tmp.unlink(missing_ok=True)
        raise


def hydra_context() -> dict[str, Any]:
    """Output folder, overrides and run mode of the current Hydra job (empty outside Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        return {
            "output_dir": hc.runtime.output_dir,
            "overrides": list(hc.overrides.task),
            "multirun": hc.mode == RunMode.MULTIRUN,
            "job_num": hc.job.get("num", None),
        }
    except Exception:
        return {"output_dir": os.getcwd(), "overrides": [], "multirun": False, "job_num": None}


def task_wrapper(task: Callable[[DictConfig], dict[str, Any]]) -> Callable[[DictConfig], dict[str, Any] | None]:
    """Run a training task so that a failure is recorded, the W&B run is closed, and a sweep goes on.

    A failed job writes results.json with status "failed" and the traceback; in a
    multirun the exception is logged and swallowed so the other jobs still run
    (the tables list the failed runs); a single run re-raises it. A run refused its
    folder (run_folder.RunFolderRefused: another live run holds it, or it holds a
    checkpoint of other overrides) writes no results.json there.
    """

    @functools.wraps(task)
    def wrapped(cfg: DictConfig) -> dict[str, Any] | None:
        ctx = hydra_context()
        start = time.time()
        try:
            return task(cfg)
        except Exception as e:
            from looplab.training.run_folder import RunFolderRefused

            out = Path(ctx["output_dir"])
            if isinstance(e, RunFolderRefused):  # the folder is another run's: nothing of this one is written there
                log.error("run refused: %s", e)
                if not ctx["multirun"]:
                    raise
                return None
            write_json_atomic(
                out / "results.json",
                {
                    "status": "failed",
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                    "task_name": cfg.get("task_name"),
                    "group": cfg.get("group"),
                    "tags": list(cfg.get("tags") or []),
                    "overrides": ctx["overrides"],
                    "config": plain_config(cfg, resolve=False),
                    "wall_time_s": time.time() - start,
                    "git_commit": git_commit(),
                },
            )
            log.error("run failed: %s: %s (recorded in %s)", type(e).__name__, e, out / "results.json")
            if not ctx["multirun"]:
                raise
            return None
        finally:
            close_wandb()

    return wrapped


def close_wandb() -> None:
    """Finish the W&B run if one is open; never raises (it must not mask the real error)."""
    try:
        import sys

        if "wandb" in sys.modules:
            import wandb

            if wandb.run is not None:
                wandb.finish()
    except Exception:
        pass


def build_loggers(cfg: DictConfig, output_dir: Path, run_name: str) -> list:
    name = cfg.logger.get("name", "none")
    if name == "none":
        return []
    if name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return [CSVLogger(save_dir=str(output_dir), name="csv", version="")]
    if name == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        offline = not os.environ.get("WANDB_API_KEY")
        if offline:
            os.environ.setdefault("WANDB_MODE", "offline")
        return [
            WandbLogger(
                project=cfg.logger.get("project", "looplab"),
                entity=cfg.logger.get("entity"),
                name=run_name,
                group=cfg.get("group"),
                tags=list(cfg.get("tags") or []),
                save_dir=str(output_dir),
                offline=offline,
                config=plain_config(cfg),
            )
        ]
    raise ValueError(f"logger={name!r} is unknown; choose wandb, csv or none")
