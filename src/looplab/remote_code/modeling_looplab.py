"""A looplab LoopedLM as a transformers model, for `trust_remote_code=True` (docs/interop.md#transformers-with-remote-code).

Copied verbatim, with configuration_looplab.py, into every folder `python -m looplab.convert to-hf`
writes. It imports torch and transformers only, and the folder's looplab_variants.py: the table of the
variants' own export code that to-hf writes beside it (a GRU state update, a researcher's; each file torch
only: export_sources.py, docs/extending.md#bring-your-export-code). The folder runs where looplab is not installed.
looplab's tests compare it with looplab's own LoopedLM for every configuration it accepts
(tests/test_remote_code.py), logits and greedy generation, so the two cannot drift silently.

    e = Prelude(Embed(tokens));  for r = 1..R:  h_r = Block(x_r),  x_1 = e
        vanilla:    x_{r+1} = h_r
        StateLoop:  s_r = a_r ⊙ s_{r−1} + (1 − a_r) ⊙ W_u h_r (+ Mixer(Norm(s_r))),  x_{r+1} = h_r + W_o s_r
        injection:  x_{r+1} ← Inject(x_{r+1}, e)     (r < R)
    hidden_r = FinalNorm(Coda(readout_r)),  readout_r = h_r (+ W_o s_r);  logits = Head(hidden_R)

The block's weights are stored once and applied R times. Every attention call keeps its keys and
values in its own slot of the stock `DynamicCache` (slot = its place in the unrolled order,
`attention_slots`), so transformers' generation and lm-eval's `hf` model run it without a cache
class of its own. A shared layer has one module per slot (`AttentionSlot`, no parameters) that
carries the slot index (`layer_idx`) and the config to the attention function. vLLM runs these
folders through looplab's native plugin (docs/vllm.md), not through its Transformers backend: that
backend builds one attention layer per attention *module*, and one looped block serves R slots.

Depth is set at load time: `from_pretrained(folder, trust_remote_code=True, n_loops=R′)` (the slot
count follows). With an exit gate (exit_gate=ouro) the forward returns the exit distribution over
the R loops when asked (`output_exit_probs=True`), and `generate(..., exit_threshold=q)` reads each
token's prediction at the first loop whose exit CDF reaches q (every loop still runs).

It runs on transformers 4.56 through 5.x (tested: scripts/transformers-matrix, docs/interop.md#tested-versions).
What differs between those releases is detected, never read off a version string:
- the attention lookup: `ALL_ATTENTION_FUNCTIONS.get_interface(name, default)` where it exists (5.1 on:
  it also validates the name), else the mapping itself (`attention_function`);
- the cache's name in model outputs: `cache` where ModelOutput maps the old `past_key_values` onto it
  (a `past_key_values` property; such a ModelOutput refuses an output given both), else `past_key_values`,
  the name older generation loops read (`CACHE_FIELD`); the forwards accept both names;
- flash attention (`attn_implementation="flash_attention_2"` and other "flash" kernels): transformers'
  flash path reads `module.config` and takes a (B, L) padding mask, not the 4-D boolean mask the other
  implementations get (`LoopContext`); it runs in fp16/bf16 only, and an fp32 model is refused by name;
- initialization: 5.x loads the weights first and then calls `_init_weights` on the whole model, marking
  what it loaded `_is_hf_initialized`; 4.x initializes first and loads over it. `init_` skips marked
  tensors, so neither order overwrites a loaded weight;
- tying: with `tie_word_embeddings` the head is the embedding after transformers' `tie_weights`, checked and
  done where transformers skipped it (5.3.0 does, for remote code whose checkpoint omits the tied head).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput

from .configuration_looplab import LoopedLMHFConfig, attention_slots, state_mixer
# the variants' own export code that this folder ships ({axis: {name: class}}; empty when none): a static relative
# import, so that transformers copies looplab_variants.py, and the files it imports, with this file
from .looplab_variants import VARIANTS

SUPPORTED_STATE_MODES = ("vanilla", "stateloop", "stateloop_attn", "stateloop_reset")  # written here; others: VARIANTS
SUPPORTED_STATE_MIXERS = ("none", "attn")
SUPPORTED_INJECTIONS = ("none", "add", "concat", "diag")


# --------------------------------------------------------------------------- layers
class LoopedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.variance_epsilon = eps  # the name vLLM's RMSNorm replacement reads
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


def rope(x, positions, base: float):
    """Rotate-half RoPE of x (B, H, T, hd) at positions (B|1, T), the tables in fp32 as looplab's."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # (B|1, T, hd/2)
    cos, sin = freqs.cos()[:, None].to(x.dtype), freqs.sin()[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def eager_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """softmax(QKᵀ·scale + mask)·V over (B, H, T, hd); returns (B, T, H, hd) like transformers' functions."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if attention_mask is None and query.shape[2] > 1:
        T, L = query.shape[2], key.shape[2]
        attention_mask = torch.ones(T, L, dtype=torch.bool, device=query.device).tril(L - T)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    return (scores.softmax(-1) @ value).transpose(1, 2).contiguous(), None


def attention_function(name: str | None) -> Callable:
    """The attention function registered under `name` (config._attn_implementation); ours for "eager"."""
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # 5.1 on: it also refuses an unknown name
        return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention)
    if name is None or name == "eager":  # 4.x, 5.0: a plain mapping of the registered names ("eager" is not one)
        return eager_attention
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise KeyError(f"`{name}` is not a valid attention implementation registered in the `AttentionInterface`")
    return ALL_ATTENTION_FUNCTIONS[name]


def is_flash_attention(name: str | None) -> bool:
    """transformers' own test for a flash kernel (flash_attention_2/3/4, hub flash kernels): "flash" in the name.
    Those take a (B, L) padding mask (or None) and read `module.config._attn_implementation`."""
    return name is not None and "flash" in name


class AttentionSlot(nn.Module):
    """What an attention function sees as `module` for one unrolled attention call: its slot
    (`layer_idx`), the head grouping and the model's config
    (transformers' flash path reads `module.config._attn_implementation`); no parameters."""

    is_causal = True

    def __init__(self, layer_idx: int, n_heads: int, n_kv_heads: int, head_dim: int, config=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_key_value_groups = n_heads // n_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim ** -0.5
        self.config = config  # the model's own config object (not a copy): set_attn_implementation reaches it


class LoopedAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, rope_base: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.rope_base = rope_base
        self.qkv_proj = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)  # cat(q, k, v)
        self.out_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, ctx: "LoopContext", slot: AttentionSlot):
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split((H * hd, Hkv * hd, Hkv * hd), dim=-1)
        q = rope(q.view(B, T, H, hd).transpose(1, 2), ctx.positions, self.rope_base)  # (B, H, T, hd)
        k = rope(k.view(B, T, Hkv, hd).transpose(1, 2), ctx.positions, self.rope_base)
        v = v.view(B, T, Hkv, hd).transpose(1, 2)
        if ctx.cache is not None:
            k, v = ctx.cache.update(k, v, slot.layer_idx)
        # the functional attention interface: from_pretrained(attn_implementation=...) / set_attn_implementation pick it
        y, _ = ctx.attend(slot, q, k, v, ctx.mask, dropout=0.0, scaling=slot.scaling, **ctx.kwargs)
        return self.out_proj(y.reshape(B, T, H * hd))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)  # cat(gate, up)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LoopedDecoderLayer(nn.Module):
    """Pre-norm LLaMA layer: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    def __init__(self, config):
        super().__init__()
        self.attn_norm = LoopedRMSNorm(config.d_model, config.norm_eps)
        self.attn = LoopedAttention(config.d_model, config.n_heads, config.n_kv_heads, config.rope_base)
        self.mlp_norm = LoopedRMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.ffn_hidden)

    def forward(self, x, ctx, slot):
        x = x + self.attn(self.attn_norm(x), ctx, slot)
        return x + self.mlp(self.mlp_norm(x))


class StateBranch(nn.Module):
    """StateLoop's per-token state around an update rule: s_r = update(h_r, s_{r−1}) (+ Mixer(Norm(s_r))), and
    x_{r+1} = h_r + W_o s_r. The rule (`build_update`, `update`, as in looplab's StateBranch) is mixed in: StateLoop's
    selective update below, or a variant's own `StateUpdate` from this folder's VARIANTS (`state_branch_class`)."""

    def __init__(self, config, options: dict | None = None):
        super().__init__()
        d, ds = config.d_model, config.state_dim
        self.options = SimpleNamespace(**(options or {}))  # the variant's options, defaults included
        self.reset_each_loop = config.state_mode == "stateloop_reset" or not getattr(self, "carries_state", True)
        self.build_update(d, ds)
        self.state_out = nn.Linear(ds, d, bias=False)
        self.s0 = nn.Parameter(torch.zeros(ds)) if config.state_init == "learned" else None
        if state_mixer(config) == "attn":
            self.mixer = LoopedAttention(ds, config.n_heads, config.n_heads, config.rope_base)
            self.mixer_norm = LoopedRMSNorm(ds, config.norm_eps)
        else:
            self.mixer = self.mixer_norm = None
        self.state_dim = ds

    def initial_state(self, h):
        B, T, _ = h.shape
        if self.s0 is None:
            return h.new_zeros(B, T, self.state_dim)
        return self.s0.to(h.dtype).expand(B, T, -1)

    def build_update(self, d, ds):
        raise NotImplementedError

    def update(self, h, s_prev):
        """(h_r, s_{r−1}) → (s_r, retention)."""
        raise NotImplementedError

    def forward(self, h, s_prev, ctx, slot):
        if self.reset_each_loop:
            s_prev = self.initial_state(h)
        s, _ = self.update(h, s_prev)
        if self.mixer is not None:
            s = s + self.mixer(self.mixer_norm(s), ctx, slot)
        return s, h + self.state_out(s)


class SelectiveUpdate:
    """StateLoop's selective update: s_r = a_r ⊙ s_{r−1} + (1 − a_r) ⊙ W_u h_r, a_r = exp(−softplus(W_Δ h_r + b_Δ)·exp(A_log))."""

    def build_update(self, d, ds):
        self.in_proj = nn.Linear(d, ds, bias=False)
        self.dt_proj = nn.Linear(d, ds, bias=True)
        self.A_log = nn.Parameter(torch.zeros(ds))

    def update(self, h, s_prev):
        a = torch.exp(-F.softplus(self.dt_proj(h)) * torch.exp(self.A_log))
        return a * s_prev + (1 - a) * self.in_proj(h), a


class SelectiveState(SelectiveUpdate, StateBranch):
    pass


def variant_code(axis: str, name: str):
    """The export code that a variant shipped for `axis` in this folder (looplab_variants.py), or None."""
    return VARIANTS.get(axis, {}).get(name)


def state_branch_class(config) -> type:
    """The state branch of config.state_mode: StateLoop's, or the variant's StateUpdate mixed into StateBranch."""
    if config.state_mode in SUPPORTED_STATE_MODES:
        return SelectiveState
    code = variant_code("state_update", config.state_mode)
    return type("VariantStateBranch", (code, StateBranch), {"__module__": __name__, "variant": config.state_mode})


def variant_options(config, axis: str) -> dict:
    """The options to-hf recorded for the variant it shipped for `axis` (config.json's looplab_variants)."""
    return ((getattr(config, "looplab_variants", None) or {}).get(axis) or {}).get("options") or {}


class AddInjection(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d, d))

    def forward(self, x, e):
        return x + F.linear(e, self.weight)


