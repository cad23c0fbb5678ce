"""What one training step costs, counted op by op: FLOPs, bytes moved, collectives, and a roofline time.

`StepCounter` is a TorchDispatchMode that sees every aten op of the step once (below autograd, FSDP2 and DTensor:
what a GPU would run) and keeps

- FLOPs: the formulas of `torch.utils.flop_counter` (what FlopCounterMode counts), except attention: torch counts
  scaled_dot_product_attention over all Sq·Sk query-key pairs whether or not it is causal; here a causal call
  (is_causal=True, the training path of every looplab attention) counts only the pairs the causal mask keeps,
  P = Σ_i min(i + 1, Sk) (top-left aligned, as SDPA's is_causal), i.e. S(S + 1)/2 when Sq = Sk = S. Forward:
  2·B·H·P·(Dqk + Dv) (scores and output); backward: torch's five matmuls (the scores recomputed, dP, dV, dQ, dK)
  over the same P pairs. The CPU kernels (`_scaled_dot_product_flash_attention_for_cpu` and its backward), which a
  plan made on a CPU runs, are counted with the same formulas (torch's counter has no entry for them: 0). An
  attention given an explicit mask falls back to matmuls and is counted as the kernel computes it, in full.
- recomputation: ops of a module's forward run during the backward (activation checkpointing), counted apart, so
  that the estimated MFU counts model FLOPs and not recomputed ones;
- a roofline time on a named GPU, torch's RuntimeEstimator cost model (torch/distributed/_tools/runtime_estimator.py:
  per op max(FLOPs / (0.75 · peak), bytes read and written / HBM bandwidth); views and tensor creation cost
  nothing), evaluated with the plan's GPU table instead of the local device's, so it runs without a GPU;
- collectives: kind, count and bytes of every c10d and functional collective (FSDP2's all-gathers and
  reduce-scatters, DTensor's all-reduce in gradient clipping, Lightning's metric reduction). Bytes per rank as
  bench/fsdp_traffic.py counts them: an all-gather's gathered output, a reduce-scatter's unsharded input, an
  all-reduce's tensor. Their time (`collective_seconds`): a ring's per-rank traffic, (n − 1)/n of those bytes
  for all-gather and reduce-scatter and 2(n − 1)/n for all-reduce, at the GPU's NVLink bandwidth when the group
  fits in one node, else at its inter-node bandwidth; no latency term, no overlap with compute.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
COMPUTE_EFFICIENCY = 0.75  # the fraction of peak FLOP/s that torch's roofline cost model assumes (utils/_runtime_estimation.py)

_SDPA_FORWARD = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
                 aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu}
_SDPA_BACKWARD = {aten._scaled_dot_product_flash_attention_backward, aten._scaled_dot_product_efficient_attention_backward,
                  aten._scaled_dot_product_cudnn_attention_backward,
                  aten._scaled_dot_product_flash_attention_for_cpu_backward}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_COLLECTIVE_WORDS = ("gather", "scatter", "reduce", "broadcast", "barrier", "alltoall", "all_to_all", "send", "recv")


def causal_pairs(s_q: int, s_k: int) -> int:
    """Query-key pairs a top-left-aligned causal mask keeps: Σ_{i<Sq} min(i + 1, Sk)."""
    full = min(s_q, s_k)
    return full * (full + 1) // 2 + max(0, s_q - s_k) * s_k


def attention_flops(q_shape, k_shape, v_shape, causal: bool, backward: bool = False) -> int:
    """torch.utils.flop_counter's SDPA count (forward or backward), scaled to the causal pairs when causal."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    full = (sdpa_backward_flop_count(q_shape, q_shape, k_shape, v_shape) if backward
            else sdpa_flop_count(q_shape, k_shape, v_shape))
    if not causal:
        return full
    s_q, s_k = q_shape[-2], k_shape[-2]
    return full * causal_pairs(s_q, s_k) // (s_q * s_k)


def _sdpa_flops(func, args, kwargs) -> int:
    from torch.fx.operator_schemas import normalize_function

    named = normalize_function(func, args, kwargs, normalize_to_only_use_kwargs=True).kwargs
    q, k, v = named["query"], named["key"], named["value"]
    causal = bool(named.get("is_causal", False))
    backward = func._overloadpacket in _SDPA_BACKWARD
    return attention_flops(tuple(q.shape), tuple(k.shape), tuple(v.shape), causal, backward=backward)


