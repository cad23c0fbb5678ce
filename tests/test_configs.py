"""Every config group option and every experiment composes, and maps onto a valid model config."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import CONF, compose
from looplab.models import ConfigError, LoopedLM
from looplab.training.compose import model_config_from_cfg, objective_from_cfg

GROUPS = ["backbone", "loop_depth", "state_mode", "exit_gate", "dataset", "hardware", "logger", "trainer", "optim"]
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if group == "exit_gate" and option != "none":
        overrides.append("exit_gate.init_from=/some/stage1.ckpt")
    cfg = compose(overrides)
    assert cfg[group] is not None
    if group in ("backbone", "loop_depth", "state_mode", "exit_gate"):
        mc = model_config_from_cfg(cfg, vocab_size=64)
        assert mc.n_layers == cfg.loop_depth.layers and mc.n_loops == cfg.loop_depth.loops
        objective_from_cfg(cfg)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name):
    cfg = compose([f"+experiment={name}"])
    assert cfg.task_name.startswith(name.split("_tiny")[0].split("_paper")[0][:4])
    mc = model_config_from_cfg(cfg, vocab_size=64)
    if "tiny" in name:  # tiny experiments really are CPU-sized: build the model
        assert LoopedLM(mc).num_parameters()["total"] < 5_000_000
    sweep = OmegaConf.select(cfg, "hydra.sweeper.params")
    if sweep:  # every swept value composes too
        for key, values in sweep.items():
            for v in str(values).split(","):
                cfg_v = compose([f"+experiment={name}", f"{key}={v}"])
                model_config_from_cfg(cfg_v, vocab_size=64)


def test_user_facing_field_names():
    cfg = compose(["loop_depth.layers=3", "loop_depth.loops=5", "backbone.d_model=48", "backbone.n_heads=3", "trainer.max_steps=20"])
    mc = model_config_from_cfg(cfg, vocab_size=10)
    assert (mc.n_layers, mc.n_loops, mc.d_model, mc.n_heads) == (3, 5, 48, 3)
    assert cfg.trainer.max_steps == 20


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["backbone.d_model=30", "backbone.n_heads=4"], "n_heads"),
        (["loop_depth.loops=0"], "loops"),
        (["loop_depth.layers=-2"], "layers"),
        (["+backbone.n_experts=4"], "n_experts"),
        (["state_mode.s0=random", "state_mode=stateloop"], "state_init"),
        (["exit_gate=ouro", "exit_gate.stage=stage3"], "stage"),
        (["exit_gate=ouro", "exit_gate.stage=stage2"], "init_from"),
        (["exit_gate=ouro", "exit_gate.final_loop_weight=heavy"], "final_loop_weight"),
    ],
)
def test_impossible_configs_name_the_field(overrides, field):
    cfg = compose(overrides)
    with pytest.raises(ConfigError, match=field):
        model_config_from_cfg(cfg, vocab_size=10)
        objective_from_cfg(cfg)


def test_table8_tiny_stage1_keeps_the_last_loop_loss():
    """The tiny exit-gate experiments train stage 1 with final_loop_weight 1 (the measured recipe);
    the group default stays Ouro's objective."""
    assert objective_from_cfg(compose(["exit_gate=ouro"]))["final_loop_weight"] == 0.0
    for name in ("exit_gate_mamba_tiny", "exit_gate_llama_tiny", "exit_gate_stateloop_tiny",
                 "exit_gate_mamba_mixed_tiny", "exit_gate_llama_mixed_tiny", "exit_gate_stateloop_mixed_tiny"):
        assert objective_from_cfg(compose([f"+experiment={name}"]))["final_loop_weight"] == 1.0


def test_unknown_option_is_rejected_by_hydra():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="dataset"):
        compose(["dataset=imagenet"])


def test_hardware_strategies_instantiate():
    """ddp/fsdp/slurm compose and their strategies build (tests/test_fsdp_train.py runs them)."""
    from lightning.pytorch.strategies import DDPStrategy

    from looplab.training.distributed import LoopedFSDPStrategy, build_strategy, resolve_precision, trainer_overrides

    cfg = compose(["hardware=fsdp"])
    assert cfg.trainer.strategy == "fsdp"
    strategy = build_strategy(cfg.trainer.strategy, dict(cfg.hardware.fsdp))
    assert isinstance(strategy, LoopedFSDPStrategy)
    # param_dtype auto: bf16 all-gathers under bf16-mixed on a GPU, fp32 on a CPU; fp32 reduction either way
    assert strategy.mp_policy("cpu").param_dtype is None and strategy.mp_policy("cpu").reduce_dtype == torch.float32
    assert strategy.accumulate_unsharded and strategy.hsdp == "auto" and strategy.gather_once
    assert resolve_precision(cfg.trainer.precision, "gpu") == "bf16-mixed"
    assert resolve_precision(cfg.trainer.precision, "cpu") == "32-true"
    with pytest.raises(ConfigError, match="param_dtype='bf17'"):
        build_strategy("fsdp", {"param_dtype": "bf17"})
    assert build_strategy("ddp") == "ddp"
    cfg = compose(["hardware=ddp", "trainer.accelerator=cpu", "trainer.devices=2"])
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False, **trainer_overrides(cfg))
    assert isinstance(trainer.strategy, DDPStrategy) and trainer.num_devices == 2
    assert trainer.precision == "32-true"  # precision auto on a CPU
    cfg = compose(["hardware=slurm"])
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.tasks_per_node == cfg.hardware.gpus_per_node == cfg.trainer.devices
    assert cfg.trainer.strategy == "ddp"
    cfg = compose(["hardware=slurm", "trainer.strategy=fsdp"])
    assert isinstance(build_strategy(cfg.trainer.strategy, dict(cfg.hardware.fsdp)), LoopedFSDPStrategy)


