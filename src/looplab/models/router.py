"""Depth routers (Mixture-of-Recursions; docs/formulations.md#routed-depth): a router picks, at every loop, the tokens that run it.

    expert_choice   loop r keeps the top-k_r of the tokens that ran loop r−1, k_r = ⌊capacity_r · T⌋
                    (MoR's default capacity_r = (R − r)/R, r = 0..R−1), scored by a linear router per loop:
                    w = scale · act(W_r x / temperature), act = sigmoid | tanh
    token_choice    one depth per token up front: p = softmax(W x_1 / temperature), depth = argmax p,
                    w = scale · p[depth]; loop r runs the tokens whose depth exceeds r

A selected token's update is weighted by its router weight (gating=weighted, MoR's default):
update=mor (MoR's code and paper) h_r = x + w·Block(x), update=delta (MoD's form) h_r = x + w·(Block(x) − x).
A token that is not selected skips the loop entirely: its h, its stream x and its StateLoop state s stay
as they were, so its readout (per-depth logits, the final logits) is the one of the last loop it ran.

Compute is really saved: the selected tokens are gathered, kept in causal (original) order, run
through the block (and the state branch) at reduced length, and scattered back. kv=recursion_wise:
inside the block, depth r's active tokens attend only to each other, with their ORIGINAL positions
for RoPE and a causal mask by original position (the gathered order is the original order, so the
plain causal mask over the gathered sequence is exactly that). Token choice pads rows of fewer active
tokens with inactive ones placed after every active one, so no active token ever sees them; their
outputs are discarded at the scatter. kv=share_first: every loop after the first reuses the first loop's
keys/values (of the tokens that ran it) in each attention layer: loop r's active tokens are the queries,
attending to the first loop's keys at original positions <= theirs (only the queries are reduced; the
StateLoop attention mixer keeps attending over the routed tokens).

Mamba-2 layers (backbone mamba2 / hybrid, and the stateloop_mamba2 mixer) are
recursion-wise: loop r's causal conv and SSM scan run over the gathered subsequence of tokens active at
loop r, so a token that stopped before loop r neither updates loop r's SSM state nor enters its conv
window — it leaves nothing for the tokens behind it, as it leaves no key in recursion_wise attention.
The SSM half is exit_compute's ssm_skip (dt = 0: no decay, no write); unlike ssm_skip, which keeps an
exited token's frozen conv input in the deeper loops' conv windows (it does not gather), the conv here
runs over the active tokens only, which the gather gives for free and which keeps the SSM and attention
layers of a hybrid block seeing the same tokens at each depth. Padded slots (inactive tokens) always
come after every active token of their row (`active_slots`), and reach the layer as padding (`valid`
False: conv input, x, B and dt zeroed), so a causal scan and conv never carry them into an active token;
a masked slot between two active ones would still sit in the conv window. kv=share_first changes the
attention layers only: Mamba-2 layers keep their recursion-wise state (a recurrent state is not a set of
keys a later loop could attend to), and a block without attention layers refuses share_first.

Expert choice is not causal (the top-k of a sequence depends on later tokens). MoR's two remedies are
offered as losses: `aux_loss_coeff` · BCE(main router logit, top-k membership), and with `aux_router`
a separate linear classifier per loop, fed the detached input, trained with `aux_router_coeff` · BCE to
predict membership (what a causal decoder would use). `z_loss_coeff` · mean(logsumexp(logits)²) is the
optional router z-loss; token choice adds `balancing_loss_coeff` · Σ_i P_i·f_i (P_i mean probability of
depth i, f_i = R · fraction of tokens assigned to depth i). The losses (already weighted) come back in
`LoopedLMOutput.routing.losses`; the training module adds them to the loss and logs them.

Causal routing and cached decoding (docs/decoding.md#routed-decoding). Top-k needs the whole sequence, so decoding
routes each new token on its own: expert choice by `inference` (aux_router: the auxiliary classifier's
logit > 0; threshold: sigmoid(main router logit) >= `inference_threshold`; default aux_router when the
aux router is on, else threshold at 0.5, the probability the aux_loss BCE calibrates), a token that is
not selected at loop r stops (MoR), a loop of capacity 1 runs every token that reached it; token choice
by its argmax depth (already causal). Each token gets a depth d_t (1..R at MoR's capacities). The same
rule runs in a cache-free forward with `depths="inference"`, and `depths=D` (B, T) runs GIVEN depths:
loop r runs the tokens with d_t > r (0-based r), with the same gather/scatter and kv modes — the
reference that cached decoding equals given the same decisions (`out.routing.depth` reports them).
With a cache (LoopedLM.allocate_cache) each (loop, layer) entry is a cache.RoutedKVCache holding only
the tokens that ran that loop (recursion_wise: its own length per depth; share_first: loop 0's entries
only, read by every loop), or, in a Mamba-2 layer, a cache.RoutedSSMCache: that loop's conv history and
SSM state over the tokens that ran it (a row whose token stopped keeps both bit for bit). Prefill and
steps are calls of the same routed forward. Compute: a loop that no token of the call runs is skipped,
and at one token per row (a decoded token) a loop runs only the rows whose token goes that deep
(`RoutedLoop.rows`: gathered, their cache entries indexed); in a prefill a loop runs the rows with some
token that runs it, and their stopped tokens compute one discarded slot that writes nothing.

The loop calls `RoutedLoop.loop_step` in place of `LoopedLM.loop_step` (same signature), which gathers,
calls the model's own loop_step on the active tokens, and scatters back. Not yet supported, and refused
with the option named: kv=share_first without an attention layer in the block, the exit gate, exits
(`ExitPolicy`) with a cache or a skip handling, speculation, compile, a call depth n_loops ≠ R.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from looplab.models.config import ROUTER_KV, ConfigError, LoopedLMConfig
from looplab.models.registry import DEPTH_ROUTERS, Supports, Variant, named_option as _named
from looplab.models.stream import Stream


@dataclass
class RoutingInfo:
    """What a routed forward decided. losses: weighted auxiliary losses to add to the training loss;
    depth (B, T): how many loops each token ran (1-based; 0 = none); selected: per loop, the (B, k)
    original positions gathered for it (None = every token; token choice pads rows with tokens that do
    not run it); ran: per loop, the (B, T) mask of tokens that ran it; active_frac: per loop."""

    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    depth: torch.Tensor | None = None
    selected: list[torch.Tensor | None] = field(default_factory=list)
    ran: list[torch.Tensor] = field(default_factory=list)
    active_frac: list[float] = field(default_factory=list)


def gather_tokens(t: torch.Tensor | None, idx: torch.Tensor | None) -> torch.Tensor | None:
    """t (B|1, T, ...) at the (B, k) positions idx; None idx = every token."""
    if t is None or idx is None:
        return t
    B = idx.shape[0]
    t = t.expand(B, *t.shape[1:])
    if t.dim() == 2:
        return t.gather(1, idx)
    return t.gather(1, idx[..., None].expand(-1, -1, *t.shape[2:]))


def scatter_tokens(full: torch.Tensor, idx: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """full with the (B, k) positions idx replaced by part (out of place, differentiable in both)."""
    if idx is None:
        return part
    return full.scatter(1, idx[..., None].expand(-1, -1, full.shape[-1]), part)


def _linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)  # MoR's linear router: no bias


_ROUTED = "routed decoding runs plain greedy/sampled steps (each token's depth is the router's); decode without it, " \
          "or use depth_router=none"


@DEPTH_ROUTERS.register("none")
class NoRouter(Variant):
    """Every token runs every loop: no router, no parameters, no state-dict keys."""

    supports = Supports(parallel_loops=True, export=True)


class DepthRouter(nn.Module, Variant):
    """Shared by both routers: the per-forward RoutedLoop, the refusals, the training step (for warm-ups).
    `train_step` is a plain attribute (no state-dict key), set by the training module every step."""

    supports = Supports(
        compile=_ROUTED, speculation=_ROUTED, exits=_ROUTED,
        parallel_loops="routing's kv=share_first and per-token depths are a different scheme; use depth_router=none",
        depth_sampling="the router is trained for the configured R loops; use loop_depth.sampler=fixed and "
                       "eval_loops=null",
        test_depth="the router is trained for the configured R loops (capacities / depths per loop); call with "
                   "n_loops=None",
        export="routed depth is not in the exported code")

    @classmethod
    def validate(cls, cfg: LoopedLMConfig) -> None:
        """Refuse, naming the field, a router configuration this model cannot run (LoopedLMConfig.validate calls it)."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        rc = cfg.depth_router
        r = f"depth_router={rc.name}"
        reason = cfg.unsupported("routing")
        need(reason is None, f"{r} with {reason}")
        need(rc.kv in ROUTER_KV, f"depth_router.kv={rc.kv!r} is unknown; choose one of {ROUTER_KV}")
        # Mamba-2 layers (backbone mamba2 / hybrid, the stateloop_mamba2 mixer) are recursion-wise under
        # either kv mode: loop r's scan and conv run over the tokens active at loop r. share_first only
        # changes attention layers, so a block without one would silently run recursion_wise.
        need(rc.kv != "share_first" or "kv" in cfg.cache_kinds(block_only=True),
             f"depth_router.kv=share_first with backbone={cfg.backbone} (block layers {cfg.layer_types!r}): "
             f"share_first reuses the first loop's attention keys/values and this block has no attention layer "
             f"(Mamba-2 layers keep a recursion-wise state); use depth_router.kv=recursion_wise")
        need(rc.router_type == "linear", f"depth_router.router_type={rc.router_type!r}: only 'linear' is offered")
        acts = cls.ACTIVATIONS
        need(rc.activation in acts, f"depth_router.activation={rc.activation!r} with {r}: choose one of {acts}")
        need(rc.gating in ("weighted", "hard"), f"depth_router.gating={rc.gating!r}: choose weighted or hard")
        need(rc.update in ("mor", "delta"), f"depth_router.update={rc.update!r}: choose mor or delta")
        for name in ("temperature", "scale"):
            v = getattr(rc, name)
            need(isinstance(v, (int, float)) and v > 0, f"depth_router.{name}={v!r} must be a positive number")
        for name in ("aux_loss_coeff", "aux_router_coeff", "z_loss_coeff", "balancing_loss_coeff"):
            v = getattr(rc, name)
            need(isinstance(v, (int, float)) and v >= 0, f"depth_router.{name}={v!r} must be a number >= 0")
        need(not rc.aux_router or (cls is ExpertChoiceRouter and rc.aux_router_coeff > 0),
             f"depth_router.aux_router=true with {r}, aux_router_coeff={rc.aux_router_coeff}: the auxiliary router is "
             "an expert_choice option and learns only from its BCE loss; set aux_router_coeff > 0 (MoR: 0.001)")
        need(isinstance(rc.capacity_warmup_steps, int) and rc.capacity_warmup_steps >= 0,
             f"depth_router.capacity_warmup_steps={rc.capacity_warmup_steps!r} must be an integer >= 0")
        cls.validate_own(cfg, need)

    @classmethod
    def validate_own(cls, cfg: LoopedLMConfig, need) -> None:
        """The router's own options (capacity, inference rule)."""

    def loop_flops(self, r: int, fractions: list[float], d: int) -> tuple[float, float]:
        """Forward FLOPs per token of the router's scoring at loop r (0-based) and of its auxiliary router, given
        the fraction of tokens that runs each loop."""
        raise NotImplementedError

    @classmethod
    def capabilities(cls, config) -> Supports:
        if config.depth_router.kv == "recursion_wise":
            return cls.supports
        return replace(cls.supports, depthwise=f"depth_router.kv={config.depth_router.kv!r}: depth-wise batching runs "
                       "recursion-wise routed caches (each loop's own tokens); use schedule='lockstep'")

    def __init__(self, cfg: LoopedLMConfig):
        super().__init__()
        self.cfg = cfg.depth_router
        self.n_loops = cfg.n_loops
        self.train_step = 0

    def check_call(self, n_loops: int | None, cache, exits=None, depths=None) -> None:
        name = f"depth_router={self.cfg.name}"
        if exits is not None and exits.skip is not None:
            raise ValueError(f"{name} with {_named('exits', exits)} (skip_compute): the router already chooses "
                             "each token's depth")
        if cache is not None and exits is not None:
            raise ValueError(f"{name} with a cache and {_named('exits', exits)}: "
                             "routed decoding reads the last loop each token ran; decode without exit options")
        if n_loops is not None and n_loops != self.n_loops:
            raise ValueError(f"{name} with n_loops={n_loops}: the router is trained for R={self.n_loops} loops "
                             f"(capacities / depths per loop); call with n_loops=None or {self.n_loops}")
        if depths is not None and not (isinstance(depths, torch.Tensor) or depths == "inference"):
            raise ValueError(f"{name}: depths={depths!r} must be None (training's routing; a cached call: the "
                             "inference router), 'inference' or a (B, T) tensor of per-token depths in 0..R")
        if cache is not None:
            from looplab.models.cache import RoutedKVCache, RoutedSSMCache

            if not isinstance(cache.get((0, 0)), (RoutedKVCache, RoutedSSMCache)):
                raise ValueError(f"{name}: the cache must come from this model's allocate_cache (per-depth routed "
                                 "KV / SSM caches)")

    def allocate_entry(self, module, batch_size: int, max_len: int, device, dtype):
        """The routed cache of one (loop, layer) or StateLoop mixer: module is a block layer or a mixer."""
        from looplab.models.cache import RoutedKVCache, RoutedSSMCache
        from looplab.models.mamba2 import Mamba2Layer, Mamba2Mixer

        if isinstance(module, (Mamba2Layer, Mamba2Mixer)):
            mixer = getattr(module, "mixer", module)
            base = mixer.allocate_cache(batch_size, max_len, device, dtype)
            return RoutedSSMCache(conv_state=base.conv_state, ssm_state=base.ssm_state)
        attn = getattr(module, "attn", module)
        return RoutedKVCache(batch_size, attn.n_kv_heads, max_len, attn.head_dim, device, dtype)

    def shares_first(self, module) -> bool:
        """kv=share_first reuses loop 0's keys/values in attention only; a Mamba-2 layer keeps its own
        recursion-wise state at every loop (there are no keys to share, only a scan over the active tokens)."""
        return self.cfg.kv == "share_first" and getattr(module, "supports", None) is not None \
            and module.supports.cache == "kv"

    def begin(self, model, x: torch.Tensor, depths=None, cache=None) -> "RoutedLoop":
        return RoutedLoop(self, model, x, depths, cache)

    def weight(self, probs: torch.Tensor) -> torch.Tensor:
        return probs if self.cfg.gating == "weighted" else torch.ones_like(probs)

    def z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(logits.float(), dim=-1).square().mean()