class ConcatInjection(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d, 2 * d))

    def forward(self, x, e):
        return F.linear(torch.cat([x, e], dim=-1), self.weight)


class DiagInjection(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(d))

    def forward(self, x, e):
        return x + torch.tanh(self.gate).to(x.dtype) * e


INJECTION_CLASSES = {"add": AddInjection, "concat": ConcatInjection, "diag": DiagInjection}


class ExitGate(nn.Module):
    """Ouro's gate: λ_t = σ(w·hidden_t + b), read off each depth's final-normed hidden state."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, 1, bias=True)

    def forward(self, hidden):
        return self.proj(hidden).squeeze(-1)  # the logit of λ


def exit_distribution(lambdas):
    """(..., R) → p (..., R): p(t) = λ_t·S_{t−1} for t < R, p(R) = S_{R−1}; sums to one."""
    R = lambdas.shape[-1]
    if R == 1:
        return torch.ones_like(lambdas)
    survival = torch.cumprod(1 - lambdas, dim=-1)
    prev = torch.cat([torch.ones_like(survival[..., :1]), survival[..., :-1]], dim=-1)
    return torch.cat([lambdas[..., :-1] * prev[..., :-1], prev[..., -1:]], dim=-1)


def threshold_exit_steps(exit_probs, q: float):
    """The first 1-based depth whose exit CDF reaches q, else R: (..., R) → (...) long."""
    R = exit_probs.shape[-1]
    hit = exit_probs.cumsum(-1) >= q
    first = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(hit[..., 0], R - 1, dtype=torch.long))
    return first.long() + 1


# --------------------------------------------------------------------------- models
@dataclass
class LoopContext:
    positions: torch.Tensor  # (B|1, T) RoPE positions
    mask: torch.Tensor | None  # (B, 1, T, L) bool: what each query reads, None = causal; flash: (B, L) padding mask
    cache: Cache | None
    attend: Callable  # the attention function of config._attn_implementation
    kwargs: dict  # the forward's further keyword arguments, handed to the attention function


# The name under which model outputs carry the cache. transformers >= 5.24 calls it `cache`: its ModelOutput has a
# `past_key_values` property that reads `cache`, renames a `past_key_values=` argument and refuses an output given
# both. Older releases (4.56 ... 5.23) have no such property, and their generation reads `past_key_values`.
CACHE_FIELD = "cache" if isinstance(getattr(ModelOutput, "past_key_values", None), property) else "past_key_values"


def output_class(name: str, doc: str, fields: list[str]) -> type:
    """A ModelOutput dataclass with `fields` (all default None); "CACHE" stands for the cache, named CACHE_FIELD."""
    return dataclasses.make_dataclass(
        name, [(CACHE_FIELD if f == "CACHE" else f, Any, dataclasses.field(default=None)) for f in fields],
        bases=(ModelOutput,), namespace={"__doc__": doc, "__module__": __name__})


LoopedLMModelOutput = output_class(
    "LoopedLMModelOutput",
    "last_hidden_state: FinalNorm(Coda(readout_R)); the cache (CACHE_FIELD); loop_hidden: (R, B, T, d), every "
    "depth's, when asked.",
    ["last_hidden_state", "CACHE", "loop_hidden"])
LoopedLMCausalLMOutput = output_class(
    "LoopedLMCausalLMOutput",
    "loss, logits, the cache (CACHE_FIELD); with the exit gate: exit_probs (B, T, R), the gate's distribution over "
    "the loops; exit_steps (B, T), 1-based, the depth each token's logits come from; loop_logits (R, B, T, V).",
    ["loss", "logits", "CACHE", "exit_probs", "exit_steps", "loop_logits"])


class LoopedLMPreTrainedModel(PreTrainedModel):
    config_class = LoopedLMHFConfig
    base_model_prefix = "model"
    _no_split_modules = ["LoopedDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = False  # the padding mask is a boolean tensor, not a block mask
    # vLLM's Transformers backend builds one attention layer per attention module; a looped block is one module
    # serving R slots, so that backend can never run this model: say so (vLLM then refuses it by name) and serve it
    # with looplab's native vLLM plugin (docs/vllm.md)
    _supports_attention_backend = False

    @torch.no_grad()
    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            init_(module.weight, lambda w: w.normal_(0.0, std))
            if module.bias is not None:
                init_(module.bias, torch.Tensor.zero_)
        elif isinstance(module, nn.Embedding):
            init_(module.weight, lambda w: w.normal_(0.0, std))
        elif isinstance(module, LoopedRMSNorm):
            init_(module.weight, lambda w: w.fill_(1.0))
        if isinstance(module, StateBranch):
            if isinstance(module, SelectiveUpdate):
                init_(module.A_log, torch.Tensor.zero_)
            init_(module.state_out.weight, torch.Tensor.zero_)
        elif isinstance(module, (AddInjection, DiagInjection)):
            init_(next(module.parameters()), torch.Tensor.zero_)
        elif isinstance(module, ConcatInjection):
            d = module.weight.shape[0]
            init_(module.weight, lambda w: w.zero_()[:, :d].copy_(torch.eye(d)))


def init_(tensor: torch.Tensor, fill: Callable) -> None:
    """Initialize `tensor` in place unless transformers loaded it: 5.x marks every tensor it loaded
    `_is_hf_initialized` and then initializes the model (its own `transformers.initialization` functions skip
    those); 4.x initializes first and loads over it."""
    if not getattr(tensor, "_is_hf_initialized", False):
        fill(tensor)


def check_config(config) -> None:
    """Refuse, naming the field, what this code cannot run (looplab's export refuses it first)."""
    if config.backbone != "llama":
        raise ValueError(f"backbone={config.backbone!r}: the exported code runs llama blocks only")
    if config.state_mode not in SUPPORTED_STATE_MODES and variant_code("state_update", config.state_mode) is None:
        raise ValueError(f"state_mode={config.state_mode!r}: the exported code runs {SUPPORTED_STATE_MODES} and the "
                         "state updates whose export code the folder ships (looplab_variants.py)")
    if state_mixer(config) not in SUPPORTED_STATE_MIXERS:
        raise ValueError(f"state_mixer={state_mixer(config)!r}: the exported code runs {SUPPORTED_STATE_MIXERS}")
    if config.injection not in SUPPORTED_INJECTIONS:
        raise ValueError(f"injection={config.injection!r}: the exported code runs {SUPPORTED_INJECTIONS}")
    for name, default in (("loop_schedule", "sequential"), ("depth_router", None)):
        value = getattr(config, name, default)
        if value not in (default, None) and not (name == "depth_router" and (value or {}).get("name", "none") == "none"):
            hint = ("; vLLM runs parallel loops with looplab's plugin (pip install 'looplab[vllm]'), and looplab "
                    "reads the folder (LoopedLM.from_pretrained)") if name == "loop_schedule" else ""
            raise ValueError(f"{name}={value!r}: the exported code runs sequential loops without a depth router{hint}")
    if not isinstance(config.n_loops, int) or config.n_loops < 1:
        raise ValueError(f"n_loops={config.n_loops!r} must be an integer >= 1")


class LoopedLMModel(LoopedLMPreTrainedModel):
    """Embedding, prelude, the shared block, the state branch, coda and final norm: hidden states."""

    def __init__(self, config: LoopedLMHFConfig):
        super().__init__(config)
        check_config(config)
        slots = attention_slots(config)
        config.num_hidden_layers = slots["total"]  # n_loops may have been overridden at load time
        self.slots_at = slots
        d, H, Hkv = config.d_model, config.n_heads, config.n_kv_heads
        self.embed = nn.Embedding(config.vocab_size, d)
        self.prelude = nn.ModuleList(LoopedDecoderLayer(config) for _ in range(config.prelude_layers))
        self.block = nn.ModuleList(LoopedDecoderLayer(config) for _ in range(config.n_layers))
        self.coda = nn.ModuleList(LoopedDecoderLayer(config) for _ in range(config.coda_layers))
        self.state = (state_branch_class(config)(config, variant_options(config, "state_update"))
                      if config.state_mode != "vanilla" else None)
        self.inject = INJECTION_CLASSES[config.injection](d) if config.injection != "none" else None
        self.exit_gate = ExitGate(d) if config.exit_gate != "none" else None  # model.exit_gate.*: with the base model
        self.final_norm = LoopedRMSNorm(d, config.norm_eps)
        state_heads = (H, H, config.state_dim // H)
        self.attention_slots = nn.ModuleList(
            AttentionSlot(i, *(state_heads if slots["state"] <= i < slots["coda"] else (H, Hkv, d // H)), config=config)
            for i in range(slots["total"]))
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def _context(self, embeds, attention_mask, position_ids, cache, kwargs) -> LoopContext:
        B, T = embeds.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        device = embeds.device
        name = self.config._attn_implementation or "sdpa"
        attend = attention_function(name)
        if is_flash_attention(name):
            return self._flash_context(name, attend, embeds, attention_mask, position_ids, past, cache, kwargs)
        mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            valid = attention_mask.to(torch.bool)  # (B, past + T): 1 = real token, 0 = (left) padding
            if position_ids is None:
                position_ids = (valid.long().cumsum(1) - 1).clamp_min(0)[:, -T:]
            if not bool(valid.all()):
                L = valid.shape[1]
                q_pos = torch.arange(L - T, L, device=device)[:, None]
                k_pos = torch.arange(L, device=device)[None]
                # causal over real keys; every query sees itself, so a padding row never attends to nothing
                mask = (((k_pos <= q_pos)[None] & valid[:, None, :]) | (k_pos == q_pos)[None])[:, None]
        elif attention_mask is not None:
            mask = attention_mask.to(torch.bool)  # a 4D mask given as is
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=device)[None]
        if mask is None and T > 1 and past > 0:
            L = past + T
            mask = torch.ones(T, L, dtype=torch.bool, device=device).tril(L - T)[None, None]
        return LoopContext(position_ids, mask, cache, attend, kwargs)

    def _flash_context(self, name, attend, embeds, attention_mask, position_ids, past, cache, kwargs) -> LoopContext:
        """Flash kernels take the (B, past + T) padding mask, None without padding (transformers' flash path unpads
        by it and applies the causal rule itself, aligned bottom-right), and run in fp16/bf16 only."""
        T = embeds.shape[1]
        if embeds.dtype == torch.float32 and not torch.is_autocast_enabled(embeds.device.type):
            raise ValueError(f"attn_implementation={name!r} runs in float16 or bfloat16, and this model computes in "
                             "float32: load it with dtype=torch.bfloat16 (or float16), run it under torch.autocast, or "
                             "use attn_implementation='sdpa'")
        mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"attn_implementation={name!r} takes a 2-D (batch, length) padding mask, got "
                                 f"{attention_mask.dim()}-D: give the 2-D mask, or use attn_implementation='sdpa'")
            valid = attention_mask.to(torch.bool)
            if position_ids is None:
                position_ids = (valid.long().cumsum(1) - 1).clamp_min(0)[:, -T:]
            if not bool(valid.all()):
                mask = valid
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=embeds.device)[None]
        return LoopContext(position_ids, mask, cache, attend, kwargs)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, output_loop_states: bool = False, return_dict=None, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        kwargs.pop("cache_position", None)
        if use_cache is None:
            use_cache = getattr(self.config, "use_cache", True) and not self.training
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if not use_cache:
            cache = None
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        ctx = self._context(inputs_embeds, attention_mask, position_ids, cache, kwargs)
        at, cfg = self.slots_at, self.config
        x = inputs_embeds
        for p, layer in enumerate(self.prelude):
            x = layer(x, ctx, self.attention_slots[at["prelude"] + p])
        e = x
        s = self.state.initial_state(x) if self.state is not None else None
        N, R, C = cfg.n_layers, cfg.n_loops, cfg.coda_layers
        every_depth = output_loop_states
        if every_depth and C and cache is not None and cache.get_seq_length(at["coda"] + (R - 1) * C) > 0 \
                and cache.get_seq_length(at["coda"]) != cache.get_seq_length(at["coda"] + (R - 1) * C):
            raise ValueError("this cache was filled without every depth's coda: give exit_threshold (or "
                             "output_exit_probs) to every call of one generation, or to none")
        readouts = []
        for r in range(R):
            if self.inject is not None and r > 0:
                x = self.inject(x, e)
            h = x
            for l, layer in enumerate(self.block):
                h = layer(h, ctx, self.attention_slots[at["block"] + r * N + l])
            if self.state is not None:
                s, x = self.state(h, s, ctx, self.attention_slots[at["state"] + r] if self.state.mixer is not None else None)
                readout = x if cfg.state_in_output else h
            else:
                x = readout = h
            if every_depth or r == R - 1:
                readouts.append((r, readout))
        hidden = []
        for r, z in readouts:
            for c, layer in enumerate(self.coda):
                z = layer(z, ctx, self.attention_slots[at["coda"] + r * C + c])
            hidden.append(self.final_norm(z))
        out = LoopedLMModelOutput(last_hidden_state=hidden[-1], loop_hidden=torch.stack(hidden) if every_depth else None,
                                  **{CACHE_FIELD: cache})
        return out if return_dict is not False else (out.last_hidden_state,)


class LoopedLMForCausalLM(LoopedLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed.weight"}

    def __init__(self, config: LoopedLMHFConfig):
        super().__init__(config)
        self.model = LoopedLMModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def tie_weights(self, *args, **kwargs):
        """transformers' tying (its signature differs between releases), then a check that it happened: with
        tie_word_embeddings the head must be the embedding. 5.3 skips the tie for a remote-code model whose checkpoint
        omits the tied head (it marks the head as loaded, then finds it "present"), leaving lm_head unloaded."""
        out = super().tie_weights(*args, **kwargs)
        embed = self.model.embed.weight
        if getattr(self.config, "tie_word_embeddings", False) and self.lm_head.weight is not embed \
                and embed.device.type != "meta":  # meta: while from_pretrained builds the model, before loading
            self.lm_head.weight = embed
            tied = getattr(self, "all_tied_weights_keys", None)  # 5.x's record of what is tied (save_pretrained)
            if isinstance(tied, dict):
                tied.update(self._tied_weights_keys)
        return out

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, output_exit_probs: bool = False, exit_threshold: float | None = None,
                return_dict=None, past_key_values=None, **kwargs):
        """exit_threshold=q: each token's logits at the first loop whose exit CDF reaches q (needs exit_gate);
        output_exit_probs: also return the exit distribution (B, T, R) and every loop's logits."""
        gate = self.model.exit_gate
        if (exit_threshold is not None or output_exit_probs) and gate is None:
            raise ValueError(f"exit_threshold={exit_threshold!r} / output_exit_probs need a model with an exit gate "
                             f"(this one has exit_gate={self.config.exit_gate!r})")
        if exit_threshold is not None and not 0 < float(exit_threshold) <= 1:
            raise ValueError(f"exit_threshold={exit_threshold!r} must lie in (0, 1]")
        every_depth = exit_threshold is not None or output_exit_probs
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_loop_states=every_depth, **kwargs)
        result = LoopedLMCausalLMOutput(**{CACHE_FIELD: getattr(out, CACHE_FIELD)})
        if every_depth:
            loop_logits = self.lm_head(out.loop_hidden)  # (R, B, T, V)
            result.exit_probs = exit_distribution(torch.sigmoid(gate(out.loop_hidden).permute(1, 2, 0)))
            result.loop_logits = loop_logits
            if exit_threshold is not None:
                steps = threshold_exit_steps(result.exit_probs, float(exit_threshold))  # (B, T)
                idx = (steps - 1)[None, ..., None].expand(1, *steps.shape, loop_logits.shape[-1])
                result.logits, result.exit_steps = loop_logits.gather(0, idx)[0], steps
            else:
                result.logits = loop_logits[-1]
        else:
            result.logits = self.lm_head(out.last_hidden_state)
        if labels is not None:
            result.loss = F.cross_entropy(result.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                          ignore_index=-100)
        return result if return_dict is not False else result.to_tuple()
