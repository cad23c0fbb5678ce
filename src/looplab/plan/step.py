"""One optimizer step of what `python -m looplab.train` builds, on fake tensors with a fake process group.

The run is built by the run's own functions, in the order Lightning 2.6 calls them for `trainer.fit`:

1. `looplab.train.build_run(cfg)` — the DataModule's stand-in (`ShapeOnlyData`: its sequence length and batch
   size; nothing is tokenised or downloaded), the LoopedLMModule and its LoopedLM, built on the meta device
   (no memory, no initialisation: values do not matter to a plan);
2. the strategy of `training.distributed.trainer_overrides(cfg)` (looplab's FSDP2 strategy with `hardware.fsdp`,
   or Lightning's single-device one) and the precision plugin that Lightning's accelerator connector picks for
   `trainer.precision` (bf16-mixed: autocast);
3. the device mesh of `ModelParallelStrategy.setup_environment` over a fake process group of the run's world size
   (`torch.testing._internal.distributed.fake_pg`: collectives that move nothing; this process is rank 0), then
   `LoopedLMModule.configure_model` (`shard_looped_model`; compile is planned eagerly, below);
4. the parameters made real-shaped fake tensors (`to_empty` under `FakeTensorMode`; the strategy's
   `convert_module`), then `LoopedLMModule.configure_optimizers`;
5. one optimizer step as Lightning's automatic optimization runs it (loops/optimization/automatic.py): per
   micro-batch `strategy.training_step` (autocast) → loss / accumulate_grad_batches → zero_grad after the first
   micro-batch's forward → `strategy.backward`; every micro-batch but the last inside
   `_block_parallel_sync_behavior` (the strategy's no-sync context); the last one through
   `strategy.optimizer_step`, which runs it as the optimizer's closure, then the module's gradient clipping,
   then `optimizer.step()`. `self.log(..., sync_dist=True)` reduces the value as Lightning does
   (`strategy.reduce`: a barrier and a 4-byte all-reduce per call; the training step logs none: its loss is reduced
   on the device, training/module.py mean_over_ranks). Before each micro-batch the ranks agree on Lightning's SIGTERM
   flag: an 8-byte broadcast, on the host since callbacks.HostSigtermFlag.

The step is the steady state: the optimizer state exists and the previous step's gradients are still allocated
when the first forward starts (Lightning frees them only at the zero_grad after that forward). One
`optimizer.step()` over zero gradients before the measured step creates them.

Where the plan cannot run what a GPU runs:
- on a machine without CUDA (the usual case) the tensors are fake *CPU* tensors: bf16-mixed is CPU autocast
  (matmuls in bf16 as on a GPU; CUDA's autocast also keeps softmax / norms in fp32, which looplab already does
  itself), attention is SDPA's CPU flash kernel (the same O(T) memory as CUDA's flash attention), and Mamba-2 runs
  the torch SSD path (on a GPU, `kernel=auto` runs mamba_ssm's fused kernels, which keep fewer activations: the
  plan overstates a Mamba-2 run's activations). Memory is counted in live tensor bytes (FSDPMemTracker), not in
  the CUDA caching allocator's rounded blocks and fragmentation.
- a value read on the host from a fake tensor (an input check's min/max, a `.item()`) reads 0, and a boolean mask
  selects every element (every token supervised: exact for language modelling, an upper bound for the tasks'
  answer-only loss, a few bytes).
- compile: torch.compile falls back to eager under an active dispatch mode (FakeTensorMode, the trackers), so a
  compiled run is planned eagerly, said so in the plan's notes: an upper bound on its memory (inductor's min-cut
  partitioner saves fewer activations) and on its time (no fusion).
"""

from __future__ import annotations

import contextlib
import copy
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from looplab.models import ConfigError


class RunWouldFail(ValueError):
    """The run's own code raised during the planned step: `python -m looplab.train` would fail there too."""


class ShapeOnlyData:
    """The run's DataModule as far as `build_run` and the plan read it, without its data: `seq_len`,
    `batch_size` and the vocabulary size (`backbone.vocab_size` when the config sets it, else the DataModule's,
    which loads its tokenizer: a local file or the hub cache, never the corpus)."""

    def __init__(self, dm: Any, vocab_size: int | None):
        self._dm = dm
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is not None:
            return int(self._vocab_size)
        try:
            return int(self._dm.vocab_size)
        except Exception as e:
            raise ConfigError(f"the plan needs the vocabulary size and the dataset's tokenizer could not be loaded "
                              f"({type(e).__name__}: {e}); set backbone.vocab_size=V") from None

    _SHAPE = ("seq_len", "batch_size", "micro_batch", "per_rank_batch_size", "name", "tokenizer_spec")  # read without any data

    def __getattr__(self, name: str) -> Any:
        if name in ShapeOnlyData._SHAPE:
            return getattr(self._dm, name)
        raise AttributeError(f"the plan's stand-in for the DataModule has no {name!r} (it holds no data)")


