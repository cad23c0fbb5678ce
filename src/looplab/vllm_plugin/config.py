"""The transformers config vLLM builds for a looplab folder (`model_type: looplab`), and what the plugin runs.

vLLM reads config.json through transformers' AutoConfig; a `convert to-hf` folder names its own config class in
`auto_map` (remote code, which needs `trust_remote_code`). The plugin registers this class for `model_type:
looplab` instead (`register()`), so vLLM needs no flag and runs none of the folder's code. It reads the same
fields (looplab's names, LoopedLMConfig's) and derives the names vLLM reads (`hidden_size`, `num_attention_heads`,
`num_key_value_heads`, `head_dim`, `num_hidden_layers` = the number of attention slots the plugin builds).

`refusal(config)` is the one place that decides what the plugin runs: it returns, naming the field and its value,
why a configuration cannot be run exactly, or None.

Settings a folder does not hold, set at load time with `hf_overrides` (docs/vllm.md):
    n_loops          the test-time depth R′ (any R′ >= 1)
    exit_threshold   q in (0, 1]: each token is read at the first loop whose exit CDF reaches q (exit_gate=ouro)
    exit_skip        "kv_copy" (with exit_threshold): the loops after a token's exit do not run for it; each later
                     (loop, layer) slot gets its exit loop's keys and values (looplab's ExitPolicy(skip="kv_copy"),
                     vllm_plugin/exits.py). None (default): every loop runs for every token.
    parallel_fold    parallel loops only: a forward of decoded tokens only runs each token's R loops as R·T rows of
                     one block call (vllm_plugin/parallel.py); true (default) or false (loop after loop, as prompts)
"""

from __future__ import annotations

from transformers import PretrainedConfig

MODEL_TYPE = "looplab"

# what the plugin runs (llama blocks, sequential or parallel loops); anything else is refused by name
STATE_MODES = ("vanilla", "stateloop", "stateloop_attn", "stateloop_reset")
INJECTIONS = ("none", "add", "concat", "diag")
EXIT_GATES = ("none", "ouro")
LOOP_SCHEDULES = ("sequential", "parallel")
LOOP_KV = ("own", "share_first", "gswa")  # parallel loops: what loop r >= 2 attends to (looplab/models/parallel.py)
LOOP_GATES = ("query", "residual")
EXIT_SKIPS = ("kv_copy",)  # what an exited token leaves in the later slots (looplab/models/exit_compute.py)
PARALLEL_ARCHITECTURE = "LoopedLMParallelForCausalLM"  # the same folder under parallel loops: a model with a carry


def slot_layout(cfg) -> dict:
    """Where each attention call keeps its keys and values (one vLLM Attention per slot):

    prelude layer p           → p
    block layer l in loop r   → P + r·N + l
    StateLoop mixer in loop r → P + R·N + r                          (state_mode=stateloop_attn)
    coda layer c at depth r   → P + R·N + R·M + r·C + c    with an exit threshold (the coda runs at every depth)
                              → P + R·N + R·M + c          otherwise (the coda runs on the last loop only)
    """
    P, N, C, R = cfg.prelude_layers, cfg.n_layers, cfg.coda_layers, cfg.n_loops
    M = 1 if cfg.state_mode == "stateloop_attn" else 0
    coda_depths = R if getattr(cfg, "exit_threshold", None) is not None else 1
    B = R * N  # parallel loops with share_first: loop 1's slots only (loops 2..R read them and keep no keys)
    if schedule(cfg) == "parallel" and getattr(cfg, "loop_kv", "own") == "share_first":
        B = N
    return {"prelude": 0, "block": P, "state": P + B, "coda": P + B + R * M,
            "total": P + B + R * M + coda_depths * C, "coda_depths": coda_depths}


def schedule(cfg) -> str:
    return getattr(cfg, "loop_schedule", "sequential") or "sequential"


def variant_state_update(cfg) -> bool:
    """A registered state update that brings its export code: registered in this process with an export_source, or
    shipped in the folder (config.json's looplab_variants). Which code runs is vllm_plugin/variants.py's to say."""
    from looplab.models.registry import REGISTRIES, ConfigError
    from looplab.vllm_plugin.variants import shipped_state_update

    if shipped_state_update(cfg).get("name") == cfg.state_mode:
        return True

    try:
        cls = REGISTRIES["state_update"].get(cfg.state_mode)
    except ConfigError:
        return False
    return getattr(cls, "export_source", None) is not None


