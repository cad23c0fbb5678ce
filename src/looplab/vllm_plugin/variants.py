"""A registered state update's own export code in the vLLM plugin (docs/extending.md#bring-your-export-code).

A variant that brings its export code (`export_source`: one torch-only file defining `StateUpdate`, with
`build_update(d, ds)` and `update(h, s_prev) -> (s_r, retention)`) runs in vLLM with the same class the exported
remote code mixes into its state branch, so the plugin, transformers' remote code and looplab compute the same thing.
Where the class comes from, in this order:

1. the variant registered in this process (looplab's built-ins such as `gru`, or a researcher's, under the
   registry's trust rules): its export_source, imported from looplab's import path — `RegisteredVariants`, the
   same lookup looplab's own copy of the exported code makes;
2. the folder's shipped file (config.json's `looplab_variants`), only when the user says so: vLLM's
   `trust_remote_code=True`. Otherwise the model is refused, naming both ways.

Nothing from a folder runs as code without that flag.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from looplab.remote_code.export_sources import HOOKS, RegisteredVariants


def shipped_state_update(cfg) -> dict:
    """config.json's record of the state update the folder ships ({name, file, options}), or {}."""
    return (getattr(cfg, "looplab_variants", None) or {}).get("state_update") or {}


def state_update_class(cfg, model_path: str | None, trust_remote_code: bool) -> type:
    """The `StateUpdate` class of cfg.state_mode (see the module docstring); ValueError naming the fix if none."""
    name = cfg.state_mode
    code = RegisteredVariants().get("state_update").get(name)
    if code is not None:
        return code
    shipped = shipped_state_update(cfg)
    if shipped.get("name") != name:
        raise ValueError(f"state_mode={name!r}: no registered state update of that name brings export code, and the "
                         "folder ships none (docs/extending.md#bring-your-export-code)")
    path = Path(model_path or ".") / shipped["file"]
    if not trust_remote_code:
        raise ValueError(f"state_mode={name!r}: its code is the folder's {shipped['file']}, which runs only with "
                         "trust_remote_code=True (vLLM's flag: you say that you trust this folder); or register the "
                         "variant in this process (its package on PYTHONPATH) and looplab takes its code from there")
    if not path.is_file():
        raise ValueError(f"state_mode={name!r}: the folder's {path} is missing (config.json's looplab_variants names it)")
    spec = importlib.util.spec_from_file_location(f"looplab_vllm_variant_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, HOOKS["state_update"])


def variant_options(cfg) -> dict:
    """The options the export recorded for the shipped state update (or the config's own, for a registered one)."""
    shipped = shipped_state_update(cfg)
    if shipped.get("name") == cfg.state_mode and shipped.get("options") is not None:
        return dict(shipped["options"])
    return dict(((getattr(cfg, "options", None) or {}).get("state_update")) or {})
