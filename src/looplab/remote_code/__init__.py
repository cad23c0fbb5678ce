"""Export a LoopedLM as a transformers folder with remote code (docs/interop.md#transformers-with-remote-code).

`write_folder(model, out)` writes what `AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`
loads: config.json (looplab's fields plus `model_type`, `architectures`, `auto_map` and the
transformers names), configuration_looplab.py and modeling_looplab.py (this package's files, copied
verbatim: they import torch and transformers only), looplab_variants.py with the export code the model's
variants bring (export_sources.py: a state update's own file, torch only; an empty table when none),
model.safetensors with the shared block stored once, and the tokenizer with a tokenizer_config.json.
`LoopedLM.from_pretrained` reads the folder too (`looplab_state_dict`).

What the exported code cannot express is refused here, naming the field (`unsupported`); nothing is
exported approximately.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from looplab.models.hub import EXPORTED_MODEL_TYPE, looplab_state_dict, to_exported_key  # noqa: F401 (re-exported)

MODEL_TYPE = EXPORTED_MODEL_TYPE
ARCHITECTURE = "LoopedLMForCausalLM"
AUTO_MAP = {
    "AutoConfig": "configuration_looplab.LoopedLMHFConfig",
    "AutoModel": "modeling_looplab.LoopedLMModel",
    "AutoModelForCausalLM": "modeling_looplab.LoopedLMForCausalLM",
}
CODE_FILES = ("configuration_looplab.py", "modeling_looplab.py")


ENGINES = ("transformers", "vllm")


def unsupported(cfg, engine: str = "transformers", **serving) -> str | None:
    """Why the folder's engine cannot run this LoopedLMConfig (the field and its value), or None.
    transformers: the exported remote code, as the variants declare it (`export`, models/registry.py; a
    researcher's variant is refused until it declares how it exports). vllm: looplab's vLLM plugin
    (`looplab.vllm_plugin.config.refusal`, read on the config.json the folder would hold; it runs parallel loops,
    which the remote code does not; `serving`: the plugin's load-time settings written as the folder's defaults,
    exit_threshold and exit_skip)."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: choose one of {ENGINES}")
    if engine == "transformers":
        from looplab.remote_code.export_sources import refusal as source_refusal

        return cfg.unsupported("export") or source_refusal(cfg)
    from looplab.vllm_plugin.config import LoopedLMVLLMConfig, refusal

    d = hf_config_dict(cfg)
    d.pop("extra", None)
    return refusal(LoopedLMVLLMConfig(**d, **serving))


def hf_config_dict(cfg, *, bos_token_id=None, eos_token_id=None) -> dict:
    """config.json of the exported folder: LoopedLMConfig.to_dict() plus the transformers keys."""
    from looplab.remote_code.configuration_looplab import LoopedLMHFConfig

    d = cfg.to_dict()
    d.pop("extra", None)
    hf = LoopedLMHFConfig(**d, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
                          architectures=[ARCHITECTURE], auto_map=dict(AUTO_MAP))
    out = hf.to_dict()
    out["extra"] = cfg.extra  # free-form looplab metadata (the run's dataset), never read by either model
    return out


def tokenizer_config(tokenizer_json: Path, eos_token: str | None, max_len: int) -> dict:
    """tokenizer_config.json for a tokenizers JSON: transformers' fast tokenizer with looplab's end-of-text token as
    bos, eos and pad (lm-eval's `hf` model reads them; an unknown one fails in decode)."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, "clean_up_tokenization_spaces": False}
    if eos_token is not None:
        cfg.update(bos_token=eos_token, eos_token=eos_token, pad_token=eos_token)
    return cfg


def write_folder(model, out, tokenizer=None, eos_token: str | None = None, engine: str = "transformers") -> Path:
    """Write `model` (a LoopedLM) as a remote-code transformers folder at `out`; returns the folder.
    tokenizer: a tokenizer.json file or a folder holding one (copied, and given a tokenizer_config.json).
    engine: the engine that must run it (`unsupported`). A folder written for vllm that the remote code cannot run
    (parallel loops) is the same folder; transformers refuses it at load, naming the field."""
    from safetensors.torch import save_file

    cfg = model.config
    reason = unsupported(cfg, engine)
    if reason:
        raise ValueError(f"cannot export for {engine}: {reason}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    for name in CODE_FILES:
        shutil.copyfile(here / name, out / name)
    sd = {to_exported_key(k): v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight")  # tied to model.embed.weight (the model's _tied_weights_keys)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    eos_id = None
    if tokenizer is not None:
        from looplab.models.hub import copy_tokenizer

        copy_tokenizer(tokenizer, out)
    if (out / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        if eos_token is None:
            from looplab.data.tokenizer import EOS_CANDIDATES

            eos_token = next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        eos_id = tok.token_to_id(eos_token) if eos_token is not None else None
        if not (out / "tokenizer_config.json").is_file():
            (out / "tokenizer_config.json").write_text(
                json.dumps(tokenizer_config(out / "tokenizer.json", eos_token, cfg.max_seq_len), indent=2))
    config = hf_config_dict(cfg, bos_token_id=eos_id, eos_token_id=eos_id)
    from looplab.remote_code.export_sources import write_sources

    # every folder has the table modeling_looplab.py imports; one that only vLLM runs ships no variant code in it
    shipped = write_sources(cfg, out, ship=engine == "transformers" or not unsupported(cfg))
    if shipped:
        config["looplab_variants"] = shipped  # the files and the variants' full options the remote code reads
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}, indent=2))
    return out
