"""The one dataclass that describes a looped model (docs/formulations.md).

Every option the papers leave open is a field here, never a constant in the
model code. `validate()` runs in `__post_init__`, so an impossible model fails
at construction with the field named, before any data is touched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

BACKBONES = ("llama", "mamba2", "hybrid")
STATE_MODES = ("vanilla", "stateloop", "stateloop_attn", "stateloop_mamba2", "stateloop_reset")
EXIT_GATES = ("none", "ouro")
INJECTIONS = ("none", "add", "concat", "diag")  # models/injection.py
DEPTH_ROUTERS = ("none", "expert_choice", "token_choice")  # models/router.py (Mixture-of-Recursions)
ROUTER_KV = ("recursion_wise", "share_first")
LOOP_SCHEDULES = ("sequential", "parallel")  # models/parallel.py (Parallel Loop Transformer)
LOOP_KV = ("own", "share_first", "gswa")
LOOP_GATES = ("query", "residual")
# the parallel-schedule fields and their defaults: a sequential model's dict (and its checkpoints' hash) omits them
PARALLEL_DEFAULTS = {"loop_kv": "own", "loop_window": 64, "loop_gate": "query", "loop_mix": (1.0, 1.0),
                     "loop_mix_learned": False, "loop_norm": False}
KERNELS = ("auto", "torch", "mamba_ssm")
# causal-conv1d's CUDA conv (csrc/causal_conv1d.cpp) has kernels for these widths only. kernel=auto
# keeps the torch conv for other widths (fused scan still used); kernel=mamba_ssm asks for the fused
# path outright, so another width is refused here rather than silently half-fused.
CAUSAL_CONV1D_WIDTHS = (2, 3, 4)


class ConfigError(ValueError):
    """An impossible configuration; the message names the field and the fix."""


def fused_conv_width_error(d_conv: int) -> str:
    return (f"d_conv={d_conv!r} with kernel=mamba_ssm: causal-conv1d's fused conv supports kernel widths "
            f"{CAUSAL_CONV1D_WIDTHS[0]}..{CAUSAL_CONV1D_WIDTHS[-1]} only; set d_conv within that range, or "
            f"kernel=auto (fused scan, torch conv at this width) or kernel=torch")


@dataclass
class RouterConfig:
    """Per-token depth chosen by a router (Mixture-of-Recursions; models/router.py, docs/formulations.md#routed-depth).
    Defaults are MoR's (raymin0223/mixture_of_recursions); conf/depth_router/*.yaml names them all."""

    name: str = "none"  # none | expert_choice | token_choice
    kv: str = "recursion_wise"  # recursion_wise: depth r attends over the tokens active at r | share_first: every
    #                             depth's queries attend to the first loop's keys/values. Mamba-2 layers and the
    #                             stateloop_mamba2 mixer are recursion-wise under either: loop r's scan and causal
    #                             conv run over the tokens active at r (a token that stopped before r neither
    #                             updates loop r's SSM state nor enters its conv window); share_first needs an
    #                             attention layer in the block
    router_type: str = "linear"  # MoR's default router head (MoR's mlp / wide_mlp are not offered yet)
    temperature: float = 1.0  # the router reads x / temperature
    activation: str | None = None  # expert_choice: sigmoid | tanh (None = sigmoid); token_choice: softmax | sigmoid (None = softmax)
    scale: float | None = None  # MoR's alpha: weight = scale · activation(logit); None = 0.1 (expert), 1.0 (token)
    gating: str = "weighted"  # weighted: the router weight multiplies the update | hard: weight 1
    update: str = "mor"  # mor: x + w·Block(x) (MoR's code and paper) | delta: x + w·(Block(x) − x) (MoD's form)
    capacity: list[float] | None = None  # expert_choice: fraction of the T tokens kept at each of the R loops,
    #                                      descending; None = MoR's [R/R, (R−1)/R, ..., 1/R]
    capacity_warmup_steps: int = 0  # expert_choice: capacity cosine-annealed from 1 to `capacity` over these steps
    aux_loss_coeff: float = 0.001  # expert_choice: BCE of the main router's logits on top-k membership (MoR aux_loss)
    aux_router: bool = False  # expert_choice: a separate linear classifier on detached input learns top-k membership
    aux_router_coeff: float = 0.001  # its BCE loss weight (MoR uses aux_loss_coeff for either sampling)
    z_loss_coeff: float = 0.0  # router z-loss (logsumexp² of the router logits); 0 = off (MoR's default)
    balancing_loss_coeff: float = 0.1  # token_choice: Σ_i P_i·f_i load-balancing loss (Switch-style, MoR's default)
    # expert_choice, how a causal forward / cached decoding routes each token (top-k needs the whole sequence):
    # aux_router: the token runs loop r when its auxiliary classifier's logit > 0 (P(top-k) > 1/2);
    # threshold: when sigmoid(main router logit) >= inference_threshold (the probability the aux_loss BCE
    # calibrates). None = aux_router when aux_router is on, else threshold (MoR: the aux router is built for this).
    inference: str | None = None
    inference_threshold: float = 0.5  # expert_choice with inference=threshold

    def __post_init__(self) -> None:
        if self.activation is None:
            self.activation = "softmax" if self.name == "token_choice" else "sigmoid"
        if self.scale is None:
            self.scale = 1.0 if self.name == "token_choice" else 0.1
        if self.capacity is not None:
            self.capacity = [float(c) for c in self.capacity]
        if self.inference is None and self.name == "expert_choice":
            self.inference = "aux_router" if self.aux_router else "threshold"

    def capacities(self, n_loops: int) -> list[float]:
        if self.capacity is not None:
            return list(self.capacity)
        return [(n_loops - i) / n_loops for i in range(n_loops)]

    def loop_fractions(self, n_loops: int, seq_len: int | None = None) -> list[float]:
        """The expected fraction of the T tokens that run each of the R loops in a training forward
        (what LoopedLM.flops_per_token counts). none: 1 at every loop. expert_choice: capacity_r after the
        capacity warm-up (during it more tokens run); with seq_len, exactly what the top-k gathers,
        min(k_{r−1}, max(1, ⌊capacity_r·T⌋))/T. token_choice: the balanced assignment the balancing loss
        pushes towards (each depth 1..R taken by 1/R of the tokens), so (R − r)/R run loop r."""
        if self.name == "none":
            return [1.0] * n_loops
        if self.name == "token_choice":
            return [(n_loops - r) / n_loops for r in range(n_loops)]
        caps = self.capacities(n_loops)
        if seq_len is None:
            out, prev = [], 1.0
            for c in caps:
                prev = min(prev, c)
                out.append(prev)
            return out
        out, k = [], seq_len
        for c in caps:
            k = min(k, max(1, int(c * seq_len)))
            out.append(k / seq_len)
        return out

    @classmethod
    def from_any(cls, value) -> "RouterConfig":
        if isinstance(value, RouterConfig):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(name=value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"depth_router: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**value)


@dataclass
class LoopedLMConfig:
    # --- shape ---------------------------------------------------------------
    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads
    n_layers: int = 1  # N: distinct layers in the looped block
    n_loops: int = 4  # R: how often the block is applied
    prelude_layers: int = 0  # non-shared layers applied once before the looped block (docs/formulations.md#prelude-and-coda)
    coda_layers: int = 0  # non-shared layers applied to a loop's readout before the final norm and head
    ffn_hidden: int | None = None  # SwiGLU hidden width; None = 8/3·d rounded up to 64
    backbone: str = "llama"  # llama | mamba2 | hybrid
    hybrid_pattern: str = "MMMA"  # hybrid: 'M' Mamba-2, 'A' attention; tiled over n_layers (and the prelude, the coda)
    max_seq_len: int = 2048
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float | None = None  # None = sqrt(2 / (5 d)) (docs/formulations.md#initialisation)

    # --- Mamba-2 (docs/formulations.md#backbones) ----------------------------
    d_state: int = 128
    headdim: int = 64
    expand: int = 2
    ngroups: int = 1
    d_conv: int = 4
    chunk_size: int = 64
    mamba_mlp: bool = False  # add a SwiGLU MLP after each Mamba-2 mixer
    kernel: str = "auto"  # auto | torch | mamba_ssm
    mamba_A_init: tuple[float, float] = (1.0, 16.0)  # A = −exp(A_log), exp(A_log) ~ U[a, b]
    mamba_dt_init: tuple[float, float] = (1e-3, 1e-1)  # softplus(dt_bias) ~ logU[a, b]

    # --- StateLoop (docs/formulations.md#stateloop) --------------------------
    state_mode: str = "vanilla"
    state_dim: int | None = None  # d_s; None = d_model
    state_init: str = "zeros"  # zeros | learned  (s_0)
    state_in_output: bool = True  # logits = Head(FinalNorm(h_R + W_o s_R))
    state_A_init: tuple[float, float] = (1.0, 16.0)  # exp(A_log) ~ U[a, b], as in Mamba
    state_dt_init: tuple[float, float] = (1e-3, 1e-1)  # softplus(b_Δ) ~ logU[a, b]

    # --- exit gate (docs/formulations.md#exit-gate) --------------------------
    exit_gate: str = "none"  # none | ouro

    # --- input injection (docs/formulations.md#input-injection) --------------
    injection: str = "none"  # none | add | concat | diag: the embedding re-enters before loops 2..R

    # --- depth router (docs/formulations.md#routed-depth) --------------------
    depth_router: RouterConfig = field(default_factory=RouterConfig)  # name none = today's model exactly

    # --- loop schedule (docs/formulations.md#parallel-loops) -----------------
    # sequential: loop r+1 reads loop r's output at the same token (every model above). parallel: cross-loop
    # parallelism, loop r+1 reads a·E + b·shift(H^(r)), the previous loop's output one token back, so the R
    # loops of one decoded token are independent rows of one block call (models/parallel.py)
    loop_schedule: str = "sequential"
    loop_kv: str = "own"  # parallel: own (each loop its own keys/values) | share_first (loops >= 2 attend to loop 1's)
    #                       | gswa (loop 1's, gated with a sliding window of loop_window over the loop's own)
    loop_window: int = 64  # gswa: the sliding window w over a loop's own keys/values (itself included)
    loop_gate: str = "query"  # gswa: g = σ(q_h·w_h + b_h) (query) | σ(Linear(RMSNorm(x))) of the residual (residual);
    #                           out = g·(attention to loop 1's keys) + (1 − g)·(windowed attention to the loop's own)
    loop_mix: tuple[float, float] = (1.0, 1.0)  # (a, b): loops >= 2 read a·E + b·shift(H); E + shift(H) by default
    loop_mix_learned: bool = False  # a and b are parameters, initialised at loop_mix
    loop_norm: bool = False  # the final norm on shift(H) before it is mixed in (vLLM's plt_normalize_per_loop)

    extra: dict[str, Any] = field(default_factory=dict)  # free-form, never read by the model

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden is None:
            self.ffn_hidden = 64 * -(-int(8 * self.d_model / 3) // 64)
        if self.state_dim is None:
            self.state_dim = self.d_model
        for name in ("state_A_init", "state_dt_init", "mamba_A_init", "mamba_dt_init", "loop_mix"):
            setattr(self, name, tuple(getattr(self, name)))
        self.depth_router = RouterConfig.from_any(self.depth_router)
        self.validate()

    # ------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len", "ffn_hidden", "state_dim"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, f"{name}={v!r} must be a positive integer")
        for name, key in (("prelude_layers", "prelude"), ("coda_layers", "coda")):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                 f"{name} (loop_depth.{key})={v!r} must be an integer >= 0 (the number of non-shared layers "
                 f"{'before' if key == 'prelude' else 'after'} the looped block; 0 = none)")
        need(
            isinstance(self.n_loops, int) and self.n_loops >= 1,
            f"n_loops (loop_depth.loops, R)={self.n_loops!r} must be >= 1: a looped model applies its block at least once",
        )
        need(self.backbone in BACKBONES, f"backbone={self.backbone!r} is unknown; choose one of {BACKBONES}")
        need(self.state_mode in STATE_MODES, f"state_mode={self.state_mode!r} is unknown; choose one of {STATE_MODES}")
        need(self.exit_gate in EXIT_GATES, f"exit_gate={self.exit_gate!r} is unknown; choose one of {EXIT_GATES}")
        need(self.injection in INJECTIONS,
             f"injection (loop_depth.injection)={self.injection!r} is unknown; choose one of {INJECTIONS}")
        need(self.kernel in KERNELS, f"kernel={self.kernel!r} is unknown; choose one of {KERNELS}")
        need(self.state_init in ("zeros", "learned"), f"state_init={self.state_init!r} must be 'zeros' or 'learned'")
        kinds = self.all_layer_types
        if "A" in kinds:
            need(
                self.d_model % self.n_heads == 0,
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"pick n_heads among the divisors of {self.d_model}",
            )
            need((self.d_model // self.n_heads) % 2 == 0, f"head dim d_model/n_heads={self.d_model // self.n_heads} must be even for RoPE")
            need(
                self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0,
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}",
            )
        if "M" in kinds or self.state_mode == "stateloop_mamba2":
            for name in ("d_state", "headdim", "expand", "ngroups", "d_conv", "chunk_size"):
                v = getattr(self, name)
                need(isinstance(v, int) and v >= 1, f"{name}={v!r} must be a positive integer")
            d_inner = self.expand * self.d_model
            need(d_inner % self.headdim == 0, f"expand*d_model={d_inner} is not divisible by headdim={self.headdim}")
            need((d_inner // self.headdim) % self.ngroups == 0, f"ngroups={self.ngroups} must divide the number of heads {d_inner // self.headdim}")
            need(self.kernel != "mamba_ssm" or self.d_conv in CAUSAL_CONV1D_WIDTHS, fused_conv_width_error(self.d_conv))
        if self.backbone == "hybrid":
            need(
                len(self.hybrid_pattern) > 0 and set(self.hybrid_pattern) <= {"M", "A"},
                f"hybrid_pattern={self.hybrid_pattern!r} must be a non-empty string of 'M' (Mamba-2) and 'A' (attention)",
            )
        if self.state_mode == "stateloop_attn":
            need(
                self.state_dim % self.n_heads == 0 and (self.state_dim // self.n_heads) % 2 == 0,
                f"state_dim={self.state_dim} must split into n_heads={self.n_heads} heads of even width for the attention mixer",
            )
        if self.state_mode == "stateloop_mamba2":
            d_inner = self.expand * self.state_dim
            need(d_inner % self.headdim == 0, f"expand*state_dim={d_inner} is not divisible by headdim={self.headdim}")
        for name in ("state_A_init", "state_dt_init", "mamba_A_init", "mamba_dt_init"):
            lo, hi = getattr(self, name)
            need(0 < lo <= hi, f"{name}={getattr(self, name)} must satisfy 0 < a <= b")
        self._validate_router(need)
        self._validate_schedule(need)

    def _validate_schedule(self, need) -> None:
        need(self.loop_schedule in LOOP_SCHEDULES,
             f"loop_schedule (loop_depth.schedule)={self.loop_schedule!r} is unknown; choose one of {LOOP_SCHEDULES}")
        if self.loop_schedule == "sequential":
            changed = [f"{k}={getattr(self, k)!r}" for k, v in PARALLEL_DEFAULTS.items()
                       if (tuple(getattr(self, k)) if k == "loop_mix" else getattr(self, k)) != v]
            need(not changed, f"{', '.join(changed)} with loop_schedule=sequential: these are options of the parallel "
                 "loop schedule; set loop_depth.schedule=parallel or leave them at their defaults")
            return
        p = "loop_schedule=parallel"
        need(self.loop_kv in LOOP_KV, f"loop_kv (loop_depth.kv)={self.loop_kv!r} is unknown; choose one of {LOOP_KV}")
        need(self.loop_gate in LOOP_GATES,
             f"loop_gate (loop_depth.gate)={self.loop_gate!r} is unknown; choose one of {LOOP_GATES}")
        need(isinstance(self.loop_window, int) and not isinstance(self.loop_window, bool) and self.loop_window >= 1,
             f"loop_window (loop_depth.window)={self.loop_window!r} must be an integer >= 1 (tokens, the current one "
             "included)")
        need(len(self.loop_mix) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                             for v in self.loop_mix),
             f"loop_mix (loop_depth.mix)={list(self.loop_mix)!r} must be two numbers [a, b]: loops >= 2 read "
             "a·E + b·shift(H)")
        need(self.backbone == "llama",
             f"{p} with backbone={self.backbone}: the parallel schedule is built for attention blocks (llama); a "
             "Mamba-2 layer's state would have to run loop by loop over time with a shifted input, which is not "
             "defined here yet; use backbone=llama or loop_schedule=sequential")
        need(self.state_mode == "vanilla",
             f"{p} with state_mode={self.state_mode}: the StateLoop state is updated along the loops of one token, "
             "and the parallel schedule puts each loop of a token at a different step; use state_mode=vanilla")
        need(self.exit_gate == "none",
             f"{p} with exit_gate={self.exit_gate}: an exit picks a loop of the same token, and under the parallel "
             "schedule loop r of a token finishes at a later step than loop r−1; use exit_gate=none")
        need(self.injection == "none",
             f"{p} with injection={self.injection}: the parallel schedule has its own embedding term (loop_mix a·E); "
             "use injection=none")
        need(self.depth_router.name == "none",
             f"{p} with depth_router={self.depth_router.name}: routing's kv=share_first and per-token depths are a "
             "different scheme; use depth_router=none")

    def _validate_router(self, need) -> None:
        rc = self.depth_router
        need(rc.name in DEPTH_ROUTERS, f"depth_router={rc.name!r} is unknown; choose one of {DEPTH_ROUTERS}")
        if rc.name == "none":
            return
        r = f"depth_router={rc.name}"
        need(self.exit_gate == "none", f"{r} with exit_gate={self.exit_gate}: a router and an exit gate both choose "
             f"the depth; combine them with exit_gate=none only")
        need(rc.kv in ROUTER_KV, f"depth_router.kv={rc.kv!r} is unknown; choose one of {ROUTER_KV}")
        # Mamba-2 layers (backbone mamba2 / hybrid, the stateloop_mamba2 mixer) are recursion-wise under
        # either kv mode: loop r's scan and conv run over the tokens active at loop r. share_first only
        # changes attention layers, so a block without one would silently run recursion_wise.
        need(rc.kv != "share_first" or "A" in self.layer_types,
             f"depth_router.kv=share_first with backbone={self.backbone} (block layers {self.layer_types!r}): "
             f"share_first reuses the first loop's attention keys/values and this block has no attention layer "
             f"(Mamba-2 layers keep a recursion-wise state); use depth_router.kv=recursion_wise")
        need(rc.router_type == "linear", f"depth_router.router_type={rc.router_type!r}: only 'linear' is offered")
        acts = ("sigmoid", "tanh") if rc.name == "expert_choice" else ("softmax", "sigmoid")
        need(rc.activation in acts, f"depth_router.activation={rc.activation!r} with {r}: choose one of {acts}")
        need(rc.gating in ("weighted", "hard"), f"depth_router.gating={rc.gating!r}: choose weighted or hard")
        need(rc.update in ("mor", "delta"), f"depth_router.update={rc.update!r}: choose mor or delta")
        for name in ("temperature", "scale"):
            v = getattr(rc, name)
            need(isinstance(v, (int, float)) and v > 0, f"depth_router.{name}={v!r} must be a positive number")
        for name in ("aux_loss_coeff", "aux_router_coeff", "z_loss_coeff", "balancing_loss_coeff"):
            v = getattr(rc, name)
            need(isinstance(v, (int, float)) and v >= 0, f"depth_router.{name}={v!r} must be a number >= 0")
        need(not rc.aux_router or (rc.name == "expert_choice" and rc.aux_router_coeff > 0),
             f"depth_router.aux_router=true with {r}, aux_router_coeff={rc.aux_router_coeff}: the auxiliary router is "
             "an expert_choice option and learns only from its BCE loss; set aux_router_coeff > 0 (MoR: 0.001)")
        need(isinstance(rc.capacity_warmup_steps, int) and rc.capacity_warmup_steps >= 0,
             f"depth_router.capacity_warmup_steps={rc.capacity_warmup_steps!r} must be an integer >= 0")
        if rc.name == "expert_choice":
            need(rc.inference in ("aux_router", "threshold"),
                 f"depth_router.inference={rc.inference!r}: choose aux_router or threshold")
            need(rc.inference != "aux_router" or rc.aux_router,
                 "depth_router.inference=aux_router needs depth_router.aux_router=true (the classifier it reads)")
            need(isinstance(rc.inference_threshold, (int, float)) and 0 < rc.inference_threshold < 1,
                 f"depth_router.inference_threshold={rc.inference_threshold!r} must lie in (0, 1)")
            need(self.n_loops >= 2, f"{r} needs loop_depth.loops >= 2 (R={self.n_loops}: nothing to route)")
            caps = rc.capacities(self.n_loops)
            need(len(caps) == self.n_loops and all(0 < c <= 1 for c in caps)
                 and all(a >= b for a, b in zip(caps, caps[1:])),
                 f"depth_router.capacity={rc.capacity!r} must hold R={self.n_loops} fractions in (0, 1], descending "
                 f"(MoR's default: {[round((self.n_loops - i) / self.n_loops, 4) for i in range(self.n_loops)]})")
        else:
            need(rc.capacity is None, f"depth_router.capacity={rc.capacity!r} is an expert_choice option; "
                 "token_choice assigns each token one depth (set capacity=null)")

    # ------------------------------------------------------------------------
    @property
    def layer_types(self) -> str:
        """One letter per layer of the looped block: 'A' attention(+MLP), 'M' Mamba-2."""
        return self._kinds(self.n_layers)

    @property
    def prelude_layer_types(self) -> str:
        """The prelude's layer kinds: the block's (hybrid: hybrid_pattern tiled from its start)."""
        return self._kinds(self.prelude_layers)

    @property
    def coda_layer_types(self) -> str:
        return self._kinds(self.coda_layers)

    @property
    def all_layer_types(self) -> str:
        """Every layer kind the model holds: prelude, block, coda."""
        return self.prelude_layer_types + self.layer_types + self.coda_layer_types

    def _kinds(self, n: int) -> str:
        if not isinstance(n, int) or n < 0:
            return ""  # validate() names the bad count
        if self.backbone == "llama":
            return "A" * n
        if self.backbone == "mamba2":
            return "M" * n
        pat = self.hybrid_pattern or "M"
        return "".join(pat[i % len(pat)] for i in range(n))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def uses_state(self) -> bool:
        return self.state_mode != "vanilla"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("state_A_init", "state_dt_init", "mamba_A_init", "mamba_dt_init"):
            d[name] = list(getattr(self, name))
        if self.depth_router.name == "none":
            d.pop("depth_router")  # a model without router: the dict (and its checkpoints' hash) as before routing existed
        if self.loop_schedule == "sequential":
            for k in ("loop_schedule", *PARALLEL_DEFAULTS):
                d.pop(k)  # likewise: a sequential model's dict as before the parallel schedule existed
        else:
            d["loop_mix"] = list(self.loop_mix)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LoopedLMConfig":
        known = {f.name for f in fields(cls)}
        if d.get("model_type") == "looplab":
            # a remote-code transformers folder (convert to-hf): looplab's fields plus transformers' own keys, which
            # transformers writes as it likes from release to release; the looplab fields are the model
            d = {k: v for k, v in d.items() if k in known}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**d)

    def architecture_dict(self) -> dict[str, Any]:
        """Fields that decide parameter shapes; a checkpoint must match these to load."""
        d = self.to_dict()
        for k in ("extra", "kernel", "chunk_size", "max_seq_len"):
            d.pop(k)
        return d
