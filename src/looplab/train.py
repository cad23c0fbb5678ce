"""python -m looplab.train [+experiment=NAME] [group=option ...] [-m]

The one place where config, data, model and trainer are composed:
instantiate → check → fit → test (→ test at each loop_depth.eval_loops depth) → results.json.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from looplab.training.run_utils import (
    build_loggers, close_wandb, git_commit, hydra_context, plain_config, resolve_compile, task_wrapper, write_json_atomic,
)

log = logging.getLogger("looplab")


def build_datamodule(cfg: DictConfig):
    ds = OmegaConf.to_container(cfg.dataset, resolve=True)
    if "_target_" not in ds:
        raise ValueError(f"dataset config {ds.get('name')!r} has no _target_ (the DataModule class to build)")
    ds.pop("name", None)
    return hydra.utils.instantiate(ds, _convert_="all")


@dataclass
class RunParts:
    """What `build_run` composes from a config: the DataModule and the LightningModule, with the
    pieces of config they were built from."""

    dm: Any
    model_cfg: Any
    objective: dict[str, Any]
    depth: Any
    eval_loops: list[int]
    use_compile: bool
    compile_why: str
    module: Any


def build_run(cfg: DictConfig, dm: Any = None) -> RunParts:
    """Seed, then the DataModule and the LightningModule, exactly as `python -m looplab.train` builds them.

    The paired arms of a table (StateLoop vs Vanilla Looped, reset vs carry, ...) go through this one
    function, so that for a given seed they start from the same values of every parameter they share
    and see the same batches (common random numbers: models/rng.py; tests/test_common_random_numbers.py).
    `dm`: a DataModule built elsewhere (the plan's shape-only stand-in, looplab/plan/step.py) instead of the config's.
    """
    import lightning as L

    from looplab.models import ConfigError
    from looplab.training.compose import depth_from_cfg, eval_loops_from_cfg, model_config_from_cfg, objective_from_cfg
    from looplab.training.module import LoopedLMModule

    L.seed_everything(cfg.seed, workers=True)
    dm = build_datamodule(cfg) if dm is None else dm  # the plan (looplab.plan) passes a shape-only stand-in
    model_cfg = model_config_from_cfg(cfg, vocab_size=getattr(dm, "vocab_size", None))
    check_run_fits(cfg, model_cfg, dm)  # before the model is allocated
    objective = objective_from_cfg(cfg)
    depth = depth_from_cfg(cfg)  # training-depth sampler + truncated backprop
    eval_loops = eval_loops_from_cfg(cfg)
    use_compile, compile_why = resolve_compile(cfg.get("compile", False), model_cfg.d_model, str(cfg.trainer.accelerator))
    refused = model_cfg.unsupported("compile_training") if use_compile else None
    if refused:
        if cfg.get("compile") is True:
            raise ConfigError(f"compile=true with {refused}")
        use_compile, compile_why = False, f"compile=auto: off ({refused.split(':')[0]} trains eagerly)"
    dataset_meta = OmegaConf.to_container(cfg.dataset, resolve=True)
    for attr in ("tokenizer_spec", "vocab_size", "seq_len", "tokenizer_identity"):
        if hasattr(dm, attr):
            try:
                dataset_meta[f"_{attr}"] = getattr(dm, attr)
            except Exception:  # a property that needs setup() first
                pass
    if getattr(dm, "hop_counts", None):  # mixed-hop p-hop: the module scores each hop count (acc_by_hops)
        dataset_meta["_hop_counts"] = list(dm.hop_counts)
    module = LoopedLMModule(
        model_config=model_cfg.to_dict(),
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        objective=objective,
        dataset=dataset_meta,
        # false | loop | layer | selective, true = layer (models/checkpointing.py)
        activation_checkpointing=cfg.hardware.get("activation_checkpointing", False),
        compile_block=use_compile,  # applied in configure_model, after any sharding
        depth=asdict(depth),
        loop_diagnostics=bool(cfg.get("loop_diagnostics", True)),  # val_diag/* (eval/diagnostics.py)
    )
    return RunParts(dm, model_cfg, objective, depth, eval_loops, use_compile, compile_why, module)


def set_micro_batches(trainer, dm, cfg: DictConfig) -> int:
    """The global batch (`dataset.batch_size`) is one optimizer step's, whatever the micro-batching: each device's
    share, batch_size / world, runs as k micro-batches of `dataset.micro_batch` sequences (k = share / micro_batch),
    or of share / k with `trainer.accumulate_grad_batches=k` (data/sampler.py micro_batching: refused in one line
    when it does not divide, or when both are set and disagree). Sets the trainer's accumulation, once the world
    size is known (devices=-1), and keeps `trainer.val_check_interval` counted in optimizer steps (Lightning counts
    it in micro-batches). Returns the sequences per device per forward."""
    from looplab.data.sampler import micro_batching

    batch = getattr(dm, "batch_size", None)
    if not isinstance(batch, int):  # a DataModule of another kind: Lightning's own accumulation, as given
        return int(cfg.dataset.get("batch_size", 1)) // max(1, trainer.world_size)
    micro, k = micro_batching(batch, trainer.world_size, getattr(dm, "micro_batch", None),
                              cfg.trainer.get("accumulate_grad_batches"))
    trainer.accumulate_grad_batches = k
    if k > 1 and isinstance(trainer.val_check_interval, int):
        trainer.val_check_interval *= k
    if k > 1:
        log.info("micro-batches: %d sequences per device per forward × %d per optimizer step (global batch %d)",
                 micro, k, batch)
    return micro


def check_same_tokenizer(meta: dict[str, Any], dm, path: str) -> None:
    """resume= and init_from=: the run's tokenizer must give the ids the checkpoint was trained with (same size is
    not enough: a permuted vocabulary trains garbage silently). Checkpoints from before identities were recorded
    carry none, and pass."""
    from looplab.data.tokenizer import check_identity

    recorded = (meta.get("dataset") or {}).get("_tokenizer_identity")
    found = getattr(dm, "tokenizer_identity", None) if recorded else None
    check_identity(recorded, found, getattr(dm, "tokenizer_spec", None) or getattr(dm, "name", None), f"checkpoint {path!r}")


def check_run_fits(cfg: DictConfig, model_cfg, dm) -> None:
    """Refuse, in one line naming the size, a run whose parameters and per-loop activations cannot fit even at their
    lower bound (models/sizing.py): `loop_depth.loops=10**12` or a huge vocabulary fails here, not in the kernel's
    OOM killer. Tokens per device: one micro-batch (the global batch over the ranks and the micro-batching, as
    set_micro_batches resolves them; one sequence when the rank count is not known yet, devices=-1)."""
    from looplab.data.sampler import micro_batching
    from looplab.models.sizing import check_fits

    seq_len = int(getattr(dm, "seq_len", None) or model_cfg.max_seq_len)
    devices, nodes = cfg.trainer.get("devices", 1), int(cfg.trainer.get("num_nodes", 1) or 1)
    world = int(devices) * nodes if isinstance(devices, int) and devices > 0 else None
    batch = int(cfg.dataset.get("batch_size", 1) or 1)
    per_device = 1
    if world:
        per_device, _ = micro_batching(batch, world, cfg.dataset.get("micro_batch"), cfg.trainer.get("accumulate_grad_batches"))
    accelerator = str(cfg.trainer.get("accelerator", "cpu"))
    fsdp = "fsdp" in str(cfg.trainer.get("strategy", ""))
    check_fits(model_cfg, where="this run", tokens=per_device * seq_len, training=True,
               device="cuda" if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()) else "cpu",
               shards=world if (fsdp and world) else 1)


def load_warm_start(model, path: str, dm=None) -> list[str]:
    """Load a (vanilla / stage-1) checkpoint into a model that may have extra branches (docs/formulations.md#stateloop);
    with the run's DataModule `dm`, its tokenizer is checked against the checkpoint's."""
    from looplab.checkpoint import check_compatible, model_state_dict, read_checkpoint

    ckpt = read_checkpoint(path)
    check_compatible(ckpt["looplab"], model.config, allow_new_branches=True)
    if dm is not None:
        check_same_tokenizer(ckpt["looplab"], dm, path)
    state = model_state_dict(ckpt)
    own = model.state_dict()
    state = {k: v for k, v in state.items() if k in own}  # a branch the new model lacks is dropped
    missing, _ = model.load_state_dict(state, strict=False)
    bad = [k for k in missing if not k.startswith(("state.", "exit_gate.", "inject.", "router."))]
    if bad:
        raise ValueError(f"checkpoint {path!r} lacks backbone weights {bad[:5]}...")
    return missing


def train(cfg: DictConfig) -> dict[str, Any]:
    """One attempt of a run in the folder it owns (training/run_folder.py): global rank 0 holds `<run>/.lock` from
    before anything is written until the end; a second live run into the folder, or resume=auto with other
    overrides than the folder's checkpoint was trained with (resume=force: anyway), is refused; orphaned temporary
    files of killed saves are removed."""
    from looplab.training.distributed import is_global_zero_from_env
    from looplab.training.run_folder import claim_run_folder

    ctx = hydra_context()
    with claim_run_folder(Path(ctx["output_dir"]), ctx["overrides"], cfg.get("resume"), rank_zero=is_global_zero_from_env()):
        return _train(cfg)


def _train(cfg: DictConfig) -> dict[str, Any]:
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ModelSummary

    from looplab.checkpoint import check_compatible, read_checkpoint_meta
    from looplab.training.callbacks import (
        AtomicCheckpointIO, AttemptClock, HostSigtermFlag, PlainProgress, Requeued, RichProgress, ThroughputMonitor,
        ThroughputRecord,
    )
    from looplab.training.distributed import check_resume_source, is_global_zero_from_env, recover_checkpoint, trainer_overrides
    from looplab.training.precision import precision_plugin

    start = time.time()
    ctx = hydra_context()
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # Hydra's handlers already print and file them
        logging.getLogger(name).handlers.clear()
    out_dir = Path(ctx["output_dir"])
    if cfg.hardware.get("num_threads"):
        torch.set_num_threads(int(cfg.hardware.num_threads))
    ckpt_dir = out_dir / "checkpoints"
    # ---- everything that can be wrong is checked before any training starts
    run = build_run(cfg)
    dm, model_cfg, objective, depth, eval_loops, module = run.dm, run.model_cfg, run.objective, run.depth, run.eval_loops, run.module
    compile_why = run.compile_why
    recover_checkpoint(ckpt_dir / "last.ckpt")  # a sharded save killed between its two renames
    set_aside_hpc_checkpoints(out_dir, ckpt_dir)  # last.ckpt is the one resume source
    ckpt_path = None
    if cfg.resume in ("auto", "force"):  # force: the folder's checkpoint even with other overrides (run_folder.py)
        if (ckpt_dir / "last.ckpt").exists():
            ckpt_path = str(ckpt_dir / "last.ckpt")
    elif cfg.resume:
        ckpt_path = str(cfg.resume)
    if ckpt_path:
        resumed_meta = read_checkpoint_meta(ckpt_path)  # metadata only, every rank
        check_compatible(resumed_meta, model_cfg)
        check_resume_source(ckpt_path, cfg)  # a sharded folder without the FSDP strategy, a model folder
        check_same_tokenizer(resumed_meta, dm, ckpt_path)
        log.info("resuming from %s", ckpt_path)

    warm = cfg.get("init_from") or (cfg.exit_gate.get("init_from") if objective["exit_stage"] else None)
    if warm and not ckpt_path:
        missing = load_warm_start(module.model, str(warm), dm)
        log.info("warm start from %s (new, untrained: %s)", warm, sorted({k.split(".")[0] for k in missing}) or "none")
    if objective["exit_stage"] == "stage2":
        module.freeze_all_but_gate()
    log.info(compile_why)

    params = module.model.num_parameters()
    seq_len = int(getattr(dm, "seq_len", model_cfg.max_seq_len))
    flops_fwd, flops_train = analytic_flops(module.model, depth, seq_len)
    causal_fwd, causal_train = analytic_flops(module.model, depth, seq_len, causal=True)  # what MFU divides by

    run_name = f"{cfg.task_name}-{out_dir.name}" if not ctx["multirun"] else f"{cfg.task_name}-{out_dir.parent.name}-{out_dir.name}"
    loggers = build_loggers(cfg, out_dir, run_name)
    throughput = ThroughputRecord()
    clock = AttemptClock(out_dir / "attempts.json", start, overrides=ctx["overrides"])  # every attempt's wall time
    if is_global_zero_from_env():
        clock.save()  # this attempt and its overrides are on record from its start (what a later resume is checked against)
    checkpointing = ModelCheckpoint(dirpath=str(ckpt_dir), filename="step{step}", save_last=True, save_top_k=0,
                                    every_n_train_steps=int(cfg.checkpoint_every_n_steps), auto_insert_metric_name=False)
    callbacks = [
        checkpointing,
        throughput,
        clock,
        # Lightning's, reading the device only at the logging steps (no host sync in a training step)
        ThroughputMonitor(batch_size_fn=lambda b: b["input_ids"].shape[0], length_fn=lambda b: b["input_ids"].numel()),
        HostSigtermFlag(),  # several ranks: Lightning's SIGTERM flag agreed on the host, not read from the GPU
    ]
    callbacks += [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c]
    if loggers:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if cfg.trainer.get("enable_model_summary", True) is not False:
        callbacks.append(ModelSummary(max_depth=2))  # shows block / state / exit_gate sizes separately
    overrides = trainer_overrides(cfg)  # precision auto, strategy fsdp
    plugins, requeue = [AtomicCheckpointIO(on_failure=clock.record_failure)], slurm_requeue(ckpt_dir / "last.ckpt", clock)
    own_precision = precision_plugin(overrides["precision"], str(cfg.trainer.accelerator))
    if own_precision is not None:  # bf16-mixed: clipping allowed with a fused optimizer (training/precision.py)
        plugins.append(own_precision)
        overrides["precision"] = None  # the plugin decides; Lightning refuses both
    if requeue:
        callbacks.append(requeue)
        plugins.append(requeue.environment)
    if cfg.trainer.get("enable_progress_bar", True) is not False:
        if sys.stdout.isatty():  # the loss on the bar is read at the logging steps only (callbacks.LoggedLoss)
            callbacks.append(RichProgress(every=int(cfg.trainer.get("log_every_n_steps") or 25), leave=True))
        else:  # SLURM, CI, `> file`: a live bar prints nothing there; plain lines instead
            callbacks.append(PlainProgress(every=int(cfg.trainer.get("log_every_n_steps") or 25)))
            overrides["enable_progress_bar"] = False
    trainer = hydra.utils.instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, plugins=plugins,
        default_root_dir=str(out_dir), _convert_="partial", **overrides,
    )
    micro = set_micro_batches(trainer, dm, cfg)  # dataset.micro_batch ⇄ trainer.accumulate_grad_batches, global batch kept
    # ThroughputMonitor reads this: training FLOPs of one per-device batch (analytic, all loops counted, causal
    # attention counted as causal: models/flops.py), so its logged MFU is the causal one
    module.flops_per_batch = causal_train * seq_len * micro  # per micro-batch: what it counts
    log.info("model: %s | params %s | state-branch overhead %.3f%% | forward FLOPs/token %.3g",
             f"{model_cfg.backbone} {model_cfg.n_layers}x{model_cfg.n_loops} (prelude {model_cfg.prelude_layers}, coda "
             f"{model_cfg.coda_layers}) {model_cfg.state_mode} gate={model_cfg.exit_gate} router={model_cfg.depth_router.name}",
             f"{params['total']:,}", 100 * params["state_branch"] / max(1, params["total"] - params["state_branch"]), flops_fwd)

    try:
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    except Requeued as e:  # SIGUSR1 under SLURM: the next attempt resumes from last.ckpt; nothing to test now
        log.info("preempted: %s", e)
        end_requeued_submitit_attempt()
        return {"status": "requeued", "global_step": trainer.global_step, "output_dir": str(out_dir)}
    if not cfg.trainer.get("fast_dev_run") and checkpointing._last_global_step_saved != trainer.global_step:
        # max_steps off the checkpoint interval: last.ckpt must be the model that results.json describes
        trainer.save_checkpoint(ckpt_dir / "last.ckpt")
    val_metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    test_metrics: dict[str, float] = {}
    if cfg.get("test_after_fit", True) and not cfg.trainer.get("fast_dev_run"):
        run_test_stage(trainer, module, dm)
        test_metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
    depth_metrics = evaluate_depths(trainer, module, dm, eval_loops) if eval_loops and not cfg.trainer.get("fast_dev_run") else {}

    results = collect_results(cfg, ctx, module, params, flops_fwd, seq_len, val_metrics, test_metrics, throughput, start, trainer,
                              flops_train=flops_train, depth_metrics=depth_metrics, causal=(causal_fwd, causal_train))
    if hasattr(dm, "unigram_perplexity") and trainer.is_global_zero:
        results["unigram_perplexity"] = dm.unigram_perplexity()  # the bar an LM arm must pass (findings' preconditions)
    if ckpt_path:
        carry_over_throughput(results, out_dir / "results.json")
    if trainer.is_global_zero:
        results["wall_time_total_s"] = clock.save(results["wall_time_s"], global_step=trainer.global_step, ended="ok")
        write_json_atomic(out_dir / "results.json", results)
        if depth_metrics:
            from looplab.tables.plots import plot_eval_loops

            plot_eval_loops(results, out_dir / "depth.png")
        close_wandb()  # its own run summary first, so ours is the last thing printed
        print_summary(results, out_dir, loggers)
    return results


def carry_over_throughput(results: dict[str, Any], previous: Path) -> None:
    """A run that trained no step now (a finished run re-tested) keeps the throughput of the invocation that
    trained it, instead of reporting a re-test as its training speed. (Wall time: AttemptClock.)"""
    try:
        prev = json.loads(previous.read_text())
    except (OSError, ValueError):
        return
    if not results["throughput"].get("tokens") and (prev.get("throughput") or {}).get("tokens"):
        results["throughput"] = prev["throughput"]


def set_aside_hpc_checkpoints(out_dir: Path, ckpt_dir: Path) -> None:
    """One resume source of truth: checkpoints/last.ckpt. Lightning resumes (fit) and *tests* from the newest
    `hpc_ckpt_N.ckpt` in the run folder whenever it runs under SLURM and is given no ckpt_path
    (`_CheckpointConnector._parse_ckpt_path`); looplab never writes one (SlurmRequeue saves last.ckpt), so one
    found here is from older code: moved into checkpoints/, where Lightning does not look, and named in the log."""
    for f in sorted(out_dir.glob("hpc_ckpt_*.ckpt")):
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        dest = ckpt_dir / f"ignored-{f.name}"
        try:
            os.replace(f, dest)
        except FileNotFoundError:  # another rank of this job moved it
            continue
        log.warning("%s is not a resume source (last.ckpt is); moved to %s", f, dest)


def slurm_requeue(last_ckpt: Path, clock):
    """Under SLURM: looplab's SIGUSR1 requeue (callbacks.SlurmRequeue; under submitit its preemption signal too)
    with Lightning's own auto-requeue off; None elsewhere."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from looplab.training.callbacks import SlurmRequeue, preemption_signals

    if not SLURMEnvironment.detect():
        return None
    return SlurmRequeue(last_ckpt, clock, preemption_signals())  # .environment: SLURMEnvironment(auto_requeue=False)


def end_requeued_submitit_attempt() -> None:
    """A submitit job (hardware=slurm) whose attempt was requeued ends here with SystemExit, not with a return:
    submitit pickles whatever the job function returns as the job's result, and its launcher, which waits for
    that file, would then take the sweep job as done while SLURM runs it again. SystemExit passes through Hydra
    and submitit (they catch Exception), so no result is written and the launcher waits for the attempt that
    finishes (the same as after `scontrol requeue`, where Lightning raises SIGTERMException, a SystemExit)."""
    from looplab.training.callbacks import under_submitit

    if under_submitit():
        log.info("submitit job requeued: ending this attempt without a result; the launcher waits for the next one")
        raise SystemExit(0)


def run_test_stage(trainer, module, dm) -> None:
    """trainer.test on the weights in memory — the final ones, which last.ckpt holds. A restore here (Lightning
    picks an hpc checkpoint when given no ckpt_path under SLURM) would score other weights than the ones
    results.json names, so it is an error."""
    trainer.test(module, datamodule=dm, verbose=False)
    if trainer.ckpt_path is not None:
        raise RuntimeError(f"the test stage restored {trainer.ckpt_path} instead of testing the final weights")


def evaluate_depths(trainer, module, dm, depths: list[int]) -> dict[str, dict[str, float]]:
    """The final model on the test split at each test-time depth R′ → {"R′": {loss, perplexity[, accuracy]}}."""
    names = {"loss": "loss", "ppl": "perplexity", "acc": "accuracy"}
    out = {}
    try:
        for d in depths:
            module.eval_depth = d
            run_test_stage(trainer, module, dm)
            split = module.test_split
            out[str(d)] = {new: float(trainer.callback_metrics[f"{split}/{old}"]) for old, new in names.items()
                           if f"{split}/{old}" in trainer.callback_metrics}
    finally:
        module.eval_depth = None
    return out


def _finite(v: float | None) -> float | None:
    """None for a metric that was never measured (NaN: no answer of that kind), so results.json stays JSON."""
    return None if v is None or v != v else v


def _series(metrics: dict[str, float], prefix: str, R: int) -> list[float | None]:
    return [metrics.get(f"{prefix}{r}") for r in range(1, R + 1)]


def analytic_flops(model, depth, seq_len: int, causal: bool = False) -> tuple[int, int]:
    """Forward and training FLOPs per token (LoopedLM.flops_per_token): at the expected training depth
    when a sampler is active (R otherwise); the backward of E[min(k, depth)] loops under truncated
    backprop. A depth-routed model runs R loops, each at the fraction of tokens its router gathers.
    causal: attention counted over the T(T + 1)/2 query-key pairs a causal mask keeps, not all T²
    (models/flops.py causal_training_flops: what MFU divides by)."""
    if causal:
        from looplab.models.flops import causal_training_flops

        return causal_training_flops(model, depth, seq_len)
    loops = None if model.router is not None else depth.expected_loops()
    back = depth.expected_backprop_loops()
    return (model.flops_per_token(seq_len, loops=loops),
            model.flops_per_token(seq_len, training=True, loops=loops, backprop_loops=back))


def train_mfu(trainer, tokens_per_s: float | None, flops_per_token: int) -> float | None:
    """Model FLOPs utilisation of the fit: causal training FLOPs per second over the devices' peak at the run's
    compute dtype (Lightning's table of GPUs; None where the peak is not known, e.g. on a CPU)."""
    from lightning.fabric.utilities.throughput import get_available_flops
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    if not tokens_per_s:
        return None
    try:
        peak = get_available_flops(trainer.strategy.root_device, _plugin_to_compute_dtype(trainer.precision_plugin))
    except Exception:
        return None
    return tokens_per_s * flops_per_token / (peak * max(1, trainer.world_size)) if peak else None


def collect_results(cfg, ctx, module, params, flops_fwd, seq_len, val, test, throughput, start, trainer,
                    flops_train: int | None = None, depth_metrics: dict | None = None,
                    causal: tuple[int, int] | None = None) -> dict[str, Any]:
    wall = time.time() - start
    R = module.R
    final = test or val
    split = "test" if test else "val"
    per_depth = {
        "acc": _series(final, f"{split}/acc_loop", R),
        "loss": _series(final, f"{split}/loss_loop", R),
    }
    if depth_metrics:  # test-time depths R′ (loop_depth.eval_loops), keyed by R′
        per_depth["eval_loops"] = depth_metrics
    hop_counts = getattr(module, "hop_counts", None) or []

    def by_hops(name: str) -> dict[str, float | None]:  # mixed-hop p-hop: {hop count: metric over its answers}
        return {str(h): _finite(final.get(f"{split}/{name}_hops{h}")) for h in hop_counts}

    if hop_counts:
        per_depth["acc_by_hops"] = {str(h): [_finite(final.get(f"{split}/acc_loop{r}_hops{h}")) for r in range(1, R + 1)]
                                    for h in hop_counts}
    exit_stats = {}
    for q in module.thresholds:
        exit_stats[str(q)] = {k: final.get(f"{split}/exit_q{q}_{k}") for k in ("acc", "loss", "mean_step", "answer_step")}
        if hop_counts:
            exit_stats[str(q)].update(acc_by_hops=by_hops(f"exit_q{q}_acc"), answer_step_by_hops=by_hops(f"exit_q{q}_answer_step"))
    state_diag = {}
    for key in ("retention", "state_norm", "state_to_stream"):
        series = _series(final, f"{split}/state_{key}_loop", R)
        if any(v is not None for v in series):
            state_diag[key] = series
    base = params["total"] - params["state_branch"] - params["exit_gate"]
    model = module.model
    # a depth-routed run counts loop r at the fraction of tokens that runs it (after the capacity warm-up)
    routed_fractions = ({"loop_fractions": model.config.depth_router.loop_fractions(model.config.n_loops, seq_len)}
                        if getattr(model, "router", None) is not None else {})
    mc = module.model.config
    return {
        "status": "ok",
        "task_name": cfg.task_name,
        "group": cfg.get("group"),
        "tags": list(cfg.get("tags") or []),
        "seed": cfg.seed,
        "model": {"backbone": mc.backbone, "layers": mc.n_layers, "loops": mc.n_loops,
                  "prelude": mc.prelude_layers, "coda": mc.coda_layers, "state_mode": mc.state_mode,
                  "exit_gate": mc.exit_gate, "exit_stage": module.objective.get("exit_stage"), "d_model": mc.d_model,
                  "depth_router": mc.depth_router.name,
                  # the parallel schedule's fields only when it is on: a sequential run's summary as before
                  **({"loop_schedule": "parallel", "loop_kv": mc.loop_kv, "loop_window": mc.loop_window}
                     if mc.loop_schedule == "parallel" else {})},
        "dataset": cfg.dataset.get("name"),
        "metrics": {**val, **test},
        "final_split": split,
        "accuracy": final.get(f"{split}/acc"),
        **({"acc_by_hops": by_hops(f"acc_loop{R}")} if hop_counts else {}),
        "loss": final.get(f"{split}/loss"),
        "perplexity": final.get(f"{split}/ppl"),
        "per_depth": per_depth,
        "exit": exit_stats,
        "exit_rule": module.eval_rule or ("gate" if module.thresholds else None),
        "exit_expected_step": final.get(f"{split}/exit_expected_step"),
        # depth_router: the metrics above route as training does (expert choice sees the whole sequence);
        # causal_*: each token routed on its own, as decoding does (training/module.py _routed_eval)
        "routing": {k: final.get(f"{split}/{m}") for k, m in (
            ("mean_depth", "router_mean_depth"), ("causal_perplexity", "causal_ppl"), ("causal_loss", "causal_loss"),
            ("causal_accuracy", "causal_acc"), ("causal_mean_depth", "causal_mean_depth"))}
        if mc.depth_router.name != "none" else None,
        "state_diagnostics": state_diag,
        "params": params,
        "state_branch_overhead": params["state_branch"] / max(1, base),
        # forward/training: every query against all T keys (FlopCounterMode's convention, the FLOP-matched tables');
        # *_causal: causal attention counted as causal (models/flops.py), what throughput.mfu divides by
        "flops_per_token": {"forward": flops_fwd, "training": 3 * flops_fwd if flops_train is None else flops_train,
                            **({"forward_causal": causal[0], "training_causal": causal[1]} if causal else {}),
                            "seq_len": seq_len, "loops": module.depth.expected_loops(), **routed_fractions},
        "depth": {**{k: v for k, v in asdict(module.depth).items() if k != "seed"},
                  "expected_loops": module.depth.expected_loops(), "eval_loops": [int(d) for d in (depth_metrics or {})]},
        "throughput": {"tokens_per_s": throughput.tokens_per_s, "train_time_s": throughput.train_time, "tokens": throughput.tokens,
                       "compiled": module.model.is_compiled,
                       "mfu": train_mfu(trainer, throughput.tokens_per_s, causal[1]) if causal else None},
        "global_step": trainer.global_step,
        "wall_time_s": wall,
        "wall_time_total_s": wall,  # every attempt's (AttemptClock, attempts.json), set by train()
        "git_commit": git_commit(),
        "overrides": ctx["overrides"],
        "output_dir": str(ctx["output_dir"]),
        "checkpoint": str(Path(ctx["output_dir"]) / "checkpoints" / "last.ckpt"),
        "config": plain_config(cfg),
    }


def print_summary(results: dict[str, Any], out_dir: Path, loggers: list) -> None:
    from rich.console import Console
    from rich.table import Table

    m = results["model"]
    console = Console()
    shape = f"{m['layers']}⊗{m['loops']}"
    if m.get("prelude") or m.get("coda"):  # older results.json files have neither
        shape = f"prelude {m.get('prelude', 0)} + {shape} + coda {m.get('coda', 0)}"
    table = Table(title=f"{results['dataset']} · {m['backbone']} {shape} · {m['state_mode']}"
                        f" · held-out {results['final_split']} split")
    table.add_column("loop depth")
    has_acc = any(v is not None for v in results["per_depth"]["acc"])
    if has_acc:
        table.add_column("answer accuracy")
    table.add_column("loss")
    for r, (acc, loss) in enumerate(zip(results["per_depth"]["acc"], results["per_depth"]["loss"]), start=1):
        row = [f"{r}"]
        if has_acc:
            row.append("-" if acc is None else f"{acc:.3f}")
        row.append("-" if loss is None else f"{loss:.3f}")
        table.add_row(*row)
    console.print(table)
    sweep = results["per_depth"].get("eval_loops")
    if sweep:  # loop_depth.eval_loops: the final model at test-time depths R′
        cells = [f"R′={d}: " + " ".join(f"{k} {v:.3f}" for k, v in vals.items() if k != "perplexity" or "accuracy" not in vals)
                 for d, vals in sorted(sweep.items(), key=lambda kv: int(kv[0]))]
        console.print(f"test-time depth (trained R={m['loops']}): " + " · ".join(cells) + "  (plot: depth.png)")
    tps = results["throughput"]["tokens_per_s"]
    overhead = f" (state branch +{100 * results['state_branch_overhead']:.2f}%)" if results["params"]["state_branch"] else ""
    console.print(f"steps {results['global_step']} · {tps or 0:,.0f} training tokens/s · wall {results['wall_time_s']:.0f} s"
                  f" · params {results['params']['total']:,}{overhead}")
    # soft_wrap: a path is printed whole on its line, never broken at the console's width (80 when piped)
    console.print(f"run folder:  {out_dir}", soft_wrap=True)
    console.print(f"results:     {out_dir / 'results.json'}", soft_wrap=True)
    console.print(f"checkpoint:  {results['checkpoint']}", soft_wrap=True)
    for lg in loggers:
        where = getattr(lg, "save_dir", None) or getattr(lg, "log_dir", None)
        offline = getattr(lg, "_offline", False)  # WandbLogger's own flag (wandb resets WANDB_MODE when its run ends)
        console.print(f"logs ({type(lg).__name__}): {where}" + ("  (offline; `make sync-wandb` uploads)" if offline else ""),
                      soft_wrap=True)


@hydra.main(version_base="1.3", config_path="../../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from looplab.cli_errors import clean_job_errors
    from looplab.training.hydra_ddp import per_job_ddp

    # bad input: one line on stderr, exit 1, the traceback in <run>/train.log (a sweep's jobs: recorded, the sweep goes on)
    with clean_job_errors("python -m looplab.train"), per_job_ddp():  # DDP children run this job only (hydra_ddp.py)
        results = task_wrapper(train)(cfg)
    if results is None:
        return None
    return results.get("accuracy") if results.get("accuracy") is not None else results.get("loss")


if __name__ == "__main__":
    from looplab.cli_errors import clean_errors
    from looplab.training.variants import refuse_unknown_keys, register_cli_variants

    # a researcher's variant named on the command line (docs/extending.md); before Hydra composes, so there is no
    # run folder yet: a bad name is one line, its traceback in a temp log (cli_errors.default_log_file)
    with clean_errors("python -m looplab.train"):
        register_cli_variants(sys.argv[1:])
        refuse_unknown_keys(sys.argv[1:])  # a key typo: the key, the closest ones and the valid ones, not Hydra's "use +"
    main()
