"""A cached decoding step with static shapes (docs/decoding.md#static-shape-decoding): capturable by CUDA graphs.

Plain cached decoding (models/generation.py) slices the key/value buffers to the current length
and counts lengths in Python, so every step has new shapes and new Python state: fine eagerly,
but `torch.compile` would recompile (or guard) at each length and CUDA graphs cannot replay it.
Here, as in gpt-fast, every step has the same shapes:

    key/values   each (loop, layer) buffer (B, Hkv, max_len, hd) is written at a position held in a
                 one-element tensor (`index_copy_`), and attention always reads all max_len keys
    mask         one (B, 1, 1, max_len) bool buffer: the keys written so far that are real tokens
                 (left padding excluded); the decoder sets column t before step t writes it
    positions    the RoPE positions of the new token, a (B, 1) tensor advanced in place

so `step` is a pure function of tensors that only mutates buffers, and
`torch.compile(step, mode="reduce-overhead")` captures it in a CUDA graph (`make gpu-check` runs it
and checks the tokens; on the CPU `compile=True` uses inductor's default mode). The prompt is prefilled
by the ordinary cached forward, whose key/values are copied into the static buffers.

Scope: attention-only models (llama backbone; vanilla or StateLoop without a mixer; any prelude,
coda and injection). Mamba-2 layers and StateLoop mixers keep Python-side lengths in their caches and
are refused, naming the option; exit rules and self-speculation use the ordinary decoders.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """A KVCache of fixed shape: `update` writes at the shared position tensor and returns the whole buffers;
    attention then reads `attn_mask` instead of building one from a length (CausalSelfAttention.forward)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, mask: torch.Tensor):
        self.k, self.v, self.index, self.attn_mask = k, v, index, mask

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.index_copy_(2, self.index, k)
        self.v.index_copy_(2, self.index, v)
        return self.k, self.v


def static_decode_unsupported(config) -> str | None:
    """Why this model cannot decode with static shapes, or None."""
    if "M" in config.all_layer_types:
        return (f"static decoding (compile=...) needs attention-only layers, but backbone={config.backbone!r} has "
                "Mamba-2 layers; decode without compile")
    if config.state_mode in ("stateloop_attn", "stateloop_mamba2"):
        return (f"static decoding (compile=...) does not cover state_mode={config.state_mode!r} (its mixer has its own "
                "cache); decode without compile")
    return None


MODES = ("eager", "compile", "reduce-overhead", "max-autotune")  # generate(static_cache=...)


def static_decoder(model, batch_size: int, max_len: int, mode: str, n_loops: int | None = None) -> "StaticDecoder":
    """The model's decoder for (batch, max_len, depth, mode), built once and reused (a compiled step compiles once)."""
    if mode not in MODES:
        raise ValueError(f"static_cache={mode!r} is unknown; choose one of {', '.join(MODES)} (or false)")
    R = model.loops(n_loops)
    decoders = model.__dict__.setdefault("_static_decoders", {})  # not a module attribute: no state-dict keys
    key = (batch_size, max_len, R, mode, model.head.weight.device, model.head.weight.dtype)
    if key not in decoders:
        decoders[key] = StaticDecoder(model, batch_size, max_len, compile=False if mode == "eager" else
                                      (True if mode == "compile" else mode), n_loops=R)
    return decoders[key]


class StaticDecoder:
    """Greedy/sampled decoding steps of one batch with static shapes; `step` may be compiled.

        dec = StaticDecoder(model, batch_size=B, max_len=T + n, compile="reduce-overhead")
        logits = dec.prefill(ids, attention_mask)        # (B, V), the last prompt position
        logits = dec.step(next_tokens)                    # (B, V), one new token per row
    """

    def __init__(self, model, batch_size: int, max_len: int, compile: bool | str = False, n_loops: int | None = None):
        reason = static_decode_unsupported(model.config)
        if reason:
            raise ValueError(reason)
        self.model = model
        self.R = model.loops(n_loops)
        p = model.head.weight
        self.cache = model.allocate_cache(batch_size, max_len, n_loops=self.R)  # prefill writes here first
        self.index = torch.zeros(1, dtype=torch.long, device=p.device)
        self.mask = torch.zeros(batch_size, 1, 1, max_len, dtype=torch.bool, device=p.device)
        self.positions = torch.zeros(batch_size, 1, dtype=torch.long, device=p.device)
        self.entries = {key: StaticKVCache(e.k, e.v, self.index, self.mask) for key, e in self.cache.entries.items()}
        self.length = 0
        self.max_len = max_len
        self._step = self._eager_step
        if compile:
            mode = compile if isinstance(compile, str) else None
            self._step = torch.compile(self._eager_step, mode=mode, fullgraph=True, dynamic=False)

    def reset(self) -> None:
        """Empty, for the next prompt of the same batch size (the compiled step is kept; stale rows are masked)."""
        c = self.cache
        c.length, c.has_padding, c.mark = 0, False, None
        c.valid.fill_(True)
        c.next_pos.zero_()
        for e in c.entries.values():
            e.length = 0
        self.mask.zero_()
        self.positions.zero_()
        self.length = 0

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The prompt through the ordinary cached forward (its key/values land in the same buffers)."""
        if self.length:
            self.reset()
        out = self.model(input_ids, attention_mask=attention_mask, cache=self.cache, n_loops=self.R)
        T = input_ids.shape[1]
        valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        self.mask[:, 0, 0, :T] = valid
        self.positions.copy_(self.cache.next_pos[:, None])
        self.length = T
        return out.logits[:, -1]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B,) or (B, 1) → the next logits (B, V)."""
        if self.length >= self.max_len:
            raise RuntimeError(f"static cache full: {self.length} tokens = max_len={self.max_len}")
        self.index.fill_(self.length)
        self.mask[:, 0, 0, self.length] = True
        logits = self._step(tokens.reshape(-1, 1), self.positions)
        self.positions += 1
        self.length += 1
        return logits

    def _eager_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        model, entries = self.model, self.entries  # entries: (loop, layer) → StaticKVCache, as LoopCache is indexed
        x = e = model.run_prelude(model.embed(tokens), positions, None, entries)
        s = model.state.initial_state(x) if model.state is not None else None
        for r in range(self.R):
            h, x, s, _ = model.loop_step(x, s, e, r, positions, None, entries)
        z = model.readout(h, x)
        for l, layer in enumerate(model.coda):
            z = layer(z, positions, None, entries[self.R - 1, ("coda", l)])
        return model.head(model.final_norm(z))[:, -1]