def test_fsdp_settings_resolve(monkeypatch):
    """hardware.fsdp's auto settings (docs/distributed.md#fsdp2-at-scale): param_dtype, hsdp, and the no-sync
    context Lightning's training loop enters for the micro-batches before the last (block_backward_sync)."""
    from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior

    from looplab.training import distributed
    from looplab.training.distributed import (LoopedFSDPStrategy, build_strategy, resolve_param_dtype, trainer_overrides,
                                              use_hsdp)

    assert resolve_param_dtype("auto", "bf16-mixed", "cuda") == torch.bfloat16
    for precision, device in (("bf16-mixed", "cpu"), ("32-true", "cuda"), ("16-mixed", "cuda"), ("bf16-true", "cuda")):
        assert resolve_param_dtype("auto", precision, device) is None, (precision, device)
    assert resolve_param_dtype("bfloat16", "32-true", "cpu") == torch.bfloat16
    assert resolve_param_dtype(None, "bf16-mixed", "cuda") is None
    assert [use_hsdp("auto", nodes, per_node) for nodes, per_node in ((1, 8), (4, 8), (2, 1))] == [False, True, False]
    assert [use_hsdp("true", 2, 1), use_hsdp("false", 4, 8), use_hsdp(True, 1, 8)] == [True, False, False]
    with pytest.raises(ConfigError, match="hsdp='maybe'"):
        build_strategy("fsdp", {"hsdp": "maybe"})
    cfg = compose(["hardware=fsdp"])
    assert set(cfg.hardware.fsdp) >= {"param_dtype", "accumulate_unsharded", "hsdp", "gather_once"}
    # resolved from the configured accelerator (a plan of a GPU run, made on a CPU, builds the GPU run's policy)
    assert trainer_overrides(cfg)["strategy"].mp_policy("cpu").param_dtype == torch.bfloat16
    cpu = compose(["hardware=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"])
    assert trainer_overrides(cpu)["strategy"].mp_policy("cpu").param_dtype is None
    entered, original = [], distributed.accumulate_without_sync
    monkeypatch.setattr(distributed, "accumulate_without_sync",
                        lambda module, keep_unsharded: (entered.append(keep_unsharded), original(module, keep_unsharded))[1])
    for keep in (True, False):
        strategy = build_strategy("fsdp", {**dict(cfg.hardware.fsdp), "accumulate_unsharded": keep})
        assert isinstance(strategy, LoopedFSDPStrategy)
        strategy._lightning_module = torch.nn.Linear(1, 1)  # no FSDP2 root in it: the context does nothing
        with _block_parallel_sync_behavior(strategy, block=True):  # what loops/optimization/automatic.py enters
            pass
    assert entered == [True, False]


# ----------------------------------------------------------------------------- fused conv widths
@pytest.mark.parametrize("d_conv", [1, 5])
def test_kernel_mamba_ssm_needs_a_causal_conv1d_width(d_conv):
    """causal-conv1d has kernels for widths 2..4: kernel=mamba_ssm refuses others, naming d_conv;
    kernel=auto keeps the torch conv for them (the fused scan is still used on CUDA)."""
    from looplab.models import ConfigError

    cfg = compose(["backbone=mamba2", f"backbone.d_conv={d_conv}", "backbone.kernel=mamba_ssm"])
    with pytest.raises(ConfigError, match=f"d_conv={d_conv}.*2..4"):
        model_config_from_cfg(cfg, vocab_size=10)
    cfg = compose(["backbone=mamba2", f"backbone.d_conv={d_conv}", "backbone.kernel=auto"])
    assert model_config_from_cfg(cfg, vocab_size=10).d_conv == d_conv


