"""looplab's LoopedLM as a native vLLM model (docs/vllm.md). Imported by vLLM only (it imports vLLM).

    e = Prelude(Embed(tokens));  for r = 1..R:  h_r = Block(x_r),  x_1 = e
        vanilla:    x_{r+1} = h_r
        StateLoop:  s_r = a_r ⊙ s_{r−1} + (1 − a_r) ⊙ W_u h_r (+ Mixer(Norm(s_r))),  x_{r+1} = h_r + W_o s_r
        injection:  x_{r+1} ← Inject(x_{r+1}, e)     (r < R; add | concat | diag)
    hidden_r = FinalNorm(Coda(readout_r)),  readout_r = h_r (+ W_o s_r);  logits = Head(hidden_R)

The reference is looplab's own LoopedLM (looplab/models/looped.py, state.py, injection.py, exit_gate.py); the
tests (tests_engines/vllm) compare greedy tokens and per-token log-probabilities with it for every configuration
this model accepts.

Built from vLLM's own layers: QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear /
ReplicatedLinear, RMSNorm, SiluAndMul, get_rope, VocabParallelEmbedding, ParallelLMHead, LogitsProcessor, and one
vLLM `Attention` per attention *slot*: an unrolled (loop, layer) call of the shared block, a prelude layer, the
StateLoop mixer of one loop, or a coda layer at one depth (`config.slot_layout`). Each slot has its own KV cache;
the block's weights exist once (they are loaded once from the folder's model.safetensors) and serve R slots per
layer. vLLM's scheduler, paged KV cache, continuous batching and sampler do the rest.

Depth R′ is set at load time (`hf_overrides={"n_loops": R′}`; the slots follow). The exit gate (exit_gate=ouro)
with `hf_overrides={"exit_threshold": q}` reads each token at the first loop whose exit CDF reaches q: the
tokens of looplab's `generate(exits=ExitPolicy(threshold=q))`: every loop still runs for every token (the later
loops' keys and values are what later tokens attend to, as in looplab's generate without `skip`), so an exit
changes which depth is read, not the compute; the coda then runs at every depth (its slots per depth), as
looplab's does. With `"exit_skip": "kv_copy"` as well, the loops after a token's exit do not run for it and the
later slots get its exit loop's keys and values (`ExitPolicy(threshold=q, skip="kv_copy")`; vllm_plugin/exits.py).

Parallel loops (loop_schedule=parallel) keep a per-request carry in a Mamba-style state layer
(looplab/vllm_plugin/parallel.py). What it cannot run exactly is refused when vLLM builds it, naming the field
(`config.refusal`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.forward_context import get_forward_context
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                               RowParallelLinear)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.sequence import IntermediateTensors

from looplab.vllm_plugin.config import refusal, schedule, slot_layout


class LoopRefused(ValueError):
    """A looplab configuration the vLLM plugin cannot run exactly (the message names the field)."""


def _supported_head_sizes(vllm_config: VllmConfig) -> list[int] | None:
    """The head sizes of the attention backend vLLM picks on this platform (None: unknown, vLLM checks itself)."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            return CPUAttentionBackend.get_supported_head_sizes()
    except Exception:  # noqa: BLE001 - a layout this version does not have: leave the check to vLLM
        return None
    return None


GRAPH_FIELDS = ("vocab_size", "d_model", "n_heads", "n_kv_heads", "n_layers", "n_loops", "prelude_layers",
                "coda_layers", "ffn_hidden", "max_seq_len", "rope_base", "norm_eps", "tie_embeddings", "state_mode",
                "state_dim", "state_init", "state_in_output", "exit_gate", "injection", "exit_threshold",
                "exit_skip", "loop_schedule", "loop_kv", "loop_window", "loop_gate", "loop_mix", "loop_mix_learned",
                "loop_norm")


