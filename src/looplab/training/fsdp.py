"""FSDP2 sharding of a looped model, without Lightning (`looplab.training.distributed` wires it into the trainer).

- `shard_looped_model`: `fully_shard` per backbone layer, then the root; under a bf16 all-gather the Mamba-2
  mixers' fp32 parameters in units of their own; `GatherOncePerStep` on the layers a forward reuses (R > 1);
- `accumulate_without_sync`: the micro-batches before the last of an optimizer step, without reduction and
  (by default) with the parameters kept gathered, so that an optimizer step's collectives do not depend on k;
- `build_fsdp_mesh`: FSDP over every rank, or HSDP (shard within a node, replicate across nodes);
- `resolve_param_dtype`: `hardware.fsdp.param_dtype: auto`.

Lightning-free so that the tests' spawned processes (tests/test_fsdp_traffic.py) need not import Lightning
(seconds per process). docs/distributed.md describes the settings and their trade-offs.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

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

        choices = "auto, null, float32, bfloat16, float16" if key == "param_dtype" else "null, float32, bfloat16, float16"
        raise ConfigError(f"hardware.fsdp.{key}={name!r} is unknown; choose one of {choices}")
    return _DTYPES[name]


def resolve_param_dtype(param_dtype: Any, precision: Any, device_type: str) -> torch.dtype | None:
    """`hardware.fsdp.param_dtype` → the all-gather (and compute) dtype of the unsharded parameters.

    `auto`: bfloat16 where the precision is bf16-mixed on a GPU (the sharded master weights, the gradient
    reduction and the optimizer stay fp32; autocast computes the matmuls in bf16 anyway, so gathering fp32
    only doubles the all-gather bytes and the gathered memory); None (gather the fp32 parameters) on a CPU,
    where looplab trains in fp32 and the tests compare against one process exactly, and under any other
    precision (32-true; 16-mixed, whose gradient scaler expects fp32 parameters; bf16-true, whose
    parameters are bf16 already)."""
    if param_dtype == "auto":
        return torch.bfloat16 if str(precision) == "bf16-mixed" and device_type == "cuda" else None
    return _dtype(param_dtype, "param_dtype")


def _hsdp_setting(value: Any) -> str:
    text = str(value).lower() if value is not None else "auto"
    if text in ("true", "false", "auto"):
        return text
    from looplab.models.config import ConfigError

    raise ConfigError(f"hardware.fsdp.hsdp={value!r} is unknown; choose auto, true or false")


def use_hsdp(hsdp: Any, num_nodes: int, per_node: int) -> bool:
    """`hardware.fsdp.hsdp` → whether to shard within a node and replicate across nodes.

    auto: where there are several nodes of several devices. One device per node has nothing to shard within
    the node (HSDP would be DDP, every rank holding the whole model's states), so auto shards across the
    nodes there; true replicates anyway. One node is plain FSDP whatever the setting."""
    setting = _hsdp_setting(hsdp)
    if num_nodes <= 1 or setting == "false":
        return False
    return setting == "true" or per_node > 1


def build_fsdp_mesh(device_type: str, world_size: int, num_nodes: int, hsdp: Any = "auto"):
    """The DeviceMesh `fully_shard` shards over: 1-D ("shard",) over every rank (FSDP), or, under HSDP,
    2-D ("replicate", "shard") = (num_nodes, ranks per node), so that a shard group is one node's ranks
    (global rank = node_rank · per_node + local_rank, Lightning's numbering) and a replicate group the
    ranks of the same local rank on every node. FSDP2 then all-gathers and reduce-scatters within the
    shard group and all-reduces each rank's reduced shard across the replicate group (HSDPMeshInfo in
    torch/distributed/fsdp/_fully_shard/_fsdp_common.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    from looplab.models.config import ConfigError

    if num_nodes < 1 or world_size % num_nodes:
        raise ConfigError(f"world size {world_size} is not a multiple of trainer.num_nodes={num_nodes}")
    per_node = world_size // num_nodes
    if use_hsdp(hsdp, num_nodes, per_node):
        return init_device_mesh(device_type, (num_nodes, per_node), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))


# A Mamba-2 mixer's children that FSDP2 may gather in bf16 as units of their own: its projections, called through
# their forward (FSDP2 gathers a unit in its forward pre-hook). The conv's weight is read directly (Mamba2Mixer._conv),
# not through conv1d's forward, so the conv stays in the mixer's own fp32 unit, with the gated norm and the
# parameters that must stay fp32 (models/mamba2.py `_FP32_PARAMS`: A_log, dt_bias, D).
MIXER_BF16_CHILDREN = ("in_proj", "out_proj")


@dataclass
class ShardedSchedule:
    """What `shard_looped_model` set up, for `accumulate_without_sync`: every FSDP unit of the model with
    the `reshard_after_forward` it was given, and the gather-once hooks (None where no layer is reused)."""

    units: list[torch.nn.Module]
    reshard_after_forward: dict[int, bool]
    gather_once: "GatherOncePerStep | None"  # the hooks on the loop-shared units (None at R = 1)
    fp32_units: list[torch.nn.Module] = field(default_factory=list)  # the Mamba-2 mixers' fp32 units
    hsdp: bool = False  # a 2-D ("replicate", "shard") mesh


_SCHEDULES: "weakref.WeakKeyDictionary[torch.nn.Module, ShardedSchedule]" = weakref.WeakKeyDictionary()


def sharded_schedule(model: torch.nn.Module) -> ShardedSchedule | None:
    return _SCHEDULES.get(model)


def _low_precision(mp_policy) -> bool:
    return mp_policy.param_dtype is not None and mp_policy.param_dtype != torch.float32


def shard_looped_model(model: torch.nn.Module, mesh=None, mp_policy=None, reshard_after_forward: bool = True,
                       gather_once: bool = True, loops: int | None = None) -> None:
    """FSDP2: `fully_shard` each backbone layer (the prelude and coda layers are units of their own too,
    being the same layer classes), then the root (embedding, state branch, exit gate, final norm and
    head). Idempotent.

    gather_once (default; `hardware.fsdp.gather_once`), where a training forward runs the block more
    than once (`loops`: the deepest training forward, default the model's R; at R = 1 no layer is reused):
    the layers used at every loop (block and coda) are all-gathered once per optimizer step, whatever R
    (`GatherOncePerStep`), and stay gathered from forward to backward whatever `reshard_after_forward`
    says; the prelude and the root follow `reshard_after_forward`. False, or R = 1: FSDP2's own schedule,
    an all-gather before each of a layer's R uses in forward and, with `reshard_after_forward`, another
    before each in backward (2R per layer and step). Either way a layer's gradient is reduce-scattered
    once per step (bench/fsdp_traffic.py measures both).

    mesh: 1-D (FSDP) or 2-D ("replicate", "shard") (HSDP, `build_fsdp_mesh`). mp_policy: FSDP2's
    MixedPrecisionPolicy (default fp32 gather, fp32 reduction). Under a low-precision `param_dtype`
    (bf16), every Mamba-2 mixer (a layer's, or StateLoop's state mixer) is split in three units: its
    input and output projections in `param_dtype`, and the mixer itself, which then holds A_log,
    dt_bias, D, the conv and the gated norm, in fp32 (no param_dtype: gathered and used as stored, as
    today). FSDP2 gathers one dtype per unit and reduce-scatters one gradient dtype per unit
    (`foreach_reduce` asserts it), so the fp32 parameters cannot share the layer's unit. The
    mixer's own code upcasts them (`.float()`) but cannot undo a bf16 rounding of A_log before exp.
    Their gradients are reduced in fp32 like every other. Not split: StateLoop's selective state's
    own A_log (models/state.py), a root parameter (its `initial_state` reads `s0` outside the state
    module's forward, so that module cannot be a unit of its own): it is gathered with the root.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return
    mp_policy = mp_policy or MixedPrecisionPolicy(reduce_dtype=torch.float32)
    loops = int(loops if loops is not None else getattr(getattr(model, "config", None), "n_loops", 1))
    looped = [*model.block, *model.coda]  # used at every loop; StateLoop's state mixer too, once split below
    if getattr(model, "state", None) is not None:
        looped.append(model.state)
    reused = {id(m) for part in looped for m in part.modules()} if loops > 1 else set()
    classes = tuple(block_layer_classes())
    units, rafs, shared, fp32_units = [], {}, [], []

    def shard(module, policy, reshard: bool) -> None:
        keep = gather_once and id(module) in reused
        raf = reshard and not keep
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=raf)
        units.append(module)
        rafs[id(module)] = raf
        if id(module) in reused:
            shared.append(module)

    if _low_precision(mp_policy):
        from looplab.models.mamba2 import Mamba2Mixer

        fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=mp_policy.reduce_dtype)
        for mixer in [m for m in model.modules() if isinstance(m, Mamba2Mixer)]:
            for name in MIXER_BF16_CHILDREN:
                shard(getattr(mixer, name), mp_policy, reshard_after_forward)
            shard(mixer, fp32, reshard_after_forward)
            fp32_units.append(mixer)
    for module in model.modules():
        if isinstance(module, classes) and not isinstance(module, FSDPModule):
            shard(module, mp_policy, reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    units.append(model)
    rafs[id(model)] = reshard_after_forward
    hooks = GatherOncePerStep(model, shared, keep_gathered=gather_once) if shared else None
    _SCHEDULES[model] = ShardedSchedule(units, rafs, hooks, fp32_units, hsdp=mesh is not None and mesh.ndim == 2)


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

    Gradient accumulation (`accumulate_without_sync`): during a micro-batch before the last of an
    optimizer step (`accumulating`) the hook keeps the layers gathered after their backward too, and
    the next root forward finds them so (`carried`) instead of freeing them: one all-gather per layer
    and optimizer step whatever the number of micro-batches; the last micro-batch frees them as above.
    That micro-batch also defers the layers' reduction to the same hook: the gradient carried from the
    earlier micro-batches is already on the unsharded parameter, so the post-backward of the R − 1
    later uses would find it and reduce-scatter it alone, and the first use the new sum again (one
    extra reduce-scatter per layer, counted before this); with the layer's gradient sync off until its
    last backward use, the reduce-scatter is once per layer and optimizer step at every k.

    keep_gathered=False (`gather_once=false` at R > 1: FSDP2's per-use schedule) installs the hooks
    for that deferred reduction only, leaving the gathering to FSDP2.
    """

    def __init__(self, root: torch.nn.Module, units: list[torch.nn.Module], keep_gathered: bool = True):
        self.units, self.keep_gathered = units, keep_gathered
        self.armed: set[int] = set()  # id of each unit whose last backward use carries the hook
        self.accumulating = False  # inside accumulate_without_sync(keep_unsharded=True)
        self.carried = False  # the previous micro-batch left its gradients (and parameters) unsharded on purpose
        self.deferred = False  # this forward's units reduce at their last backward use only (the hook)
        no_trace = torch._dynamo.disable  # as FSDP2's own hooks: plain Python around compiled layers (compile_block)
        root.register_forward_pre_hook(no_trace(self._root_pre_forward))
        root.register_forward_hook(no_trace(self._root_post_forward))
        for unit in units:
            unit.register_forward_hook(no_trace(self._unit_post_forward))

    def _root_pre_forward(self, root, args) -> None:
        if _in_backward():
            return
        self.armed.clear()
        carried, self.carried = self.carried, False
        self.deferred = carried and not self.accumulating and torch.is_grad_enabled()
        for unit in self.units:
            if self.keep_gathered:
                if not carried:
                    unit.reshard()  # a no-op unless a forward with a graph was never backpropagated
                unit.set_reshard_after_backward(not torch.is_grad_enabled(), recurse=False)
            if self.deferred:
                unit.set_requires_gradient_sync(False, recurse=False)

    def _last_backward_use(self, unit) -> None:
        """Before the backward of the unit's first call with a graph: the last of its backward uses."""
        if self.accumulating:
            return
        if self.keep_gathered:
            unit.set_reshard_after_backward(True, recurse=False)
        if self.deferred:
            unit.set_requires_gradient_sync(True, recurse=False)

    def _unit_post_forward(self, unit, args, output) -> None:
        if _in_backward() or not torch.is_grad_enabled() or id(unit) in self.armed:
            return
        out = next((t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if out is None:
            return
        self.armed.add(id(unit))
        out.register_hook(lambda grad, unit=unit: self._last_backward_use(unit))

    def _root_post_forward(self, root, args, output) -> None:
        if _in_backward():
            return
        for unit in self.units:
            if id(unit) not in self.armed:  # no backward will run through it: free it now (and reduce as usual)
                if self.keep_gathered:
                    unit.set_reshard_after_backward(True, recurse=False)
                    unit.reshard()
                if self.deferred:
                    unit.set_requires_gradient_sync(True, recurse=False)


@contextlib.contextmanager
def accumulate_without_sync(module: torch.nn.Module, keep_unsharded: bool = True) -> Iterator[None]:
    """A micro-batch before the last of an optimizer step (forward and backward inside): its gradients are
    accumulated, not reduced; the last micro-batch, run outside, reduces their sum once.

    Every FSDP2 root under `module` (a LightningModule, or the sharded model itself) stops reducing
    (`set_requires_gradient_sync(False)`: FSDP2 keeps each unit's unsharded gradient, in the reduce
    dtype, fp32, and adds the next micro-batch's to it). With keep_unsharded
    (`hardware.fsdp.accumulate_unsharded`, default) the parameters also stay gathered from the first
    micro-batch's forward to the last one's backward: no unit reshards after forward or backward here,
    and `GatherOncePerStep` leaves its units gathered for the next micro-batch. The last micro-batch runs
    the configured schedule from there, so each unit is all-gathered as often per optimizer step as at
    k = 1 (its first gather done by the first micro-batch instead) and reduce-scattered once: the
    collectives of an optimizer step do not depend on k (tests/test_fsdp_traffic.py). The price is
    memory: the whole model's gathered parameters (param_dtype) and unsharded gradients (fp32) live
    through the optimizer step's micro-batches, what DDP holds, where k = 1 holds one unit's at a time
    (plus the loop-shared block under gather_once).

    keep_unsharded=False: the parameters are freed as configured and gathered again by every micro-batch
    (k times the all-gathers), and under flat FSDP the gradients are reduce-scattered by every micro-batch
    (k times the reduce-scatters), keeping only sharded gradients: FSDP2's lowest-memory schedule. Under
    HSDP the micro-batches reduce-scatter within the node but keep their shard unreduced across nodes
    (`set_requires_all_reduce(False)`, a sharded fp32 accumulator): the inter-node all-reduce happens
    once per optimizer step either way.
    """
    roots = [m for m in module.modules() if m in _SCHEDULES]
    schedules = [_SCHEDULES[r] for r in roots]
    for root, sched in zip(roots, schedules):
        if keep_unsharded:
            root.set_requires_gradient_sync(False)
            for unit in sched.units:
                unit.set_reshard_after_forward(False, recurse=False)
                unit.set_reshard_after_backward(False, recurse=False)
            if sched.gather_once is not None:
                sched.gather_once.accumulating = True
        elif sched.hsdp:
            root.set_requires_all_reduce(False)
    try:
        yield
    finally:
        for root, sched in zip(roots, schedules):
            root.set_requires_gradient_sync(True)  # reduce-scatter and (HSDP) all-reduce back on
            if keep_unsharded:
                hooks = sched.gather_once
                kept = set(map(id, hooks.units)) if hooks is not None and hooks.keep_gathered else set()
                for unit in sched.units:
                    unit.set_reshard_after_forward(sched.reshard_after_forward[id(unit)], recurse=False)
                    if id(unit) not in kept:  # GatherOncePerStep sets its own at the next root forward
                        unit.set_reshard_after_backward(True, recurse=False)
                if sched.gather_once is not None:
                    sched.gather_once.accumulating = False
                    sched.gather_once.carried = True
