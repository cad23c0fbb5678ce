"""looplab's DataModules by name, and the one way to rebuild a DataModule from what a model recorded.

A checkpoint or a Hub-style folder records the dataset config it was trained on (`looplab.dataset` in a
checkpoint, `extra.dataset` in a folder's config.json), so that eval, the bench and the lm-eval adapter evaluate
on the same data with the same tokenizer. That record is data from someone else's model: handing it to
`hydra.utils.instantiate` would call any `_target_` in it, nested ones included (Hydra's blocklist stops
os.system, not `torch.load(..., weights_only=False)` on a file shipped with the model). So it never reaches
instantiate: its `_target_` must name one of the classes below, every other field must be plain data with no
`_target_` at any depth, and the class is called directly with those fields.

The configs a user composes (conf/dataset/*.yaml) are the user's own and go through Hydra as before
(looplab.train); tests/test_security.py checks that every one of them names a class registered here.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

# name → "module:Class": the only classes a recorded dataset config may build
DATA_MODULES: dict[str, str] = {
    "lm": "looplab.data.lm:LMDataModule",
    "task": "looplab.data.tasks:TaskDataModule",
}

# Hydra's reserved keys: any of them inside a recorded config would make instantiate call or reshape something
HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")


class UntrustedConfigError(ValueError):
    """A config read from a model asks for something other than plain data; nothing was built or called."""


def allowed_targets() -> dict[str, str]:
    """The `_target_` spellings a recorded dataset config may use ("looplab.data.lm.LMDataModule") → "module:Class"."""
    return {target.replace(":", "."): target for target in DATA_MODULES.values()}


def check_plain_data(value: Any, key: str, source: str) -> None:
    """Refuse anything but JSON-like data (None, bool, int, float, str, lists, string-keyed mappings), and any
    Hydra key at any depth, naming the key path."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain_data(v, f"{key}[{i}]", source)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise UntrustedConfigError(f"{source}: {key} has a non-string key {k!r}; a recorded config is plain data")
            if k in HYDRA_KEYS:
                raise UntrustedConfigError(
                    f"{source}: {key}.{k}={v!r} is refused: a config read from a model is data, and looplab never "
                    "instantiates what it names")
            check_plain_data(v, f"{key}.{k}", source)
        return
    raise UntrustedConfigError(f"{source}: {key} holds a {type(value).__name__}; a recorded config is plain data")


def datamodule_from_meta(dataset: dict[str, Any] | None, *, source: str = "the checkpoint", **overrides: Any):
    """The DataModule a model was trained on, rebuilt from its recorded dataset config (eval, perplexity, the
    bench's trained-run loaders): the recorded `_target_` must be one of DATA_MODULES, every field plain data;
    `overrides` (val_tokens, batch sizes, ...) replace recorded fields. Keys starting with '_' are facts the run
    recorded (`_vocab_size`, `_tokenizer_identity`, ...), not constructor arguments. The tokenizer is checked
    against the identity the run recorded (looplab.data.tokenizer.check_identity)."""
    dataset = dict(dataset or {})
    target = dataset.get("_target_")
    if target is None:
        raise ValueError(f"{source} records no dataset (_target_ missing); evaluate it through the Python API instead")
    allowed = allowed_targets()
    if target not in allowed:
        raise UntrustedConfigError(
            f"{source}: dataset._target_={target!r} is refused: a model's recorded dataset may only name one of "
            f"looplab's data modules {sorted(allowed)} (looplab.data.registry.DATA_MODULES)")
    for k, v in dataset.items():
        if k != "_target_":
            check_plain_data(v, f"dataset.{k}", source)
    kwargs = {k: v for k, v in dataset.items() if not k.startswith("_") and k != "name"}
    kwargs.update(overrides)
    module, _, attr = allowed[target].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"{source}: its dataset config does not fit {attr} ({e})") from None
    dm = cls(**kwargs)
    recorded = dataset.get("_tokenizer_identity")
    if recorded and hasattr(dm, "tokenizer_identity"):
        from looplab.data.tokenizer import check_identity

        check_identity(recorded, dm.tokenizer_identity, getattr(dm, "tokenizer_spec", None) or dataset.get("task"), source)
    return dm