def micro_batch_per_rank(dm: Any, world: int, accumulate: int | None = None) -> tuple[int, int]:
    """(sequences per rank in one micro-batch, micro-batches per optimizer step), as the run resolves them
    (train.py set_micro_batches, data/sampler.py micro_batching): `dataset.batch_size` is the global batch of one
    optimizer step, each rank's share of it cut by `dataset.micro_batch` or `trainer.accumulate_grad_batches`."""
    from looplab.data.sampler import micro_batching

    try:
        return micro_batching(int(dm.batch_size), world, getattr(dm, "micro_batch", None), accumulate)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@contextlib.contextmanager
def fake_process_group(world: int):
    """A fake process group of `world` ranks for the duration (this process is rank 0)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("python -m looplab.plan needs a process without a process group (it makes a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_values():
    """Under FakeTensorMode: a host read of a fake value gives 0, and a boolean mask (nonzero) selects every element
    (module docstring). Both are data-dependent, which fake tensors refuse."""
    from torch._subclasses import fake_impls

    aten = torch.ops.aten

    def nonzero(fake_mode, func, arg):
        return arg.new_empty_strided((arg.numel(), arg.dim()), (max(arg.dim(), 1), 1), dtype=torch.int64)

    def local_scalar_dense(fake_mode, func, arg):
        return False if arg.dtype == torch.bool else 0 if not arg.is_floating_point() else 0.0

    table = fake_impls.op_implementations_dict
    saved = {op: table.get(op) for op in (aten.nonzero.default, aten._local_scalar_dense.default)}
    table[aten.nonzero.default] = nonzero
    table[aten._local_scalar_dense.default] = local_scalar_dense
    try:
        yield
    finally:
        for op, impl in saved.items():
            if impl is None:
                table.pop(op, None)
            else:
                table[op] = impl


def precision_plugin(flag: str, device_type: str):
    """The precision plugin Lightning's accelerator connector picks for `flag` under looplab's strategies
    (lightning/pytorch/trainer/connectors/accelerator_connector.py `_check_and_init_precision`)."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    from looplab.training.precision import precision_plugin as runs_own

    own = runs_own(flag, device_type)
    if own is not None:  # what train.py passes instead of the flag
        return own
    if flag in ("16-true", "bf16-true"):
        return HalfPrecision(flag)
    if flag == "32-true":
        return Precision()
    if flag in ("16-mixed", "bf16-mixed"):
        return MixedPrecision(flag, device_type)
    raise ConfigError(f"trainer.precision={flag!r}: the plan knows 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true")


@dataclass
class PlanTrainer:
    """What the LightningModule, the strategy and the precision plugin read from `trainer` during a training
    step, with the values Lightning's Trainer gives them for this config (no callbacks: none of looplab's
    changes a step's tensors)."""

    strategy: Any
    precision_plugin: Any
    lightning_module: Any
    accumulate_grad_batches: int
    max_steps: int
    gradient_clip_val: float | None
    gradient_clip_algorithm: Any
    world_size: int
    num_nodes: int
    num_devices: int
    global_step: int = 1
    current_epoch: int = 0
    global_rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    is_global_zero: bool = True
    barebones: bool = False
    training: bool = True
    callbacks: list = field(default_factory=list)
    loggers: list = field(default_factory=list)
    logger: Any = None

    def __post_init__(self):
        from lightning.pytorch.profilers import PassThroughProfiler

        self.profiler = PassThroughProfiler()


@dataclass
class Measurement:
    """One measured step: memory (FSDPMemTracker's peak snapshot, by category), and the StepCounter's counts."""

    peak_bytes: int
    breakdown: dict[str, int]
    tracker_breakdown: dict[str, int]
    micro_batch: int
    grad_accum: int
    world: int
    seq_len: int
    precision: str
    strategy: str
    device: str
    activation_checkpointing: Any
    compiled: bool
    parameters: int
    accelerator: str = "gpu"
    flops: int = 0
    recompute_flops: int = 0
    compute_seconds: float = 0.0
    collective_seconds: float = 0.0
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    collective_bytes: int = 0
    bytes_moved: int = 0
    top_ops: dict[str, float] = field(default_factory=dict)
    vocab_size: int = 0
    notes: list[str] = field(default_factory=list)


