"""Hub-style folders for LoopedLM: `save_pretrained(dir)` / `from_pretrained(dir)` (docs/interop.md#hub-folders).

A folder holds `config.json` (LoopedLMConfig.to_dict()), `model.safetensors`, a model
card (`README.md`) naming N⊗R, the backbone, the state mode and the exit gate, and,
when given, the tokenizer files. It is huggingface_hub's `ModelHubMixin`, so
`push_to_hub` works wherever the hub is reachable, and `from_pretrained` takes a hub
id as well as a folder.

Weights are read from safetensors only, strictly (every key present, none left over):
a folder can never run code on load, unlike a pickle, and a model never silently keeps
freshly initialised weights for a missing key.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelHubMixin

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# what a tokenizer of a transformers folder (or a looplab one) is made of
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


EXPORTED_MODEL_TYPE = "looplab"  # config.json's model_type in a remote-code transformers folder (looplab.remote_code)


def to_exported_key(name: str) -> str:
    """looplab state-dict name → the remote-code export's: the head is `lm_head`, the rest lives under `model.`."""
    return "lm_head.weight" if name == "head.weight" else f"model.{name}"


def looplab_state_dict(exported: dict) -> dict:
    """The inverse of `to_exported_key` over a whole state dict (a tied head is absent from both)."""
    out = {}
    for k, v in exported.items():
        if k == "lm_head.weight":
            out["head.weight"] = v
        elif k.startswith("model."):
            out[k[len("model."):]] = v
        else:
            raise KeyError(f"unexpected weight {k!r} in an exported looplab folder")
    return out


def safetensors_shapes(path: str | os.PathLike) -> dict[str, list[int]]:
    """{tensor name: shape} from a safetensors file's header, which safetensors checks against the file (a crafted
    header, a truncated or foreign file); ValueError naming the file instead of safetensors' own error."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # SafetensorError (header too large, invalid JSON, file not covered), OSError, ...
        raise ValueError(f"{str(path)!r} is not a readable safetensors file (corrupt, truncated or not safetensors: "
                         f"{type(e).__name__}: {e})") from None


def check_weight_shapes(model, shapes: dict[str, Any], weights: str, config: str) -> None:
    """Refuse, naming the first tensor, weights whose shapes differ from those the config builds (a config.json or a
    recorded config edited, or from another model): a ValueError instead of load_state_dict's size-mismatch error.
    Names absent from either side are left to the strict load."""
    bad = [(k, list(shapes[k]), list(v.shape)) for k, v in model.state_dict().items()
           if k in shapes and list(shapes[k]) != list(v.shape)]
    if bad:
        name, found, wanted = bad[0]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise ValueError(f"the weights in {weights} do not match {config}: {name} has shape {found} there but {wanted} "
                         f"under the config{more}; the config and the weights come from different models")


def copy_tokenizer(src: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Copy a tokenizer into `out`: `src` is a tokenizer.json file or a folder holding one.
    Returns the copied file names (empty when the folder has none)."""
    src, out = Path(src), Path(out)
    if src.is_file():
        shutil.copyfile(src, out / "tokenizer.json")
        return ["tokenizer.json"]
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
            shutil.copyfile(src / name, out / name)
            copied.append(name)
    return copied


def model_card_text(cfg, num_params: int, source: str | None = None) -> str:
    n, r = cfg.n_layers, cfg.n_loops
    lines = [
        "---",
        "library_name: looplab",
        "tags: [looplab, looped-language-model]",
        "---",
        "",
        f"# looplab looped language model ({n}⊗{r})",
        "",
        f"A block of N = {n} layers applied R = {r} times (looplab's LoopedLM).",
        "",
        "| field | value |",
        "|---|---|",
        f"| N⊗R | {n}⊗{r} |",
        *([f"| prelude / coda layers | {cfg.prelude_layers} / {cfg.coda_layers} |"]
          if getattr(cfg, "prelude_layers", 0) or getattr(cfg, "coda_layers", 0) else []),
        f"| backbone | {cfg.backbone}" + (f" (layers {cfg.layer_types})" if len(set(cfg.layer_types)) > 1 else "") + " |",
        f"| state mode | {cfg.state_mode} |",
        f"| exit gate | {cfg.exit_gate} |",
        f"| d_model | {cfg.d_model} |",
        f"| vocab size | {cfg.vocab_size} |",
        f"| parameters | {num_params:,} |",
    ]
    if source:
        lines.append(f"| converted from | {source} |")
    if isinstance(cfg.extra, dict) and cfg.extra.get("block_layers") is not None:
        lines.append(f"| block initialised from source layers | {cfg.extra['block_layers']} |")
    lines += [
        "",
        "Load with:",
        "",
        "```python",
        "from looplab.models import LoopedLM",
        "model = LoopedLM.from_pretrained(PATH_OR_HUB_ID)",
        "```",
        "",
    ]
    return "\n".join(lines)