def _key_compile_cache(vllm_config: VllmConfig, cfg) -> None:
    """Put the looplab fields that shape the forward into vLLM's compile-cache key.

    vLLM 0.32 keys its torch.compile cache (compilation/decorators.py, caching.py) by VllmConfig.compute_hash(),
    which leaves out `hf_overrides` and the contents of config.json: without this, a folder served at R = 3 and
    then with hf_overrides={"n_loops": 5} or {"exit_threshold": q} (or a folder re-exported to the same path)
    would reload the first graph and run the wrong model (read from vLLM's source; with this key it cannot). The
    fields go into `additional_config`, which that hash covers and which nothing else here reads."""
    extra = vllm_config.additional_config
    if isinstance(extra, dict):
        extra["looplab"] = {k: getattr(cfg, k, None) for k in GRAPH_FIELDS}


# --------------------------------------------------------------------------- layers
class SlotAttention(nn.Module):
    """Causal self-attention with RoPE whose keys and values go to the slot it is called with (an `Attention`).

    Weights: qkv_proj (cat(q, k, v), as looplab stores it) and out_proj, looplab's names."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, max_pos: int, rope_base: float, prefix: str):
        super().__init__()
        self.head_dim = dim // n_heads
        self.q_size, self.kv_size = n_heads * self.head_dim, n_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(dim, self.head_dim, n_heads, n_kv_heads, bias=False,
                                          prefix=f"{prefix}.qkv_proj")
        self.out_proj = RowParallelLinear(n_heads * self.head_dim, dim, bias=False, prefix=f"{prefix}.out_proj")
        self.loop_gate = None  # parallel loops with loop_kv=gswa: this layer's gate (set by the model)
        self.rotary_emb = get_rope(self.head_dim, max_position=max_pos, is_neox_style=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": float(rope_base)})

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rope: bool = True):
        """x (T, d) → q, k, v, with RoPE on q and k (rope=False: none, for rows that are all gone)."""
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if rope:
            q, k = self.rotary_emb(positions, q, k)
        return q, k, v

    def attend(self, slot, q, k, v, residual):
        """slot: an `Attention`, or a parallel loop's reads (`LoopReads`: which slots loop r >= 2 attends to)."""
        return slot(q, k, v) if isinstance(slot, Attention) else slot(q, k, v, residual, self.loop_gate)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slot, residual=None) -> torch.Tensor:
        out, _ = self.out_proj(self.attend(slot, *self.qkv(x, positions), residual))
        return out

    def forward_folded(self, x, positions, slots: list, residual) -> torch.Tensor:
        """Parallel loops' folded decoding step: x (R·T, d), loop-major, the R loops of T decoded tokens. One
        projection over every row; each loop's T rows go to its own slots[r] (an `Attention`, or `LoopReads`)."""
        q, k, v = self.qkv(x, positions)
        T = x.shape[0] // len(slots)
        rows = [slice(r * T, (r + 1) * T) for r in range(len(slots))]
        out, _ = self.out_proj(torch.cat([self.attend(slot, q[i], k[i], v[i], residual[i]) for slot, i in zip(slots, rows)]))
        return out

    def forward_rows(self, x, positions, slot: Attention, rows, key):
        """The rows still looping (x, positions: theirs) with exits that skip compute (vllm_plugin/exits.py): their
        projections only; the slot is called for every token, an exited one with its kept keys and values."""
        q, k, v = self.qkv(x, positions, rope=x.shape[0] > 0)  # (every row may have exited: the slot still
        y = slot(*rows.full(key, q, k, v))  # gets the kept keys and values)
        out, _ = self.out_proj(rows.gather(y))
        return out


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(dim, [hidden, hidden], bias=False,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(hidden, dim, bias=False, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()  # silu(first half) · second half: looplab's gate, up order

    def forward(self, x):
        out, _ = self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))
        return out


