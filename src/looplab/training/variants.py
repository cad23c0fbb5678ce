"""A researcher's variants on the command line (docs/extending.md#from-the-command-line).

Hydra selects a config-group option by its yaml file. A variant registered in the researcher's own module
(models/registry.py) has none inside looplab, so before Hydra composes, `python -m looplab.train` imports the
variants its overrides name and gives each a node in Hydra's ConfigStore under its group, named as it was
registered:

    python -m looplab.train state_mode=my_pkg.gru               # the module my_pkg.gru registers "my_pkg.gru"
    python -m looplab.train -m state_mode=vanilla,my_pkg.gru    # sweeps too
    python -m looplab.train state_mode=my_pkg.gru state_mode.gate_bias=2.0   # its own options (its Options' fields)

A key its state mode does not have (`state_mode.gate_bais=2.0`) is refused here, naming the key and the valid ones,
where Hydra would answer "use +state_mode.gate_bais" (which only moves the refusal to the model's config).

Values that are not group options (state_mode.mixer=..., loop_depth.schedule=..., loop_depth.injection=...,
exit_gate.eval_rule=...) need nothing of this: the registry imports them when the model is built. A yaml of the
researcher's own, in a folder added with `hydra.searchpath=[file://my_conf]` (or `pkg://my_pkg.conf`), works as
any group option does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

from looplab.models.registry import BACKBONES, DEPTH_ROUTERS, EXIT_GATES, STATE_UPDATES, Registry

# config group → the registry whose names it selects (the key holding the name is `name`)
GROUPS: dict[str, Registry] = {"state_mode": STATE_UPDATES, "backbone": BACKBONES, "exit_gate": EXIT_GATES,
                               "depth_router": DEPTH_ROUTERS}


# looplab's own group options (src/looplab/training/variants.py → the repository's conf/): `backbone=llama_1.4b` names
# conf/backbone/llama_1.4b.yaml, not a module llama_1 with an attribute 4b
CONF = Path(__file__).resolve().parents[3] / "conf"


def _values(overrides: Iterable[str]) -> list[tuple[str, str]]:
    """(group, value) of every `group=value` (or `group=a,b,c` sweep) override naming a dotted variant: a dotted value
    that is not one of looplab's own yaml options (llama_1.4b, mamba2_370m, ...)."""
    out = []
    for arg in overrides:
        key, eq, value = arg.partition("=")
        key = key.lstrip("+~")
        if not eq or key not in GROUPS:
            continue
        for v in value.split(","):
            v = v.strip()
            if ("." in v or ":" in v) and not (CONF / key / f"{v}.yaml").is_file():
                out.append((key, v))
    return out


def register_cli_variants(overrides: Iterable[str]) -> list[str]:
    """Import the variants the overrides name and store a Hydra node for each (the ones registered in looplab ship
    yaml files); → the group/name entries stored."""
    from hydra.core.config_store import ConfigStore

    overrides = list(overrides)
    cs = ConfigStore.instance()
    stored = []
    for group, name in _values(overrides):
        cls = GROUPS[group].get(name)  # imports the researcher's module; ConfigError naming the value otherwise
        node = {"name": name}
        if group == "state_mode":  # the keys every state mode takes, and its own options, overridable by key
            node.update({"mixer": None, "d_s": None, "s0": "zeros", "in_output": True})
            opts = getattr(cls, "Options", None)
            if opts is not None:
                node.update({f.name: getattr(opts(), f.name) for f in dataclasses.fields(opts)})
            _refuse_unknown_keys(overrides, name, cls, node)
        cs.store(group=group, name=name, node=node)
        stored.append(f"{group}/{name}")
    return stored


def _refuse_unknown_keys(overrides: list[str], name: str, cls: type, node: dict) -> None:
    """`state_mode.KEY=v` for a key that neither the stored node nor any state mode has: refused naming the key and
    the valid ones, before Hydra's hint to add it with `+`. An experiment or a yaml of the user's own may add keys to
    the group, so then Hydra decides."""
    from looplab.models.registry import ConfigError, UnknownOptionError
    from looplab.training.compose import state_mode_keys, unknown_options_message

    if any(a.lstrip("+~").startswith(("experiment=", "hydra.searchpath")) for a in overrides):
        return
    opts = getattr(cls, "Options", None)
    own = sorted(f.name for f in dataclasses.fields(opts)) if opts is not None else []
    valid = set(node) | set(state_mode_keys()) | set(own)
    for arg in overrides:
        key, eq, _ = arg.partition("=")
        if not eq or not key.startswith("state_mode."):
            continue
        option = key[len("state_mode."):].split(".")[0]
        if option not in valid:
            raise ConfigError(unknown_options_message(
                UnknownOptionError(f"state_mode={name!r}", [option], own, axis="state_update")))
