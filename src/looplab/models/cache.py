"""Decoding caches (docs/decoding.md#caches).

A looped block applies layer l at every loop r, and each application sees a
different input, so one cache entry is kept per (loop, layer) — not per layer
as in an ordinary decoder. StateLoop mixers are shared across loops too and get
entries keyed (loop, "state").

Every entry, and the LoopCache holding them, has one rollback interface for decoders that
write tokens they may take back (self-speculation, models/speculative.py):
`checkpoint()` marks the current length; `rollback(keep)` forgets everything written after
the first `keep` tokens since the mark. KVCache: the length moves back (the stale rows are
overwritten by the next write, as in gpt-fast). SSMCache: the state is not a prefix of
anything, so between checkpoint() and rollback() the Mamba-2 mixer records the state after
every position it writes (`trail`; references to tensors the step computes anyway, plus one
copy of the state at the mark) and rollback copies the state of the last kept position back.

The StateLoop per-token state s_r itself needs no cache across tokens: it is
carried along the loops of one token and reset to s_0 at the next token, so
after a token's R loops nothing of it is needed again (only the mixer, which
looks across tokens, keeps per-loop caches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch


class KVCache:
    """Preallocated key/value buffers written in place at the current length (no re-concatenation)."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.mark = 0  # length at checkpoint()

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, Hkv, T, hd) at the current length; return views of everything cached so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise RuntimeError(f"KV cache full: {end} tokens > max_len={self.max_len}; allocate a longer cache")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def checkpoint(self) -> None:
        self.mark = self.length

    def rollback(self, keep: int) -> None:
        """Forget what was written after the first `keep` tokens since checkpoint()."""
        self.length = min(self.length, self.mark + keep)

    def copy_position_from(self, other: "KVCache", pos: int, rows: torch.Tensor | None = None) -> None:
        """Reuse another entry's key/values at one position (exit-gate skip_compute)."""
        if rows is None:
            self.k[:, :, pos] = other.k[:, :, pos]
            self.v[:, :, pos] = other.v[:, :, pos]
        else:
            self.k[rows, :, pos] = other.k[rows, :, pos]
            self.v[rows, :, pos] = other.v[rows, :, pos]

    def nbytes(self, used_only: bool = True) -> int:
        n = self.length if used_only else self.max_len
        return 2 * self.k[:, :, :n].numel() * self.k.element_size()


@dataclass
class SSMCache:
    """Mamba-2 decoding state: the causal conv's last inputs and the SSM state (constant size in length)."""

    conv_state: torch.Tensor  # (B, conv_dim, d_conv - 1)
    ssm_state: torch.Tensor  # (B, nheads, headdim, d_state)
    length: int = 0
    # the last token's raw conv input and dt before softplus (B, conv_dim), (B, nheads): an exited
    # token's deeper loops reuse them instead of projecting again (Mamba2Mixer.step_from)
    last_xBC: torch.Tensor | None = None
    last_dt_raw: torch.Tensor | None = None
    # between checkpoint() and rollback(): per written call, the conv window (B, K-1+T, conv_dim)
    # and the SSM state after each of its T positions (Mamba2Mixer.forward appends)
    trail: list[tuple[torch.Tensor, list[torch.Tensor]]] | None = None
    mark: tuple[int, torch.Tensor, torch.Tensor] | None = None  # length, conv and SSM state at checkpoint()

    def write_conv(self, window: torch.Tensor) -> None:
        """Keep the conv history after a call: the last K−1 inputs of its window (B, K−1+T, conv_dim)."""
        self.conv_state.copy_(window[:, window.shape[1] - self.conv_state.shape[-1]:].transpose(1, 2))

    def write_state(self, state: torch.Tensor, T: int) -> None:
        """Keep the SSM state after a call of T tokens."""
        self.ssm_state.copy_(state)
        self.length += T

    def checkpoint(self) -> None:
        self.trail = []
        self.mark = (self.length, self.conv_state.clone(), self.ssm_state.clone())

    def rollback(self, keep: int) -> None:
        """Restore the state after the first `keep` positions written since checkpoint(); stop recording."""
        start, conv0, ssm0 = self.mark
        written = sum(len(states) for _, states in self.trail)
        if keep == 0 and written:
            self.conv_state.copy_(conv0)
            self.ssm_state.copy_(ssm0)
        elif keep < written:
            i = keep  # 1-based index of the last kept position inside the call that wrote it
            for window, states in self.trail:
                if i <= len(states):
                    # the conv history after position i-1 of this call: its window's rows i .. i+K-2
                    K1 = self.conv_state.shape[-1]
                    self.conv_state.copy_(window[:, i : i + K1].transpose(1, 2))
                    self.ssm_state.copy_(states[i - 1])
                    break
                i -= len(states)
        self.length = min(self.length, start + keep)
        self.trail = self.mark = None

    def nbytes(self, used_only: bool = True) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.ssm_state))