class DecoderLayer(nn.Module):
    """looplab's pre-norm AttentionLayer: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    def __init__(self, cfg, prefix: str):
        super().__init__()
        d = cfg.d_model
        self.attn_norm = RMSNorm(d, eps=cfg.norm_eps)
        self.attn = SlotAttention(d, cfg.n_heads, cfg.n_kv_heads, cfg.max_seq_len, cfg.rope_base, f"{prefix}.attn")
        self.mlp_norm = RMSNorm(d, eps=cfg.norm_eps)
        self.mlp = SwiGLU(d, cfg.ffn_hidden, f"{prefix}.mlp")
        self.rows_pre, self.rows_post = self._rows_pre, self._rows_post  # forward_rows; compiled by compile_rows()

    def forward(self, x, positions, slot):
        x = x + self.attn(self.attn_norm(x), positions, slot, residual=x)
        return x + self.mlp(self.mlp_norm(x))

    def forward_folded(self, x, positions, slots):
        x = x + self.attn.forward_folded(self.attn_norm(x), positions, slots, residual=x)
        return x + self.mlp(self.mlp_norm(x))

    def forward_rows(self, x, positions, slot, rows, key):
        """Exits that skip compute (vllm_plugin/exits.py): x, positions are the rows still looping. Their
        arithmetic before the attention slot (norm, projection, RoPE) and after it (output projection, MLP, both
        residuals) runs as two functions of the rows, compiled (`compile_rows`: dynamic in their number; the exit
        loops run in an eager op, where vLLM's graph does not reach) unless vLLM runs eagerly; the slot call and
        the rows' gather and scatter stay eager."""
        if x.shape[0] == 0:  # every row has exited: the slot still gets every token's kept keys and values
            slot(*rows.full(key, *self.attn.qkv(x, positions, rope=False)))
            return x
        y = slot(*rows.full(key, *self.rows_pre(x, positions)))
        return self.rows_post(x, rows.gather(y))

    def compile_rows(self) -> None:
        self.rows_pre = torch.compile(self._rows_pre, dynamic=True)
        self.rows_post = torch.compile(self._rows_post, dynamic=True)

    def _rows_pre(self, x, positions):
        return self.attn.qkv(self.attn_norm(x), positions)

    def _rows_post(self, x, y):
        out, _ = self.attn.out_proj(y)
        x = x + out
        return x + self.mlp(self.mlp_norm(x))


class LoopReads:
    """What loop r >= 2's attention reads under parallel loops (looplab/vllm_plugin/parallel.py): `kv` own (its
    slot), share_first (loop 1's slot, read only) or gswa (g·loop 1's slot + (1 − g)·its own windowed slot)."""

    def __init__(self, kv: str, first: Attention, own: Attention | None, n_heads: int):
        self.kv, self.first, self.own, self.H = kv, first, own, n_heads

    def __call__(self, q, k, v, residual, gate):
        if self.kv == "own":
            return self.own(q, k, v)
        glob = self.first(q, None, None)
        if self.kv == "share_first":
            return glob
        local = self.own(q, k, v)
        T = q.shape[0]
        # looplab's own gate (models/parallel.py), on its layout: q (1, H, T, hd), residual (1, T, d) → (1, H, T, 1)
        g = gate(q.view(T, self.H, -1).transpose(0, 1)[None], residual[None])[0].transpose(0, 1)  # (T, H, 1)
        return (g * glob.view(T, self.H, -1) + (1 - g) * local.view(T, self.H, -1)).reshape(T, -1)


class StateBranch(nn.Module):
    """StateLoop's per-token state (looplab/models/state.py): one per model, shared by the loops."""

    def __init__(self, cfg, prefix: str):
        super().__init__()
        d, ds = cfg.d_model, cfg.state_dim
        self.state_dim = ds
        self.reset_each_loop = cfg.state_mode == "stateloop_reset"
        self.in_proj = ReplicatedLinear(d, ds, bias=False, prefix=f"{prefix}.in_proj")  # W_u
        self.dt_proj = ReplicatedLinear(d, ds, bias=True, prefix=f"{prefix}.dt_proj")  # W_Δ, b_Δ
        self.A_log = nn.Parameter(torch.zeros(ds), requires_grad=False)
        self.state_out = ReplicatedLinear(ds, d, bias=False, prefix=f"{prefix}.state_out")  # W_o
        self.s0 = nn.Parameter(torch.zeros(ds), requires_grad=False) if cfg.state_init == "learned" else None
        self.mixer = self.mixer_norm = None
        if cfg.state_mode == "stateloop_attn":  # n_heads heads of width d_s / n_heads, no GQA (looplab's mixer)
            self.mixer = SlotAttention(ds, cfg.n_heads, cfg.n_heads, cfg.max_seq_len, cfg.rope_base, f"{prefix}.mixer")
            self.mixer_norm = RMSNorm(ds, eps=cfg.norm_eps)

    def initial_state(self, h: torch.Tensor) -> torch.Tensor:
        if self.s0 is None:
            return h.new_zeros(h.shape[0], self.state_dim)
        return self.s0.to(h.dtype).expand(h.shape[0], -1)

    def forward(self, h, s_prev, positions, slot, rows=None):
        """rows (exits that skip compute, vllm_plugin/exits.py): h, s_prev and positions are the rows still looping';
        the mixer's slot still sees every token."""
        if self.reset_each_loop:
            s_prev = self.initial_state(h)
        dt = F.softplus(self.dt_proj(h)[0])
        a = torch.exp(-dt * torch.exp(self.A_log))
        s = a * s_prev + (1 - a) * self.in_proj(h)[0]
        if self.mixer is not None:
            z = self.mixer_norm(s)
            s = s + (self.mixer(z, positions, slot) if rows is None
                     else self.mixer.forward_rows(z, positions, slot, rows, ("mixer",)))
        return s, h + self.state_out(s)[0]


class VariantStateBranch(nn.Module):
    """A registered state update's own export code (vllm_plugin/variants.py) around StateLoop's branch:
    s_r = update(h_r, s_{r−1}), x_{r+1} = h_r + W_o s_r, as the exported remote code's StateBranch (no mixer). The
    update's parameters are the ones its `build_update` creates, under the names looplab's checkpoints use."""

    mixer = None

    def __init__(self, cfg, prefix: str, options: dict):
        from types import SimpleNamespace

        super().__init__()
        d, ds = cfg.d_model, cfg.state_dim
        self.state_dim, self.options = ds, SimpleNamespace(**options)
        self.reset_each_loop = not getattr(self, "carries_state", True)
        self.build_update(d, ds)
        self.state_out = ReplicatedLinear(ds, d, bias=False, prefix=f"{prefix}.state_out")  # W_o
        self.s0 = nn.Parameter(torch.zeros(ds), requires_grad=False) if cfg.state_init == "learned" else None

    initial_state = StateBranch.initial_state

    def forward(self, h, s_prev, positions, slot, rows=None):
        if self.reset_each_loop:
            s_prev = self.initial_state(h)
        s, _ = self.update(h, s_prev)
        return s, h + self.state_out(s)[0]


def state_branch(cfg, prefix: str, vllm_config: VllmConfig) -> nn.Module:
    """StateLoop's branch, or a registered update rule's own code mixed into VariantStateBranch."""
    from looplab.vllm_plugin.config import STATE_MODES

    if cfg.state_mode in STATE_MODES:
        return StateBranch(cfg, prefix)
    from looplab.vllm_plugin.variants import state_update_class, variant_options

    mc = vllm_config.model_config
    try:
        code = state_update_class(cfg, mc.model, bool(mc.trust_remote_code))
    except ValueError as e:
        raise LoopRefused(f"looplab's vLLM plugin: {e}") from None
    cls = type("VariantStateBranch", (code, VariantStateBranch), {"__module__": __name__})
    return cls(cfg, prefix, variant_options(cfg))


class DiagInjection(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(d), requires_grad=False)

    def forward(self, x, e):
        return x + torch.tanh(self.gate).to(x.dtype) * e


class Injection(nn.Module):
    """add: x + W_in e;  concat: W_c [x; e] (looplab/models/injection.py); the weight is `inject.weight`."""

    def __init__(self, mode: str, d: int, prefix: str):
        super().__init__()
        self.mode = mode
        self.linear = ReplicatedLinear(2 * d if mode == "concat" else d, d, bias=False, prefix=prefix)

    def forward(self, x, e):
        if self.mode == "concat":
            return self.linear(torch.cat([x, e], dim=-1))[0]
        return x + self.linear(e)[0]


# --------------------------------------------------------------------------- the model
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0,
                                         "inputs_embeds": 0})
class LoopedLMModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg = vllm_config.model_config.hf_config
        reason = refusal(cfg, _supported_head_sizes(vllm_config))
        if reason:
            raise LoopRefused(f"looplab's vLLM plugin cannot run this model exactly: {reason} (docs/vllm.md)")
        cache_config = vllm_config.cache_config
        _key_compile_cache(vllm_config, cfg)
        self.cfg = cfg
        self.layout = at = slot_layout(cfg)
        cfg.num_hidden_layers = at["total"]
        d, H, Hkv = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        self.embed = VocabParallelEmbedding(cfg.vocab_size, d, prefix=f"{prefix}.embed")
        self.prelude = nn.ModuleList(DecoderLayer(cfg, f"{prefix}.prelude.{i}") for i in range(cfg.prelude_layers))
        self.block = nn.ModuleList(DecoderLayer(cfg, f"{prefix}.block.{i}") for i in range(cfg.n_layers))
        self.coda = nn.ModuleList(DecoderLayer(cfg, f"{prefix}.coda.{i}") for i in range(cfg.coda_layers))
        self.state = state_branch(cfg, f"{prefix}.state", vllm_config) if cfg.state_mode != "vanilla" else None
        self.inject = None
        if cfg.injection == "diag":
            self.inject = DiagInjection(d)
        elif cfg.injection != "none":
            self.inject = Injection(cfg.injection, d, f"{prefix}.inject")
        self.exit_gate = None
        if cfg.exit_gate != "none":
            self.exit_gate = nn.Module()
            self.exit_gate.proj = ReplicatedLinear(d, 1, bias=True, prefix=f"{prefix}.exit_gate.proj")
        self.final_norm = RMSNorm(d, eps=cfg.norm_eps)
        self.exit_threshold = getattr(cfg, "exit_threshold", None)
        # one vLLM Attention (own KV cache) per slot; the mixer's slots have the mixer's heads
        hd, mixer_heads = d // H, (H, H, cfg.state_dim // H)

        self.parallel = schedule(cfg) == "parallel"
        window = None
        if self.parallel and cfg.loop_kv == "gswa":  # loops 2..R's own keys: a sliding window of w tokens
            window = {at["block"] + r * cfg.n_layers + l for r in range(1, cfg.n_loops) for l in range(cfg.n_layers)}

        def slot(i):
            heads, kv_heads, width = mixer_heads if at["state"] <= i < at["coda"] else (H, Hkv, hd)
            extra = {"per_layer_sliding_window": cfg.loop_window} if window and i in window else {}
            return Attention(heads, width, width ** -0.5, num_kv_heads=kv_heads, cache_config=cache_config,
                             prefix=f"{prefix}.slots.{i}", **extra)

        self.slots = nn.ModuleList(slot(i) for i in range(at["total"]))
        self.carry = self.loop_input = None
        self.fold = self.parallel and cfg.n_loops > 1 and getattr(cfg, "parallel_fold", True)
        from vllm.config import CompilationMode

        self.eager = vllm_config.compilation_config.mode == CompilationMode.NONE
        # the folded decoding step (forward_folded), compiled on its first calls unless vLLM runs eagerly
        self._folded_step = None if not self.fold else self._fold if self.eager else torch.compile(self._fold, dynamic=True)
        self._folded_warm = False  # compiled at T = 1 and T >= 2 (`folded_step_cold`)
        if self.parallel:
            self._build_parallel(cfg, prefix)
        self.exit_loops = None
        if getattr(cfg, "exit_skip", None) is not None:  # the loops as one eager op, found by name (exits.py)
            from looplab.vllm_plugin.exits import ExitLoops

            name = f"{prefix}.exit_loops"
            context = vllm_config.compilation_config.static_forward_context
            if name in context:
                raise ValueError(f"Duplicate layer name: {name}")
            context[name] = self.exit_loops = ExitLoops(self, name)
            if not self.eager:
                for layer in (*self.block, *self.coda):
                    layer.compile_rows()
        from looplab.vllm_plugin.graphs import CARRY_OPS, EXIT_OPS, keep_out_of_graphs

        keep_out_of_graphs(vllm_config.compilation_config, (CARRY_OPS if self.parallel else ())
                           + (EXIT_OPS if self.exit_loops is not None else ()))

    def _build_parallel(self, cfg, prefix: str) -> None:
        """Parallel loops: a·E + b·prev (`loop_input`, parameters with loop_mix_learned), the per-request carry,
        each block layer's G-SWA gate, and which slots loop r >= 2 reads. The mix and the gate are looplab's own
        modules (models/parallel.py: the same parameter names and arithmetic as the reference)."""
        from looplab.models.parallel import LoopGate, LoopInput
        from looplab.vllm_plugin.parallel import LoopCarry

        self.loop_input = LoopInput(cfg)
        # at R = 1 too: vLLM built this class for a model with a state layer (it reads nothing from it then)
        self.carry = LoopCarry(cfg, f"{prefix}.carry.{self.layout['total']}")  # one integer in a layer's name
        N, first = cfg.n_layers, self.layout["block"]
        for layer in self.block:
            layer.attn.loop_gate = LoopGate(cfg) if cfg.loop_kv == "gswa" else None
        self.reads = [[None] * N] + [
            [LoopReads(cfg.loop_kv, self.slots[first + l],
                       None if cfg.loop_kv == "share_first" else self.slots[first + r * N + l], cfg.n_heads)
             for l in range(N)] for r in range(1, cfg.n_loops)]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        cfg, at, slots = self.cfg, self.layout, self.slots
        x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        for p, layer in enumerate(self.prelude):
            x = layer(x, positions, slots[at["prelude"] + p])
        if self.parallel:
            return self._forward_parallel(x, positions)
        if self.exit_loops is not None:
            return torch.ops.vllm.looplab_exit_loops(x, positions, self.exit_loops.name)
        e = x
        s = self.state.initial_state(x) if self.state is not None else None
        N, R = cfg.n_layers, cfg.n_loops
        every_depth = self.exit_threshold is not None
        exit_state = None
        hidden = None
        for r in range(R):
            if self.inject is not None and r > 0:
                x = self.inject(x, e)
            h = x
            for l, layer in enumerate(self.block):
                h = layer(h, positions, slots[at["block"] + r * N + l])
            if self.state is not None:
                mixer_slot = slots[at["state"] + r] if self.state.mixer is not None else None
                s, x = self.state(h, s, positions, mixer_slot)
                readout = x if cfg.state_in_output else h
            else:
                x = readout = h
            if every_depth:  # this depth's FinalNorm(Coda(readout)) and the exit rule, before the next loop runs
                exit_state = self._exit_step(r, self._head_input(readout, positions, r), exit_state)
            elif r == R - 1:
                hidden = self._head_input(readout, positions, 0)
        return exit_state[0] if every_depth else hidden

    def _forward_parallel(self, e: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """loop 1: H^(1) = Block(E);  loop r >= 2: H^(r) = Block(a·E + b·shift(N(H^(r−1)))), loop by loop over the
        forward's tokens; the carry gives each request's first token the previous forward's N(H^(1..R−1))."""
        from looplab.vllm_plugin.parallel import carried_in, keep_carry, shift

        cfg, R, first_slot = self.cfg, self.cfg.n_loops, self.layout["block"]
        norm = self.final_norm if getattr(cfg, "loop_norm", False) else None
        carried, first = carried_in(self.carry, e) if R > 1 else (None, None)
        kept, h = [], e
        for r in range(R):
            h = e if r == 0 else self.loop_input(e, shift(kept[-1], carried[:, r - 1], first, positions))
            for l, layer in enumerate(self.block):
                h = layer(h, positions, self.slots[first_slot + l] if r == 0 else self.reads[r][l])
            if r < R - 1:
                kept.append(norm(h) if norm is not None else h)
        out = self._head_input(h, positions, 0)
        return keep_carry(self.carry, kept, out) if R > 1 else out

    @property
    def folded_step_cold(self) -> bool:
        return not self.eager and not self._folded_warm

    def fold_this_forward(self) -> bool:
        """Parallel loops, and this forward decodes one token per request and nothing else: its R loops can fold."""
        return self.fold and self.carry.decode_only()

    def forward_folded(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                       inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """A decoding step under parallel loops, folded (looplab's Engine does the same): token t's loop r ≥ 2 reads
        a·E_t + b·N(H^(r−1)) of token t − 1, which a decoded token finds in its carry, so no loop of the step waits
        for another and the R loops run as R·T rows (loop-major) of one block call. Each loop's attention still
        goes to its own slots.

        vLLM compiles `forward` (the sequential loops); which of the two a forward takes depends on its metadata
        (`fold_this_forward`, asked outside the compiled graph), so this step is compiled on its own, with
        torch.compile (dynamic in T), unless vLLM runs eagerly. Measured: eager, the folded step was no faster than
        the compiled sequential loops (docs/vllm.md#parallel-loops)."""
        from looplab.vllm_plugin.parallel import FOLDED

        self._folded_warm = self._folded_warm or positions.shape[-1] == 1
        if get_forward_context().attn_metadata is not None:
            FOLDED["forwards"] += 1
            FOLDED["tokens"] += positions.shape[0]
        # fresh tensors, not views of vLLM's persistent input buffers: the compiled step's guards would otherwise
        # tell the dummy run's whole buffer from a forward's slice of it and compile once more
        fresh = lambda t: None if t is None else t.clone()
        return self._folded_step(fresh(input_ids), fresh(positions), fresh(inputs_embeds))

    def _fold(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
              inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        from looplab.vllm_plugin.parallel import carried_in, keep_carry

        cfg, R, first_slot = self.cfg, self.cfg.n_loops, self.layout["block"]
        x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        for p, layer in enumerate(self.prelude):
            x = layer(x, positions, self.slots[self.layout["prelude"] + p])
        e, T = x, x.shape[0]
        carried, _ = carried_in(self.carry, e)  # (T, R − 1, d): every row is its request's first in this forward
        h = torch.cat([e] + [self.loop_input(e, carried[:, r - 1]) for r in range(1, R)])  # (R·T, d)
        rows = positions.repeat(R)
        for l, layer in enumerate(self.block):
            h = layer.forward_folded(h, rows, [self.slots[first_slot + l]] + [self.reads[r][l] for r in range(1, R)])
        norm = self.final_norm if getattr(cfg, "loop_norm", False) else None
        loops = h.view(R, T, -1)
        kept = [norm(loops[r]) if norm is not None else loops[r] for r in range(R - 1)]
        return keep_carry(self.carry, kept, self._head_input(loops[R - 1], positions, 0))

    def _head_input(self, z, positions, depth: int):
        """FinalNorm(Coda(z)) with depth `depth`'s coda slots."""
        C, start = self.cfg.coda_layers, self.layout["coda"]
        for c, layer in enumerate(self.coda):
            z = layer(z, positions, self.slots[start + depth * C + c])
        return self.final_norm(z)

    def head_input_rows(self, z, positions, depth: int, rows):
        """_head_input on the rows still looping (exits that skip compute): depth `depth`'s coda slots see every
        token, an exited one with its exit depth's keys and values."""
        C, start = self.cfg.coda_layers, self.layout["coda"]
        for c, layer in enumerate(self.coda):
            z = layer.forward_rows(z, positions, self.slots[start + depth * C + c], rows, ("coda", c))
        return self.final_norm(z)

    def _exit_step(self, r: int, hidden: torch.Tensor, state):
        """Ouro's exit rule, one depth at a time (looplab/models/exit_gate.py's exit_distribution and
        threshold_exit_steps in the same arithmetic order): λ_r = σ(gate(hidden_r)); p(r) = λ_r·S_{r−1} (r < R),
        p(R) = S_{R−1}; a token is read at the first depth whose CDF Σ p reaches q, else at R. state: (the hidden
        read so far (T, d), S_{r−1} (T,), CDF (T,), exited (T,) bool)."""
        R, q = self.cfg.n_loops, float(self.exit_threshold)
        if state is None:
            ones = hidden.new_ones(hidden.shape[0])
            state = (hidden, ones, torch.zeros_like(ones), torch.zeros_like(ones, dtype=torch.bool))
        chosen, survival, cdf, exited = state
        if r < R - 1:
            lam = torch.sigmoid(self.exit_gate.proj(hidden)[0].squeeze(-1))
            p = lam * survival
            survival = survival * (1 - lam)
        else:
            p = survival
        cdf = cdf + p
        now = ~exited & ((cdf >= q) | (r == R - 1))
        chosen = torch.where(now[:, None], hidden, chosen)
        return chosen, survival, cdf, exited | now


class LoopedLMForCausalLM(nn.Module):
    """vLLM's entry point for `architectures: ["LoopedLMForCausalLM"]` (registered by looplab.vllm_plugin)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg = vllm_config.model_config.hf_config
        self.config = cfg
        self.model = LoopedLMModel(vllm_config=vllm_config, prefix=_join(prefix, "model"))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.d_model, prefix=_join(prefix, "lm_head"))
        if cfg.tie_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed)
        self.logits_processor = LogitsProcessor(cfg.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if self.model.fold_this_forward():  # (outside the compiled graph: see forward_folded)
            return self.model.forward_folded(input_ids, positions, inputs_embeds)
        out = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        if self.model.fold and get_forward_context().attn_metadata is None and self.model.folded_step_cold:
            # vLLM's start-up dummy run (no metadata: attention and the carry compute nothing) compiles the
            # sequential forward; compile the folded step here too, not in the first requests' decoding steps:
            # at this T (a graph for every T >= 2) and at T = 1 (torch.compile specialises a size of 1)
            for rows in (slice(None), slice(0, 1)):
                self.model.forward_folded(None if input_ids is None else input_ids[rows], positions[..., rows],
                                          None if inputs_embeds is None else inputs_embeds[rows])
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The folder's tensors (looplab's names under `model.` and `lm_head`), each loaded once; the shared block's
        weights serve all of its slots. Every parameter must be given, and every tensor must have a parameter."""
        params = dict(self.named_parameters())
        renames = {}
        if isinstance(self.model.inject, Injection):
            renames["model.inject.weight"] = "model.inject.linear.weight"
        loaded: set[str] = set()
        for name, tensor in weights:
            name = renames.get(name, name)
            if name not in params:
                raise LoopRefused(f"weight {name!r} in the folder has no place in the vLLM model (a looplab feature "
                                  "the plugin does not build; docs/vllm.md)")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        if self.config.tie_embeddings:
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise LoopRefused(f"the folder has no weights for {missing}")
        return loaded


class LoopedLMParallelForCausalLM(LoopedLMForCausalLM, HasInnerState, IsHybrid):
    """The same model under loop_schedule=parallel: vLLM keeps its per-request carry (`LoopCarry`) as it keeps a
    Mamba layer's state, so the class declares the state's shape and dtype (vLLM sizes its cache from them)."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        from looplab.vllm_plugin.parallel import carry_shape

        return (carry_shape(vllm_config.model_config.hf_config),)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        from looplab.vllm_plugin.parallel import carry_dtype

        return (carry_dtype(vllm_config),)

    @classmethod
    def get_mamba_state_copy_func(cls):
        from looplab.vllm_plugin.parallel import copy_whole_state

        return (copy_whole_state,)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
