"""Distributed strategies chosen by the `hardware` config; the model file knows nothing of them.

`trainer.strategy: fsdp` (hardware=fsdp, or any hardware with `trainer.strategy=fsdp`) is FSDP2:
`fully_shard` per backbone layer and once at the root, through Lightning's
`ModelParallelStrategy` and the LightningModule's `configure_model` hook. Why FSDP2 and not
Lightning's FSDPStrategy (FSDP1), which looplab used before:

* FSDP1's `FSDPPrecision` refuses norm gradient clipping outright; FSDP2 parameters are DTensors
  and `torch.nn.utils.clip_grad_norm_` computes the global norm over their shards.
* FSDP1 flattens parameters (1-D views under `use_orig_params`), which emptied the weight-decay
  group; FSDP2 keeps every parameter's logical shape (and looplab groups by name anyway).
* FSDP1 `bf16-mixed` all-gathers parameters and reduces gradients in bf16; here the policy is
  the DDP recipe: fp32 sharded master weights, bf16 compute under Lightning's autocast,
  fp32 gradient reduction (`MixedPrecisionPolicy(param_dtype=None, reduce_dtype=float32)`).
* FSDP1 does not run on a CPU in torch 2.13; FSDP2 does (gloo), so `make test` executes it.

A looped block calls each sharded layer R times per forward. Left to itself FSDP2 all-gathers
the layer before each call and again before each call's backward (2R all-gathers per layer and
step); `GatherOncePerStep` keeps the block's layers gathered from their first call to the
backward of that call, so traffic does not grow with R: one all-gather and one reduce-scatter
of each layer per step, its gradient the sum of the R uses (tests/test_fsdp_traffic.py counts
the collectives, tests/test_distributed.py checks the gradients against one process).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

_DTYPES = {None: None, "null": None, "float32": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def block_layer_classes() -> set[type]:
    """One sharding unit per backbone layer."""
    from looplab.models.llama import AttentionLayer
    from looplab.models.mamba2 import Mamba2Layer

    return {AttentionLayer, Mamba2Layer}


def _dtype(name: Any, key: str) -> torch.dtype | None:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        from looplab.models.config import ConfigError

        raise ConfigError(f"hardware.fsdp.{key}={name!r} is unknown; choose one of null, float32, bfloat16, float16")
    return _DTYPES[name]


class LoopedFSDPStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy as pure FSDP2 (one data-parallel mesh dimension over every
    rank, no tensor parallelism), with its sharding settings and an atomic sharded checkpoint.

    The LightningModule's `configure_model` calls `shard_looped_model` with this strategy's
    settings (looplab.training.module). Activation checkpointing is not this strategy's job:
    `hardware.activation_checkpointing` checkpoints each loop once, under every strategy.
    """

    def __init__(self, param_dtype: Any = None, reduce_dtype: Any = "float32", reshard_after_forward: bool = True,
                 sharded_checkpoint: bool = True, gather_once: bool = True, **kwargs):
        super().__init__(save_distributed_checkpoint=bool(sharded_checkpoint), **kwargs)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self.mp_policy = MixedPrecisionPolicy(param_dtype=_dtype(param_dtype, "param_dtype"),
                                              reduce_dtype=_dtype(reduce_dtype, "reduce_dtype"))
        self.reshard_after_forward = bool(reshard_after_forward)
        self.gather_once = bool(gather_once)  # see shard_looped_model

    def setup_environment(self) -> None:
        # ModelParallelStrategy's "auto" sizes mean data-parallel across nodes and tensor-parallel
        # within one; looplab shards one data-parallel dimension over all ranks instead
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

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


