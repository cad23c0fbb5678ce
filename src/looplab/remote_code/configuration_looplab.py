"""transformers config of an exported looplab model (docs/interop.md#transformers-with-remote-code).

This file is copied verbatim into every folder `python -m looplab.convert to-hf` writes; it imports
torch and transformers only, so the folder loads where looplab is not installed:

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)            # depth R
    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, n_loops=6)  # test-time depth R′

The looplab fields keep looplab's names (n_layers, n_loops, state_mode, ...: LoopedLMConfig's), so
`LoopedLM.from_pretrained(folder)` reads the same config.json; the transformers names
(hidden_size, num_attention_heads, ...) are derived from them. `num_hidden_layers` is the number of
key/value slots, one per unrolled attention call (see `attention_slots`), not the number of
distinct layers: the stock DynamicCache sizes itself by it.
"""

try:
    from transformers import PreTrainedConfig  # transformers 5.x's name
except ImportError:  # 4.x
    from transformers import PretrainedConfig as PreTrainedConfig

# Not used here: imported so that transformers keys this config class by the variant code the folder ships too.
# transformers names a folder's remote code by the folder's name and a hash of the file and its relative imports, and
# reuses the model class it registered for a config class; without this import two folders of one name (runs/a/hf,
# runs/b/hf) with different variant code would share one config class, and the second would run the first's model.
from .looplab_variants import VARIANTS as _SHIPPED_VARIANTS  # noqa: F401,E402


def state_mixer(config) -> str:
    """The state's cross-token mixer: none or attn (state_mode=stateloop_attn names the attention mixer; another state
    update names it in state_mixer, kept in config.json only when set)."""
    if config.state_mode == "stateloop_attn":
        return "attn"
    return getattr(config, "state_mixer", None) or "none"


def attention_slots(config) -> dict:
    """Where each attention call keeps its keys and values: slot = its index in the unrolled order.

    prelude layer p            → p
    block layer l in loop r    → P + r·N + l
    StateLoop mixer in loop r  → P + R·N + r                  (the attention mixer: state_mixer)
    coda layer c at depth r    → P + R·N + R·M + r·C + c      (M = 1 with a mixer; the coda runs at each
                                                               depth whose output is read: exits)
    Returns {"prelude": P, "block": ..., ...} starts and the total as "total"."""
    P, N, C, R = config.prelude_layers, config.n_layers, config.coda_layers, config.n_loops
    M = 1 if state_mixer(config) == "attn" else 0
    return {"prelude": 0, "block": P, "state": P + R * N, "coda": P + R * N + R * M,
            "total": P + R * N + R * M + R * C}


class LoopedLMHFConfig(PreTrainedConfig):
    model_type = "looplab"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(self, vocab_size=256, d_model=64, n_heads=4, n_kv_heads=None, n_layers=1, n_loops=4,
                 prelude_layers=0, coda_layers=0, ffn_hidden=None, backbone="llama", max_seq_len=2048,
                 rope_base=10000.0, norm_eps=1e-5, tie_embeddings=False, state_mode="vanilla", state_dim=None,
                 state_init="zeros", state_in_output=True, exit_gate="none", injection="none", **kwargs):
        self.vocab_size, self.d_model, self.n_heads = vocab_size, d_model, n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.n_layers, self.n_loops = n_layers, n_loops
        self.prelude_layers, self.coda_layers = prelude_layers, coda_layers
        self.ffn_hidden = 64 * -(-int(8 * d_model / 3) // 64) if ffn_hidden is None else ffn_hidden
        self.backbone, self.max_seq_len, self.rope_base, self.norm_eps = backbone, max_seq_len, rope_base, norm_eps
        self.tie_embeddings = tie_embeddings
        self.state_mode, self.state_dim = state_mode, d_model if state_dim is None else state_dim
        self.state_init, self.state_in_output = state_init, state_in_output
        self.exit_gate, self.injection = exit_gate, injection
        mixer = kwargs.pop("state_mixer", None)
        if mixer is not None:  # kept only when set, as in looplab's config.json (read before super().__init__ sets it)
            self.state_mixer = mixer
        # the names transformers, lm-eval and vLLM read
        for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "max_position_embeddings", "rms_norm_eps", "num_hidden_layers"):
            kwargs.pop(k, None)  # always derived from the looplab fields above
        self.hidden_size = d_model
        self.num_attention_heads, self.num_key_value_heads = n_heads, self.n_kv_heads
        self.head_dim = d_model // n_heads
        self.intermediate_size = self.ffn_hidden
        self.max_position_embeddings, self.rms_norm_eps = max_seq_len, norm_eps
        self.num_hidden_layers = attention_slots(self)["total"]
        kwargs["tie_word_embeddings"] = bool(tie_embeddings)
        self.use_cache = kwargs.pop("use_cache", True)
        super().__init__(**kwargs)
