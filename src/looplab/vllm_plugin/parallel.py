"""Parallel loops (loop_schedule=parallel) in the vLLM plugin: the carry between decoding steps, and the attention
of loops 2..R (looplab/models/parallel.py is the reference; docs/formulations.md#parallel-loops).

    loop 1:      H^(1) = Block(E)
    loop r ≥ 2:  H^(r) = Block(a·E + b·N(shift(H^(r−1))))      shift: token t reads t − 1 (zeros at position 0)

vLLM hands the model a flat batch of tokens from many requests, each request's tokens contiguous, and continues a
request in later forwards (its next chunk of prompt, or one decoded token). Within a request's chunk the shift is
the previous row; a chunk's first token (position > 0) reads what the previous forward left: N(H^(r)) of the
request's last token, r = 1..R−1 (looplab's `LoopCache.carry["loop_hidden"]`). vLLM 0.32 keeps per-request
state only in Mamba-style layers (a slot per request that its scheduler allocates, frees and passes in the
attention metadata), so the carry is one: `LoopCarry`, a MambaBase layer with one state of shape (R − 1, d) per
request and no weights, on the short-convolution backend's metadata (decode rows first, one token each, then
prefill rows with their `query_start_loc`). It reads the carry of each request's first token before the loops
and writes each request's last token's N(H^(1..R−1)) after them.

Attention of loop r ≥ 2 (`loop_kv`), with loop 1's slot the one every loop-1 call writes:
    own          its own slot (one full KV cache per (loop, layer)), as the sequential schedule.
    share_first  loop 1's slot, read without writing (vLLM's `Attention(q, None, None)`, as iquest_loopcoder.py).
    gswa         g·Attn(loop 1's slot) + (1 − g)·Attn(its own slot, a sliding window of w tokens), g per head:
                 σ(q_h·w_h + b_h) from the query after RoPE (`loop_gate=query`) or σ(Linear(RMSNorm(x))) from the
                 layer's input (`residual`).
Loops run one after another over the forward's tokens (looplab's cache-free forward, and its prefill). A forward
that only decodes (one token per request, no prompt rows) folds them instead, as looplab's Engine does: a decoded
token's loop r ≥ 2 reads its carry, not a row of this forward, so its R loops run as R·T rows of one block call,
each loop's attention in its own slots (`LoopedLMModel.forward_folded`; `hf_overrides={"parallel_fold": False}`
keeps loop after loop).
"""

from __future__ import annotations

from collections import Counter

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaCopySpec
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum


# folded decoding steps over the process's forwards (what a test reads to see them run; the engine runs in its process)
FOLDED = Counter()


def carry_shape(cfg) -> tuple[int, int]:
    return (max(cfg.n_loops - 1, 1), cfg.d_model)


def carry_dtype(vllm_config: VllmConfig) -> torch.dtype:
    return vllm_config.model_config.dtype


def copy_whole_state(state: torch.Tensor, block_ids: list[int], cur_block_idx: int,
                     num_accepted_tokens: int) -> MambaCopySpec:
    """Prefix caching in align mode copies a request's carry as a whole (it is the state after its last token)."""
    src = state[block_ids[cur_block_idx + num_accepted_tokens - 1]]
    return MambaCopySpec(start_addr=src.data_ptr(), num_elements=src.numel())