def refusal(cfg, supported_head_sizes=None) -> str | None:
    """Why the plugin cannot run this config exactly (the field and its value), or None."""
    def bad(field, why):
        return f"{field}={getattr(cfg, field, None)!r}: {why}"

    if cfg.backbone != "llama":
        return bad("backbone", "Mamba-2 and hybrid blocks are not in the vLLM plugin yet (it has no Mamba-2 layer "
                   "with one state per (loop, layer)); serve them with looplab.serve.Engine")
    if cfg.state_mode not in STATE_MODES and not variant_state_update(cfg):
        return bad("state_mode", f"the plugin runs {', '.join(STATE_MODES)} and registered update rules that bring "
                   "their export code (export_source; stateloop_mamba2's Mamba-2 mixer is not in it)")
    if cfg.injection not in INJECTIONS:
        return bad("injection", f"the plugin runs {', '.join(INJECTIONS)}")
    if cfg.exit_gate not in EXIT_GATES:
        return bad("exit_gate", f"the plugin runs {', '.join(EXIT_GATES)}")
    sched = schedule(cfg)
    if sched not in LOOP_SCHEDULES:
        return bad("loop_schedule", f"the plugin runs {', '.join(LOOP_SCHEDULES)}")
    if sched == "parallel":
        if getattr(cfg, "loop_kv", "own") not in LOOP_KV:
            return bad("loop_kv", f"the plugin runs {', '.join(LOOP_KV)}")
        if getattr(cfg, "loop_gate", "query") not in LOOP_GATES:
            return bad("loop_gate", f"the plugin runs {', '.join(LOOP_GATES)}")
        for field, ok in (("state_mode", "vanilla"), ("injection", "none"), ("exit_gate", "none")):
            if getattr(cfg, field) != ok:
                return bad(field, f"looplab runs parallel loops with {field}={ok} only")
        if getattr(cfg, "exit_threshold", None) is not None:
            return bad("exit_threshold", "exits pick a loop of the same token, which parallel loops compute at a "
                       "later step")
    router = getattr(cfg, "depth_router", None)
    if router not in (None, "none") and not (isinstance(router, dict) and router.get("name", "none") == "none"):
        return bad("depth_router", "routed depth runs each loop on a subset of the tokens, which vLLM's attention "
                   "metadata (one per forward, for every token) cannot express")
    mixer = getattr(cfg, "state_mixer", None)
    if mixer not in (None, "none"):
        return bad("state_mixer", f"with state_mode={cfg.state_mode!r}: the plugin runs the attention mixer with the "
                   "stateloop update only (state_mode=stateloop_attn)")
    options = dict(getattr(cfg, "options", None) or {})
    if cfg.state_mode not in STATE_MODES:  # a registered update rule's options reach its own code (self.options)
        options.pop("state_update", None)
    if options:
        return bad("options", "a registered variant's own hyperparameters; the plugin runs looplab's built-in variants "
                   "at their defaults only")
    if not isinstance(cfg.n_loops, int) or isinstance(cfg.n_loops, bool) or cfg.n_loops < 1:
        return bad("n_loops", "must be an integer >= 1")
    q = getattr(cfg, "exit_threshold", None)
    if q is not None:
        if cfg.exit_gate == "none":
            return bad("exit_threshold", "needs a model with an exit gate (exit_gate=ouro)")
        if not isinstance(q, (int, float)) or isinstance(q, bool) or not 0 < float(q) <= 1:
            return bad("exit_threshold", "must lie in (0, 1]")
    if not isinstance(getattr(cfg, "parallel_fold", True), bool):
        return bad("parallel_fold", "must be true or false")
    skip = getattr(cfg, "exit_skip", None)
    if skip is not None:
        if skip not in EXIT_SKIPS:
            return bad("exit_skip", f"the plugin runs {', '.join(EXIT_SKIPS)} (attention-only models: ssm_skip and "
                       "ssm_propagate fill Mamba-2 states, which the plugin does not build)")
        if q is None:
            return bad("exit_skip", "skips the loops after a token's exit, so it needs an exit_threshold")
    if supported_head_sizes is not None:
        hd = cfg.d_model // cfg.n_heads
        if hd not in supported_head_sizes:
            return (f"d_model/n_heads={cfg.d_model}/{cfg.n_heads}={hd}: vLLM's attention backend here supports head "
                    f"sizes {list(supported_head_sizes)}")
        if cfg.state_mode == "stateloop_attn" and cfg.state_dim // cfg.n_heads not in supported_head_sizes:
            return (f"state_dim/n_heads={cfg.state_dim}/{cfg.n_heads}={cfg.state_dim // cfg.n_heads} (the "
                    f"stateloop_attn mixer's head size): vLLM's attention backend here supports head sizes "
                    f"{list(supported_head_sizes)}")
    return None