# ----------------------------------------------------------------------------- compile=auto on accelerator=auto
def test_resolve_compile_resolves_accelerator_auto(monkeypatch):
    """accelerator=auto is judged as the device Lightning will pick, not as 'not measured'."""
    import shutil

    import torch

    from looplab.training import run_utils

    monkeypatch.setattr(run_utils, "auto_accelerator", lambda: "cpu")
    has_cxx = bool(shutil.which("c++") or shutil.which("g++") or __import__("os").environ.get("CXX"))
    on, why = run_utils.resolve_compile("auto", 1024, "auto")
    assert (on, why.startswith("compile=auto")) == (has_cxx, True) and "not measured" not in why
    on, why = run_utils.resolve_compile("auto", 64, "auto")
    assert not on and "d_model=64" in why
    monkeypatch.setattr(run_utils, "auto_accelerator", lambda: "cuda")
    on, why = run_utils.resolve_compile("auto", 1024, "auto")
    assert on and "accelerator=auto (cuda on this machine)" in why  # GPU training compiles (compile=auto)
    monkeypatch.setattr(run_utils, "auto_accelerator", lambda: "mps")
    on, why = run_utils.resolve_compile("auto", 1024, "auto")
    assert not on and "accelerator=auto (mps on this machine)" in why
    monkeypatch.undo()
    expected = "cuda" if torch.cuda.is_available() else "cpu"  # the real pick on this machine
    assert run_utils.auto_accelerator() in (expected, "mps", "tpu")


# ----------------------------------------------------------------------------- checkpoints: mmap, meta, sharded folders
def _tiny_checkpoint():
    import torch

    from looplab.checkpoint import looplab_meta
    from looplab.models import LoopedLMConfig

    torch.manual_seed(0)
    cfg = LoopedLMConfig(vocab_size=16, d_model=16, n_heads=2, n_layers=1, n_loops=2)
    model = LoopedLM(cfg)
    meta = looplab_meta(cfg, {"name": "phop"})
    state = {"model." + k: v.clone() for k, v in model.state_dict().items()}
    return model, meta, state


def test_checkpoint_file_is_mmapped_and_meta_read_alone(tmp_path, monkeypatch):
    import torch

    from looplab.checkpoint import load_model, read_checkpoint, read_checkpoint_meta

    model, meta, state = _tiny_checkpoint()
    path = tmp_path / "last.ckpt"
    torch.save({"looplab": meta, "state_dict": state, "global_step": 7, "optimizer_states": []}, path)
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real_load(*a, **kw))
    assert read_checkpoint_meta(path) == meta
    assert read_checkpoint(path)["global_step"] == 7
    assert calls and all(kw.get("mmap") is True for kw in calls)
    loaded, got_meta = load_model(path)
    assert got_meta == meta
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_checkpoint_errors_name_the_problem(tmp_path):
    import torch

    from looplab.checkpoint import read_checkpoint, read_checkpoint_meta

    for reader in (read_checkpoint, read_checkpoint_meta):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            reader(tmp_path / "missing.ckpt")
        (tmp_path / "empty.ckpt").write_bytes(b"")
        with pytest.raises(ValueError, match="is empty"):
            reader(tmp_path / "empty.ckpt")
        (tmp_path / "bad.ckpt").write_bytes(b"PK\x03\x04 truncated zip")
        with pytest.raises(ValueError, match="cannot be read"):
            reader(tmp_path / "bad.ckpt")
        torch.save({"state_dict": {}}, tmp_path / "other.ckpt")
        with pytest.raises(ValueError, match="not a looplab checkpoint"):
            reader(tmp_path / "other.ckpt")
        (tmp_path / "folder.ckpt").mkdir(exist_ok=True)
        with pytest.raises(FileNotFoundError, match="meta.pt"):
            reader(tmp_path / "folder.ckpt")


@pytest.mark.filterwarnings("ignore:torch.distributed is")
def test_sharded_checkpoint_folder_loads_in_one_process(tmp_path):
    """The layout of Lightning's ModelParallelStrategy (FSDP2) save_checkpoint, written by the same
    helper with no process group: torch.distributed.checkpoint files + meta.pt."""
    import torch
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save

    from looplab.checkpoint import load_model, read_checkpoint, read_checkpoint_meta

    model, meta, state = _tiny_checkpoint()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 16, (2, 5))).logits.sum().backward()
    opt.step()
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    _distributed_checkpoint_save({"state_dict": state, "optimizer_0": opt.state_dict()}, folder)
    torch.save({"looplab": meta, "global_step": 3, "epoch": 0}, folder / "meta.pt")
    assert (folder / ".metadata").is_file()

    assert read_checkpoint_meta(folder) == meta
    ckpt = read_checkpoint(folder)
    assert ckpt["global_step"] == 3 and set(ckpt["state_dict"]) == set(state)
    loaded, got_meta = load_model(folder)
    assert got_meta == meta
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state["model." + k]), k
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:20])  # a truncated shard
    with pytest.raises(ValueError, match="sharded checkpoint .* cannot be read"):
        read_checkpoint(folder)
    (folder / ".metadata").unlink()  # shards without their index
    with pytest.raises(ValueError, match="sharded checkpoint .* cannot be read: its index .metadata is missing"):
        read_checkpoint(folder)