@DEPTH_ROUTERS.register("expert_choice")
class ExpertChoiceRouter(DepthRouter):
    ACTIVATIONS = ("sigmoid", "tanh")

    def loop_flops(self, r, fractions, d):
        cand = 1.0 if r == 0 else fractions[r - 1]  # loop r scores the tokens that ran the previous loop
        aux_on = getattr(self, "aux_routers", None) is not None and self.cfg.aux_router_coeff > 0
        return 2 * d * cand, (2 * d * cand if aux_on else 0)

    @classmethod
    def validate_own(cls, cfg, need):
        rc, r = cfg.depth_router, f"depth_router={cfg.depth_router.name}"
        need(rc.inference in ("aux_router", "threshold"),
             f"depth_router.inference={rc.inference!r}: choose aux_router or threshold")
        need(rc.inference != "aux_router" or rc.aux_router,
             "depth_router.inference=aux_router needs depth_router.aux_router=true (the classifier it reads)")
        need(isinstance(rc.inference_threshold, (int, float)) and 0 < rc.inference_threshold < 1,
             f"depth_router.inference_threshold={rc.inference_threshold!r} must lie in (0, 1)")
        need(cfg.n_loops >= 2, f"{r} needs loop_depth.loops >= 2 (R={cfg.n_loops}: nothing to route)")
        caps = rc.capacities(cfg.n_loops)
        need(len(caps) == cfg.n_loops and all(0 < c <= 1 for c in caps)
             and all(a >= b for a, b in zip(caps, caps[1:])),
             f"depth_router.capacity={rc.capacity!r} must hold R={cfg.n_loops} fractions in (0, 1], descending "
             f"(MoR's default: {[round((cfg.n_loops - i) / cfg.n_loops, 4) for i in range(cfg.n_loops)]})")
    def __init__(self, cfg: LoopedLMConfig):
        super().__init__(cfg)
        R = cfg.n_loops
        self.routers = nn.ModuleList(_linear(cfg.d_model, 1) for _ in range(R))  # one per loop (MoR: per recursion)
        self.aux_routers = nn.ModuleList(_linear(cfg.d_model, 1) for _ in range(R)) if self.cfg.aux_router else None
        self.capacity = self.cfg.capacities(R)

    def capacity_at(self, r: int) -> float:
        """Loop r's capacity; in training, cosine-annealed from 1 over capacity_warmup_steps (MoR)."""
        c, warm = self.capacity[r], self.cfg.capacity_warmup_steps
        if not self.training or warm <= 0:
            return c
        decay = 0.5 * (1.0 + math.cos(math.pi * min(1.0, self.train_step / warm)))
        return c + (1.0 - c) * decay

    def select(self, r: int, x: torch.Tensor, cand: torch.Tensor | None, state: RoutingInfo):
        """Loop r's tokens among the candidates cand (B, kc) (None = all T) → (idx, live, weight)."""
        cfg, T = self.cfg, x.shape[1]
        xc = gather_tokens(x, cand)
        z = self.routers[r](xc / cfg.temperature).squeeze(-1)  # (B, kc)
        probs = cfg.scale * (torch.sigmoid(z) if cfg.activation == "sigmoid" else torch.tanh(z))
        k = min(max(1, int(self.capacity_at(r) * T)), xc.shape[1])
        pick = probs.topk(k, dim=1, sorted=False).indices.sort(dim=1).values  # causal order kept
        target = torch.zeros_like(z).scatter_(1, pick, 1.0)
        losses = state.losses
        if cfg.aux_loss_coeff > 0:
            _add(losses, "router_bce", cfg.aux_loss_coeff * F.binary_cross_entropy_with_logits(z.float(), target.float()))
        if self.aux_routers is not None and cfg.aux_router_coeff > 0:
            za = self.aux_routers[r](xc.detach()).squeeze(-1)
            _add(losses, "aux_router_bce",
                 cfg.aux_router_coeff * F.binary_cross_entropy_with_logits(za.float(), target.float()))
        if cfg.z_loss_coeff > 0:
            _add(losses, "router_z", cfg.z_loss_coeff * self.z_loss(z[..., None]))
        weight = self.weight(probs.gather(1, pick))
        idx = pick if cand is None else cand.gather(1, pick)
        if cand is None and k == T:
            idx = None  # every token, in order: no gather needed
        return idx, None, weight

    def decide(self, r: int, x: torch.Tensor, ran_prev: torch.Tensor, given: torch.Tensor | None):
        """Causal routing (decoding, depths='inference' or given): which tokens run loop r, per token
        → (active (B, T), weight (B, T)). Given depths: active = depth > r. Otherwise a token that ran loop
        r−1 runs loop r when the inference rule says so (`inference`: aux_router logit > 0, or
        sigmoid(main logit) >= inference_threshold); a loop of capacity 1 runs every such token, as top-k does.
        The weight is always the main router's, as in training."""
        cfg = self.cfg
        z = self.routers[r](x / cfg.temperature).squeeze(-1)
        w = self.weight(cfg.scale * (torch.sigmoid(z) if cfg.activation == "sigmoid" else torch.tanh(z)))
        if given is not None:
            return given > r, w
        if self.capacity[r] >= 1:
            return ran_prev, w
        if cfg.inference == "aux_router":
            sel = self.aux_routers[r](x).squeeze(-1) > 0
        else:
            sel = torch.sigmoid(z) >= cfg.inference_threshold
        return ran_prev & sel, w