class LoopedLMVLLMConfig(PretrainedConfig):
    """config.json of a `convert to-hf` folder, as the plugin reads it (no remote code)."""

    model_type = MODEL_TYPE

    def __init__(self, vocab_size=256, d_model=64, n_heads=4, n_kv_heads=None, n_layers=1, n_loops=4,
                 prelude_layers=0, coda_layers=0, ffn_hidden=None, backbone="llama", max_seq_len=2048,
                 rope_base=10000.0, norm_eps=1e-5, tie_embeddings=False, state_mode="vanilla", state_dim=None,
                 state_init="zeros", state_in_output=True, exit_gate="none", injection="none", exit_threshold=None,
                 exit_skip=None, **kwargs):
        self.vocab_size, self.d_model, self.n_heads = vocab_size, d_model, n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.n_layers, self.n_loops = n_layers, n_loops
        self.prelude_layers, self.coda_layers = prelude_layers, coda_layers
        self.ffn_hidden = 64 * -(-int(8 * d_model / 3) // 64) if ffn_hidden is None else ffn_hidden
        self.backbone, self.max_seq_len, self.rope_base, self.norm_eps = backbone, max_seq_len, rope_base, norm_eps
        self.tie_embeddings = tie_embeddings
        mixer = kwargs.get("state_mixer")
        if mixer in (None, "none"):
            kwargs.pop("state_mixer", None)
        elif mixer == "attn" and state_mode in ("stateloop", "stateloop_attn"):
            state_mode = "stateloop_attn"  # the same model under looplab's two spellings
            kwargs.pop("state_mixer")
        # any other mixer (or the attention mixer with another update rule) stays, and `refusal` names it
        self.state_mode, self.state_dim = state_mode, d_model if state_dim is None else state_dim
        self.state_init, self.state_in_output = state_init, state_in_output
        self.exit_gate, self.injection = exit_gate, injection
        self.exit_threshold, self.exit_skip = exit_threshold, exit_skip
        for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "max_position_embeddings", "rms_norm_eps", "num_hidden_layers"):
            kwargs.pop(k, None)  # derived from the looplab fields (`_derive`)
        kwargs["tie_word_embeddings"] = bool(tie_embeddings)
        kwargs.pop("auto_map", None)  # the folder's remote code is not used: the plugin's classes are
        if kwargs.get("loop_schedule") == "parallel":  # vLLM gives a model with per-request state its own class
            kwargs["architectures"] = [PARALLEL_ARCHITECTURE]
        super().__init__(**kwargs)
        self._derive()

    def _derive(self) -> None:
        object.__setattr__(self, "hidden_size", self.d_model)
        object.__setattr__(self, "num_attention_heads", self.n_heads)
        object.__setattr__(self, "num_key_value_heads", self.n_kv_heads)
        object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        object.__setattr__(self, "intermediate_size", self.ffn_hidden)
        object.__setattr__(self, "max_position_embeddings", self.max_seq_len)
        object.__setattr__(self, "rms_norm_eps", self.norm_eps)
        object.__setattr__(self, "num_hidden_layers", slot_layout(self)["total"])
        object.__setattr__(self, "tie_word_embeddings", bool(self.tie_embeddings))

    def update(self, config_dict):
        """hf_overrides (e.g. {"n_loops": 6, "exit_threshold": 0.5}) arrive here: the derived names follow."""
        super().update(config_dict)
        self._derive()