class LoopCarry(MambaBase):
    """Per request: N(H^(r)) of its last token, r = 1..R−1, shape (R − 1, d). No weights."""

    def __init__(self, cfg, prefix: str):
        super().__init__()
        vllm_config = get_current_vllm_config()
        if vllm_config.num_speculative_tokens:
            raise ValueError("loop_schedule=parallel: the vLLM plugin does not run speculative decoding with "
                             "parallel loops (their carry is one state per request, with no per-draft slots)")
        self.shape, self.dtype = carry_shape(cfg), carry_dtype(vllm_config)
        self.prefix = prefix
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_state_shape(self):
        return (self.shape,)

    def get_state_dtype(self):
        return (self.dtype,)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV  # its metadata only: slots, decode/prefill split, query starts

    def metadata(self):
        """This forward's short-convolution metadata for the carry, or None (a profiling run)."""
        meta = get_forward_context().attn_metadata
        return meta.get(self.prefix) if isinstance(meta, dict) else None

    def rows(self, num_tokens: int, device):
        """(first token, last token, state slot) of each request in this forward, or None (a profiling run)."""
        meta = self.metadata()
        if meta is None:
            return None
        n_dec, n_dec_tok = meta.num_decodes, meta.num_decode_tokens
        firsts, lasts, slots = [], [], []
        if n_dec:
            idx = torch.arange(n_dec_tok, device=device)
            firsts.append(idx)
            lasts.append(idx)
            slots.append(meta.state_indices_tensor_d[:, 0])
        if meta.num_prefills:
            qsl = meta.query_start_loc_p.to(device) + n_dec_tok
            firsts.append(qsl[:-1])
            lasts.append(qsl[1:] - 1)
            slots.append(meta.state_indices_tensor_p)
        firsts, lasts, slots = torch.cat(firsts), torch.cat(lasts), torch.cat(slots).long()
        # padded rows (a CUDA graph's batch rounded up to a captured size) carry slot −1 (PAD_SLOT_ID): indexing with
        # it would read, and write over, the last state block, another request's carry
        real = slots >= 0
        return firsts[real], lasts[real], slots[real]

    def decode_only(self) -> bool:
        """This forward decodes one token per request and has no prompt rows (False in a profiling run)."""
        meta = self.metadata()
        return meta is not None and meta.num_prefills == 0 and meta.num_decodes > 0

    def read(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """like (T, d) → (carried (T, R−1, d): each request's carry at its first token's row, zeros elsewhere;
        first (T,): 1.0 at those rows)."""
        carried = like.new_zeros(like.shape[0], *self.shape)
        first = like.new_zeros(like.shape[0])
        rows = self.rows(like.shape[0], like.device)
        if rows is not None:
            f, _, slot = rows
            carried[f] = self.kv_cache[0][slot].to(carried.dtype)
            first[f] = 1
        else:  # profiling: every row its own request
            first.fill_(1)
        return carried, first

    def write(self, last_loops: torch.Tensor) -> None:
        """last_loops (T, R−1, d) = N(H^(1..R−1)) of every token: each request's last token's rows are kept."""
        rows = self.rows(last_loops.shape[0], last_loops.device)
        if rows is not None:
            _, last, slot = rows
            self.kv_cache[0][slot] = last_loops[last].to(self.dtype)


def _layer(name: str) -> LoopCarry:
    return get_forward_context().no_compile_layers[name]


def looplab_carry_read(like: torch.Tensor, depth: int, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer(layer_name).read(like)


def _carry_read_fake(like: torch.Tensor, depth: int, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return like.new_empty(like.shape[0], depth, like.shape[1]), like.new_empty(like.shape[0])


def looplab_carry_write(loops: list[torch.Tensor], out: torch.Tensor, layer_name: str) -> torch.Tensor:
    _layer(layer_name).write(torch.stack(loops, 1))
    return out.clone()


def _carry_write_fake(loops: list[torch.Tensor], out: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(out)


# Custom ops, as vLLM's own Mamba layers have them, so that a compiled graph keeps them as opaque calls. Both are
# functional: the read returns new tensors, the write returns the forward's output (so it runs before the output is
# used, and is never dropped). The write takes the loops' outputs as a list and stacks them itself. Measured: with
# torch.stack in the graph, feeding the op, vLLM's compiled forward computed loop 1's output wrong (exact in eager
# mode, and with either op alone); probably inductor writing the loops' outputs in place into the stack's buffer.
direct_register_custom_op(op_name="looplab_carry_read", op_func=looplab_carry_read, fake_impl=_carry_read_fake)
direct_register_custom_op(op_name="looplab_carry_write", op_func=looplab_carry_write, fake_impl=_carry_write_fake)


def carried_in(carry: LoopCarry, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(carried (T, R−1, d), first (T, 1)): each request's carry at its first token's row (zeros elsewhere), and
    1.0 at those rows."""
    carried, first = torch.ops.vllm.looplab_carry_read(like, carry.shape[0], carry.prefix)
    return carried, first[:, None]


def shift(h: torch.Tensor, carried_r: torch.Tensor, first: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """h (T, d) = N(H^(r−1)) → the value at each token's previous token: the previous row, or the carried value at
    a request's first row; zeros at position 0 (a request's first token starts its chains, as looplab's shift)."""
    prev = torch.cat([h.new_zeros(1, h.shape[1]), h[:-1]], 0)
    prev = torch.where(first > 0, carried_r, prev)
    return prev.masked_fill((positions == 0)[:, None], 0.0)


def keep_carry(carry: LoopCarry, loops: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """loops: N(H^(r)) (T, d) of r = 1..R−1 → each request's last token's rows become its carry; returns `out`
    (passed as a list: see the note above the ops)."""
    return torch.ops.vllm.looplab_carry_write(loops, out, carry.prefix)