class LoopCache:
    """All decoding state of one LoopedLM generation: entries keyed by (loop, layer) plus the padding mask."""

    def __init__(self, entries: dict[tuple[int, Hashable], object], batch_size: int, max_len: int, device):
        self.entries = entries
        self.max_len = max_len
        self.length = 0
        self.valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.has_padding = False
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.mark: tuple[int, torch.Tensor] | None = None  # length and next positions at checkpoint()

    def __getitem__(self, key: tuple[int, Hashable]):
        return self.entries[key]

    def get(self, key, default=None):
        return self.entries.get(key, default)

    def nbytes(self) -> int:
        return sum(e.nbytes() for e in self.entries.values())

    def checkpoint(self) -> None:
        """Mark the current length of every entry; tokens written after it can be taken back."""
        self.mark = (self.length, self.next_pos.clone())
        for entry in self.entries.values():
            entry.checkpoint()

    def rollback(self, keep: int) -> None:
        """Keep the first `keep` tokens written since checkpoint() in every entry, forget the rest.
        Only for tokens registered without a new attention mask (decoding steps): the padding mask
        of the dropped columns is left as it was (all valid)."""
        start, next_pos = self.mark
        if not 0 <= keep <= self.length - start:
            raise ValueError(f"rollback(keep={keep}): only {self.length - start} tokens were written since checkpoint()")
        for entry in self.entries.values():
            entry.rollback(keep)
        self.length = start + keep
        self.next_pos = next_pos + keep
        self.mark = None

    def advance(self, attention_mask: torch.Tensor | None, T: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Register T new tokens; return their positions (B|1, T) and the key-validity mask (or None)."""
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise RuntimeError(f"cache full: {end} tokens > max_len={self.max_len}")
        if attention_mask is not None:
            new_valid = attention_mask.to(torch.bool)
            self.valid[:, start:end] = new_valid
            self.has_padding = self.has_padding or not bool(new_valid.all())
            positions = (self.next_pos[:, None] + new_valid.long().cumsum(1) - 1).clamp_min(0)
            self.next_pos += new_valid.long().sum(1)
        else:
            positions = self.next_pos[:, None] + torch.arange(T, device=self.valid.device)
            self.next_pos += T
        self.length = end
        return positions, (self.valid[:, :end] if self.has_padding else None)


class RoutedKVCache:
    """depth_router decoding (models/router.py, docs/decoding.md#routed-decoding): one (loop, layer)'s keys/values of ONLY the
    tokens that ran that loop, so each depth's cache has its own length (MoR's recursion-wise caching).

    The batch's rows share one buffer (B, Hkv, max_len, hd); row b holds its own `lengths[b]` tokens in
    columns 0..lengths[b]−1, in causal (original) order, and `valid` (B, max_len) marks the columns that
    hold a real key (written, and not left padding). `length` = max over rows: the shared buffer's used
    length, which `nbytes` counts (exact at batch 1; in a batch, rows with fewer tokens leave invalid
    columns that no query reads). A query sees the valid columns up to its own (causal by original
    position, since every row is written in order), and always its own column (a padding query never
    gets an empty row). Under kv=share_first only loop 0's entries exist; `read_shared` hands later
    loops' queries loop 0's keys, each query up to the column its own token wrote at loop 0 (`cols`).
    No rollback: self-speculation is refused with a router."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.length = 0
        self.cols: torch.Tensor | None = None  # (B, T) the column each token of the last call wrote (−1: none)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, k, v, tok, live, valid, n_call: int):
        """k, v (B, Hkv, n, hd): the n gathered slots of this call; tok (B, n) their indices in the call
        (None = 0..n−1); live (B, n): the slots whose token runs this loop (None = all; the others come after
        every live one of their row, are computed and discarded, and write nothing); valid (B, n): real tokens
        (None = all). → (keys, values, mask (B, 1, n, L))."""
        B, _, n, _ = k.shape
        live = torch.ones(B, n, dtype=torch.bool, device=k.device) if live is None else live
        count = live.sum(1)
        cols = self.lengths[:, None] + live.long().cumsum(1) - 1  # a non-live slot: its row's last live column
        end = int((self.lengths + count).max())
        if end > self.max_len:
            raise RuntimeError(f"KV cache full: {end} tokens > max_len={self.max_len}; allocate a longer cache")
        rows, js = live.nonzero(as_tuple=True)
        c = cols[rows, js]
        self.k[rows, :, c] = k[rows, :, js]
        self.v[rows, :, c] = v[rows, :, js]
        self.valid[rows, c] = True if valid is None else valid[rows, js]
        self.lengths += count
        self.length = max(self.length, end)
        tok = torch.arange(n, device=k.device).expand(B, n) if tok is None else tok
        self.cols = torch.full((B, n_call), -1, dtype=torch.long, device=k.device).scatter(
            1, tok, torch.where(live, cols, -1))
        return self.k[:, :, :self.length], self.v[:, :, :self.length], self._mask(cols)

    def read_shared(self, tok, n: int):
        """kv=share_first, a later loop: its n query slots (tokens tok of the last call, None = 0..n−1) read
        the keys/values this loop-0 entry holds, each up to the column its own token wrote."""
        q = self.cols[:, :n] if tok is None else self.cols.gather(1, tok)
        return self.k[:, :, :self.length], self.v[:, :, :self.length], self._mask(q)

    def _mask(self, q: torch.Tensor) -> torch.Tensor:
        kc = torch.arange(self.length, device=q.device)
        own = kc == q[..., None]
        m = ((kc <= q[..., None]) & self.valid[:, None, :self.length]) | own
        m = m | (~m.any(-1, keepdim=True) & (kc == 0))  # a discarded slot that sees nothing: no NaN row
        return m[:, None]

    def checkpoint(self) -> None:
        raise ValueError("a depth_router cache takes nothing back (self-speculation does not route)")

    def rollback(self, keep: int) -> None:
        self.checkpoint()

    def nbytes(self, used_only: bool = True) -> int:
        n = self.length if used_only else self.max_len
        return 2 * self.k[:, :, :n].numel() * self.k.element_size()


@dataclass
class RoutedSSMCache(SSMCache):
    """depth_router decoding in a Mamba-2 layer (or a StateLoop Mamba-2 mixer): one loop's conv history
    and SSM state over ONLY the tokens that ran that loop, the recurrent counterpart of RoutedKVCache
    (models/router.py: a token that stopped is absent from the deeper loops' scans and conv windows).

    Before each call the routed loop hands the entry `live` (B, n): which of the call's n gathered slots
    run the loop (None = all). Live slots come first in every row (router.active_slots), and the others
    reach the mixer as padding (conv input, x, B and dt zeroed: the state neither decays nor is written),
    so the scan over a row's slots leaves the state after its last live token; the conv history keeps the
    K−1 inputs up to that token (not the zeroed slots after it), and a row with no live slot keeps both
    states exactly. `lengths` (B,): the tokens each row has written. No rollback (nothing routed speculates)."""

    lengths: torch.Tensor | None = None
    live: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.lengths is None:
            self.lengths = torch.zeros(self.conv_state.shape[0], dtype=torch.long, device=self.conv_state.device)

    def route(self, live: torch.Tensor | None) -> "RoutedSSMCache":
        self.live = live
        return self

    def _counts(self, n: int) -> torch.Tensor:
        if self.live is None:
            return torch.full_like(self.lengths, n)
        return self.live.sum(1)

    def write_conv(self, window: torch.Tensor) -> None:
        K1 = self.conv_state.shape[-1]
        n = window.shape[1] - K1
        cols = self._counts(n)[:, None] + torch.arange(K1, device=window.device)  # (B, K−1): up to the last live input
        kept = window.gather(1, cols[..., None].expand(-1, -1, window.shape[2]))
        self.conv_state.copy_(kept.transpose(1, 2))

    def write_state(self, state: torch.Tensor, T: int) -> None:
        count = self._counts(T)
        ran = (count > 0)[:, None, None, None]  # a row whose token stopped keeps its state bit for bit
        self.ssm_state.copy_(torch.where(ran, state, self.ssm_state))
        self.lengths += count
        self.length = int(self.lengths.max())

    def checkpoint(self) -> None:
        raise ValueError("a depth_router cache takes nothing back (self-speculation does not route)")

    def rollback(self, keep: int) -> None:
        self.checkpoint()