_CATEGORIES = {  # FSDPMemTracker / MemTracker reference types → the plan's breakdown
    "Sharded Param": "parameters", "Unsharded Param": "parameters", "Buffer": "parameters", "All Gather": "parameters",
    "Parameter": "parameters",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Reduce Scatter": "gradients", "Gradient": "gradients",
    "OptState": "optimizer_state", "Optstate": "optimizer_state",
    "Activation": "activations", "Inputs": "activations", "Input": "activations",
    "Temp": "temporaries", "Other": "temporaries",
}
BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


def plan_device(cfg: DictConfig) -> tuple[str, str]:
    """(the run's accelerator, the device the fake tensors claim): a GPU run is faked on CUDA where this machine
    has it, else on the CPU (module docstring)."""
    acc = str(cfg.trainer.get("accelerator", "auto"))
    if acc in ("auto", "gpu", "cuda"):
        return "gpu", ("cuda" if torch.cuda.is_available() else "cpu")
    if acc == "cpu":
        return "cpu", "cpu"
    raise ConfigError(f"trainer.accelerator={acc!r}: the plan knows gpu (cuda) and cpu runs")


def world_of(cfg: DictConfig) -> tuple[int, int]:
    """(world size, devices per node) = (num_nodes · devices, devices); devices must be a count."""
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"trainer.devices={devices!r}: give the plan the GPUs per node as a number, e.g. trainer.devices=8")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"trainer.num_nodes={nodes!r} must be a number >= 1")
    return nodes * devices, devices


def _loss_of(output: Any) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output


def _optimizer_of(conf: Any) -> tuple[Any, Any]:
    """configure_optimizers' return → (optimizer, scheduler or None): the forms looplab uses."""
    if isinstance(conf, dict):
        sched = conf.get("lr_scheduler")
        return conf["optimizer"], (sched.get("scheduler") if isinstance(sched, dict) else sched)
    if isinstance(conf, (list, tuple)):
        return conf[0][0] if isinstance(conf[0], (list, tuple)) else conf[0], None
    return conf, None