class LoopedHubMixin(ModelHubMixin, library_name="looplab", tags=["looplab"]):
    """The hub half of LoopedLM; it reads `self.config` (a LoopedLMConfig) and the state dict."""

    def save_pretrained(self, save_directory, *, tokenizer: str | os.PathLike | None = None, **kwargs):
        """Write config.json, model.safetensors, README.md and (tokenizer=FILE_OR_DIR) the tokenizer."""
        save_directory = Path(save_directory)
        save_directory.mkdir(parents=True, exist_ok=True)
        (save_directory / "README.md").unlink(missing_ok=True)  # the card describes this model, not a previous one
        self._pending_tokenizer = tokenizer
        try:
            return super().save_pretrained(save_directory, **kwargs)
        finally:
            self._pending_tokenizer = None

    def _save_pretrained(self, save_directory: Path) -> None:
        from safetensors.torch import save_model

        save_model(self, str(save_directory / WEIGHTS_NAME))  # tied head/embedding stored once
        (save_directory / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2, sort_keys=True))
        if getattr(self, "_pending_tokenizer", None) is not None:
            copy_tokenizer(self._pending_tokenizer, save_directory)

    def generate_model_card(self, *args, **kwargs) -> ModelCard:
        source = self.config.extra.get("converted_from") if isinstance(self.config.extra, dict) else None
        return ModelCard(model_card_text(self.config, sum(p.numel() for p in self.parameters()), source))

    @classmethod
    def _from_pretrained(
        cls,
        *,
        model_id: str,
        revision: str | None,
        cache_dir,
        force_download: bool,
        local_files_only: bool,
        token,
        config: dict[str, Any] | None = None,
        map_location: str = "cpu",
        **config_overrides,
    ):
        from safetensors.torch import load_model

        from looplab.models.config import LoopedLMConfig

        if config is None:
            raise FileNotFoundError(f"{model_id!r} has no {CONFIG_NAME}: not a looplab folder (convert a transformers "
                                    "folder with python -m looplab.convert from-hf)")
        if os.path.isdir(model_id):
            weights = os.path.join(model_id, WEIGHTS_NAME)
            if not os.path.isfile(weights):
                raise FileNotFoundError(f"{model_id!r} has no {WEIGHTS_NAME}")
        else:
            from huggingface_hub import hf_hub_download

            weights = hf_hub_download(model_id, WEIGHTS_NAME, revision=revision, cache_dir=cache_dir,
                                      force_download=force_download, local_files_only=local_files_only, token=token)
        cfg = LoopedLMConfig.from_dict({**config, **config_overrides},  # overrides: kernel, chunk_size, ...
                                       source=f"{os.path.join(str(model_id), CONFIG_NAME)!r}")
        from looplab.models.sizing import check_fits

        check_fits(cfg, where=f"{str(model_id)!r}")  # before the parameters are allocated
        shapes = safetensors_shapes(weights)  # a corrupt or truncated file is refused before anything is allocated
        exported = config.get("model_type") == EXPORTED_MODEL_TYPE
        model = cls(cfg)
        check_weight_shapes(model, looplab_state_dict(shapes) if exported else shapes, repr(str(weights)),
                            repr(os.path.join(str(model_id), CONFIG_NAME)))
        if exported:  # convert to-hf's remote-code folder: transformers' names
            from safetensors.torch import load_file

            sd = looplab_state_dict(load_file(weights, device=str(map_location)))
            if cfg.tie_embeddings:
                sd["head.weight"] = sd["embed.weight"]
            model.load_state_dict(sd, strict=True)
        else:
            load_model(model, weights, strict=True, device=str(map_location))
        model.eval()
        return model
