"""Parallel loops: cross-loop parallelism and gated shared-KV attention (docs/formulations.md#parallel-loops).

The Parallel Loop Transformer (PLT; Wu, Chen et al., arXiv 2510.24824; served by vLLM's `iquest_loopcoder.py`)
changes what loop r+1 reads: the previous loop's output one token back, not at the same token.

    loop 1:      H^(1) = Block(E)
    loop r ≥ 2:  H^(r) = Block(a·E + b·N(shift(H^(r−1))))      shift: position t reads t − 1
    logits = Head(FinalNorm(Coda(H^(R))))

E is the prelude's output (the embedding without one); N is the final norm with `loop_norm`, else the
identity; (a, b) = `loop_mix`, parameters with `loop_mix_learned`. The shift puts zeros at each row's
first real token (RoPE position 0), so a left-padded row starts its chains where its tokens start. The
prediction at t then comes from a chain that started at token t − R + 1.

Why: in decoding, loop r of token i reads loop r−1 of token i − 1, which the previous step computed. The R
loops of one token are independent rows at the same position, so one call of the shared block on R rows
produces every loop (`decode_folded`) and the weights are read once per token, as for an unlooped model.
The decoder carries R − 1 vectors per row between steps (`LoopCache.carry["loop_hidden"]`: N(H^(r)) of the
last token, r = 1..R−1).

Attention (`loop_kv`) — what loop r ≥ 2's queries read:
    own          its own keys/values (causal), one full cache per loop: R full caches.
    share_first  loop 1's keys/values only (causal): one full cache. Loop r ≥ 2 computes no keys it keeps.
    gswa         out = g·Attn(q, loop-1 K/V, causal) + (1 − g)·Attn(q, own K/V in a window of w tokens,
                 itself included), g ∈ (0, 1) per head and position: σ(q_h·w_h + b_h) from the query after
                 RoPE (`loop_gate=query`, vLLM's default) or σ(Linear(RMSNorm(x))) from the layer's input
                 residual (`residual`). g multiplies the global (loop-1) branch, as in vLLM. KV memory: one
                 full cache plus R − 1 rings of w tokens.
Loop 1 always attends causally to its own keys/values (for share_first and gswa: the shared cache).

Design choices where the papers are silent: the gate is one per layer, shared by loops 2..R (vLLM's); the
coda runs on the last loop's output only (a cache holds coda entries for loop R only); the window counts
tokens (a left-padding column is never in it); `n_loops=R′` runs R′ loops of the same schedule (loop r's
output does not depend on later loops, so depth R′'s first R loops are depth R's).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from looplab.models.config import LOOP_GATES, LOOP_KV, ConfigError, LoopedLMConfig
from looplab.models.llama import RMSNorm, attention_mask
from looplab.models.outputs import LoopedLMOutput
from looplab.models.registry import LOOP_SCHEDULES, Supports
from looplab.models.schedule import LoopSchedule

__all__ = ["LoopAttention", "LoopGate", "LoopInput", "Parallel", "ParallelKVCache", "decode_folded",
           "parallel_forward", "parallel_states"]

NO_COLUMN = -(1 << 40)  # a ring slot that holds no token (never inside a window)


class LoopInput(nn.Module):
    """a·E + b·prev: what loops 2..R read. Parameters only with loop_mix_learned (else no state-dict keys)."""

    def __init__(self, cfg: LoopedLMConfig):
        super().__init__()
        self.init = tuple(float(v) for v in cfg.loop_mix)
        if cfg.loop_mix_learned:
            self.a = nn.Parameter(torch.tensor(self.init[0]))
            self.b = nn.Parameter(torch.tensor(self.init[1]))
        else:
            self.a, self.b = self.init

    def forward(self, e: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        if isinstance(self.a, float) and self.init == (1.0, 1.0):
            return e + prev
        return self.a * e + self.b * prev

    @torch.no_grad()
    def reset_special_parameters(self, generator=None) -> None:
        if isinstance(self.a, nn.Parameter):
            self.a.fill_(self.init[0])
            self.b.fill_(self.init[1])


class LoopGate(nn.Module):
    """G-SWA's per-head gate g (b, H, T, 1): the weight of the global (loop-1 keys/values) branch."""

    def __init__(self, cfg: LoopedLMConfig):
        super().__init__()
        self.mode = cfg.loop_gate
        H, hd = cfg.n_heads, cfg.head_dim
        if self.mode == "query":
            self.weight = nn.Parameter(torch.empty(H, hd))  # initialised with the other matrices (models/looped.py)
            self.bias = nn.Parameter(torch.zeros(H))  # g = 1/2 at the bias: both branches weigh alike at init
        else:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.proj = nn.Linear(cfg.d_model, H, bias=True)

    def logit(self, q: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The gate's logit (b, H, T, 1); q (b, H, T, hd) after RoPE, residual (b, T, d) the layer's input."""
        if self.mode == "query":
            w, b = self.weight, self.bias
            if w.dtype != q.dtype:
                w, b = w.to(q.dtype), b.to(q.dtype)
            return torch.matmul(q, w[:, :, None]).add_(b[:, None, None])
        return self.proj(self.norm(residual)).transpose(1, 2)[..., None]

    def forward(self, q: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """g (b, H, T, 1), the global branch's weight."""
        return torch.sigmoid(self.logit(q, residual))

    def local_weight(self, q: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """1 − g = σ(−logit), the window branch's weight (one op fewer than 1 − σ)."""
        return torch.sigmoid(self.logit(q, residual).neg_())

    def flops_per_token(self) -> int:
        return 2 * sum(p.numel() for p in self.parameters() if p.dim() == 2)


def _sdpa(q, k, v, mask, causal: bool = True):
    """mask None: causal over T queries and T keys when causal (the Step's convention), else every key."""
    T = q.shape[2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None and T > 1,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _window_mask(qc: torch.Tensor, kc: torch.Tensor, w: int) -> torch.Tensor:
    """(b, 1, T, L): query column qc (b, T) reads key column kc (b, L) when qc − w < kc ≤ qc (NO_COLUMN never)."""
    q, k = qc[..., None], kc[:, None, :]
    return ((k <= q) & (k > q - w))[:, None]


class LoopAttention:
    """The attention of one block layer in a cache-free parallel forward: which keys/values loop r reads.
    `loop` is set before each loop's layer call; loop 1's keys/values are kept for the later loops."""

    def __init__(self, cfg: LoopedLMConfig, valid: torch.Tensor | None):
        self.kv, self.w, self.valid = cfg.loop_kv, cfg.loop_window, valid
        self.loop = 0
        self.first: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, q, k, v, attn, residual):
        T = q.shape[2]
        causal = attention_mask(self.valid, T, T, q.device)
        if self.loop == 0:
            self.first = (k, v)
        if self.loop == 0 or self.kv == "own":
            return _sdpa(q, k, v, causal)
        k1, v1 = self.first
        glob = _sdpa(q, k1, v1, causal)
        if self.kv == "share_first":
            return glob
        col = torch.arange(T, device=q.device)[None]
        keys = col if self.valid is None else torch.where(self.valid, col, NO_COLUMN)
        local = _sdpa(q, k, v, _window_mask(col.expand(keys.shape[0], T), keys, self.w)
                      | torch.eye(T, dtype=torch.bool, device=q.device))  # a padding query reads itself: no NaN
        g = attn.loop_gate(q, residual)
        return g * glob + (1 - g) * local


class ParallelKVCache:
    """Decoding entry of one block layer under the parallel schedule, over the owner's per-row Step.

    own: k, v (B, R·Hkv, max_len, hd), loop r's heads at r·Hkv..(r+1)·Hkv (so one attention call serves the R
    rows of a folded step: query head r·H + h reads kv head r·Hkv + h·Hkv/H, grouped-query attention's own
    grouping). share_first / gswa: k, v (B, Hkv, max_len, hd), loop 1's only. gswa also keeps a ring per loop
    2..R: ring_k, ring_v (B, (R−1)·Hkv, w, hd), token column c in slot c mod w, `ring_cols` (B, w) the column
    each slot holds (NO_COLUMN: none, or left padding), shared by the loops (written once a call's last loop
    has run). `loop`: set by the driver, the loop a prefill call runs, None for a folded step (R rows).
    Self-speculation does not decode parallel loops: no checkpoint/rollback."""

    def __init__(self, cfg: LoopedLMConfig, n_loops: int, batch_size: int, max_len: int, device, dtype):
        self.kv, self.R, self.w = cfg.loop_kv, n_loops, cfg.loop_window
        self.Hkv, self.hd = cfg.n_kv_heads, cfg.head_dim
        heads = self.R * self.Hkv if self.kv == "own" else self.Hkv
        self.k = torch.zeros(batch_size, heads, max_len, self.hd, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.ring_k = self.ring_v = self.ring_cols = None
        if self.kv == "gswa" and self.R > 1:
            self.ring_k = torch.zeros(batch_size, (self.R - 1) * self.Hkv, self.w, self.hd, device=device, dtype=dtype)
            self.ring_v = torch.zeros_like(self.ring_k)
            self.ring_cols = torch.full((batch_size, self.w), NO_COLUMN, dtype=torch.long, device=device)
        self.owner = None
        self.loop: int | None = 0

    # ------------------------------------------------------------- buffers over the Step
    def _rows(self):
        st = self.owner.step
        return st, (self.owner.all_rows if st.rows is None else st.rows)

    def _write(self, k, v, h0: int, h1: int):
        """This call's keys/values (b, h1−h0, T, hd) into heads h0..h1 at the Step's columns; → the used prefix
        of those heads (b, h1−h0, L, hd) twice and the Step's mask."""
        st, rows = self._rows()
        T = k.shape[2]
        if st.rows is None and st.start is not None:
            self.k[:, h0:h1, st.start:st.start + T] = k
            self.v[:, h0:h1, st.start:st.start + T] = v
        else:
            self.k[rows[:, None], h0:h1, st.cols] = k.transpose(1, 2).to(self.k.dtype)
            self.v[rows[:, None], h0:h1, st.cols] = v.transpose(1, 2).to(self.v.dtype)
        return self._read(h0, h1)

    def _read(self, h0: int, h1: int):
        st, _ = self._rows()
        if st.rows is None:
            return self.k[:, h0:h1, :st.L], self.v[:, h0:h1, :st.L], st.mask
        return self.k[st.rows, h0:h1, :st.L], self.v[st.rows, h0:h1, :st.L], st.mask

    # ------------------------------------------------------------- attention
    def attend(self, q, k, v, attn, residual):
        if self.loop is None:
            return self._folded(q, k, v, attn, residual)
        r, H = self.loop, self.Hkv
        if self.kv == "own":
            return _sdpa(q, *self._write(k, v, r * H, (r + 1) * H))
        if r == 0:
            return _sdpa(q, *self._write(k, v, 0, H))
        glob = _sdpa(q, *self._read(0, H))
        if self.kv == "share_first":
            return glob
        return self._gated(glob, self._local_prefill(q, k, v, r), attn, q, residual)

    @staticmethod
    def _gated(glob, local, attn, q, residual):
        """g·glob + (1 − g)·local = glob + (1 − g)·(local − glob); written into glob when no graph is kept."""
        w = attn.loop_gate.local_weight(q, residual)
        return torch.lerp(glob, local, w) if torch.is_grad_enabled() else glob.lerp_(local, w)

    def _local_prefill(self, q, k, v, r: int):
        """Loop r's windowed attention over the ring (tokens of earlier calls) and this call's own keys, then the
        last min(T, w) keys written into the ring."""
        st, rows = self._rows()
        T, w = k.shape[2], self.w
        h0, h1 = (r - 1) * self.Hkv, r * self.Hkv
        real = self.owner.valid[rows[:, None], st.cols]  # (b, T)
        new_cols = torch.where(real, st.cols, NO_COLUMN)
        keys = torch.cat([self.ring_k[rows, h0:h1], k], 2)
        values = torch.cat([self.ring_v[rows, h0:h1], v], 2)
        kcols = torch.cat([self.ring_cols[rows], new_cols], 1)  # (b, w + T)
        mask = _window_mask(st.cols, kcols, w)
        own = torch.zeros(T, w + T, dtype=torch.bool, device=q.device)
        own[:, w:] = torch.eye(T, dtype=torch.bool, device=q.device)
        out = _sdpa(q, keys, values, mask | own)  # a padding query reads itself: no NaN
        n = min(T, w)
        slots = st.cols[:, T - n:] % w
        self.ring_k[rows[:, None], h0:h1, slots] = k[:, :, T - n:].transpose(1, 2).to(self.ring_k.dtype)
        self.ring_v[rows[:, None], h0:h1, slots] = v[:, :, T - n:].transpose(1, 2).to(self.ring_v.dtype)
        if r == self.R - 1:  # every loop has read the ring's columns before this call: now they move on
            self.ring_cols[rows[:, None], slots] = new_cols[:, T - n:]
        return out

    def _folded(self, q, k, v, attn, residual):
        """One decoded token, its R loops as the R query rows: q (b, H, R, hd), k, v (b, Hkv, R, hd)."""
        b, H, R, hd = q.shape
        Hkv = self.Hkv
        if self.kv == "own":  # loop r's keys into its own heads; one grouped call for the R rows
            kk = k.transpose(1, 2).reshape(b, R * Hkv, 1, hd)
            vv = v.transpose(1, 2).reshape(b, R * Hkv, 1, hd)
            K, V, mask = self._write(kk, vv, 0, R * Hkv)
            y = _sdpa(q.transpose(1, 2).reshape(b, R * H, 1, hd), K, V, mask)
            return y.view(b, R, H, hd).transpose(1, 2)
        K, V, mask = self._write(k[:, :, :1], v[:, :, :1], 0, Hkv)  # loop 1's key/value is the shared one
        glob = _sdpa(q, K, V, mask, causal=False)  # the R rows sit at one position: each reads every column so far
        if self.kv == "share_first" or R == 1:
            return glob
        st, rows = self._rows()
        later_k = k[:, :, 1:].transpose(1, 2).reshape(b, (R - 1) * Hkv, hd)
        later_v = v[:, :, 1:].transpose(1, 2).reshape(b, (R - 1) * Hkv, hd)
        if st.rows is None and st.start is not None:  # every row at one column: a slice, no scatter
            slot = st.start % self.w
            self.ring_k[:, :, slot] = later_k
            self.ring_v[:, :, slot] = later_v
            self.ring_cols[:, slot] = st.start
            cols, ring_k, ring_v = self.ring_cols, self.ring_k, self.ring_v
        else:
            col = st.cols[:, 0]  # (b,)
            slot = col % self.w
            self.ring_k[rows, :, slot] = later_k.to(self.ring_k.dtype)
            self.ring_v[rows, :, slot] = later_v.to(self.ring_v.dtype)
            self.ring_cols[rows, slot] = col
            cols, ring_k, ring_v = self.ring_cols[rows], self.ring_k[rows], self.ring_v[rows]
        # slot s holds the latest token whose column is s mod w, so every slot that holds a real token is inside
        # the window of the token just written: the window mask is "holds a token"
        mask = (cols >= 0)[:, None, None]  # (b, 1, 1, w)
        local = _sdpa(q[:, :, 1:].transpose(1, 2).reshape(b, (R - 1) * H, 1, hd), ring_k, ring_v, mask)
        local = local.view(b, R - 1, H, hd).transpose(1, 2)
        later = self._gated(glob[:, :, 1:], local, attn, q[:, :, 1:], residual[:, 1:])
        return glob if not torch.is_grad_enabled() else torch.cat([glob[:, :, :1], later], 2)  # else written in place

    # ------------------------------------------------------------- the entry contract
    def checkpoint(self) -> None:
        raise ValueError("loop_schedule=parallel caches take nothing back (self-speculation does not decode parallel "
                         "loops)")

    def rollback(self, keep) -> None:
        self.checkpoint()

    def reset_rows(self, rows: torch.Tensor) -> None:
        if self.ring_cols is not None:
            self.ring_cols[rows] = NO_COLUMN  # full-cache columns beyond a row's length are never read

    def nbytes(self, used_only: bool = True) -> int:
        n = self.owner.used_columns() if used_only and self.owner is not None else self.k.shape[2]
        full = 2 * self.k[:, :, :n].numel() * self.k.element_size()
        ring = 0 if self.ring_k is None else 2 * self.ring_k.numel() * self.ring_k.element_size()
        return full + ring


# ------------------------------------------------------------------ the drivers
def _block(model, x, positions, valid, kv, r):
    """One call of the shared block; r: the loop (None: a folded decoding step). Set here, inside what per-loop
    activation checkpointing recomputes, so a recomputed loop attends as it did."""
    for entry in kv:
        entry.loop = r
    for layer, entry in zip(model.block, kv):
        x = layer(x, positions, valid, entry)
    return x


def _layer(layer, x, positions, valid, entry, r):
    """One block layer at loop r, as per-layer activation checkpointing runs (and recomputes) it: the loop is set
    inside, so the recomputation reads the keys/values loop r read (loop 1's are kept by its entry)."""
    entry.loop = r
    return layer(x, positions, valid, entry)


def _shift(h: torch.Tensor, positions: torch.Tensor, carry: torch.Tensor | None) -> torch.Tensor:
    """h (b, T, d) one position to the right: column t reads t − 1, column 0 the carried last token (zeros without
    one), and zeros where a row's tokens start (RoPE position 0)."""
    first = h.new_zeros(h.shape[0], 1, h.shape[2]) if carry is None else carry[:, None].to(h.dtype)
    prev = torch.cat([first, h[:, :-1]], 1)
    return prev.masked_fill((positions == 0)[..., None], 0.0)


def _loop_norm(model, h):
    return model.final_norm(h) if model.config.loop_norm else h


def _run(model, input_ids, attention_mask, cache, R: int):
    """Embed, prelude and the R loops, loop by loop over the call's T tokens → (H^(1..R) list, e, positions, valid)."""
    positions, valid = model.positions(input_ids, attention_mask, cache)
    e = model.start(input_ids, positions, valid, cache).x
    kv = ([cache[0, l] for l in range(len(model.block))] if cache is not None
          else [LoopAttention(model.config, valid) for _ in model.block])
    rows = cache.step.rows if cache is not None else None
    carry = None
    if cache is not None and R > 1 and "loop_hidden" in cache.carry:
        carry = cache.carry["loop_hidden"] if rows is None else cache.carry["loop_hidden"][rows]
    ckpt = model.checkpoint_loops and model.training and cache is None and torch.is_grad_enabled()
    per_layer = model.per_layer_checkpoint(cache)  # activation_checkpointing=layer|selective
    hs, x = [], e
    for r in range(R):
        if r > 0:
            x = model.loop_input(e, _shift(_loop_norm(model, hs[-1]), positions, None if carry is None else carry[:, r - 1]))
        if ckpt:
            h = torch.utils.checkpoint.checkpoint(_block, model, x, positions, valid, kv, r, use_reentrant=False)
        elif per_layer:
            h = x
            for layer, entry in zip(model.block, kv):
                h = model.apply_layer(_layer, layer, h, positions, valid, entry, r)
        else:
            h = _block(model, x, positions, valid, kv, r)
        hs.append(h)
    if cache is not None and R > 1:
        _keep_carry(model, cache, torch.stack([_loop_norm(model, h[:, -1]) for h in hs[:-1]], 1), rows)
    return hs, e, positions, valid


def _keep_carry(model, cache, new: torch.Tensor, rows) -> None:
    """N(H^(r)) of the call's last token (b, R−1, d): what the next token's loops 2..R read."""
    if "loop_hidden" not in cache.carry:
        cache.carry["loop_hidden"] = new.new_zeros(cache.batch_size, *new.shape[1:])
    if rows is None:
        cache.carry["loop_hidden"].copy_(new)
    else:
        cache.carry["loop_hidden"][rows] = new.to(cache.carry["loop_hidden"].dtype)


def parallel_forward(model, input_ids, attention_mask=None, cache=None, n_loops=None, *, backprop_loops=None,
                     return_all_loops: bool = False, exits=None, depths=None, targets=None) -> LoopedLMOutput:
    """LoopedLM.forward under loop_schedule=parallel: the CLP forward (teacher-forced: every loop over every
    token), or with a cache one decoded token per row as one folded block call (`decode_folded`)."""
    bad = [f"{k}={v!r}" for k, v in (("backprop_loops", backprop_loops), ("exits", exits), ("depths", depths))
           if v is not None]
    if bad:
        raise ValueError(f"loop_schedule=parallel does not take {', '.join(bad)}: exits pick a loop of the same token, "
                         "truncated backprop and depth routing are defined for the sequential schedule only")
    R = model.loops(n_loops)
    if cache is not None:
        cache.check_depth(R)
        if return_all_loops:
            raise ValueError("loop_schedule=parallel with a cache reads the last loop only (its cache holds coda "
                             "entries for loop R); call without return_all_loops")
        if input_ids.shape[1] == 1 and R > 1 and attention_mask is None:
            return LoopedLMOutput(logits=decode_folded(model, input_ids, cache, R)[:, None])
    hs, _, positions, valid = _run(model, input_ids, attention_mask, cache, R)
    if not return_all_loops:
        z = model.final_norm(model.coda_at(hs[-1], R - 1, positions, valid, cache))
        if targets is not None:  # a training loss: per-token losses, the head in chunks (models/loss.py)
            return LoopedLMOutput(logits=None, token_loss=model.token_losses(z, targets))
        return LoopedLMOutput(logits=model.head(z))
    loop_hidden = model.final_norm(torch.stack([model.coda_at(h, r, positions, valid) for r, h in enumerate(hs)]))
    if targets is not None:
        loop_losses = model.token_losses(loop_hidden, targets[None].expand(R, *targets.shape))
        return LoopedLMOutput(logits=None, loop_hidden=loop_hidden, token_loss=loop_losses[-1], loop_token_loss=loop_losses)
    loop_logits = model.head(loop_hidden)
    return LoopedLMOutput(logits=loop_logits[-1], loop_logits=loop_logits, loop_hidden=loop_hidden)


def decode_folded(model, tokens: torch.Tensor, cache, R: int) -> torch.Tensor:
    """One token per row (b, 1), all R loops in ONE call of the shared block on R rows per sequence → logits (b, V).
    Row 1 reads E; row r ≥ 2 reads a·E + b·(the carried N(H^(r−1)) of the previous token); all rows sit at the
    token's RoPE position. The carry becomes rows 1..R−1's outputs; the coda and head read row R."""
    positions, _ = model.positions(tokens, None, cache)  # (b, 1)
    e = model.start(tokens, positions, None, cache).x  # (b, 1, d)
    rows = cache.step.rows
    b = e.shape[0]
    carry = cache.carry.get("loop_hidden")
    # a fresh or reset row's carry is zero: a row whose first token this is starts its chains, as the shift does
    carry = e.new_zeros(b, R - 1, e.shape[2]) if carry is None else (carry if rows is None else carry[rows])
    x = torch.cat([e, model.loop_input(e, carry)], 1)  # (b, R, d)
    kv = [cache[0, l] for l in range(len(model.block))]
    h = _block(model, x, positions.expand(b, R), None, kv, None)
    _keep_carry(model, cache, _loop_norm(model, h[:, :R - 1]), rows)
    return model.logits_at(h[:, R - 1:], R - 1, positions, None, cache)[:, -1]


def parallel_states(model, input_ids, attention_mask, n_loops: int):
    """The cache-free CLP forward's per-loop states: (H^(1..R′) list of (B, T, d), E, positions, valid)."""
    return _run(model, input_ids, attention_mask, None, n_loops)


# ------------------------------------------------------------------ the schedule
@LOOP_SCHEDULES.register("parallel")
class Parallel(LoopSchedule):
    """PLT's cross-loop parallelism (module docstring): its own forward, cache and folded decoding step."""

    sequential = False
    supports = Supports(
        compile="its folded decoding step is not compiled; decode with compile=False",
        compile_training="the parallel schedule trains eagerly: its attention reads another loop's keys through a "
                         "per-call object that a compiled layer would retrace; set compile=false",
        speculation="drafts read a shallower loop of the same token, which the parallel schedule computes at a later "
                    "step",
        exits="exits read a shallower loop of the same token, which the parallel schedule computes at a later step",
        depthwise="parallel loops already run every loop of a token in one block call; use schedule='lockstep'",
        depth_sampling="the parallel schedule trains at its configured R with every loop's gradient; use "
                       "loop_depth.sampler=fixed, backprop_loops=null",
        parallel_loops=True,
        routing="routing's kv=share_first and per-token depths are a different scheme; use depth_router=none",
        export="parallel loops (cross-loop shift, shared/windowed KV) are not in the exported transformers code; "
               "`to-hf --vllm` writes them for vLLM (docs/vllm.md)")

    @classmethod
    def validate(cls, cfg):
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(cfg.loop_kv in LOOP_KV, f"loop_kv (loop_depth.kv)={cfg.loop_kv!r} is unknown; choose one of {LOOP_KV}")
        need(cfg.loop_gate in LOOP_GATES,
             f"loop_gate (loop_depth.gate)={cfg.loop_gate!r} is unknown; choose one of {LOOP_GATES}")
        need(isinstance(cfg.loop_window, int) and not isinstance(cfg.loop_window, bool) and cfg.loop_window >= 1,
             f"loop_window (loop_depth.window)={cfg.loop_window!r} must be an integer >= 1 (tokens, the current one "
             "included)")
        need(len(cfg.loop_mix) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                            for v in cfg.loop_mix),
             f"loop_mix (loop_depth.mix)={list(cfg.loop_mix)!r} must be two numbers [a, b]: loops >= 2 read "
             "a·E + b·shift(H)")
        reason = cfg.unsupported("parallel_loops")
        need(reason is None, f"loop_schedule=parallel with {reason}")

    @classmethod
    def build(cls, model):
        cfg = model.config
        model.loop_input = LoopInput(cfg)
        if cfg.loop_kv == "gswa":  # one gate per block attention layer, shared by loops 2..R
            for layer in model.block:
                layer.attn.loop_gate = LoopGate(cfg)

    @classmethod
    def forward(cls, model, input_ids, attention_mask, cache, n_loops, **kw):
        kw.pop("return_diagnostics", None)
        return parallel_forward(model, input_ids, attention_mask, cache, n_loops, **kw)

    @classmethod
    def allocate_cache(cls, model, batch_size, max_len, device, dtype, n_loops, static):
        from looplab.models.cache import LoopCache

        if static:
            raise ValueError("loop_schedule=parallel decodes with an eager cache (static=False): its folded step is "
                             "not compiled")
        entries = {("prelude", l): layer.allocate_cache(batch_size, max_len, device, dtype)
                   for l, layer in enumerate(model.prelude)}
        for l in range(len(model.block)):  # one entry per block layer for every loop, the coda of loop R only
            entries[(0, l)] = ParallelKVCache(model.config, n_loops, batch_size, max_len, device, dtype)
        for l, layer in enumerate(model.coda):
            entries[(n_loops - 1, ("coda", l))] = layer.allocate_cache(batch_size, max_len, device, dtype)
        return LoopCache(entries, batch_size, max_len, device, n_loops=n_loops)

    @classmethod
    def loop_flops(cls, model, seq_len: int) -> int:
        """What loops 2..R compute beyond the block (the G-SWA window and gate), per token and loop."""
        cfg = model.config
        if cfg.loop_kv != "gswa":
            return 0
        return sum(4 * min(cfg.loop_window, seq_len) * cfg.n_heads * cfg.head_dim + layer.attn.loop_gate.flops_per_token()
                   for layer in model.block)
