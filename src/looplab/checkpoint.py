"""Reading looplab checkpoints without Lightning.

A training checkpoint is Lightning's dict plus a `looplab` entry written by the
LightningModule: the model config, the resolved dataset config, and an
architecture hash. `load_model` rebuilds the plain `LoopedLM` from it, and
`check_compatible` refuses a checkpoint from another architecture with the
differing fields named.

Two layouts are read:

* a file (`last.ckpt`): one `torch.save` dict. It is opened with `mmap=True`, so reading
  the metadata does not read the weights (tensors are paged in only when touched);
  `read_checkpoint_meta` returns just the `looplab` entry.
* a folder (`last.ckpt/`): the sharded checkpoint of Lightning's ModelParallelStrategy
  (FSDP2, `hardware=fsdp`): `torch.distributed.checkpoint` files (`.metadata`, `*.distcp`)
  holding `state_dict` and `optimizer_N`, plus `meta.pt` with every non-tensor entry (the
  `looplab` entry included; lightning/pytorch/strategies/model_parallel.py save_checkpoint).
  The metadata comes from `meta.pt` alone; `read_checkpoint` assembles the full model state
  dict in this one process (no process group needed), leaving the optimizer shards unread.
* a Hub-style folder (`config.json` + `model.safetensors`, from `LoopedLM.save_pretrained`,
  `python -m looplab.convert from-hf` or `to-hf`): read through safetensors; its tokenizer.json,
  when present, becomes the dataset's tokenizer, so `init_from=DIR`, eval and generate accept it.

Pickled files are read with `torch.load(weights_only=True)` and an explicit allowlist (see
SAFE_GLOBALS), a sharded folder's `.metadata` with an unpickler that admits only
torch.distributed.checkpoint's index classes (DCP_METADATA_GLOBALS): a checkpoint from someone
else cannot run code when loaded, resume under FSDP included (`load_sharded`).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from looplab.models import ConfigError, LoopedLM, LoopedLMConfig
from looplab.models.hub import check_weight_shapes
from looplab.models.sizing import check_fits

MODEL_PREFIX = "model."


def architecture_hash(cfg: LoopedLMConfig) -> str:
    blob = json.dumps(cfg.architecture_dict(), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def looplab_meta(cfg: LoopedLMConfig, dataset: dict[str, Any] | None = None, **extra) -> dict[str, Any]:
    return {"model_config": cfg.to_dict(), "architecture_hash": architecture_hash(cfg), "dataset": dataset or {}, **extra}


SHARDED_META_FILE = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME


PRETRAINED_FILES = ("config.json", "model.safetensors")  # looplab.models.hub


def _checkpoint_layout(path: Path) -> str:
    """'file', 'sharded' (a folder with meta.pt) or 'pretrained' (a Hub-style folder);
    FileNotFoundError naming what is missing."""
    if path.is_dir():
        if (path / SHARDED_META_FILE).is_file():
            return "sharded"
        if all((path / f).is_file() for f in PRETRAINED_FILES):
            return "pretrained"
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} is a folder without {SHARDED_META_FILE}: not a sharded (FSDP2) checkpoint"
            " (an interrupted save? look for a .NAME.old or .NAME.tmp next to it)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    return "file"


# Every checkpoint is read with torch.load(weights_only=True): a pickle may name any callable, and
# unpickling calls it, so a checkpoint from someone else could run code on `init_from=`, `resume=`,
# eval, generate, the lm-eval adapter or convert. torch's weights-only unpickler already admits
# tensors, storages, OrderedDict and plain containers, which is all that looplab's own Lightning
# checkpoints hold (checked on 88 checkpoints of this project: file and sharded meta.pt, optimizer
# and scheduler states, callback states, hyper-parameters saved as plain dicts). The allowlist below
# adds nothing else; a file that needs another global is refused, never trusted.
SAFE_GLOBALS: list = [collections.OrderedDict]


class UnsafeCheckpointError(ValueError):
    """The checkpoint needs a global outside the allowlist to unpickle; it is not loaded."""


def _torch_load(path: Path | io.BytesIO, map_location, mmap: bool):
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def _unsafe(path: Path, e: Exception, what: str = "it", allowlist: str = "weights-only allowlist") -> UnsafeCheckpointError:
    first = str(e).strip().splitlines()
    why = next((l for l in first if "GLOBAL" in l or "global" in l), first[0] if first else type(e).__name__)
    return UnsafeCheckpointError(
        f"checkpoint {str(path)!r} was refused: unpickling {what} needs something outside looplab's {allowlist} "
        f"({why.strip()}). A pickle can run arbitrary code, so it is not loaded; if the file comes from a source "
        "you trust, re-save its tensors with safetensors (LoopedLM.save_pretrained)"
    )


# what torch's weights-only unpickler says when a pickle names a global or callable outside the allowlist (torch
# _weights_only_unpickler.py); any other unpickling error is a file that is not a pickle torch.save wrote
_UNSAFE_MARKS = ("GLOBAL", "add_safe_globals", "call reduce for")


def _refused(path: Path, e: pickle.UnpicklingError) -> ValueError:
    """An unpickling refusal: unsafe when the pickle needs a global outside the allowlist; otherwise the bytes are
    not a torch checkpoint at all (random bytes, a foreign file, corruption), and saying "unsafe" would mislead."""
    return _unsafe(path, e) if any(m in str(e) for m in _UNSAFE_MARKS) else _not_a_checkpoint(path, e)


def _not_a_checkpoint(path: Path, e: Exception) -> ValueError:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    why = next((ln for ln in lines if ln.startswith("Unsupported")), lines[0] if lines else "")
    return ValueError(f"checkpoint {str(path)!r} cannot be read: it is not a torch checkpoint (corrupt, truncated, or "
                      f"not a checkpoint at all; {type(e).__name__}: {why})")


def _load_file(path: Path, map_location="cpu") -> dict[str, Any]:
    """torch.load (weights only) with mmap (the weights stay on disk until touched), clear errors for bad files."""
    if path.stat().st_size == 0:
        raise ValueError(f"checkpoint {str(path)!r} is empty (an interrupted write?)")
    try:
        ckpt = _torch_load(path, map_location, mmap=True)
    except pickle.UnpicklingError as e:
        raise _refused(path, e) from None
    except Exception:  # a legacy (non-zip) torch.save file cannot be mmapped; or the file is bad
        try:
            ckpt = _torch_load(path, map_location, mmap=False)
        except pickle.UnpicklingError as e:
            raise _refused(path, e) from None
        except Exception as e:  # truncated zip, not a torch file, ...
            raise _not_a_checkpoint(path, e) from e
    if not isinstance(ckpt, dict):
        raise ValueError(f"checkpoint {str(path)!r} holds a {type(ckpt).__name__}, not a checkpoint dict")
    return ckpt


def _require_looplab(ckpt: dict[str, Any], path: Path) -> None:
    if "looplab" not in ckpt:
        raise ValueError(f"{str(path)!r} is not a looplab checkpoint (no 'looplab' entry)")
    _check_recorded_dataset(ckpt["looplab"], f"checkpoint {str(path)!r}")


def _check_recorded_dataset(meta: Any, source: str) -> None:
    """A model's recorded dataset config is data (looplab.data.registry): refused on every read, whatever reads it
    next, if it names a class other than looplab's data modules or holds a Hydra key at any depth."""
    from looplab.data.registry import UntrustedConfigError, allowed_targets, check_plain_data

    if not isinstance(meta, dict):
        raise ValueError(f"{source}: its 'looplab' entry is a {type(meta).__name__}, not a mapping")
    dataset = meta.get("dataset") or {}
    if not isinstance(dataset, dict):
        raise UntrustedConfigError(f"{source}: its dataset record is a {type(dataset).__name__}, not a mapping")
    target = dataset.get("_target_")
    if target is not None and target not in allowed_targets():
        raise UntrustedConfigError(
            f"{source}: dataset._target_={target!r} is refused: a model's recorded dataset may only name one of "
            f"looplab's data modules {sorted(allowed_targets())} (looplab.data.registry.DATA_MODULES)")
    for k, v in dataset.items():
        if k != "_target_":
            check_plain_data(v, f"dataset.{k}", source)


