"""Every config group option and every experiment composes, and maps onto a valid model config."""

from __future__ import annotations

import pytest
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
    ],
)
def test_impossible_configs_name_the_field(overrides, field):
    cfg = compose(overrides)
    with pytest.raises(ConfigError, match=field):
        model_config_from_cfg(cfg, vocab_size=10)
        objective_from_cfg(cfg)


def test_unknown_option_is_rejected_by_hydra():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="dataset"):
        compose(["dataset=imagenet"])


def test_hardware_strategies_instantiate():
    """ddp/fsdp/slurm cannot run here, but their configs compose and their strategies build."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from looplab.training.distributed import fsdp_strategy

    cfg = compose(["hardware=fsdp"])
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, FSDPStrategy)
    assert fsdp_strategy(activation_checkpointing=True) is not None
    cfg = compose(["hardware=ddp", "trainer.accelerator=cpu", "trainer.devices=2"])
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, DDPStrategy) and trainer.num_devices == 2
    cfg = compose(["hardware=slurm"])
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.tasks_per_node == cfg.hardware.gpus_per_node == cfg.trainer.devices
    assert cfg.trainer.strategy == "ddp"