def shard_looped_model(model: torch.nn.Module, mesh=None, mp_policy=None, reshard_after_forward: bool = True,
                       gather_once: bool = True) -> None:
    """FSDP2: `fully_shard` each backbone layer (the prelude and coda layers are units of their own too,
    being the same layer classes), then the root (embedding, state branch, exit gate, final norm and
    head). Idempotent.

    gather_once (default; `hardware.fsdp.gather_once`): the layers used at every loop (block and coda)
    are all-gathered once per optimizer step, whatever R (`GatherOncePerStep`), and stay gathered from
    forward to backward whatever `reshard_after_forward` says; the prelude and the root follow
    `reshard_after_forward`. False: FSDP2's own schedule, an all-gather before each of a
    layer's R uses in forward and another before each in backward (2R per layer and step). Either
    way a layer's gradient is reduce-scattered once per step (bench/fsdp_traffic.py measures both).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(reduce_dtype=torch.float32)}
    classes = tuple(block_layer_classes())
    reused = {id(m) for m in (*model.block, *model.coda)} if gather_once else set()
    units = []
    for module in model.modules():
        if isinstance(module, classes):
            keep = id(module) in reused
            fully_shard(module, reshard_after_forward=reshard_after_forward and not keep, **kwargs)
            if keep:
                units.append(module)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    if units:
        GatherOncePerStep(model, units)


def _in_backward() -> bool:
    """Inside an autograd backward (e.g. an activation-checkpoint recomputation): no new step starts there."""
    return torch._C._current_graph_task_id() != -1


class GatherOncePerStep:
    """One all-gather per loop-shared layer per training step (forward and backward together), whatever R.

    FSDP2 treats each of a layer's R calls as its own use: it all-gathers before each call and frees
    after it (`reshard_after_forward`), and all-gathers again before each call's backward and frees
    after it (`reshard_after_backward`): 2R all-gathers per layer and step (bench/fsdp_traffic.py:
    34 for a 2-layer block at R = 8 against 6 at R = 1). Its reduce-scatter is already once per step:
    the R uses of a parameter feed one autograd accumulator, which fires once, with their sum, in the
    backward of the first use, so the post-backward of the R − 1 later uses finds no gradient yet.

    Here each such layer is sharded with `reshard_after_forward=False`, so its first call gathers it
    and the R − 1 others find it gathered; at the root's forward it is told not to reshard after
    backward, so the backward of its R − 1 later calls finds it gathered too; and a hook on the output
    of its first call with a graph switches resharding back on before that call's backward — the last
    of the layer's backward — which reduce-scatters the summed gradient and frees the layer.

    A forward without a graph (evaluation) or in which no call had a graph (a frozen block) frees the
    layers at the root's forward end: one all-gather per layer and forward there too. The memory price
    is the block's gathered parameters held for the whole step instead of one layer at a time: N
    layers, what DDP holds for the block (yet the measured peak resident memory was lower than under
    the per-use schedule, 803 against 1,259 MB a rank at d 512, R = 8: bench/fsdp_traffic.py).
    Another forward with a graph before the backward of the first frees the layers; FSDP2 then
    gathers them again in backward where needed (correct, only more traffic).
    """

    def __init__(self, root: torch.nn.Module, units: list[torch.nn.Module]):
        self.units = units
        self.armed: set[int] = set()  # id of each unit whose last backward use carries the hook
        no_trace = torch._dynamo.disable  # as FSDP2's own hooks: plain Python around compiled layers (compile_block)
        root.register_forward_pre_hook(no_trace(self._root_pre_forward))
        root.register_forward_hook(no_trace(self._root_post_forward))
        for unit in units:
            unit.register_forward_hook(no_trace(self._unit_post_forward))

    def _root_pre_forward(self, root, args) -> None:
        if _in_backward():
            return
        self.armed.clear()
        for unit in self.units:
            unit.reshard()  # a no-op unless a forward with a graph was never backpropagated
            unit.set_reshard_after_backward(not torch.is_grad_enabled(), recurse=False)

    def _unit_post_forward(self, unit, args, output) -> None:
        if _in_backward() or not torch.is_grad_enabled() or id(unit) in self.armed:
            return
        out = next((t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if out is None:
            return
        self.armed.add(id(unit))
        out.register_hook(lambda grad, unit=unit: unit.set_reshard_after_backward(True, recurse=False))

    def _root_post_forward(self, root, args, output) -> None:
        if _in_backward():
            return
        for unit in self.units:
            if id(unit) not in self.armed:  # no backward will run through it: free it now
                unit.set_reshard_after_backward(True, recurse=False)
                unit.reshard()


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

    out: dict[str, Any] = {"precision": resolve_precision(cfg.trainer.get("precision", "32-true"), str(cfg.trainer.accelerator))}
    if cfg.trainer.get("strategy") == "fsdp":  # not Lightning's FSDP1 "fsdp"
        out["strategy"] = build_strategy("fsdp", OmegaConf.to_container(cfg.hardware.get("fsdp") or {}, resolve=True))
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
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    return "bf16-mixed" if accelerator in ("gpu", "cuda") else "32-true"