def _pretrained_meta(path: Path) -> dict[str, Any]:
    """The `looplab` entry of a Hub-style folder: its config, and its tokenizer as the dataset's."""
    cfg = json.loads((path / "config.json").read_text())
    if "model_type" in cfg and cfg["model_type"] != "looplab":  # looplab: convert to-hf's remote-code folder
        raise ValueError(f"{str(path)!r} is a transformers folder (model_type={cfg['model_type']!r}), not a looplab one; "
                         f"convert it first: python -m looplab.convert from-hf {path} --out DIR")
    model_cfg = LoopedLMConfig.from_dict(cfg, source=f"{str(path / 'config.json')!r}")
    dataset: dict[str, Any] = dict(model_cfg.extra.get("dataset") or {})  # to-hf keeps the run's dataset config
    if (path / "tokenizer.json").is_file():
        dataset["tokenizer"] = str(path / "tokenizer.json")
        from looplab.data.tokenizer import folder_eos_token

        eos = folder_eos_token(path)
        if eos:
            dataset["eos_token"] = eos
    meta = looplab_meta(model_cfg, dataset, source=str(path))
    _check_recorded_dataset(meta, f"{str(path / 'config.json')!r}")
    return meta


def read_checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The `looplab` entry (model config, dataset, architecture hash) without reading the weights:
    cheap enough for every rank to call at resume."""
    path = Path(path)
    layout = _checkpoint_layout(path)
    if layout == "pretrained":
        return _pretrained_meta(path)
    ckpt = _load_file(path / SHARDED_META_FILE if layout == "sharded" else path)
    _require_looplab(ckpt, path)
    return ckpt["looplab"]


# ---- sharded folders: torch.distributed.checkpoint (DCP), read safely
#
# torch's FileSystemReader unpickles `.metadata` with plain pickle.load, and its planners read every
# non-tensor entry with torch.load(weights_only=False) (torch 2.13 filesystem.py read_metadata,
# default_planner.py load_bytes): a folder whose meta.pt is benign but whose .metadata is crafted
# would run code on init_from=, eval, generate, convert, the lm-eval adapter and FSDP resume.
# Every DCP read in looplab goes through the reader below instead.

# Everything a DCP `.metadata` pickles, read off this project's FSDP2 checkpoints (2 ranks: model and
# AdamW states) and a one-process dcp.save (fp32 and bf16): the index dataclasses, each tensor's
# dtype, layout (pickled as torch.serialization._get_layout(name), a table lookup) and memory format
# (an enum), torch.Size offsets, and the checkpoint_id Lightning passes as a PosixPath. Only plain
# data is built from them; torch dtypes are admitted by value (getattr(torch, name) is a dtype).
DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
})


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        # exact (module, name) pairs: a dotted name ("Metadata.__init__.__globals__") matches nothing
        if (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not a torch.distributed.checkpoint metadata class")


class _WeightsOnlyBytes:
    """The load planner as the reader hands it data: each non-tensor entry (optimizer hyper-parameters,
    ...) is unpickled weights-only here, then passed on re-saved from the clean object, because the
    planner itself would torch.load the stored bytes with weights_only=False."""

    def __init__(self, planner, reader):
        self._planner, self._reader = planner, reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = _torch_load(value, "cpu", mmap=False)
        except pickle.UnpicklingError as e:
            self._reader.refused = _unsafe(Path(self._reader.path), e, f"its non-tensor entry {fqn!r}")
            raise self._reader.refused from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)

    def __getattr__(self, name: str):  # resolve_tensor, commit_tensor: tensors are read weights-only by torch
        return getattr(self._planner, name)


@functools.cache
def _safe_reader_class() -> type:
    # defined on first use: importing torch.distributed.checkpoint takes ~1 s, which
    # `import looplab.checkpoint` (the LightningModule, eval, generate) should not pay
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """FileSystemReader whose `.metadata` (global or per rank) admits only DCP_METADATA_GLOBALS and whose
        non-tensor entries are unpickled weights-only; `refused` keeps the refusal, which DCP's collectives
        would otherwise wrap into a CheckpointException (load_sharded re-raises it as itself)."""

        refused: UnsafeCheckpointError | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                try:
                    metadata = _DCPMetadataUnpickler(f).load()
                except pickle.UnpicklingError as e:
                    self.refused = _unsafe(Path(self.path), e, f"its index {Path(path).name}",
                                          "allowlist of checkpoint-metadata classes")
                    raise self.refused from None
            if not isinstance(metadata, Metadata):
                raise ValueError(f"sharded checkpoint {str(self.path)!r}: {Path(path).name} holds a "
                                 f"{type(metadata).__name__}, not a torch.distributed.checkpoint Metadata")
            # the index names the shard files to read: names inside this folder only (DCP writes __R_N.distcp),
            # not ../ or absolute paths that would read any file (or /dev/zero) as tensor bytes
            files = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
            outside = sorted(str(f) for f in files if not isinstance(f, str) or f in ("", ".", "..") or Path(f).name != f)
            if outside:
                self.refused = UnsafeCheckpointError(f"checkpoint {str(self.path)!r} was refused: its index {Path(path).name} "
                                                     f"names shard files outside the folder ({outside[:3]})")
                raise self.refused
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            return super().read_data(plan, _WeightsOnlyBytes(planner, self))

    return SafeFileSystemReader


def _read_dcp(path: Path, load) -> None:
    """load(reader) with looplab's safe reader; a refusal is raised as the UnsafeCheckpointError itself."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    reader = _safe_reader_class()(str(path))
    reader.read_metadata()  # refused here, before DCP's collectives wrap the error (every rank reads it anyway)
    try:
        load(reader)
    except (Exception, CheckpointException):
        if reader.refused is not None:
            raise reader.refused from None
        raise