def op_flops(func, args, kwargs, out) -> int:
    from torch.utils.flop_counter import flop_registry

    packet = func._overloadpacket
    if packet in _SDPA_FORWARD or packet in _SDPA_BACKWARD:
        return _sdpa_flops(func, args, kwargs)
    formula = flop_registry.get(packet)
    return int(formula(*args, **(kwargs or {}), out_val=out)) if formula is not None else 0


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def collective(func, args, kwargs) -> tuple[str, int, object] | None:
    """(kind, bytes per rank, group) of a collective op, None for any other op (and for waits)."""
    if func.namespace not in _COLLECTIVE_NAMESPACES:
        return None
    name = func._overloadpacket.__name__.strip("_")
    if not any(k in name for k in _COLLECTIVE_WORDS):  # waits, autograd wrappers, work objects: not collectives
        return None
    if "barrier" in name:
        return "barrier", 0, None
    kwargs = kwargs or {}
    if func.namespace == "c10d":  # ProcessGroup ops: (outputs, inputs, group, ...) or (tensors, group, ...)
        group = next((a for a in args if isinstance(a, torch.ScriptObject) or type(a).__name__.endswith("ProcessGroup")), None)
        if "allgather" in name:
            return "all_gather", _nbytes(args[0]), group
        if "reduce_scatter" in name:
            return "reduce_scatter", _nbytes(args[1]), group
        if "allreduce" in name:
            return "all_reduce", _nbytes(args[0]), group
        return name.removesuffix("_"), _nbytes(args[0]), group
    group = args[-1] if args and isinstance(args[-1], str) else kwargs.get("group_name")
    if "all_gather" in name:  # functional: (input, group_size, group_name) -> the gathered output
        return "all_gather", _nbytes(args[0]) * int(args[1]), group
    if "reduce_scatter" in name:
        return "reduce_scatter", _nbytes(args[0]), group
    if "all_reduce" in name:
        return "all_reduce", _nbytes(args[0]), group
    return name, _nbytes(args[0]), group


def _group_ranks(group) -> list[int] | None:
    import torch.distributed as dist

    try:
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group)
        if group is None:
            return None
        if isinstance(group, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        return dist.get_process_group_ranks(group)
    except Exception:  # a group the plan cannot name: the world's
        return None


@dataclass
class Collectives:
    """Collectives of one optimizer step on one rank: {kind: count}, {kind: bytes}, and their ring time."""

    count: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"count": int(self.count[k]), "bytes": int(self.bytes[k])} for k in sorted(self.count)}

    @property
    def total_bytes(self) -> int:
        return int(sum(self.bytes.values()))


def collective_seconds(kind: str, nbytes: int, ranks: list[int] | None, world: int, per_node: int, gpu) -> float:
    """Ring time of one collective: per-rank traffic at NVLink speed within a node, else at the inter-node speed."""
    n = len(ranks) if ranks else world
    if n <= 1 or nbytes == 0:
        return 0.0
    nodes = {r // per_node for r in ranks} if ranks else {r // per_node for r in range(world)}
    bw = gpu.nvlink_bytes_per_s if len(nodes) == 1 else gpu.internode_bytes_per_s
    factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}.get(kind, 1.0)
    return factor * nbytes / bw


class StepCounter(TorchDispatchMode):
    """Counts FLOPs, bytes, roofline seconds and collectives of the ops it sees (module docstring).

    gpu: the GPU of the roofline (None: collectives and FLOPs only). world, per_node: the ranks of the run
    and the GPUs per node, for the collectives' time."""

    def __init__(self, gpu=None, world: int = 1, per_node: int = 1):
        super().__init__()
        self.gpu, self.world, self.per_node = gpu, max(1, world), max(1, per_node)
        self.flops = 0
        self.recompute_flops = 0
        self.compute_seconds = 0.0
        self.bytes_moved = 0
        self.seconds_by_op: Counter = Counter()  # roofline seconds per aten op: where the estimate's time goes
        self.collectives = Collectives()
        self._recompute_depth = 0
        self._hooks = []

    # activation checkpointing: a module forward that runs inside the backward is a recomputation
    def _pre(self, module, args):
        if torch._C._current_graph_task_id() != -1:
            self._recompute_depth += 1

    def _post(self, module, args, out):
        if torch._C._current_graph_task_id() != -1 and self._recompute_depth:
            self._recompute_depth -= 1

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._hooks = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or (isinstance(t, type) and issubclass(t, DTensor)) for t in types):
            return NotImplemented  # let DTensor run its local ops: those are what a GPU executes
        out = func(*args, **(kwargs or {}))
        coll = collective(func, args, kwargs)
        if coll is not None:
            kind, nbytes, group = coll
            self.collectives.count[kind] += 1
            self.collectives.bytes[kind] += nbytes
            if self.gpu is not None:
                ranks = _group_ranks(group)
                self.collectives.seconds += collective_seconds(kind, nbytes, ranks, self.world, self.per_node, self.gpu)
            return out
        if func.namespace in _COLLECTIVE_NAMESPACES:
            return out
        self._count(func, args, kwargs, out)
        return out

    def _count(self, func, args, kwargs, out) -> None:
        from torch.utils._runtime_estimation import _IGNORE_OPS, get_num_bytes

        packet = func._overloadpacket
        if packet in _IGNORE_OPS or func.is_view or func.namespace == "prim":  # views, creation, metadata (prim.device)
            return
        flops = op_flops(func, args, kwargs, out)
        self.flops += flops
        if self._recompute_depth:
            self.recompute_flops += flops
        if self.gpu is None:
            return
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        nbytes = sum(get_num_bytes(t) for t in tensors)
        self.bytes_moved += nbytes
        seconds = nbytes / self.gpu.hbm_bytes_per_s
        if flops:
            dtypes = [t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            peak = self.gpu.peak_flops(dtypes[0] if dtypes else torch.float32)
            seconds = max(seconds, flops / (COMPUTE_EFFICIENCY * peak))
        self.compute_seconds += seconds
        self.seconds_by_op[packet.__name__] += seconds