@DEPTH_ROUTERS.register("token_choice")
class TokenChoiceRouter(DepthRouter):
    ACTIVATIONS = ("softmax", "sigmoid")

    def loop_flops(self, r, fractions, d):
        return (2 * d * self.n_loops if r == 0 else 0), 0  # one score per depth, once, at the first loop

    @classmethod
    def validate_own(cls, cfg, need):
        rc = cfg.depth_router
        need(rc.capacity is None, f"depth_router.capacity={rc.capacity!r} is an expert_choice option; "
             "token_choice assigns each token one depth (set capacity=null)")
    def __init__(self, cfg: LoopedLMConfig):
        super().__init__(cfg)
        self.router = _linear(cfg.d_model, cfg.n_loops)  # a score per depth 1..R

    def assign(self, x: torch.Tensor, state: RoutingInfo):
        """Each token's depth (B, T) in 1..R and weight (B, T), from the first loop's input."""
        cfg, R = self.cfg, self.n_loops
        logits, probs = self.scores(x)
        depth, weight = self.choose(probs)
        choice = depth - 1  # (B, T) in 0..R−1
        if cfg.balancing_loss_coeff > 0:
            frac = torch.bincount(choice.flatten(), minlength=R).to(probs.dtype) / choice.numel()
            P = probs.float().mean(dim=(0, 1))
            _add(state.losses, "balance", cfg.balancing_loss_coeff * (P * R * frac.float()).sum())
        if cfg.z_loss_coeff > 0:
            _add(state.losses, "router_z", cfg.z_loss_coeff * self.z_loss(logits))
        return depth, weight

    def choose(self, probs: torch.Tensor):
        """Depth probabilities (..., R) → each token's depth (...) in 1..R (the argmax) and its weight."""
        choice = probs.argmax(-1)
        return choice + 1, self.weight(probs.gather(-1, choice[..., None]).squeeze(-1))

    def scores(self, x: torch.Tensor):
        """The router's logits and probabilities (B, T, R) over depths 1..R."""
        logits = self.router(x / self.cfg.temperature)
        act = logits.softmax(-1) if self.cfg.activation == "softmax" else torch.sigmoid(logits)
        return logits, self.cfg.scale * act

    def assign_given(self, x: torch.Tensor, depth: torch.Tensor):
        """Given depths (B, T) in 0..R: the weight of each token's given depth (that of depth 1 for depth 0)."""
        _, probs = self.scores(x)
        return depth, self.weight(probs.gather(-1, (depth - 1).clamp_min(0)[..., None]).squeeze(-1))

    def select(self, r: int, depth: torch.Tensor, weight: torch.Tensor):
        """Loop r's tokens: depth > r, in original order; rows with fewer are padded with inactive
        tokens placed after all active ones (live False: computed, never seen, discarded; active_slots)."""
        idx, live = active_slots(depth > r)
        if idx is False:  # no token runs loop r (training assigns depths >= 1, given depths may not)
            idx = torch.zeros_like(depth[:, :1])
            live = torch.zeros_like(idx, dtype=torch.bool)
        return idx, live, gather_tokens(weight, idx)[..., None]