def load_sharded(state: dict[str, Any], path: str | os.PathLike) -> None:
    """`torch.distributed.checkpoint.load(state, checkpoint_id=path)` through the safe reader: fills `state`
    in place, on every rank of the process group (FSDP resume) or in this process alone."""
    from torch.distributed.checkpoint import load

    _read_dcp(Path(path), lambda reader: load(state, storage_reader=reader))


def read_sharded_extras(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded folder's meta.pt: every non-tensor entry of the Lightning checkpoint (epoch, loops,
    callback states, the `looplab` entry), what resume restores besides the weights and optimizers."""
    return _load_file(Path(path) / SHARDED_META_FILE)


def _load_sharded_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The full `state_dict` of a torch.distributed.checkpoint folder, read in this process."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not (path / ".metadata").is_file():
        raise ValueError(f"sharded checkpoint {str(path)!r} cannot be read: its index .metadata is missing"
                         " (an interrupted save?)")
    loaded: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent here
            warnings.filterwarnings("ignore", message=".*torch.distributed is .*uninitialized.*")
            _read_dcp(path, lambda reader: loaded.update(_load_state_dict_from_keys(keys={"state_dict"}, storage_reader=reader)))
    except UnsafeCheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise ValueError(f"sharded checkpoint {str(path)!r} cannot be read: {type(e).__name__}: {e}") from e
    if "state_dict" not in loaded:
        raise ValueError(f"sharded checkpoint {str(path)!r} holds no 'state_dict' (keys: {sorted(loaded)[:5]})")
    return loaded["state_dict"]


def read_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict[str, Any]:
    """The checkpoint dict: a file (mmapped), or a sharded folder as {meta.pt entries, 'state_dict'}."""
    path = Path(path)
    layout = _checkpoint_layout(path)
    if layout == "pretrained":
        model = LoopedLM.from_pretrained(str(path), map_location=str(map_location))
        state = {MODEL_PREFIX + k: v for k, v in model.state_dict().items()}
        return {"state_dict": state, "looplab": _pretrained_meta(path)}
    if layout == "file":
        ckpt = _load_file(path, map_location)
        _require_looplab(ckpt, path)
        return ckpt
    ckpt = _load_file(path / SHARDED_META_FILE, map_location)
    _require_looplab(ckpt, path)
    state = _load_sharded_state_dict(path)
    if str(map_location) != "cpu":
        state = {k: v.to(map_location) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return {**ckpt, "state_dict": state}


def check_compatible(meta: dict[str, Any], cfg: LoopedLMConfig, *, allow_new_branches: bool = False) -> None:
    """Raise ConfigError naming every architecture field that differs.

    allow_new_branches: warm-starting a StateLoop / gated model from a vanilla one
    (docs/formulations.md#stateloop) may differ in state_mode, state fields, exit_gate, injection and depth_router only.
    """
    old = LoopedLMConfig.from_dict(meta["model_config"], source="the checkpoint's config").architecture_dict()
    new = cfg.architecture_dict()
    diff = {k: (old.get(k), new.get(k)) for k in new if old.get(k) != new.get(k)}
    if allow_new_branches:
        diff = {k: v for k, v in diff.items() if not (k.startswith("state_") or k in ("exit_gate", "injection", "depth_router"))}
    if diff:
        lines = ", ".join(f"{k}: checkpoint={a!r} vs config={b!r}" for k, (a, b) in sorted(diff.items()))
        raise ConfigError(f"checkpoint was trained with another architecture ({lines}); use the matching config")


def model_state_dict(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k[len(MODEL_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(MODEL_PREFIX)}


def load_model(path: str | os.PathLike, map_location="cpu", **config_overrides) -> tuple[LoopedLM, dict[str, Any]]:
    """Rebuild the LoopedLM of a checkpoint (file, sharded folder or Hub-style folder);
    config_overrides may change non-architecture fields (kernel, ...)."""
    if Path(path).is_dir() and _checkpoint_layout(Path(path)) == "pretrained":
        meta = _pretrained_meta(Path(path))
        model = LoopedLM.from_pretrained(str(path), map_location=str(map_location), **config_overrides)
        return model, meta
    ckpt = read_checkpoint(path, map_location)
    meta = ckpt["looplab"]
    cfg = LoopedLMConfig.from_dict({**meta["model_config"], **config_overrides}, source=f"checkpoint {str(path)!r}")
    check_fits(cfg, where=f"checkpoint {str(path)!r}")  # before the parameters are allocated
    model = LoopedLM(cfg)
    state = model_state_dict(ckpt)
    check_weight_shapes(model, {k: v.shape for k, v in state.items() if isinstance(v, torch.Tensor)},
                        f"checkpoint {str(path)!r}", "its recorded model config")
    model.load_state_dict(state)
    model.eval()
    return model, meta
