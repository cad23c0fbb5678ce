"""Hydra config groups → the plain dataclasses the model and objective take.

The one place that knows how `backbone`, `loop_depth`, `state_mode`,
`exit_gate` and `depth_router` map onto `LoopedLMConfig`; every mapping error names the config
key the user typed.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from looplab.models import ConfigError, LoopedLMConfig
from looplab.models.registry import UnknownOptionError, did_you_mean
from looplab.training.depth import DepthSampler

# backbone.<key> → LoopedLMConfig field (same name unless listed)
_BACKBONE_RENAMES = {"name": "backbone"}
_STATE_KEYS = {"name": "state_mode", "mixer": "state_mixer", "d_s": "state_dim", "s0": "state_init",
               "in_output": "state_in_output", "A_init": "state_A_init", "dt_init": "state_dt_init"}
# a variant's own options (LoopedLMConfig.options[axis]): state_mode's other keys are its update rule's; these
# keys hold the others' (models/registry.py OPTION_AXES)
_OPTION_KEYS = {("state_mode", "mixer_options"): "state_mixer", ("loop_depth", "schedule_options"): "loop_schedule",
                ("loop_depth", "injection_options"): "injection", ("backbone", "options"): "backbone"}
# how the user typed an option of each axis, for errors: state_mode.<key>, loop_depth.injection_options.<key>, ...
_TYPED = {axis: f"{group}.{key}." for (group, key), axis in _OPTION_KEYS.items()} | {"state_update": "state_mode."}
_GATE_MODEL_KEYS = {"name": "exit_gate"}
# loop_depth.<key> → LoopedLMConfig field: the loop schedule (models/parallel.py)
_SCHEDULE_KEYS = {"schedule": "loop_schedule", "kv": "loop_kv", "window": "loop_window", "gate": "loop_gate",
                  "mix": "loop_mix", "mix_learned": "loop_mix_learned", "norm": "loop_norm"}
EXIT_STAGES = ("stage1", "stage2")


def _plain(node) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})


def model_config_from_cfg(cfg: DictConfig, vocab_size: int | None = None) -> LoopedLMConfig:
    backbone = _plain(cfg.backbone)
    loop = _plain(cfg.loop_depth)
    for key in ("layers", "loops"):
        if key not in loop:
            raise ConfigError(f"loop_depth.{key} is missing (loop_depth needs layers=N and loops=R)")
    fields: dict[str, Any] = {"n_layers": loop["layers"], "n_loops": loop["loops"], "injection": loop.get("injection") or "none",
                              "prelude_layers": 0 if loop.get("prelude") is None else loop["prelude"],
                              "coda_layers": 0 if loop.get("coda") is None else loop["coda"]}
    if not isinstance(loop["loops"], int) or loop["loops"] < 1:
        raise ConfigError(f"loop_depth.loops={loop['loops']!r} must be an integer >= 1 (R, the number of loops)")
    if not isinstance(loop["layers"], int) or loop["layers"] < 1:
        raise ConfigError(f"loop_depth.layers={loop['layers']!r} must be an integer >= 1 (N, the block's layers)")
    for key in ("prelude", "coda"):
        v = fields[f"{key}_layers"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"loop_depth.{key}={v!r} must be an integer >= 0 (non-shared layers "
                              f"{'before' if key == 'prelude' else 'after'} the looped block; 0 = none)")

    for key, name in _SCHEDULE_KEYS.items():
        if loop.get(key) is not None:
            fields[name] = loop[key]

    options: dict[str, dict[str, Any]] = {}
    groups = {"state_mode": _plain(cfg.state_mode), "loop_depth": loop, "backbone": backbone}
    for (group, key), axis in _OPTION_KEYS.items():
        value = groups[group].pop(key, None)
        if value:
            if not isinstance(value, dict):
                raise ConfigError(f"{group}.{key}={value!r} must be a mapping of option → value")
            options[axis] = dict(value)

    known = set(LoopedLMConfig.__dataclass_fields__) - {"options"}
    for key, value in backbone.items():
        name = _BACKBONE_RENAMES.get(key, key)
        if name not in known:
            raise ConfigError(f"backbone.{key} is not a known backbone option (known: {sorted(known)})")
        fields[name] = value
    data_vocab = vocab_size
    if fields.get("vocab_size") is None:
        if data_vocab is None:
            raise ConfigError("backbone.vocab_size is null and no dataset vocabulary is known")
        fields["vocab_size"] = data_vocab
    elif data_vocab is not None and fields["vocab_size"] < data_vocab:
        raise ConfigError(f"backbone.vocab_size={fields['vocab_size']} is smaller than the dataset's vocabulary ({data_vocab})")

    update_options = {}
    for key, value in groups["state_mode"].items():
        if key in _STATE_KEYS:
            if value is not None or key == "d_s":
                fields[_STATE_KEYS[key]] = value
        else:  # the update rule's own option (LoopedLMConfig checks it against the rule's Options)
            update_options[key] = value
    if update_options:
        options["state_update"] = update_options
    if options:
        fields["options"] = options
    fields["exit_gate"] = _plain(cfg.exit_gate).get("name", "none")
    router = router_from_cfg(cfg)
    if router is not None:
        fields["depth_router"] = router
    try:
        model_cfg = LoopedLMConfig(**fields)
    except UnknownOptionError as e:
        raise ConfigError(unknown_options_message(e)) from None
    sampled = [f"loop_depth.{k}={loop.get(k)!r}" for k, ok in (("sampler", "fixed"), ("backprop_loops", None))
               if loop.get(k, ok) != ok]
    if sampled:
        reason = model_cfg.unsupported("depth_sampling")
        if reason:
            raise ConfigError(f"{', '.join(sampled)} with {reason}")
    return model_cfg


def unknown_options_message(e: UnknownOptionError) -> str:
    """The options a variant refused, named as they were typed (state_mode.forget_bais, loop_depth.injection_options.
    rnk), with the closest valid key and every valid one."""
    prefix = _TYPED.get(e.axis, "")
    keys = ", ".join(prefix + k for k in e.unknown)
    verb = "is not an option" if len(e.unknown) == 1 else "are not options"
    hint = did_you_mean(e.unknown, e.known, prefix)
    valid = f"its options: {', '.join(e.known)}" if e.known else "it takes no options"
    if e.axis == "state_update":  # the keys of the state_mode group itself are valid too
        valid += f"; every state_mode also takes {', '.join(state_mode_keys())}"
    return f"{keys} {verb} of {e.where}{hint}; {valid}"


def state_mode_keys() -> list[str]:
    """The keys every state_mode takes, beside its update rule's own options."""
    return sorted([*_STATE_KEYS, "mixer_options"])