def _add(losses: dict, name: str, value: torch.Tensor) -> None:
    losses[name] = losses[name] + value if name in losses else value


class _SharedKVEntry:
    """kv=share_first, one attention layer at one loop, passed where a KV cache goes: loop 0 records the
    layer's keys/values (RoPE at the original positions); a later loop returns them instead of its own,
    with `attn_mask` (read by CausalSelfAttention): the query of the token at index t of the sequence sees
    the recorded keys of tokens at indices <= t (original order: for real tokens, original positions <= its
    own; valid ones only, and its own key, so no row is empty; indices rather than positions, because left
    padding shares position 0 with the first real token)."""

    def __init__(self, store: dict, l: int, r: int, q_tok: torch.Tensor):
        self.store, self.l, self.r = store, l, r
        self.attn_mask = None
        if r > 0:
            tok0, valid0 = store["tokens"], store["valid"]
            keys = tok0[:, None, :] <= q_tok[:, :, None]  # (B, k, T0)
            if valid0 is not None:
                keys = (keys & valid0[:, None, :]) | (tok0[:, None, :] == q_tok[:, :, None])
            self.attn_mask = keys[:, None]  # (B, 1, k, T0)

    def update(self, k: torch.Tensor, v: torch.Tensor):
        if self.r == 0:
            self.store[self.l] = (k, v)
            return k, v, self.attn_mask_for(k.shape[2])
        return (*self.store[self.l], self.attn_mask)

    def attn_mask_for(self, T: int):
        """Loop 0 attends causally among its gathered tokens, padding excluded (its own key always kept)."""
        valid0 = self.store["valid"]
        if valid0 is None:
            return None
        causal = torch.ones(T, T, dtype=torch.bool, device=valid0.device).tril()
        own = torch.eye(T, dtype=torch.bool, device=valid0.device)
        return ((causal & valid0[:, None, :]) | own)[:, None]


