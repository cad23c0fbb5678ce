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


# config groups whose keys a typo can miss; Hydra's answer to `group.KEY=v` for a KEY the group does not have is
# "use +group.KEY=v", which only moves the refusal to the model's config (or silently adds an ignored key)
KEYED_GROUPS = ("backbone", "loop_depth", "state_mode", "exit_gate", "depth_router", "dataset", "optim", "trainer",
                "hardware")


def refuse_unknown_keys(overrides: Iterable[str], config_name: str = "train") -> None:
    """`group.KEY=v` where the composed group has no KEY: one line naming the key, the closest ones and the valid
    ones, before Hydra's "use +". Composes the config with the overrides (hydra.* but the search path left out);
    a sweep is not checked here, and anything else that fails to compose is left for Hydra to report."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from looplab.models.registry import ConfigError, close_matches

    overrides = list(overrides)
    if any(a in ("-m", "--multirun") or _is_sweep(a) for a in overrides):
        return  # a sweep's jobs compose one by one; Hydra reports there
    given = [a for a in overrides if "=" in a and not a.startswith("-")
             and (not a.startswith("hydra.") or a.startswith("hydra.searchpath="))]
    typed = [a for a in given if "." in a.partition("=")[0] and a.partition("=")[0].split(".")[0] in KEYED_GROUPS]
    if not typed:
        return
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="check"):
            try:
                compose(config_name=config_name, overrides=given)
                return
            except ConfigCompositionException as e:
                bad = _not_in_struct(e)
                if bad is None or bad not in {a.partition("=")[0] for a in typed}:
                    return
                others = [a for a in given if a.partition("=")[0] != bad]
                try:
                    cfg = compose(config_name=config_name, overrides=others)
                except Exception:
                    return
    except Exception:  # a config this check cannot compose: Hydra reports it as it would have
        return
    parent, _, key = bad.rpartition(".")
    node = cfg
    for part in parent.split("."):
        node = node.get(part) if hasattr(node, "get") else None
    if not hasattr(node, "keys"):
        return
    valid = sorted(str(k) for k in node.keys())
    close = close_matches(key, valid, n=3)
    hint = f" (did you mean {', '.join(f'{parent}.{c}' for c in close)}?)" if close else ""
    raise ConfigError(f"{bad} is not a key of {parent}{hint}; its keys: {', '.join(valid)} (a key of your own "
                      f"yaml or experiment is added with +{bad}=...)")


def _is_sweep(arg: str) -> bool:
    """`key=a,b` or a sweep function (range(...), choice(...), glob(...)): not a list in brackets or quotes."""
    value = arg.partition("=")[2]
    if value.startswith(("range(", "choice(", "glob(", "interval(", "tag(")):
        return True
    depth, quoted = 0, None
    for ch in value:
        if quoted:
            quoted = None if ch == quoted else quoted
        elif ch in "'\"":
            quoted = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            return True
    return False


def _not_in_struct(e: Exception) -> str | None:
    """The full key of Hydra's "Could not override 'a.b'. ... Key 'b' is not in struct", else None."""
    import re

    text = str(e) + " " + str(e.__cause__ or "")
    m = re.search(r"Could not override '([\w.]+)'", text)
    return m.group(1) if m and "is not in struct" in text else None