def router_from_cfg(cfg: DictConfig) -> dict[str, Any] | None:
    """depth_router.* → LoopedLMConfig.depth_router (None when none or absent: the model field's default).
    capacity_warmup_steps=null is MoR's default: the optimizer's warm-up steps."""
    router = _plain(cfg.get("depth_router"))
    name = router.get("name", "none")
    if name == "none":
        return None
    loop = _plain(cfg.get("loop_depth"))
    if loop.get("sampler", "fixed") != "fixed" or loop.get("eval_loops"):
        raise ConfigError(f"depth_router={name} with loop_depth.sampler={loop.get('sampler')!r}, eval_loops="
                          f"{loop.get('eval_loops')!r}: the router is trained for the configured R loops; use "
                          "loop_depth.sampler=fixed and eval_loops=null")
    if router.get("capacity_warmup_steps") is None:
        _, warm = schedule_steps(_plain(cfg.get("optim")), (cfg.get("trainer") or {}).get("max_steps"))
        router["capacity_warmup_steps"] = int(warm)
    return router


def schedule_steps(optim: dict[str, Any], max_steps: int | None) -> tuple[int, float]:
    """(total, warm-up) steps of the learning-rate schedule (training/module.py lr_factor): total = max_steps,
    1000 when it is unset or not positive; warm-up = optim.warmup_steps, else warmup_frac (0.02) of total."""
    total = int(max_steps) if max_steps and int(max_steps) > 0 else 1000
    warm = optim.get("warmup_steps")
    return total, (int(optim.get("warmup_frac", 0.02) * total) if warm is None else warm)


def objective_from_cfg(cfg: DictConfig) -> dict[str, Any]:
    gate = _plain(cfg.exit_gate)
    name = gate.get("name", "none")
    stage = gate.get("stage", None) if name != "none" else None
    if stage is not None and stage not in EXIT_STAGES:
        raise ConfigError(f"exit_gate.stage={stage!r} is unknown; choose one of {EXIT_STAGES}")
    if stage == "stage2" and not gate.get("init_from") and not cfg.get("init_from"):
        raise ConfigError("exit_gate.stage=stage2 trains the gate of a trained model: set exit_gate.init_from=PATH/TO.ckpt")
    for key in ("beta", "final_loop_weight", "k", "gamma"):
        if key in gate and not isinstance(gate[key], (int, float)):
            raise ConfigError(f"exit_gate.{key}={gate[key]!r} must be a number")
    skip_prob = gate.get("skip_train_prob", 0.0)
    if not isinstance(skip_prob, (int, float)) or not 0 <= skip_prob < 1:
        raise ConfigError(f"exit_gate.skip_train_prob={skip_prob!r} must be a number in [0, 1)")
    handling = None
    if skip_prob > 0:
        from looplab.models.exit_compute import resolve_handling

        try:
            handling = resolve_handling(gate.get("skip_compute", False))
        except ValueError as e:
            raise ConfigError(f"exit_gate.{e}") from None
        if handling is None:
            raise ConfigError(f"exit_gate.skip_train_prob={skip_prob} trains for a skip_compute handling: set "
                              "exit_gate.skip_compute to kv_copy, ssm_skip or ssm_propagate")
        if stage is not None:
            raise ConfigError(f"exit_gate.skip_train_prob={skip_prob} with exit_gate.stage={stage}: exit-aware "
                              "fine-tuning trains the backbone with exit_gate=none; train the gate afterwards (stage 2)")
    return {
        "exit_stage": stage,
        "skip_train_prob": float(skip_prob),
        "skip_handling": handling,
        "beta": float(gate.get("beta", 0.1)),
        "final_loop_weight": float(gate.get("final_loop_weight", 0.0)),
        "k": float(gate.get("k", 50.0)),
        "gamma": float(gate.get("gamma", 0.005)),
        "eval_thresholds": list(gate.get("eval_thresholds") or []),
        "eval_rule": gate.get("eval_rule") or None,
        "eval_per_depth": bool(cfg.get("eval_per_depth", True)),
    }


def depth_from_cfg(cfg: DictConfig) -> DepthSampler:
    """loop_depth.{sampler, min_loops, max_loops, sigma, backprop_loops} → the training-depth sampler,
    seeded by the run's seed (so every rank and a resumed run draw the same depths)."""
    return DepthSampler.from_config(_plain(cfg.loop_depth), seed=int(cfg.get("seed") or 0))


def eval_loops_from_cfg(cfg: DictConfig) -> list[int]:
    """loop_depth.eval_loops: the test-time depths evaluated after the test split ([] = none)."""
    value = _plain(cfg.loop_depth).get("eval_loops")
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in value):
        raise ConfigError(f"loop_depth.eval_loops={value!r} must be a list of integers >= 1 (e.g. [1,2,4,8]) or null")
    return sorted(set(value))