class _SharedKV:
    """The `cache` a routed loop_step gets under kv=share_first: cache[r, l] → _SharedKVEntry for an
    attention layer, None for a Mamba-2 layer (recursion-wise: its scan runs over the routed tokens)."""

    def __init__(self, store: dict, r: int, tokens: torch.Tensor, valid: torch.Tensor | None, B: int, shared_layers):
        self.store, self.r, self.shared_layers = store, r, shared_layers
        self.q_tok = tokens.expand(B, tokens.shape[1])  # the gathered tokens' indices in the sequence
        if r == 0:
            store["tokens"], store["valid"] = self.q_tok, valid

    def __getitem__(self, key):
        if key[1] not in self.shared_layers:
            return None
        return _SharedKVEntry(self.store, key[1], self.r, self.q_tok)

    def get(self, key, default=None):  # the StateLoop mixer keeps its own attention over the routed tokens
        return default


class _RoutedWrite:
    """One (loop, layer)'s RoutedKVCache as the attention's `cache`: writes the live slots, hands back the
    entry's keys/values and, in `attn_mask`, which of them each query sees."""

    def __init__(self, entry, view: "_RoutedCacheView", share_read: bool = False):
        self.entry, self.view, self.share_read = entry, view, share_read

    def update(self, k: torch.Tensor, v: torch.Tensor):
        w = self.view
        if self.share_read:
            return self.entry.read_shared(w.tok, k.shape[2])
        return self.entry.write(k, v, w.tok, w.live, w.valid, w.n_call)