def measure(cfg: DictConfig, gpu=None, count: bool = True) -> Measurement:
    """Build the run of `cfg` and measure one optimizer step (module docstring). gpu: the roofline's GPU."""
    from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from looplab.plan.cost import StepCounter
    from looplab.train import build_datamodule, build_run
    from looplab.training.distributed import trainer_overrides

    PeakFSDPMemTracker, PeakMemTracker = _peak_only(FSDPMemTracker), _peak_only(MemTracker)

    world, per_node = world_of(cfg)
    accelerator, device = plan_device(cfg)
    cfg = copy.deepcopy(cfg)
    OmegaConf.set_struct(cfg, False)
    cfg.trainer.accelerator = accelerator  # `auto` on a CPU box would resolve to the CPU: the plan is of a GPU run
    overrides = trainer_overrides(cfg)
    flag = overrides["precision"]
    accum = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    notes: list[str] = []

    with fake_process_group(world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backbone_vocab = OmegaConf.select(cfg, "backbone.vocab_size")
        dm = ShapeOnlyData(build_datamodule(cfg), backbone_vocab)
        with torch.device("meta"):
            run = build_run(cfg, dm=dm)
        module = run.module
        n_params = int(module.model.num_parameters()["total"])
        (micro, accum), seq_len = micro_batch_per_rank(dm, world, accum), int(dm.seq_len)
        vocab = int(run.model_cfg.vocab_size)
        plugin = precision_plugin(flag, device)
        strategy = overrides.get("strategy")
        fsdp = isinstance(strategy, ModelParallelStrategy)
        if not fsdp:
            name = str(cfg.trainer.get("strategy", "auto"))
            if world > 1 and name not in ("ddp", "auto", "ddp_spawn", "ddp_find_unused_parameters_true"):
                raise ConfigError(f"trainer.strategy={name!r}: the plan knows fsdp (looplab's FSDP2), ddp and one device")
            strategy = SingleDeviceStrategy(device=torch.device(device))
            if world > 1:
                notes.append("ddp: the step is one replica's; its gradient all-reduce and bucket memory are analytic")
        _connect(strategy, plugin, module, device, world, per_node)
        clip_alg = cfg.trainer.get("gradient_clip_algorithm")
        trainer = PlanTrainer(strategy=strategy, precision_plugin=plugin, lightning_module=module,
                              accumulate_grad_batches=accum, max_steps=int(cfg.trainer.get("max_steps") or -1),
                              gradient_clip_val=cfg.trainer.get("gradient_clip_val"),
                              gradient_clip_algorithm=GradClipAlgorithmType(str(clip_alg).lower()) if clip_alg else None,
                              world_size=world, num_nodes=world // per_node, num_devices=per_node)
        module._trainer = trainer
        if fsdp:  # the strategy's own setup: its device mesh over the (fake) process group, given to the module
            strategy.setup_environment()
        compiled = bool(module.compile_block)
        if compiled:  # torch.compile falls back to eager under the dispatch modes a plan runs in: plan it eagerly
            module.compile_block = False
            notes.append("compile=true is planned eagerly (torch.compile does not trace under fake tensors' dispatch "
                         "modes): the memory is an upper bound, compile's fusion and recomputation are not modelled")
        module.configure_model()
        logged = _reduce_logged_values(module, strategy)

        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake, fake_values():
            module.model.to_empty(device=device)
            strategy.model = module = plugin.convert_module(module)
            optimizer, _ = _optimizer_of(module.configure_optimizers())
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for p in params:  # steady state: optimizer state exists, last step's gradients still allocated
                p.grad = torch.zeros_like(p)
            with _step_errors():
                optimizer.step()
            tracker = PeakFSDPMemTracker(module.model, optimizer) if fsdp else PeakMemTracker()
            if not fsdp:
                tracker.track_external(module.model, optimizer)
            counter = StepCounter(gpu if count else None, world, per_node)
            with tracker, counter:
                for i in range(accum):
                    if world > 1:  # Lightning 2.6 broadcasts its SIGTERM flag before every micro-batch (training_epoch_loop;
                        # on the host: callbacks.HostSigtermFlag)
                        dist.broadcast(torch.zeros(1, dtype=torch.long, device=device), src=0)
                    batch = {"input_ids": torch.zeros(micro, seq_len, dtype=torch.long, device=device),
                             "targets": torch.zeros(micro, seq_len, dtype=torch.long, device=device)}
                    if i:
                        tracker.reset_mod_stats()  # the trackers refuse a second root forward in one step otherwise
                    if fsdp:
                        tracker.track_inputs((batch,))
                    with _step_errors():
                        run_micro_batch(trainer, module, optimizer, batch, i, accum, tracker)
            snapshot = tracker.get_tracker_snapshot("peak")
        logged.restore()

    dev_snap = max(snapshot.values(), key=lambda d: d.get("Total", 0)) if snapshot else {"Total": 0}
    raw = {(k.value if hasattr(k, "value") else str(k)): int(v) for k, v in dev_snap.items()}
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    for k, v in raw.items():
        if k != "Total":
            breakdown[_CATEGORIES.get(k, "temporaries")] += v
    peak = raw.get("Total", 0)
    m = Measurement(peak_bytes=peak, breakdown=breakdown, tracker_breakdown=raw, micro_batch=micro, grad_accum=accum,
                    world=world, seq_len=seq_len, precision=flag, device=device,
                    strategy="fsdp2" if fsdp else ("ddp" if world > 1 else "single"),
                    activation_checkpointing=OmegaConf.select(cfg, "hardware.activation_checkpointing"), compiled=compiled,
                    parameters=n_params, accelerator=accelerator, vocab_size=vocab, notes=notes)
    m.flops, m.recompute_flops = counter.flops, counter.recompute_flops
    m.compute_seconds, m.collective_seconds = counter.compute_seconds, counter.collectives.seconds
    m.collectives, m.collective_bytes = counter.collectives.as_dict(), counter.collectives.total_bytes
    m.bytes_moved, m.top_ops = counter.bytes_moved, dict(counter.seconds_by_op.most_common(8))
    if not fsdp and world > 1:
        _add_ddp(m, module_param_bytes=4 * m.parameters, gpu=gpu, per_node=per_node)
    return m


class PlanCannotRun(RuntimeError):
    """The step uses something fake tensors cannot run (a value-dependent shape, an op without a fake kernel)."""


@contextlib.contextmanager
def _step_errors():
    """An error in the planned step: the plan's own limit (fake tensors) or the run's (RunWouldFail)."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               UnsupportedFakeTensorException, UnsupportedOperatorException)

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException,
            UnsupportedOperatorException) as e:
        raise PlanCannotRun(f"the plan cannot run this step on fake tensors ({type(e).__name__}: {e}); the run itself "
                            "may be fine") from e
    except (RunWouldFail, PlanCannotRun):
        raise
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1].filename.replace("\\", "/")
        if any(part in where for part in ("/distributed/_tools/", "/looplab/plan/", "/torch/_subclasses/")):
            # the plan's own tracking, counting or fake tensors failed, not the run
            raise PlanCannotRun(f"the plan could not count this step ({type(e).__name__}: {e})") from e
        raise RunWouldFail(f"the run's own training step raised {type(e).__name__}: {e} "
                           "(python -m looplab.train would stop there too)") from e


def _connect(strategy, plugin, module, device: str, world: int, per_node: int) -> None:
    """What Lightning's accelerator connector and Trainer give a strategy before `setup_environment`
    (`_AcceleratorConnector._lazy_init_strategy`, `strategy.connect`): accelerator, precision plugin, cluster
    environment of `world` ranks (this process rank 0), devices, nodes, and the LightningModule."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    strategy.accelerator = CUDAAccelerator() if device == "cuda" else CPUAccelerator()
    strategy.precision_plugin = plugin
    if hasattr(strategy, "cluster_environment"):
        strategy.cluster_environment = LightningEnvironment()
        strategy.parallel_devices = [torch.device(device, 0) if device == "cuda" else torch.device(device)] * per_node
        strategy.num_nodes = world // per_node
        strategy.set_world_ranks()
    strategy._lightning_module = module
    strategy.model = module


def _peak_only(tracker_class):
    """`tracker_class` keeping the peak of the whole step only: torch's trackers also keep every module's own peak,
    walking all modules at every op, which was a tenth of a 1.4B plan's time; the plan reads the global peak."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    class PeakOnly(tracker_class):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    PeakOnly.__name__ = PeakOnly.__qualname__ = f"PeakOnly{tracker_class.__name__}"
    return PeakOnly


def run_micro_batch(trainer, module, optimizer, batch, i: int, accum: int, tracker=None) -> None:
    """Micro-batch i of an optimizer step, as Lightning's automatic optimization runs it (module docstring).

    The last micro-batch runs as the optimizer's closure, inside `optimizer.step()`: the memory tracker, which
    counts what is allocated during a step as optimizer state, is told it is outside the step meanwhile."""
    from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior

    strategy = trainer.strategy

    def closure():
        in_opt = getattr(tracker, "_in_opt", False)
        if tracker is not None:
            tracker._in_opt = False
        try:
            loss = _loss_of(strategy.training_step(batch, i)) / accum  # _ClosureResult: normalised by accumulation
            if i == 0:  # Lightning's zero_grad_fn: first micro-batch of the step, after its forward
                module.optimizer_zero_grad(trainer.current_epoch, i, optimizer)
            strategy.backward(loss, optimizer)
        finally:
            if tracker is not None:
                tracker._in_opt = in_opt
        return loss

    if i < accum - 1:
        with _block_parallel_sync_behavior(strategy, block=True):
            closure()
    else:
        strategy.optimizer_step(optimizer, closure)


class _reduce_logged_values:
    """`self.log(name, value, sync_dist=True)` inside the step: the reduction Lightning's result collection makes for
    an on-step value (`strategy.reduce(value.float().clone(), group, reduce_op)`), and nothing else."""

    def __init__(self, module, strategy):
        self.module, self.strategy = module, strategy
        module.log = self.log
        module.log_dict = self.log_dict

    def log(self, name, value, prog_bar=False, logger=None, on_step=None, on_epoch=None, reduce_fx="mean",
            enable_graph=False, sync_dist=False, sync_dist_group=None, *args, **kwargs):
        if not sync_dist or on_step is False:
            return
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value))
        op = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
        self.strategy.reduce(value.detach().float().clone(), sync_dist_group, reduce_op=op)

    def log_dict(self, dictionary, *args, **kwargs):
        for k, v in dictionary.items():
            self.log(k, v, *args, **kwargs)

    def restore(self):
        for name in ("log", "log_dict"):
            self.module.__dict__.pop(name, None)


def _add_ddp(m: Measurement, module_param_bytes: int, gpu, per_node: int) -> None:
    """DDP (analytic): one all-reduce of every fp32 gradient per optimizer step in 25 MiB buckets (no sync while
    accumulating: Lightning's `block_backward_sync`), and its buckets, one more copy of the gradients."""
    from looplab.plan.cost import collective_seconds

    bucket = 25 * 2**20
    count = -(-module_param_bytes // bucket)
    seen = m.collectives.get("all_reduce", {})
    m.collectives = {**m.collectives, "all_reduce": {"count": seen.get("count", 0) + count,
                                                    "bytes": seen.get("bytes", 0) + module_param_bytes}}
    m.collective_bytes += module_param_bytes
    if gpu is not None:
        m.collective_seconds += collective_seconds("all_reduce", module_param_bytes, None, m.world, per_node, gpu)
    m.breakdown["gradients"] += module_param_bytes
    m.peak_bytes += module_param_bytes
