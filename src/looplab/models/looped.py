"""LoopedLM: a prelude, a block of N layers applied R times (N⊗R), and a coda (docs/formulations.md#looping).

    e = Prelude(Embed(tokens));  for r = 1..R:  h_r = Block(x_r),  x_1 = e
        vanilla:    x_{r+1} = h_r
        StateLoop:  s_r = update(s_{r−1}, h_r),  x_{r+1} = h_r + W_o s_r
        injection:  x_{r+1} ← Inject(x_{r+1}, e)     (r < R; none | add | concat | diag)
    logits = Head(FinalNorm(Coda(readout_R))),  readout_r = h_r (+ W_o s_r)

Prelude and coda (Huginn's prelude/core/coda; docs/formulations.md#prelude-and-coda): `prelude_layers` and `coda_layers`
non-shared layers of the block's kinds (hybrid: `hybrid_pattern` tiled over each); at the default
0 / 0 the model is exactly the plain N⊗R one (no parameters, no state-dict keys). The prelude runs
once per token; its output e is the first loop's input and what injection re-injects. The coda is
part of the readout, not of the recurrence: it never feeds back into the loop. Design choice: every
depth's readout passes through the same coda before the shared final norm and head, so per-depth
logits (`return_all_loops`), exit gates (λ_t reads FinalNorm(Coda(readout_t))), exit rules and the
StateLoop readout h_t + W_o s_t all see what the final prediction sees; a depth-t prediction is then
the model's own prediction at depth t (Huginn decodes intermediate depths this way too), and a gate
trained at depth t reads what the head reads. The cost: the coda runs at each depth whose output is
read (per-depth outputs, exit thresholds and rules, expected exit, gate training), and only on the
last readout otherwise. The coda at depth t sees its own inputs, so decoding keeps one coda cache
entry per (loop, coda layer) — `(r, ("coda", l))` — and one per prelude layer, `("prelude", l)`; the
coda entries of depth r < R are filled only by calls that read per-depth outputs, so one cache must
be used with or without them throughout (mixing is refused).

Order of operations in one loop r: the block, then the state branch (x_{r+1} = h_r + W_o s_r),
then the readout is taken (readout_r, what per-depth logits, exit gates and exit rules read), and
only then is the embedding injected into the next loop's input (models/injection.py). So readouts
never contain the injection, and nothing is injected after the last loop. The injection is run at
the start of loop r+1, inside that loop's gradient context: under truncated backprop the first
loop with a graph still sends gradients into the injection and the embedding.

The final norm and head are shared by every depth, so any loop's readout can
be decoded (per-depth metrics, exit gates). Plain PyTorch: no Lightning, Hydra
or data code is imported here.

Depth is a call-time knob (docs/formulations.md#depth-as-a-knob): `model(ids, n_loops=R′)` runs the shared block R′ times for
any R′ ≥ 1, also beyond the configured R (`None` = R); `allocate_cache(..., n_loops=R′)` sizes the
decoding caches for R′ and a cache only serves forwards at the depth it was allocated for. Beyond R
nothing changes in the equations: StateLoop keeps updating its per-token state, and the exit gate's
distribution is taken over the R′ loops actually run — p(t) = λ_t S_{t−1} for t < R′ and the last
step R′ takes the remaining mass S_{R′−1} — so `exit_threshold`, exit rules, `exit_min_loops` and
`exit_at_step` range over 1..R′. `backprop_loops=k` (randomized-depth training, Huginn's truncated
backprop) runs loops 1..R′−k under no_grad, so only the last k loops, the final norm, the head and
the gate get gradients; the earlier iterate enters loop R′−k+1 as a constant.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn as nn

from looplab.models.backbone import build_layer
from looplab.models.cache import LoopCache
from looplab.models.checkpointing import PER_LAYER, checkpoint_mode, checkpointed
from looplab.models.config import LoopedLMConfig
from looplab.models.exits import ExitPolicy, forward_with_skips, read_depths
from looplab.models.hub import LoopedHubMixin
from looplab.models.injection import build_injection
from looplab.models.inputs import check_inputs
from looplab.models.llama import RMSNorm
from looplab.models.loss import chunked_token_losses
from looplab.models.outputs import LoopedLMOutput
from looplab.models.registry import EXIT_GATES, LOOP_SCHEDULES, STATE_UPDATES
from looplab.models.rng import draw_init_seed, named_generator
from looplab.models.router import build_router
from looplab.models.stream import Stream

__all__ = ["LoopedLM", "LoopedLMOutput", "build_layer", "check_inputs"]


class LoopedLM(nn.Module, LoopedHubMixin):
    """N⊗R looped LM; `save_pretrained(dir)` / `from_pretrained(dir)` come from LoopedHubMixin (models/hub.py)."""

    def __init__(self, config: LoopedLMConfig):
        super().__init__()
        self.config = cfg = config
        # Common random numbers (models/rng.py): one draw from the global generator, then every
        # parameter from its own (seed, name) generator. The submodules' own default inits run on a
        # forked generator, so building a branch never moves the global stream either: two arms
        # built after the same seed leave it in the same state.
        self.init_seed = draw_init_seed()
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            # empty lists when 0: no parameters, no state-dict keys (a plain N⊗R checkpoint loads strictly)
            self.prelude = nn.ModuleList(build_layer(kind, cfg) for kind in cfg.prelude_layer_types)
            self.block = nn.ModuleList(build_layer(kind, cfg) for kind in cfg.layer_types)
            self.coda = nn.ModuleList(build_layer(kind, cfg) for kind in cfg.coda_layer_types)
            # the variants (models/registry.py): a registered class each, None where a choice builds nothing
            self.state = STATE_UPDATES.get(cfg.state_update)(cfg) if cfg.uses_state else None
            gate = EXIT_GATES.get(cfg.exit_gate)
            self.exit_gate = gate(cfg.d_model) if issubclass(gate, nn.Module) else None
            self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings:
                self.head.weight = self.embed.weight
            self.inject = build_injection(cfg)  # None: no parameters, no state-dict keys
            self.router = build_router(cfg)  # depth_router (models/router.py); None: no parameters, no state-dict keys
            # the loop schedule (models/schedule.py) may add modules: loop_schedule=parallel (models/parallel.py) adds
            # what loops 2..R read and G-SWA's gate in each block attention layer; None under the sequential schedule
            self.schedule = LOOP_SCHEDULES.get(cfg.loop_schedule)
            self.loop_input = None
            self.schedule.build(self)
        # set by the training config (hardware.activation_checkpointing; models/checkpointing.py): None, loop, layer, selective
        self.activation_checkpointing = None
        # forward(targets=...): tokens per chunk of the head + cross-entropy (None: models/loss.py's size rule)
        self.loss_chunk_tokens: int | None = None
        self._compiled_layers: list | None = None  # compile_block(); a plain list: no state-dict keys
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Every parameter from its own generator, seeded by (seed, its name) (models/rng.py): a
        parameter's initial values depend on the seed, its name and shape and its init rule alone,
        never on which other modules the model has. seed: the model's `init_seed` by default."""
        cfg = self.config
        seed = self.init_seed if seed is None else int(seed)
        self.init_seed = seed
        std = cfg.init_std or math.sqrt(2 / (5 * cfg.d_model))
        # residual writers are applied P + N·R + C times per forward, so scale by the effective depth
        out_std = std / math.sqrt(2 * (cfg.prelude_layers + cfg.n_layers * cfg.n_loops + cfg.coda_layers))
        for name, p in self.named_parameters():
            if p.dim() == 2 and not name.startswith(("state.state_out", "inject.")):
                s = out_std if name.endswith(("out_proj.weight", "down_proj.weight")) else std
                g = named_generator(seed, name, p.device)
                nn.init.trunc_normal_(p, std=s, a=-2 * s, b=2 * s, generator=g)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for mod_name, m in self.named_modules():
            if m is not self and hasattr(m, "reset_special_parameters"):
                # SSM A_log/dt/D and conv, state gate, zero W_o: a generator of the module's own name
                p = next(m.parameters(), None)
                m.reset_special_parameters(generator=named_generator(seed, mod_name, p.device if p is not None else None))

    # --------------------------------------------------------------- summary
    def num_parameters(self) -> dict[str, int]:
        def count(mod):
            return sum(p.numel() for p in mod.parameters()) if mod is not None else 0

        total = sum(p.numel() for p in self.parameters())
        return {
            "total": total,
            "embedding": self.embed.weight.numel(),
            "prelude": count(self.prelude),
            "block": count(self.block),
            "coda": count(self.coda),
            "state_branch": count(self.state),
            "exit_gate": count(self.exit_gate),
            "injection": count(self.inject),
            "non_embedding": total - self.embed.weight.numel(),
        }

    def flops_per_token(self, seq_len: int, training: bool = False, loops: float | None = None,
                        backprop_loops: float | None = None, all_readouts: bool = False,
                        loop_fractions: list[float] | None = None) -> int:
        """Analytic FLOPs per token counting every loop (unique parameters undercount a looped model).

        Forward: prelude + R·(Σ_layers + state branch) + readout, readout = coda + LM head: once (the
        last loop's, as a plain forward reads it) or, with `all_readouts`, at each of the R loops (a
        forward with per-depth outputs). Training counts backward as 2× forward; the prelude's and
        the readout's backward are counted in full. Attention scores are counted over all seq_len
        keys (the convention of FlopCounterMode). `loops` replaces R (a test-time depth, or a depth
        sampler's expected depth, hence a float); `backprop_loops` is the (expected) number of loops
        whose backward runs under truncated backprop (default: all of them).

        With a depth router (models/router.py; a training forward's routing) loop r runs on the fraction
        f_r of the T tokens that it gathers: `loop_fractions`, by default `RouterConfig.loop_fractions`
        (expert choice: capacity_r after the warm-up, k_r/T exactly; token choice: the balanced (R − r)/R).
        Per token of the sequence, loop r costs f_r · (the block at length L_r), where the seq-length term
        is counted over the keys a gathered query sees, all of them: kv=recursion_wise L_r = f_r·T (the
        k_r active tokens attend among themselves), kv=share_first L_r = f_0·T (loop 0's keys); the
        StateLoop branch (its attention mixer is recursion-wise under either kv mode) at f_r·T, the
        injection before loops 2..R at f_r. The router: expert choice a d→1 linear per loop on the tokens
        that ran the previous loop (f_{r−1}, f_{−1} = 1), and the auxiliary router's alike when it is on
        (its input is detached: its backward is its weight gradient, 1× forward); token choice one d→R
        linear on every token before loop 0. Top-k, sort, gather and scatter are not counted (no FLOPs
        for FlopCounterMode either). Truncated backprop: the last `backprop_loops` loops' backward, router
        included. A routed model runs R loops: `loops` must be None or R.
        """
        cfg = self.config
        if self.router is not None or loop_fractions is not None:
            return self._routed_flops(seq_len, training, loops, backprop_loops, all_readouts, loop_fractions)
        loops = cfg.n_loops if loops is None else loops
        per_loop = sum(layer.flops_per_token(seq_len) for layer in self.block)
        if self.state is not None:
            per_loop += self.state.flops_per_token(seq_len)
        prelude = sum(layer.flops_per_token(seq_len) for layer in self.prelude)
        readout = sum(layer.flops_per_token(seq_len) for layer in self.coda) + 2 * cfg.d_model * cfg.vocab_size
        readout *= loops if all_readouts else 1
        inj = self.inject.flops_per_token() if self.inject is not None else 0  # before loops 2..R
        # what the schedule adds in loops 2..R (parallel G-SWA: a window of w keys and the gate)
        inj += self.schedule.loop_flops(self, seq_len)
        fwd = prelude + loops * per_loop + max(loops - 1, 0) * inj + readout
        if not training:
            return round(fwd)
        back = loops if backprop_loops is None else min(backprop_loops, loops)
        return round(fwd + 2 * (prelude + back * per_loop + min(back, max(loops - 1, 0)) * inj + readout))

    def _routed_flops(self, seq_len, training, loops, backprop_loops, all_readouts, loop_fractions) -> int:
        """flops_per_token of a depth-routed model (its docstring says what is counted)."""
        cfg, rt = self.config, self.router
        R = cfg.n_loops
        if rt is None:
            raise ValueError("loop_fractions= counts a depth-routed model's loops; this model has depth_router=none")
        if loops is not None and loops != R:
            raise ValueError(f"depth_router={rt.cfg.name} runs R={R} loops; flops_per_token(loops={loops}) is not "
                             "a depth it runs (give loops=None)")
        fr = [float(f) for f in (rt.cfg.loop_fractions(R, seq_len) if loop_fractions is None else loop_fractions)]
        if len(fr) != R or any(not 0 <= f <= 1 for f in fr):
            raise ValueError(f"loop_fractions={fr}: give R={R} fractions in [0, 1]")
        d = cfg.d_model
        share = rt.cfg.kv == "share_first"
        prelude = sum(layer.flops_per_token(seq_len) for layer in self.prelude)
        readout = sum(layer.flops_per_token(seq_len) for layer in self.coda) + 2 * d * cfg.vocab_size
        readout *= R if all_readouts else 1
        inj = self.inject.flops_per_token() if self.inject is not None else 0
        loop_f, aux_f = [], []
        for r, f in enumerate(fr):
            keys = (fr[0] if share and r > 0 else f) * seq_len
            block = sum(layer.flops_per_token(keys) for layer in self.block)
            if self.state is not None:
                block += self.state.flops_per_token(f * seq_len)
            router, aux = rt.loop_flops(r, fr, d)  # the router's own scoring at loop r (models/router.py)
            loop_f.append(f * (block + (inj if r > 0 else 0)) + router)
            aux_f.append(aux)
        fwd = prelude + sum(loop_f) + sum(aux_f) + readout
        if not training:
            return round(fwd)
        back = R if backprop_loops is None else min(backprop_loops, R)
        w = [min(1.0, max(0.0, back - (R - 1 - r))) for r in range(R)]  # the last `back` loops get a backward
        return round(fwd + 2 * (prelude + readout + sum(wr * lf for wr, lf in zip(w, loop_f)))
                     + sum(wr * af for wr, af in zip(w, aux_f)))

    # ----------------------------------------------------------------- cache
    def allocate_cache(self, batch_size: int, max_len: int, device=None, dtype=None, n_loops: int | None = None,
                       static: bool = False) -> LoopCache:
        """Caches for decoding at depth n_loops (default R): one entry per (loop, layer), one per
        prelude layer ("prelude", l) and one per (loop, coda layer) (r, ("coda", l)). max_len is at
        most max_seq_len, so the positions a cache hands out need no bound check (RoPE skips it).
        static=True: fixed-shape reads (a compiled or CUDA-graph step; attention layers only).
        With a depth router the block's (and the StateLoop mixer's) entries are RoutedKVCaches (attention)
        or RoutedSSMCaches (Mamba-2) holding only the tokens that reached their loop; kv=share_first keeps
        loop 0's attention entries only."""
        if max_len > self.config.max_seq_len:
            raise ValueError(f"allocate_cache(max_len={max_len}) exceeds max_seq_len={self.config.max_seq_len}; "
                             "decode fewer tokens or raise backbone.max_seq_len")
        p = self.head.weight
        device, dtype = device or p.device, dtype or p.dtype
        entries = {("prelude", l): layer.allocate_cache(batch_size, max_len, device, dtype)
                   for l, layer in enumerate(self.prelude)}
        rt = self.router
        R = self.loops(n_loops)
        own = self.schedule.allocate_cache(self, batch_size, max_len, device, dtype, R, static)
        if own is not None:  # a schedule's own layout (parallel: one entry per block layer for every loop)
            return own
        for r in range(R):
            for l, layer in enumerate(self.block):
                if rt is None:
                    entries[(r, l)] = layer.allocate_cache(batch_size, max_len, device, dtype)
                elif r == 0 or not rt.shares_first(layer):
                    entries[(r, l)] = rt.allocate_entry(layer, batch_size, max_len, device, dtype)
            if self.state is not None and self.state.mixer is not None:
                entries[(r, "state")] = (self.state.allocate_cache(batch_size, max_len, device, dtype) if rt is None
                                         else rt.allocate_entry(self.state.mixer, batch_size, max_len, device, dtype))
            for l, layer in enumerate(self.coda):
                entries[(r, ("coda", l))] = layer.allocate_cache(batch_size, max_len, device, dtype)
        return LoopCache(entries, batch_size, max_len, device, n_loops=R, static=static)

    def loops(self, n_loops: int | None = None) -> int:
        """The depth a call runs: n_loops (any R′ ≥ 1, also beyond the trained R) or the config's R."""
        if n_loops is None:
            return self.config.n_loops
        if isinstance(n_loops, bool) or not isinstance(n_loops, int) or n_loops < 1:
            raise ValueError(f"n_loops={n_loops!r} must be an integer >= 1 (the number of loops to run; None = "
                             f"the configured R={self.config.n_loops})")
        return n_loops

    # ------------------------------------------------- activation checkpointing
    @property
    def activation_checkpointing(self) -> str | None:
        """None, 'loop', 'layer' or 'selective' (models/checkpointing.py); set from any value `checkpoint_mode` takes."""
        return self._ac_mode

    @activation_checkpointing.setter
    def activation_checkpointing(self, value) -> None:
        self._ac_mode = checkpoint_mode(value)

    @property
    def checkpoint_loops(self) -> bool:
        """The per-loop checkpoint (activation_checkpointing='loop'); True/False sets it (the older knob)."""
        return self._ac_mode == "loop"

    @checkpoint_loops.setter
    def checkpoint_loops(self, value: bool) -> None:
        self._ac_mode = "loop" if value else None

    def per_layer_checkpoint(self, cache=None) -> bool:
        """Whether this call's layers are checkpointed one by one (layer / selective, a training forward with a
        graph and no decoding cache)."""
        return self._ac_mode in PER_LAYER and cache is None and self.training and torch.is_grad_enabled()

    def apply_layer(self, layer: Callable, *args, **kwargs):
        """layer(*args, **kwargs), under its own checkpoint when per-layer activation checkpointing is on. Every
        layer application of a training forward goes through here: prelude, block, coda, the state update, the
        parallel schedule's block layers and the exit reference's frozen-input calls."""
        if self.per_layer_checkpoint():
            return checkpointed(layer, *args, selective=self._ac_mode == "selective", **kwargs)
        return layer(*args, **kwargs)

    def token_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy (fp32, 0 at ignored targets) of Head(hidden) without the (…, V) logits of all
        tokens at once (models/loss.py): hidden (…, d) after the final norm, targets (…)."""
        return chunked_token_losses(self.head, hidden, targets, self.loss_chunk_tokens)

    # --------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T)
        *,
        attention_mask: torch.Tensor | None = None,  # (B, T), 1 = real token, 0 = (left) padding
        cache: LoopCache | None = None,
        n_loops: int | None = None,
        backprop_loops: int | None = None,
        return_all_loops: bool = False,
        return_diagnostics: bool = False,
        exits: ExitPolicy | None = None,
        depths: torch.Tensor | str | None = None,  # depth_router only: 'inference' or (B, T) given depths (models/router.py)
        targets: torch.Tensor | None = None,  # (B, T) next-token targets (-100: no loss): a training loss, see below
    ) -> LoopedLMOutput:
        """The loops and the readout; which depth each token reads is the ExitPolicy's (models/exits.py).

        targets: the output holds each token's cross-entropy (`token_loss` (B, T) fp32, 0 where the target is -100;
        with return_all_loops also `loop_token_loss` (R′, B, T); with an exit policy that skips compute, the loss
        at each token's exit) and no logits: the head and cross-entropy run in chunks of tokens (models/loss.py),
        so the (B, T, V) logits of the whole call never exist at once."""
        if targets is not None and cache is not None:
            raise ValueError("forward(targets=...) is a training loss; a decoding call (cache=) reads logits")
        # a cached call is a decoder's: its prompt was checked once (generate, Engine.add), its later tokens are the
        # model's own, so only the shapes are checked here (no host sync in a decoding step); a cache-free call's T
        # bounds its RoPE positions; a training forward checks the ids on the device (no host sync in a training step)
        check_inputs(input_ids, attention_mask, self.config.vocab_size, values=cache is None,
                     max_len=self.config.max_seq_len if cache is None else None, on_device=self.training)
        if not self.schedule.sequential:  # its own forward over the sequence (loop_schedule=parallel: models/parallel.py)
            return self.schedule.forward(self, input_ids, attention_mask, cache, n_loops, backprop_loops=backprop_loops,
                                         return_all_loops=return_all_loops, exits=exits, depths=depths,
                                         **({"targets": targets} if targets is not None else {}))
        if self.router is not None:
            self.router.check_call(n_loops, cache, exits, depths)
        elif depths is not None:
            raise ValueError("depths= routes tokens by a depth router; this model has depth_router=none")
        if exits is not None and exits.skip is not None:
            # the exit-aware reference is a forward of the model itself, so whatever wraps forward
            # (FSDP2's root all-gather, DDP) wraps it too
            return forward_with_skips(self, input_ids, attention_mask, exits, n_loops, targets=targets, cache=cache,
                                      return_diagnostics=return_diagnostics, backprop_loops=backprop_loops)
        R = self.loops(n_loops)
        if cache is not None:
            cache.check_depth(R)
        positions, valid = self.positions(input_ids, attention_mask, cache)
        stream = self.start(input_ids, positions, valid, cache)
        route = self.router.begin(self, stream.x, depths, cache) if self.router is not None else None  # models/router.py
        readouts, diag = [], {"retention": [], "state_norm": [], "state_to_stream": []}

        def after(r, st, rows):
            readouts.append(self.readout(st))
            if return_diagnostics and st.retention is not None:
                with torch.no_grad():
                    diag["retention"].append(st.retention.mean().item())
                    diag["state_norm"].append(st.s.norm(dim=-1).mean().item())
                    diag["state_to_stream"].append(((st.x - st.h).norm() / st.h.norm().clamp_min(1e-12)).item())

        self.run_loops(stream, range(R), cache, step=route.loop_step if route else None,
                       rows=route.rows if route else None, after=after,
                       no_grad_loops=self._no_grad_loops(R, backprop_loops))
        diagnostics = {k: v for k, v in diag.items() if v}
        out = read_depths(self, readouts, exits, return_all_loops, positions, valid, cache, diagnostics, targets)
        out.routing = route.finish() if route is not None else None
        return out

    # ---------------------------------------------------- the loop body, once
    def start(self, input_ids: torch.Tensor, positions, valid, cache=None) -> Stream:
        """Embed → prelude → s_0: the first loop's input (the prelude runs once per token, no exits there)."""
        x = self.embed(input_ids)
        for l, layer in enumerate(self._train_layers("prelude", cache)):
            x = (self.apply_layer(layer, x, positions, valid, None) if cache is None
                 else layer(x, positions, valid, cache["prelude", l]))
        s = self.state.initial_state(x) if self.state is not None else None
        return Stream(x=x, e=x, s=s, h=None, positions=positions, valid=valid)

    def run_loops(self, stream: Stream, loops: range, cache=None, *, step: Callable | None = None,
                  rows: Callable | None = None, after: Callable | None = None, no_grad_loops: int = 0) -> Stream:
        """Loops `loops` (0-based) over the stream: the only driver of the shared block. Forward, prefill, plain,
        draft, verify, skip and routed decoding all run their loops here.

        step(stream, r, cache) → stream: one loop (default `loop_step`; a depth router's routed step).
        rows(r, stream) → None (every row runs loop r) or a (b′,) index tensor of the rows that do — the
        others keep their stream and are not computed (an exited or stopped token; b′ may be 0); the cache
        covers only those rows meanwhile (`LoopCache.restrict`).
        after(r, stream, rows): once loop r has run (readouts, exit decisions), with the merged stream.
        no_grad_loops: truncated backprop, the first loops run without a graph (their output a constant)."""
        step = step or self.loop_step
        for r in loops:
            with torch.no_grad() if r < no_grad_loops else contextlib.nullcontext():
                idx = rows(r, stream) if rows is not None else None
                if idx is None:
                    stream = step(stream, r, cache)
                elif idx.numel():
                    with cache.restrict(idx) if cache is not None else contextlib.nullcontext():
                        sub = step(stream.select(idx), r, cache)
                    stream = stream.merge(idx, sub)
                if after is not None:
                    after(r, stream, idx)
        return stream

    def loop_step(self, st: Stream, r: int, cache=None, gate=None, call=None) -> Stream:
        """Loop r (0-based), as the loop schedule runs it (models/schedule.py; sequential: `loop_body`). Every
        driver — forward, prefill, every decoder, the exit reference, routing — runs a loop through here.
        gate(x, h): a depth router's weighting of the block's update; call(layer, key, x, positions, valid,
        entry): how each layer is applied (the exit reference's frozen inputs, models/exit_compute.py)."""
        return self.schedule.step(self, st, r, cache, gate=gate, call=call)

    def loop_body(self, st: Stream, r: int, cache=None, gate=None, call=None) -> Stream:
        """One loop r (0-based): re-inject e (r > 0), apply the block, update the state branch."""
        x = st.x
        if self.inject is not None and r > 0:
            x = self.inject(x, st.e)
        h = self._run_block(x, r, st.positions, st.valid, cache, call)
        if gate is not None:
            h = gate(x, h)
        if self.state is None:
            return Stream(h, st.e, None, h, st.positions, st.valid)
        if cache is None and call is None:  # per-layer checkpointing: the state update is one unit
            s, x, a = self.apply_layer(self.state, h, st.s, st.positions, st.valid, None)
        else:  # the exit reference's call applies (and checkpoints) the state mixer itself
            s, x, a = self.state(h, st.s, st.positions, st.valid, cache.get((r, "state")) if cache is not None else None,
                                 call=call)
        return Stream(x, st.e, s, h, st.positions, st.valid, a)

    def readout(self, st: Stream) -> torch.Tensor:
        """What a loop's prediction reads: h_r + W_o s_r under StateLoop (state_in_output), else h_r."""
        return st.x if self.state is not None and self.config.state_in_output else st.h

    def coda_at(self, z, r: int, positions, valid, cache=None, call=None) -> torch.Tensor:
        """The coda on loop r's readout z (0-based r), with that depth's coda caches."""
        for l, layer in enumerate(self._train_layers("coda", cache, call)):
            key = ("coda", l)
            entry = None
            if cache is not None:
                entry = cache[r, key]
                cache.check_filled((r, key), entry)
            if call is not None:
                z = call(layer, key, z, positions, valid, entry)
            else:
                z = self.apply_layer(layer, z, positions, valid, None) if entry is None else layer(z, positions, valid, entry)
        return z

    def logits_at(self, z, r: int, positions, valid, cache=None) -> torch.Tensor:
        """Head(FinalNorm(Coda(readout))) of loop r's readout z (b, T, d), with depth r's coda caches."""
        return self.head(self.final_norm(self.coda_at(z, r, positions, valid, cache)))

    def positions(self, input_ids, attention_mask=None, cache=None):
        """RoPE positions (b|1, T) and validity (b, T) (None = all real) of a call's tokens; with a cache they
        continue each row's own tokens (`LoopCache.advance`)."""
        if cache is not None:
            return cache.advance(attention_mask, input_ids.shape[1])
        T = input_ids.shape[1]
        if attention_mask is None:
            return torch.arange(T, device=input_ids.device)[None], None
        valid = attention_mask.to(torch.bool)
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        return positions, (None if bool(valid.all()) else valid)

    @staticmethod
    def _no_grad_loops(R: int, backprop_loops: int | None) -> int:
        """How many leading loops run under no_grad when only the last `backprop_loops` get gradients."""
        if backprop_loops is None:
            return 0
        if isinstance(backprop_loops, bool) or not isinstance(backprop_loops, int) or backprop_loops < 1:
            raise ValueError(f"backprop_loops={backprop_loops!r} must be an integer >= 1 (or None = every loop)")
        return max(0, R - backprop_loops)

    def _run_block(self, x, r, positions, valid, cache, call=None):
        """One application of the shared block (loop r); per-loop activation checkpointing (activation_checkpointing
        = 'loop') trades recomputation for memory that otherwise grows with N·R; per-layer ('layer', 'selective')
        happens in _block_forward."""
        if self._ac_mode == "loop" and self.training and cache is None and call is None and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._block_forward, x, positions, valid, None, r, use_reentrant=False)
        return self._block_forward(x, positions, valid, cache, r, call)

    def compile_block(self, **compile_kwargs) -> None:
        """`torch.compile` each block layer once for training; the R loops reuse the compiled code. The prelude
        and coda layers are compiled too: layers of one kind share their graph (Dynamo traces a layer class's
        forward once and guards on shapes, not on which layer or loop calls it: tests/test_compiled_training.py).

        Only cache-free training forwards use it. Evaluation, scoring and cached decoding keep
        the eager layers: their shapes change from call to call, and each new shape would be
        another compilation (a compiled decoding step is models/generation.py's, over a static cache).
        Parameters stay shared with the eager layers (same state dict).
        """
        refused = self.config.unsupported("compile_training")
        if refused:
            raise ValueError(f"compile_block with {refused}")
        self._compiled_layers = [torch.compile(layer, **compile_kwargs) for layer in self.block]
        # plain lists in a dict: no submodules, no state-dict keys
        self._compiled_ends = {part: [torch.compile(layer, **compile_kwargs) for layer in getattr(self, part)]
                               for part in ("prelude", "coda")}

    def _train_layers(self, part: str, cache=None, call=None):
        """The prelude's or coda's layers as this call runs them: compiled (compile_block) in a cache-free training
        forward, the eager modules otherwise."""
        ends = self.__dict__.get("_compiled_ends")
        if ends is not None and self.training and cache is None and call is None:
            return ends[part]
        return getattr(self, part)

    @property
    def is_compiled(self) -> bool:
        return self._compiled_layers is not None

    def _block_forward(self, x, positions, valid, cache, r, call=None):
        compiled = self._compiled_layers is not None and self.training and cache is None and call is None
        per_layer = call is None and self.per_layer_checkpoint(cache)
        for l, layer in enumerate(self._compiled_layers if compiled else self.block):
            entry = cache[r, l] if cache is not None else None
            if call is not None:
                x = call(layer, l, x, positions, valid, entry)
            elif per_layer:
                x = checkpointed(layer, x, positions, valid, None, selective=self._ac_mode == "selective")
            else:
                x = layer(x, positions, valid, entry)
        return x

    # -------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **options):
        """Cached generation; see looplab.models.generation.generate for the options (keyword-only groups)."""
        from looplab.models.generation import generate

        return generate(self, input_ids, max_new_tokens, **options)

    @torch.no_grad()
    def stream(self, input_ids: torch.Tensor, max_new_tokens: int, **options):
        """Token-by-token generation; the options of `generate`."""
        from looplab.models.generation import stream

        return stream(self, input_ids, max_new_tokens, **options)