class _RoutedCacheView:
    """The `cache` a routed loop_step gets in cached decoding: cache[r, l] → _RoutedWrite of an attention
    entry (kv=share_first, r > 0: a read of loop 0's entry, the only one allocated), or the layer's
    RoutedSSMCache told which slots are live; cache.get((r, "state")): the StateLoop mixer's own per-loop
    entry (recursion-wise under either kv mode, as in the cache-free forward)."""

    def __init__(self, cache, r: int, tok, live, valid, n_call: int, share_first: bool):
        self.cache, self.r, self.share_first = cache, r, share_first
        self.tok, self.live, self.valid, self.n_call = tok, live, valid, n_call

    def __getitem__(self, key):
        r, l = key
        if self.share_first and r > 0 and key not in self.cache.entries:
            return _RoutedWrite(self.cache[0, l], self, share_read=True)
        return self._wrap(self.cache[key])

    def get(self, key, default=None):
        entry = self.cache.get(key)
        return default if entry is None else self._wrap(entry)

    def _wrap(self, entry):
        from looplab.models.cache import RoutedSSMCache

        if isinstance(entry, RoutedSSMCache):
            return entry.route(self.live)
        return _RoutedWrite(entry, self)


def active_slots(active: torch.Tensor):
    """(B, T) mask of the tokens that run a loop → (idx, live): idx (B, k) their indices in original order,
    rows with fewer padded with inactive tokens placed after every active one (live False), k = the most
    active tokens of a row; idx None = every token in order (live None); k = 0: idx is False.
    Inactive tokens always follow a row's active ones, also when some row runs all T: in a Mamba-2 layer
    a masked slot between two active tokens would still sit in the conv window (as zeros), while one
    after them is seen by nobody, in a causal scan as in causal attention."""
    T = active.shape[1]
    kmax = int(active.sum(1).max())
    if kmax == 0:
        return False, None
    if bool(active.all()):
        return None, None
    key = (~active).long() * T + torch.arange(T, device=active.device)
    idx = key.argsort(dim=1)[:, :kmax]
    return idx, active.gather(1, idx)


