"""Distributed strategies chosen by the `hardware` config; the model file knows nothing of them.

`trainer.strategy: fsdp` (hardware=fsdp, or any hardware with `trainer.strategy=fsdp`) is FSDP2:
`fully_shard` per backbone layer and once at the root, through Lightning's
`ModelParallelStrategy` and the LightningModule's `configure_model` hook. Why FSDP2 and not
Lightning's FSDPStrategy (FSDP1), which looplab used before:

* FSDP1's `FSDPPrecision` refuses norm gradient clipping outright; FSDP2 parameters are DTensors
  and `torch.nn.utils.clip_grad_norm_` computes the global norm over their shards.
* FSDP1 flattens parameters (1-D views under `use_orig_params`), which emptied the weight-decay
  group; FSDP2 keeps every parameter's logical shape (and looplab groups by name anyway).
* FSDP1 `bf16-mixed` all-gathers parameters and reduces gradients in bf16; here the sharded
  master weights are fp32 and gradients are reduced in fp32, with bf16 all-gathers under
  bf16-mixed on GPUs (`hardware.fsdp.param_dtype: auto`; fp32 on a CPU) except the SSM
  parameters (`A_log`, `dt_bias`, `D`), which are gathered and used in fp32 (`shard_looped_model`).
* FSDP1 does not run on a CPU in torch 2.13; FSDP2 does (gloo), so `make test` executes it.

A looped block calls each sharded layer R times per forward. Left to itself FSDP2 all-gathers
the layer before each call and again before each call's backward (2R all-gathers per layer and
step); `GatherOncePerStep` keeps the block's layers gathered from their first call to the
backward of that call, so traffic does not grow with R: one all-gather and one reduce-scatter
of each layer per step, its gradient the sum of the R uses (tests/test_fsdp_traffic.py counts
the collectives, tests/test_distributed.py checks the gradients against one process). At R = 1
there is nothing to share and the layers follow FSDP2's own schedule (`reshard_after_forward`).

Gradient accumulation (`trainer.accumulate_grad_batches = k`): Lightning calls the strategy's
`block_backward_sync` around every micro-batch but the last of an optimizer step
(loops/optimization/automatic.py); here that is `accumulate_without_sync`: no reduction until the
last micro-batch and, with `hardware.fsdp.accumulate_unsharded` (default), the parameters kept
gathered across the micro-batches, so the collectives of an optimizer step do not depend on k.

Across nodes (`trainer.num_nodes > 1`) the mesh is HSDP by default (`hardware.fsdp.hsdp: auto`):
parameters sharded within a node and replicated across nodes (`build_fsdp_mesh`), so all-gathers
and reduce-scatters stay on the node's NVLink and only an all-reduce of each rank's shard crosses
the network.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from looplab.training.fsdp import (MIXER_BF16_CHILDREN, GatherOncePerStep, _dtype, _hsdp_setting,  # noqa: F401
                                   accumulate_without_sync, block_layer_classes, build_fsdp_mesh,
                                   resolve_param_dtype, shard_looped_model, sharded_schedule, use_hsdp)


class LoopedFSDPStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy as pure FSDP2 (no tensor parallelism; one data-parallel mesh
    dimension over every rank, or HSDP across nodes), with its sharding settings, a no-sync gradient
    accumulation and an atomic sharded checkpoint.

    The LightningModule's `configure_model` calls `shard_looped_model` with `shard_options()`
    (looplab.training.module). Activation checkpointing is not this strategy's job:
    `hardware.activation_checkpointing` (false | loop | layer | selective, models/checkpointing.py) applies the
    same under every strategy.
    """

    def __init__(self, param_dtype: Any = "auto", reduce_dtype: Any = "float32", reshard_after_forward: bool = True,
                 sharded_checkpoint: bool = True, gather_once: bool = True, accumulate_unsharded: bool = True,
                 hsdp: Any = "auto", **kwargs):
        super().__init__(save_distributed_checkpoint=bool(sharded_checkpoint), **kwargs)
        if param_dtype != "auto":
            _dtype(param_dtype, "param_dtype")  # an unknown name fails here, before any process starts
        self.param_dtype = param_dtype  # resolved with the precision and the device in mp_policy()
        self.reduce_dtype = _dtype(reduce_dtype, "reduce_dtype")
        self.reshard_after_forward = bool(reshard_after_forward)
        self.gather_once = bool(gather_once)  # see shard_looped_model
        self.accumulate_unsharded = bool(accumulate_unsharded)  # see accumulate_without_sync
        self.hsdp = _hsdp_setting(hsdp)
        self._fsdp_mesh = None

    def mp_policy(self, device_type: str | None = None):
        """FSDP2's MixedPrecisionPolicy: `param_dtype` resolved (`resolve_param_dtype`), fp32 reduction."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        precision = getattr(self.precision_plugin, "precision", "32-true")
        device_type = device_type or (self._fsdp_mesh.device_type if self._fsdp_mesh is not None else self.root_device.type)
        return MixedPrecisionPolicy(param_dtype=resolve_param_dtype(self.param_dtype, precision, device_type),
                                    reduce_dtype=self.reduce_dtype)

    def setup_environment(self) -> None:
        # ModelParallelStrategy's "auto" sizes mean data-parallel across nodes and tensor-parallel
        # within one; looplab's batches are data-parallel over all ranks (the sampler reads the
        # "data_parallel" dimension of Lightning's mesh); fully_shard gets fsdp_mesh() instead
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def fsdp_mesh(self, device_mesh=None, num_nodes: int | None = None):
        """The mesh `fully_shard` shards over (`build_fsdp_mesh`: FSDP, or HSDP across nodes), built once from
        the world of Lightning's device mesh (`device_mesh`, default this strategy's) and the number of nodes."""
        if self._fsdp_mesh is None:
            mesh = device_mesh if device_mesh is not None else self.device_mesh
            nodes = int(num_nodes if num_nodes is not None else self.num_nodes)
            if use_hsdp(self.hsdp, nodes, mesh.size() // max(nodes, 1)):
                self._fsdp_mesh = build_fsdp_mesh(mesh.device_type, mesh.size(), nodes, self.hsdp)
            else:  # FSDP over every rank: Lightning's own data-parallel dimension (no new process groups)
                self._fsdp_mesh = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
        return self._fsdp_mesh

    def shard_options(self, device_mesh=None, num_nodes: int | None = None) -> dict[str, Any]:
        """`shard_looped_model`'s keyword arguments for this run."""
        mesh = self.fsdp_mesh(device_mesh, num_nodes)
        return {"mesh": mesh, "mp_policy": self.mp_policy(mesh.device_type),
                "reshard_after_forward": self.reshard_after_forward, "gather_once": self.gather_once}

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's training loop runs every micro-batch but the last of an optimizer step inside this
        (`_block_parallel_sync_behavior` in loops/optimization/automatic.py); ParallelStrategy's version
        only knows DDP's `no_sync`, so under FSDP2 every micro-batch reduce-scattered its gradients."""
        with accumulate_without_sync(self.lightning_module, keep_unsharded=self.accumulate_unsharded):
            yield

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        """Every rank writes its shard into a temporary folder; rank 0 then swaps it in by rename.

        A run killed while saving leaves the previous checkpoint intact (or, killed between the
        two renames, as `.NAME.old`, which `recover_checkpoint` puts back).
        """
        if not self._save_distributed_checkpoint:  # one file gathered on rank 0, written by the (atomic) CheckpointIO
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        tmp, old = path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")
        if self.is_global_zero and tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        self.barrier("looplab_ckpt_tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("looplab_ckpt_written")
        if self.is_global_zero:
            _fsync_tree(tmp)
            if path.exists():
                if old.exists():
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
                os.replace(path, old)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            if old.exists():
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        self.barrier("looplab_ckpt_swapped")

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's sharded resume (lightning/fabric/strategies/model_parallel.py _load_checkpoint),
        reading through looplab's safe DCP reader: Lightning's own goes through torch's FileSystemReader,
        which unpickles `.metadata` and the non-tensor entries (optimizer hyper-parameters) unrestricted."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_optimizer_state_dict)

        from looplab.checkpoint import SHARDED_META_FILE, load_sharded, read_sharded_extras

        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path.is_dir() and (path / SHARDED_META_FILE).is_file()):  # one file (sharded_checkpoint=false)
            return super().load_checkpoint(path, weights_only=True)
        model_state = {"state_dict": get_model_state_dict(self.model)}
        load_sharded(model_state, path)
        self.model.load_state_dict(model_state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):  # each optimizer separately, as Lightning saves them
            optim_state = {f"optimizer_{i}": get_optimizer_state_dict(self.model, optimizer)}
            load_sharded(optim_state, path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optim_state[f"optimizer_{i}"],
                                     options=StateDictOptions(cpu_offload=True))
        return read_sharded_extras(path)  # epoch, loops, callbacks, ...: everything but weights and optimizers


