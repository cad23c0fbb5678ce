"""The one dataclass that describes a looped model (docs/formulations.md).

Every option the papers leave open is a field here, never a constant in the
model code. `validate()` runs in `__post_init__`, so an impossible model fails
at construction with the field named, before any data is touched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from looplab.models.registry import (BACKBONES, DEPTH_ROUTERS, EXIT_GATES, INJECTIONS, LAYERS, LOOP_SCHEDULES,
                                     STATE_MIXERS, STATE_UPDATES, ConfigError, UnknownOptionError, names_from,
                                     option_values, refuse_as_config_error)

# a variant's options live in `LoopedLMConfig.options[axis]` (the axes whose variants build model parts)
OPTION_AXES = {"state_update": STATE_UPDATES, "state_mixer": STATE_MIXERS, "backbone": BACKBONES,
               "injection": INJECTIONS, "loop_schedule": LOOP_SCHEDULES}


def _keep_if(cond):
    """Field metadata: `to_dict` (and so the architecture hash) keeps the field only where cond(config) holds, so a
    field added later leaves every earlier model's dict and checkpoints' hash as they were."""
    return {"keep_if": cond}

ROUTER_KV = ("recursion_wise", "share_first")
LOOP_KV = ("own", "share_first", "gswa")
LOOP_GATES = ("query", "residual")
KERNELS = ("auto", "torch", "mamba_ssm")
# causal-conv1d's CUDA conv (csrc/causal_conv1d.cpp) has kernels for these widths only. kernel=auto
# keeps the torch conv for other widths (fused scan still used); kernel=mamba_ssm asks for the fused
# path outright, so another width is refused here rather than silently half-fused.
CAUSAL_CONV1D_WIDTHS = (2, 3, 4)


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
    backbone: str = "llama"  # a registered backbone (models/backbone.py): llama | mamba2 | hybrid
    hybrid_pattern: str = "MMMA"  # hybrid: layer letters ('M' Mamba-2, 'A' attention) tiled over n_layers (and the prelude, the coda)
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
    # The scan's chunk length: a speed/memory knob, not an architecture field (both scans compute the same maths
    # at any chunk length; excluded from the architecture hash). chunk_size: the pure-PyTorch SSD scan's (64: its
    # fastest on the CPU, and its saved Q×Q decay matrices grow with Q); fused_chunk_size: mamba_ssm's Triton scan's
    # (256: mamba_ssm's Mamba2 default, what its kernels are tuned for). docs/gpu.md#kernels
    chunk_size: int = 64
    fused_chunk_size: int = field(default=256, metadata=_keep_if(lambda c: c.fused_chunk_size != 256))
    mamba_mlp: bool = False  # add a SwiGLU MLP after each Mamba-2 mixer
    kernel: str = "auto"  # auto | torch | mamba_ssm
    mamba_A_init: tuple[float, float] = (1.0, 16.0)  # A = −exp(A_log), exp(A_log) ~ U[a, b]
    mamba_dt_init: tuple[float, float] = (1e-3, 1e-1)  # softplus(dt_bias) ~ logU[a, b]

    # --- StateLoop (docs/formulations.md#stateloop) --------------------------
    # the update rule (models/state.py): vanilla | stateloop | stateloop_reset | gru | a registered one; or an
    # alias naming a rule and a mixer (stateloop_attn = stateloop + attn, stateloop_mamba2 = stateloop + mamba2).
    # After construction it holds the alias wherever one names the (rule, mixer) pair, else the rule.
    state_mode: str = "vanilla"
    # the state's cross-token mixer: none | attn | mamba2 | a registered one; None = what state_mode implies.
    # After construction it always names the mixer.
    state_mixer: str | None = field(default=None, metadata=_keep_if(
        lambda c: c.state_mixer != "none" and c.state_mode not in STATE_UPDATES.aliases()))
    state_dim: int | None = None  # d_s; None = d_model
    state_init: str = "zeros"  # zeros | learned  (s_0)
    state_in_output: bool = True  # logits = Head(FinalNorm(h_R + W_o s_R))
    state_A_init: tuple[float, float] = (1.0, 16.0)  # selective update: exp(A_log) ~ U[a, b], as in Mamba
    state_dt_init: tuple[float, float] = (1e-3, 1e-1)  # selective update: softplus(b_Δ) ~ logU[a, b]

    # --- exit gate (docs/formulations.md#exit-gate) --------------------------
    exit_gate: str = "none"  # none | ouro

    # --- input injection (docs/formulations.md#input-injection) --------------
    injection: str = "none"  # none | add | concat | diag: the embedding re-enters before loops 2..R

    # --- depth router (docs/formulations.md#routed-depth) --------------------
    depth_router: RouterConfig = field(default_factory=RouterConfig,  # name none = today's model exactly
                                       metadata=_keep_if(lambda c: c.depth_router.name != "none"))

    # --- loop schedule (docs/formulations.md#parallel-loops) -----------------
    # sequential: loop r+1 reads loop r's output at the same token (every model above). parallel: cross-loop
    # parallelism, loop r+1 reads a·E + b·shift(H^(r)), the previous loop's output one token back, so the R
    # loops of one decoded token are independent rows of one block call (models/parallel.py). The parallel
    # schedule's options are kept in a sequential model's dict (and its checkpoints' hash) only when set.
    loop_schedule: str = field(default="sequential", metadata=_keep_if(lambda c: c.loop_schedule != "sequential"))
    loop_kv: str = field(default="own", metadata=_keep_if(lambda c: c.loop_schedule != "sequential"))
    #  parallel: own (each loop its own keys/values) | share_first (loops >= 2 attend to loop 1's)
    #  | gswa (loop 1's, gated with a sliding window of loop_window over the loop's own)
    loop_window: int = field(default=64, metadata=_keep_if(lambda c: c.loop_schedule != "sequential"))
    #  gswa: the sliding window w over a loop's own keys/values (itself included)
    loop_gate: str = field(default="query", metadata=_keep_if(lambda c: c.loop_schedule != "sequential"))
    #  gswa: g = σ(q_h·w_h + b_h) (query) | σ(Linear(RMSNorm(x))) of the residual (residual);
    #  out = g·(attention to loop 1's keys) + (1 − g)·(windowed attention to the loop's own)
    loop_mix: tuple[float, float] = field(default=(1.0, 1.0),
                                          metadata=_keep_if(lambda c: c.loop_schedule != "sequential"))
    #  (a, b): loops >= 2 read a·E + b·shift(H); E + shift(H) by default
    loop_mix_learned: bool = field(default=False, metadata=_keep_if(lambda c: c.loop_schedule != "sequential"))
    #  a and b are parameters, initialised at loop_mix
    loop_norm: bool = field(default=False, metadata=_keep_if(lambda c: c.loop_schedule != "sequential"))
    #  the final norm on shift(H) before it is mixed in (vLLM's plt_normalize_per_loop)

    # --- a registered variant's own hyperparameters, by axis (models/registry.py OPTION_AXES) ----
    # e.g. {"state_update": {"gate_bias": 1.0}}; values at their defaults are dropped, so an option enters the
    # architecture hash only where it is set to something else
    options: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=_keep_if(lambda c: bool(c.options)))

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
        self._resolve_state()
        self._resolve_options()
        self.validate()

    def _resolve_state(self) -> None:
        """state_mode / state_mixer → the update rule and the mixer; the canonical names (the alias when one names
        the pair), so that two spellings of one model are one config with one hash."""
        aliases = STATE_UPDATES.aliases()
        mode, mixer = self.state_mode, self.state_mixer
        if isinstance(mode, str) and mode in aliases:
            update, implied = aliases[mode]
            if mixer not in (None, implied):
                raise ConfigError(f"state_mode={mode!r} (= {update} + mixer {implied}) with state_mixer={mixer!r}: "
                                  f"set state_mode={update} state_mixer={mixer}, or drop state_mixer")
            mixer = implied
        else:
            update = mode
        STATE_UPDATES.get(update)  # unknown names fail here, naming the field
        mixer = "none" if mixer is None else mixer
        STATE_MIXERS.get(mixer)
        self.state_mixer = mixer
        self.state_mode = next((a for a, pair in aliases.items() if pair == (update, mixer)), update)

    def _resolve_options(self) -> None:
        if not isinstance(self.options, dict):
            raise ConfigError(f"options={self.options!r} must be a mapping of axis → {{option: value}}")
        out = {}
        for axis, values in self.options.items():
            if axis not in OPTION_AXES:
                raise ConfigError(f"options[{axis!r}]: unknown axis; choose one of {sorted(OPTION_AXES)}")
            cls = OPTION_AXES[axis].get(self.variant_name(axis))
            try:
                kept = option_values(cls, values, f"{OPTION_AXES[axis].field}={self.variant_name(axis)!r}")
            except UnknownOptionError as e:
                e.axis = axis  # the Hydra front end names the keys as typed (training/compose.py)
                raise
            if kept:
                out[axis] = kept
        self.options = out

    # ------------------------------------------------------------------------
    @property
    def state_update(self) -> str:
        """The update rule's registered name (state_mode without the mixer an alias names)."""
        alias = STATE_UPDATES.aliases().get(self.state_mode)
        return self.state_mode if alias is None else alias[0]

    def variant_name(self, axis: str) -> str:
        """The name chosen on one axis (models/registry.py REGISTRIES)."""
        return {"state_update": self.state_update, "state_mixer": self.state_mixer, "backbone": self.backbone,
                "injection": self.injection, "loop_schedule": self.loop_schedule, "exit_gate": self.exit_gate,
                "depth_router": self.depth_router.name}[axis]

    def variants(self) -> list[tuple[str, type]]:
        """Every variant this model is built from, each with how the config names it — the block's layer kinds,
        the state update and mixer, the exit gate, the injection, the router, the loop schedule."""
        out = [(f"backbone={self.backbone}", BACKBONES.get(self.backbone))]
        kinds = self.all_layer_types
        for kind in dict.fromkeys(kinds):
            cls = LAYERS.get(kind)
            mixed = len(set(kinds)) > 1
            out.append((f"backbone={self.backbone}" + (f" ({cls.title} layers)" if mixed else ""), cls))
        out.append((f"state_mode={self.state_mode}", STATE_UPDATES.get(self.state_update)))
        if self.state_mixer != "none":
            out.append((f"state_mode={self.state_mode} (mixer {self.state_mixer})", STATE_MIXERS.get(self.state_mixer)))
        out.append((f"exit_gate={self.exit_gate}", EXIT_GATES.get(self.exit_gate)))
        out.append((f"injection={self.injection}", INJECTIONS.get(self.injection)))
        out.append((f"depth_router={self.depth_router.name}", DEPTH_ROUTERS.get(self.depth_router.name)))
        out.append((f"loop_schedule={self.loop_schedule}", LOOP_SCHEDULES.get(self.loop_schedule)))
        return out

    def unsupported(self, feature: str) -> str | None:
        """Why this model cannot do `feature` (models/registry.py FEATURES), naming every variant that refuses it, or
        None."""
        reasons = [f"{where}: {reason}" for where, cls in self.variants()
                   if (reason := cls.capabilities(self).why_not(feature))]
        return "; and ".join(reasons) if reasons else None

    def cache_owners(self, block_only: bool = False) -> list[tuple[str, str]]:
        """(where, cache kind) of every part that keeps a decoding cache entry per loop (prelude and coda included
        unless block_only)."""
        kinds = self.layer_types if block_only else self.all_layer_types
        out = []
        for kind in dict.fromkeys(kinds):
            cache = LAYERS.get(kind).supports.cache
            if cache:
                out.append((f"backbone={self.backbone!r} has {LAYERS.get(kind).title} layers", cache))
        if self.state_mixer != "none":
            cache = STATE_MIXERS.get(self.state_mixer).supports.cache
            if cache:
                out.append((f"the state mixer of state_mode={self.state_mode!r} is {self.state_mixer}", cache))
        return out

    def cache_kinds(self, block_only: bool = False) -> set[str]:
        return {kind for _, kind in self.cache_owners(block_only)}

    # ------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len", "ffn_hidden", "state_dim"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name}={v!r} must be a positive integer")
        for name, key in (("prelude_layers", "prelude"), ("coda_layers", "coda")):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                 f"{name} (loop_depth.{key})={v!r} must be an integer >= 0 (the number of non-shared layers "
                 f"{'before' if key == 'prelude' else 'after'} the looped block; 0 = none)")
        need(
            isinstance(self.n_loops, int) and not isinstance(self.n_loops, bool) and self.n_loops >= 1,
            f"n_loops (loop_depth.loops, R)={self.n_loops!r} must be >= 1: a looped model applies its block at least once",
        )
        backbone = BACKBONES.get(self.backbone)
        EXIT_GATES.get(self.exit_gate)
        INJECTIONS.get(self.injection)
        need(self.kernel in KERNELS, f"kernel={self.kernel!r} is unknown; choose one of {KERNELS}")
        need(self.state_init in ("zeros", "learned"), f"state_init={self.state_init!r} must be 'zeros' or 'learned'")
        # every variant's own check refuses as a ConfigError, a researcher's raising a plain ValueError included
        refuse_as_config_error(backbone.validate, self)
        for kind in dict.fromkeys(self.all_layer_types):  # each layer kind checks the widths it needs
            check = getattr(LAYERS.get(kind), "validate", None)
            if check is not None:
                refuse_as_config_error(check, self)
        if self.state_mixer != "none":
            need(STATE_UPDATES.get(self.state_update).builds_state,
                 f"state_mixer={self.state_mixer!r} with state_mode={self.state_update!r}: a mixer mixes the StateLoop "
                 "state, and this mode keeps none; choose a state update (e.g. state_mode=stateloop)")
            refuse_as_config_error(STATE_MIXERS.get(self.state_mixer).validate, self)
        for name in ("state_A_init", "state_dt_init", "mamba_A_init", "mamba_dt_init"):
            lo, hi = getattr(self, name)
            need(0 < lo <= hi, f"{name}={getattr(self, name)} must satisfy 0 < a <= b")
        router = DEPTH_ROUTERS.get(self.depth_router.name)
        if hasattr(router, "validate"):
            refuse_as_config_error(router.validate, self)
        refuse_as_config_error(LOOP_SCHEDULES.get(self.loop_schedule).validate, self)

    def validate_mamba_fields(self) -> None:
        """The Mamba-2 settings, for a Mamba-2 layer or mixer anywhere in the model."""
        for name in ("d_state", "headdim", "expand", "ngroups", "d_conv", "chunk_size", "fused_chunk_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        d_inner = self.expand * self.d_model
        if d_inner % self.headdim:
            raise ConfigError(f"expand*d_model={d_inner} is not divisible by headdim={self.headdim}")
        if (d_inner // self.headdim) % self.ngroups:
            raise ConfigError(f"ngroups={self.ngroups} must divide the number of heads {d_inner // self.headdim}")
        if self.kernel == "mamba_ssm" and self.d_conv not in CAUSAL_CONV1D_WIDTHS:
            raise ConfigError(fused_conv_width_error(self.d_conv))

    # ------------------------------------------------------------------------
    @property
    def layer_types(self) -> str:
        """One letter per layer of the looped block (models/registry.py LAYERS): 'A' attention(+MLP), 'M' Mamba-2."""
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
        return BACKBONES.get(self.backbone).layer_kinds(self, n)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def uses_state(self) -> bool:
        return STATE_UPDATES.get(self.state_update).builds_state

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for f in fields(self):
            keep = f.metadata.get("keep_if")
            if keep is not None and not keep(self):
                d.pop(f.name)  # a field added later: an earlier model's dict (and its checkpoints' hash) as it was
        for name in ("state_A_init", "state_dt_init", "mamba_A_init", "mamba_dt_init", "loop_mix"):
            if name in d:
                d[name] = list(getattr(self, name))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "a loaded model config") -> "LoopedLMConfig":
        """A config read back from a checkpoint or a folder (`source` names it in errors). Its variant names are data:
        a name that is not registered imports nothing unless its package is trusted (models/registry.py names_from)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: the model config is a {type(d).__name__}, not a mapping of fields")
        known = {f.name for f in fields(cls)}
        if d.get("model_type") == "looplab":
            # a remote-code transformers folder (convert to-hf): looplab's fields plus transformers' own keys, which
            # transformers writes as it likes from release to release; the looplab fields are the model
            d = {k: v for k, v in d.items() if k in known}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s) {unknown}; known fields: {sorted(known)}")
        with names_from(source):
            return cls(**d)

    def architecture_dict(self) -> dict[str, Any]:
        """Fields that decide parameter shapes; a checkpoint must match these to load."""
        d = self.to_dict()
        for k in ("extra", "kernel", "chunk_size", "max_seq_len"):
            d.pop(k)
        d.pop("fused_chunk_size", None)  # kept in to_dict only where it is not the default
        return d