class RoutedLoop:
    """One routed forward: `loop_step` runs the model's loop step on the selected tokens (LoopedLM.run_loops'
    `step`), and in cached one-token decoding `rows` gathers the rows whose token runs a loop (its `rows`).

    depths=None without a cache: training's routing (expert choice top-k, token choice argmax).
    depths='inference', or any cached call: causal routing per token (ExpertChoiceRouter.decide; token
    choice's argmax depth, already causal). depths=(B, T) tensor: the given depths, token t runs loops
    1..depths[t] (0 = none) — the reference that cached decoding equals given the same decisions."""

    def __init__(self, router: DepthRouter, model, x: torch.Tensor, depths=None, cache=None):
        self.router, self.model, self.cache = router, model, cache
        self.info = RoutingInfo(depth=torch.zeros(x.shape[:2], dtype=torch.long, device=x.device))
        self.h = x  # a token that never ran a loop reads its input
        self.cand: torch.Tensor | None = None  # expert choice: the tokens that ran the previous loop
        self.assigned = None
        self.shared: dict = {}  # kv=share_first: loop 0's keys/values per layer, with their positions
        self.shared_layers = {l for l, layer in enumerate(model.block) if router.shares_first(layer)}
        self.causal = depths is not None or cache is not None
        self.by_rows = cache is not None and x.shape[1] == 1  # one token per row: gather rows, not tokens
        self.weight_now: torch.Tensor | None = None  # by_rows: the gathered rows' router weights (b, 1)
        self.given = depths if isinstance(depths, torch.Tensor) else None
        if self.given is not None:
            if self.given.shape != x.shape[:2]:
                raise ValueError(f"depths of shape {tuple(self.given.shape)}: give one depth per token, "
                                 f"{tuple(x.shape[:2])}")
            if bool((self.given < 0).any()) or bool((self.given > router.n_loops).any()):
                raise ValueError(f"depths must lie in 0..R={router.n_loops}")
            self.given = self.given.to(device=x.device, dtype=torch.long)

    def _decide(self, r: int, x):
        router = self.router
        if isinstance(router, ExpertChoiceRouter):
            return router.decide(r, x, self.info.depth >= r, self.given)
        if self.assigned is None:
            self.assigned = (router.assign(x, self.info) if self.given is None
                             else router.assign_given(x, self.given))
        depth, weight = self.assigned
        return depth > r, weight

    def rows(self, r: int, st):
        """Cached one-token decoding: the rows whose token runs loop r (None = all; the others are not computed
        and their entries not touched — a stopped token leaves nothing at the deeper loops)."""
        if not self.by_rows:
            return None
        active, w = self._decide(r, st.x)  # (B, 1)
        ran = active.clone()
        self._record(r, None, ran)
        if bool(active.all()):
            self.weight_now = w[..., None]
            return None
        idx = active[:, 0].nonzero().squeeze(1)
        self.weight_now = w[idx][..., None]
        return idx

    def loop_step(self, st, r: int, cache):
        router = self.router
        update = router.cfg.update
        if self.by_rows:  # every gathered row's token runs this loop
            w = self.weight_now

            def gate(x_in, h_block):
                return x_in + w * (h_block if update == "mor" else h_block - x_in)

            kv = _RoutedCacheView(cache, r, None, None, st.valid, 1, router.cfg.kv == "share_first")
            return self.model.loop_step(st, r, kv, gate=gate)
        x, s, e, positions, valid = st.x, st.s, st.e, st.positions, st.valid
        B, T = x.shape[:2]
        if self.causal:
            active, w_full = self._decide(r, x)
            idx, live = active_slots(active)
            if idx is False:  # no token runs this loop
                self._record(r, idx, torch.zeros_like(active))
                return replace(st, h=self.h)
            w = gather_tokens(w_full, idx)[..., None]
        elif isinstance(router, ExpertChoiceRouter):
            idx, live, w = router.select(r, x, self.cand, self.info)
            w = w[..., None]
            self.cand = idx
        else:
            if self.assigned is None:
                self.assigned = router.assign(x, self.info)
            idx, live, w = router.select(r, *self.assigned)
        x_a, s_a, e_a = gather_tokens(x, idx), gather_tokens(s, idx), gather_tokens(e, idx)
        pos_a, valid_a = gather_tokens(positions, idx), gather_tokens(valid, idx)
        if live is not None:  # slots that do not run this loop are no key for anyone (idx None: they sit in between)
            valid_a = live if valid_a is None else valid_a & live
        share = router.cfg.kv == "share_first"

        def gate(x_in, h_block):  # the router weight multiplies the update (called by model.loop_step)
            return x_in + w * (h_block if update == "mor" else h_block - x_in)

        if cache is not None:
            kv = _RoutedCacheView(cache, r, idx, live, valid_a, T, share)
        elif share:
            tok = idx if idx is not None else torch.arange(T, device=x.device)[None]
            kv = _SharedKV(self.shared, r, tok, valid_a, B, self.shared_layers)
        else:
            kv = None
        sub = self.model.loop_step(Stream(x_a, e_a, s_a, None, pos_a, valid_a), r, kv, gate=gate)
        h_a, xn_a, sn_a = sub.h, sub.x, sub.s
        if live is not None:  # padded slots: keep what they were
            keep = live[..., None]
            h_a = torch.where(keep, h_a, gather_tokens(self.h, idx))
            xn_a = torch.where(keep, xn_a, x_a)
            sn_a = torch.where(keep, sn_a, s_a) if s is not None else None
        self.h = h = scatter_tokens(self.h, idx, h_a)
        x = scatter_tokens(x, idx, xn_a)
        s = scatter_tokens(s, idx, sn_a) if s is not None else None
        if idx is None:
            ran = torch.ones_like(self.info.depth, dtype=torch.bool) if live is None else live
        else:
            src = torch.ones_like(idx, dtype=torch.bool) if live is None else live
            ran = torch.zeros_like(self.info.depth, dtype=torch.bool).scatter(1, idx, src)
        self._record(r, idx, ran)
        return Stream(x, e, s, h, positions, valid, sub.retention)

    def _record(self, r: int, idx, ran: torch.Tensor) -> None:
        self.info.depth = torch.where(ran, r + 1, self.info.depth)
        self.info.selected.append(idx if idx is not False else ran.new_zeros(ran.shape[0], 0, dtype=torch.long))
        self.info.ran.append(ran)
        self.info.active_frac.append(float(ran.float().mean()))

    def finish(self) -> RoutingInfo:
        return self.info


def build_router(cfg: LoopedLMConfig) -> DepthRouter | None:
    """The model's router module (None: depth_router=none, or a registered router that is not a module)."""
    cls = DEPTH_ROUTERS.get(cfg.depth_router.name)
    return cls(cfg) if issubclass(cls, nn.Module) else None