def _fsync_tree(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_global_zero_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is global rank 0 of its job, before any process group exists.

    Read as Lightning reads the rank (lightning.fabric.utilities.rank_zero._get_rank): RANK (torchrun),
    then LOCAL_RANK (Lightning's own launcher gives its children LOCAL_RANK and NODE_RANK) before
    SLURM_PROCID, since a SLURM job's single task may launch its ranks itself and they all inherit
    SLURM_PROCID=0; then JSM_NAMESPACE_RANK (LSF). Unlike Lightning's, LOCAL_RANK=0 on a node with
    NODE_RANK>0 is not rank 0: with one process per node every node's would be. No variable at all:
    a single process, or the launcher before it starts its children.
    """
    env = os.environ if env is None else env
    if "RANK" in env:
        return int(env["RANK"]) == 0
    if "LOCAL_RANK" in env:
        return int(env["LOCAL_RANK"]) == 0 and int(env.get("NODE_RANK") or env.get("GROUP_RANK") or 0) == 0
    for key in ("SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in env:
            return int(env[key]) == 0
    return True


# How long a rank waits for rank 0 to put a checkpoint back: torch's default process-group timeout,
# which the ranks would otherwise wait for each other at init_process_group anyway (rank 0 may
# start late: imports, the data module built before this point).
RECOVER_TIMEOUT_S = 1800.0


def recover_checkpoint(path: str | os.PathLike, timeout_s: float = RECOVER_TIMEOUT_S, poll_s: float = 0.2) -> bool:
    """Put back `.NAME.old` when a sharded save was killed between its two renames; True where this
    process did it.

    Called on every rank before the process group exists, so only global rank 0 renames (two ranks of
    one SLURM or torchrun job could otherwise race on it); the others wait until the checkpoint is back.
    """
    path = Path(path)
    old = path.with_name(f".{path.name}.old")

    def interrupted() -> bool:
        return not path.exists() and old.exists()

    if is_global_zero_from_env():
        if interrupted():
            os.replace(old, path)
            return True
        return False
    deadline = time.monotonic() + timeout_s
    while interrupted():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"this rank (not global rank 0) waited {timeout_s:.0f} s for rank 0 to put back the interrupted "
                f"checkpoint {str(old)!r} as {str(path)!r}; did rank 0 start, with the same output folder? "
                f"(rename it yourself to resume: mv {old} {path})"
            )
        time.sleep(poll_s)
    return False


def build_strategy(strategy: Any, fsdp_options: dict[str, Any] | None = None) -> Any:
    """`trainer.strategy` as the config gives it → what Lightning's Trainer takes.

    "fsdp" is looplab's FSDP2 strategy with `hardware.fsdp` options; anything else (ddp, auto,
    an instantiated strategy) passes through unchanged.
    """
    if strategy == "fsdp":
        return LoopedFSDPStrategy(**(fsdp_options or {}))
    return strategy


def trainer_overrides(cfg) -> dict[str, Any]:
    """What `hydra.utils.instantiate(cfg.trainer, ...)` needs beyond the config: the resolved
    precision, and looplab's FSDP2 strategy object for `trainer.strategy: fsdp`."""
    from omegaconf import OmegaConf

    accelerator = str(cfg.trainer.accelerator)
    out: dict[str, Any] = {"precision": resolve_precision(cfg.trainer.get("precision", "32-true"), accelerator)}
    if cfg.trainer.get("strategy") == "fsdp":  # not Lightning's FSDP1 "fsdp"
        options = OmegaConf.to_container(cfg.hardware.get("fsdp") or {}, resolve=True)
        if options.get("param_dtype", "auto") == "auto":  # from the configured accelerator, as the precision is:
            # a plan of a GPU run made on a CPU (looplab.plan) then builds what the GPU run builds
            gpu = "cuda" if _accelerator(accelerator) in ("gpu", "cuda") else "cpu"
            options["param_dtype"] = resolve_param_dtype("auto", out["precision"], gpu)
        out["strategy"] = build_strategy("fsdp", options)
    return out


def check_resume_source(ckpt_path: str | os.PathLike, cfg) -> None:
    """Refuse, naming the path and what to do instead, a resume= folder this run's strategy cannot read: a sharded
    (FSDP2) checkpoint is read by the FSDP strategy only (any other opens it as one file: IsADirectoryError deep in
    Lightning), and a Hub-style model folder holds weights but no training state to resume."""
    from looplab.checkpoint import SHARDED_META_FILE
    from looplab.models.config import ConfigError

    path = Path(ckpt_path)
    if not path.is_dir():
        return
    if not (path / SHARDED_META_FILE).is_file():
        raise ConfigError(f"resume={str(ckpt_path)!r} is a model folder (weights, no optimizer state or step): there is "
                          f"no training state to resume; start a run from its weights with init_from={ckpt_path}")
    strategy = cfg.trainer.get("strategy")
    if strategy != "fsdp":
        raise ConfigError(f"resume={str(ckpt_path)!r} is a sharded (FSDP2) checkpoint folder, which only the FSDP "
                          f"strategy reads (trainer.strategy={strategy!r} here): resume with hardware=fsdp (on a CPU add "
                          f"trainer.accelerator=cpu trainer.devices=N), or start from its weights with init_from={ckpt_path}")


def resolve_precision(precision: Any, accelerator: str) -> str:
    """`trainer.precision: auto` → bf16-mixed on a GPU, 32-true on a CPU (bf16 matmuls crawl there)."""
    if precision != "auto":
        return str(precision)
    return "bf16-mixed" if _accelerator(accelerator) in ("gpu", "cuda") else "32-true"


def _accelerator(accelerator: str) -> str:
    """`trainer.accelerator: auto` as Lightning resolves it here (a GPU where CUDA is available)."""
    if accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return accelerator
