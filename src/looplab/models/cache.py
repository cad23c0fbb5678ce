"""Decoding caches: one contract for every layer kind and every decoder (docs/decoding.md#caches).

A looped block applies layer l at every loop r, and each application sees a different input, so one
entry is kept per (loop, layer) — not per layer as in an ordinary decoder — plus one per prelude layer
("prelude", l), one per (loop, coda layer) (r, ("coda", l)) and one per (loop, "state") for a StateLoop
mixer. The StateLoop per-token state itself needs no cache across tokens: it lives along the loops of
one token.

One owner. A `LoopCache` holds the entries and everything about columns that they share: per-row
lengths `(B,)`, the RoPE position of each row's next token, which columns hold a real token (left
padding does not), and the state a decoder carries between steps (`carry`). Each call of the model
registers its tokens once (`advance`), which computes one `Step` — the columns each row writes, the
positions, and the mask that says which keys each query reads — and every entry of every layer reads
that Step: no entry keeps a length of its own, and rows may stand at different lengths.

The contract every entry keeps (`CacheEntry`): `checkpoint()`, `rollback(keep)` with `keep` a `(B,)`
tensor of the tokens each row keeps since the checkpoint, `reset_rows(rows)`, `nbytes()`.

    KVCache      (B, Hkv, max_len, hd) key/value buffers written at each row's own columns. In eager
                 decoding a call reads the used prefix (the longest row's columns) under the Step's mask;
                 a static cache (`LoopCache(static=True)`) reads the whole buffer under a mask and keeps
                 no Python-side state, so a decoding step can be compiled or captured in a CUDA graph.
    SSMCache     Mamba-2: the conv history and SSM state, constant in length. Between checkpoint() and
                 rollback() the mixer records the state after every position it writes, and rollback
                 restores each row's own kept position.
    RoutedKVCache, RoutedSSMCache   depth routing: one loop's keys/values (or conv/SSM state) of only
                 the tokens that ran that loop; their per-row lengths are their own (models/router.py).

Row subsets. `select_rows(rows)` makes the next calls write only those rows (prefill into free rows of a
running batch); `restrict(rows)` narrows the current Step to some rows for part of a call (the loops a row
no longer needs once its token has exited or stopped: models/exit_compute.py, models/router.py). Every
entry reads the rows from the Step, so the rest of the batch is neither computed nor touched.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Hashable, Protocol

import torch


class CacheEntry(Protocol):
    """What every (loop, layer) entry offers its LoopCache and the decoders."""

    owner: "LoopCache | None"

    def checkpoint(self) -> None: ...

    def rollback(self, keep: torch.Tensor) -> None: ...

    def reset_rows(self, rows: torch.Tensor) -> None: ...

    def nbytes(self) -> int: ...


@dataclass
class Step:
    """One call's tokens as every entry sees them (computed once by LoopCache.advance).

    positions (b, T) RoPE positions; cols (b, T) the columns each row writes; rows (b,) the rows of the
    batch this call runs (None = all B, in order); start: the column every row writes from when they all
    agree (eager fast path: slices instead of scatters), else None; L: the key columns a query reads
    (eager: the longest row's used prefix; static: max_len); mask (b, 1, T, L) bool, or None when plain
    causal attention is exact (no padding, every row at `start`, and T == 1 or start == 0)."""

    positions: torch.Tensor
    cols: torch.Tensor
    rows: torch.Tensor | None
    start: int | None
    L: int
    mask: torch.Tensor | None
    T: int

    def subset(self, idx: torch.Tensor) -> "Step":
        """The Step of rows idx (b′,) of this call (indices into this Step's rows)."""
        rows = idx if self.rows is None else self.rows[idx]
        mask = None if self.mask is None else self.mask[idx]
        return Step(self.positions[idx], self.cols[idx], rows, self.start, self.L, mask, self.T)


class KVCache:
    """Preallocated key/value buffers, written in place at each row's columns (no re-concatenation).

    The entry keeps no length: the LoopCache's Step says where this call writes and what it reads, so a
    rollback is the owner's lengths moving back (stale columns are overwritten by the next write, as in
    gpt-fast) and reset_rows costs nothing."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.owner: LoopCache | None = None
        self.upto = 0  # the columns this entry was written up to (a coda entry's misuse guard, LoopCache.check_filled)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor):
        """Write this call's (b, Hkv, T, hd) keys/values; → (keys, values, mask) for the call's queries."""
        st = self.owner.step
        T = k.shape[2]
        if st.rows is None and st.start is not None:
            self.k[:, :, st.start : st.start + T] = k
            self.v[:, :, st.start : st.start + T] = v
            return self.k[:, :, : st.L], self.v[:, :, : st.L], st.mask
        self.write(self.owner.all_rows if st.rows is None else st.rows, st.cols, k, v)
        if st.rows is None:
            return self.k[:, :, : st.L], self.v[:, :, : st.L], st.mask
        return self.k[st.rows, :, : st.L], self.v[st.rows, :, : st.L], st.mask

    def write(self, rows: torch.Tensor, cols: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """(b, Hkv, T, hd) keys/values at rows (b,) and their columns cols (b, T)."""
        # an indexed write needs the buffer's dtype (a model under autocast hands bf16 keys to an fp32 cache)
        self.k[rows[:, None], :, cols] = k.transpose(1, 2).to(self.k.dtype)  # (b, T, Hkv, hd) at (row, col)
        self.v[rows[:, None], :, cols] = v.transpose(1, 2).to(self.v.dtype)

    def read_rows_into(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The first keys.shape[2] columns of rows (b,) into keys/values (b, Hkv, L, hd), one copy each."""
        L = keys.shape[2]
        torch.index_select(self.k[:, :, :L], 0, rows, out=keys)
        torch.index_select(self.v[:, :, :L], 0, rows, out=values)

    def copy_columns_from(self, other: "KVCache", rows: torch.Tensor, cols: torch.Tensor) -> None:
        """Another entry's key/values at (rows, cols) (b,) each: an exited token's deeper loops (kv_copy)."""
        self.k[rows, :, cols] = other.k[rows, :, cols]
        self.v[rows, :, cols] = other.v[rows, :, cols]

    def checkpoint(self) -> None:
        pass  # lengths live in the owner

    def rollback(self, keep: torch.Tensor) -> None:
        pass

    def reset_rows(self, rows: torch.Tensor) -> None:
        pass  # columns beyond a row's length are never read

    def nbytes(self, used_only: bool = True) -> int:
        n = self.owner.used_columns() if used_only and self.owner is not None else self.max_len
        return 2 * self.k[:, :, :n].numel() * self.k.element_size()


@dataclass
class SSMCache:
    """Mamba-2 decoding state: the causal conv's last inputs and the SSM state (constant size in length).
    Reads and writes cover the rows of the owner's current Step."""

    conv_state: torch.Tensor  # (B, conv_dim, d_conv - 1)
    ssm_state: torch.Tensor  # (B, nheads, headdim, d_state)
    # the last token's raw conv input and dt before softplus (B, conv_dim), (B, nheads): an exited
    # token's deeper loops reuse them instead of projecting again (Mamba2Mixer.step_from)
    last_xBC: torch.Tensor | None = None
    last_dt_raw: torch.Tensor | None = None
    owner: "LoopCache | None" = None
    upto: int = 0
    # between checkpoint() and rollback(): per written call, the conv window (B, K-1+T, conv_dim)
    # and the SSM state after each of its T positions (Mamba2Mixer.forward appends)
    trail: list[tuple[torch.Tensor, list[torch.Tensor]]] | None = None
    mark: tuple[torch.Tensor, torch.Tensor] | None = None  # conv and SSM state at checkpoint()
    trail_rows: torch.Tensor | None = None

    @property
    def rows(self) -> torch.Tensor | None:
        step = self.owner.step if self.owner is not None else None
        return step.rows if step is not None else None

    def history(self) -> torch.Tensor:
        """(b, conv_dim, K−1) conv inputs of the call's rows."""
        rows = self.rows
        return self.conv_state if rows is None else self.conv_state[rows]

    def state(self) -> torch.Tensor:
        rows = self.rows
        return self.ssm_state if rows is None else self.ssm_state[rows]

    def write_conv(self, window: torch.Tensor) -> None:
        """Keep the conv history after a call: the last K−1 inputs of its window (b, K−1+T, conv_dim)."""
        kept = window[:, window.shape[1] - self.conv_state.shape[-1]:].transpose(1, 2)
        rows = self.rows
        if rows is None:
            self.conv_state.copy_(kept)
        else:
            self.conv_state[rows] = kept.to(self.conv_state.dtype)

    def write_state(self, state: torch.Tensor, T: int) -> None:
        """Keep the SSM state after a call of T tokens."""
        rows = self.rows
        if rows is None:
            self.ssm_state.copy_(state)
        else:
            self.ssm_state[rows] = state.to(self.ssm_state.dtype)

    def write_last(self, xBC: torch.Tensor, dt_raw: torch.Tensor) -> None:
        """The call's last token's raw conv input and dt (b, conv_dim), (b, nheads)."""
        rows = self.rows
        if self.last_xBC is None:
            B = self.conv_state.shape[0]
            self.last_xBC = xBC.new_zeros(B, xBC.shape[-1])
            self.last_dt_raw = dt_raw.new_zeros(B, dt_raw.shape[-1])
        if rows is None:
            self.last_xBC.copy_(xBC)
            self.last_dt_raw.copy_(dt_raw)
        else:
            self.last_xBC[rows] = xBC.to(self.last_xBC.dtype)
            self.last_dt_raw[rows] = dt_raw.to(self.last_dt_raw.dtype)

    def checkpoint(self) -> None:
        self.trail = []
        self.trail_rows = self.owner.selected if self.owner is not None else None  # the rows the round writes
        rows = self.trail_rows
        self.mark = ((self.conv_state.clone(), self.ssm_state.clone()) if rows is None
                     else (self.conv_state[rows], self.ssm_state[rows]))

    def rollback(self, keep: torch.Tensor) -> None:
        """Each row b gets back the state after the first keep[b] positions written since checkpoint()."""
        conv0, ssm0 = self.mark
        rows = self.trail_rows
        if rows is not None:
            keep = keep[rows]
        K1 = self.conv_state.shape[-1]
        convs, states = [], []  # after every written position, in order
        for window, call_states in self.trail:
            for j, st in enumerate(call_states):  # the conv history after position j: rows j+1 .. j+K−1
                convs.append(window[:, j + 1 : j + 1 + K1].transpose(1, 2))
                states.append(st)
        self.trail = self.mark = None
        if not states:
            return
        b = keep.shape[0]
        idx = (keep - 1).clamp(0, len(states) - 1)
        ar = torch.arange(b, device=keep.device)
        conv = torch.stack(convs)[idx, ar].to(self.conv_state.dtype)
        ssm = torch.stack(states)[idx, ar]
        none = (keep == 0)
        conv = torch.where(none[:, None, None], conv0, conv)
        ssm = torch.where(none[:, None, None, None], ssm0, ssm)
        if rows is None:
            self.conv_state.copy_(conv)
            self.ssm_state.copy_(ssm)
        else:
            self.conv_state[rows] = conv.to(self.conv_state.dtype)
            self.ssm_state[rows] = ssm.to(self.ssm_state.dtype)

    def reset_rows(self, rows: torch.Tensor) -> None:
        self.conv_state[rows] = 0
        self.ssm_state[rows] = 0

    def nbytes(self, used_only: bool = True) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.ssm_state))


class LoopCache:
    """All decoding state of one batch: entries keyed by (loop, layer), per-row lengths, positions and
    padding, and what a decoder carries between steps (`carry`: name → (B, ...) tensor, zeroed by
    reset_rows). `static=True`: reads cover the whole buffers under a mask, and `advance` keeps no
    Python-side state, so a decoding step can be compiled or captured in a CUDA graph."""

    def __init__(self, entries: dict[tuple[int, Hashable], object], batch_size: int, max_len: int, device,
                 n_loops: int | None = None, static: bool = False):
        self.entries = entries
        for entry in entries.values():
            entry.owner = self
        self.batch_size, self.max_len, self.n_loops, self.static = batch_size, max_len, n_loops, static
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # tokens written per row
        # the same per-row lengths on the host (eager caches): every length a call writes is known there already (T
        # per selected row), so reading how many key columns to attend over never waits for the device
        self.host_lengths: list[int] = [0] * batch_size
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # each row's next RoPE position
        self.valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)  # False: a padding column
        self.all_rows = torch.arange(batch_size, device=device)
        self.carry: dict[str, torch.Tensor] = {}
        self.step: Step | None = None
        self.has_padding = False
        self.uniform: int | None = 0  # eager: every row's length when they all agree (Python-side), else None
        self.selected: torch.Tensor | None = None  # select_rows: the rows the next calls write
        self.selected_host: list[int] | None = None  # the same rows on the host
        self.mark: tuple[torch.Tensor, torch.Tensor] | None = None
        self.check_coda = True  # the coda misuse guard (check_filled) holds while rows agree on their length

    def __getitem__(self, key: tuple[int, Hashable]):
        return self.entries[key]

    def get(self, key, default=None):
        return self.entries.get(key, default)

    def nbytes(self) -> int:
        return sum(e.nbytes() for e in self.entries.values())

    def buffers(self):
        """Every tensor this cache and its entries hold: what a compiled step reads and mutates in place."""
        yield from (self.lengths, self.next_pos, self.valid, self.all_rows, *self.carry.values())
        for entry in self.entries.values():
            yield from (v for v in vars(entry).values() if isinstance(v, torch.Tensor))

    def used_columns(self) -> int:
        if self.static:
            return int(self.lengths.max())
        return self.uniform if self.uniform is not None else max(self.host_lengths)

    def check_depth(self, n_loops: int) -> None:
        if self.n_loops != n_loops:
            raise ValueError(f"this call runs n_loops={n_loops} but the cache was allocated for {self.n_loops} loops; "
                             f"allocate_cache(..., n_loops={n_loops}) and decode every step at that depth")

    # ------------------------------------------------------------------ a call's tokens
    def advance(self, attention_mask: torch.Tensor | None, T: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Register T new tokens of the selected rows (all by default); → their positions (b, T) and their
        own validity (b, T) (None = all real). The Step every entry reads is set here."""
        rows = self.selected
        new_valid = attention_mask.to(torch.bool) if attention_mask is not None else None
        if self.static:
            return self._advance_static(rows, new_valid, T)
        B = self.batch_size if rows is None else rows.shape[0]
        device = self.lengths.device
        ar = torch.arange(T, device=device)
        if rows is None and self.uniform is not None:
            start, end = self.uniform, self.uniform + T
            if end > self.max_len:
                raise RuntimeError(f"cache full: {end} tokens > max_len={self.max_len}")
            self.host_lengths = [end] * self.batch_size
            cols = (start + ar).expand(B, T)
            if new_valid is not None:
                self.valid[:, start:end] = new_valid
                self.has_padding = self.has_padding or not bool(new_valid.all())
            self.lengths += T
            self.uniform = end
            L = end
            mask = None
            if self.has_padding or (T > 1 and start > 0):
                mask = self._mask(self.valid[:, :L], cols, L)
        else:
            lens = self.lengths if rows is None else self.lengths[rows]
            cols = lens[:, None] + ar
            host = self._host_rows(rows)
            lens_host = [self.host_lengths[r] for r in host]
            L = max(lens_host) + T
            if L > self.max_len:
                raise RuntimeError(f"cache full: {L} tokens > max_len={self.max_len}")
            r_idx = self.all_rows if rows is None else rows
            if new_valid is not None:
                self.valid[r_idx[:, None], cols] = new_valid
                self.has_padding = self.has_padding or not bool(new_valid.all())
            else:
                self.valid[r_idx[:, None], cols] = True
            self.lengths[r_idx] = lens + T
            for r in host:
                self.host_lengths[r] += T
            start = lens_host[0] if all(n == lens_host[0] for n in lens_host) else None
            self._refresh_uniform()
            mask = self._mask(self.valid[r_idx, :L], cols, L)
        positions = self._positions(rows, new_valid, T)
        self.step = Step(positions, cols, rows, start, L, mask, T)
        return positions, (None if new_valid is None or bool(new_valid.all()) else new_valid)

    def _advance_static(self, rows, new_valid, T: int):
        if rows is not None:
            raise ValueError("a static cache decodes the whole batch at once; select_rows needs an eager cache")
        cols = self.lengths[:, None] + torch.arange(T, device=self.lengths.device)
        if not torch.compiler.is_compiling():  # eager only: a compiled step keeps no host sync (the caller sized it)
            end = int(self.lengths.max()) + T
            if end > self.max_len:
                raise RuntimeError(f"cache full: {end} tokens > max_len={self.max_len}")
        self.valid.scatter_(1, cols, True if new_valid is None else new_valid)
        self.lengths += T
        positions = self._positions(None, new_valid, T)
        mask = self._mask(self.valid, cols, self.max_len)
        self.step = Step(positions, cols, None, None, self.max_len, mask, T)
        return positions, new_valid

    def _positions(self, rows, new_valid, T: int) -> torch.Tensor:
        nxt = self.next_pos if rows is None else self.next_pos[rows]
        if new_valid is not None:
            positions = (nxt[:, None] + new_valid.long().cumsum(1) - 1).clamp_min(0)
            added = new_valid.long().sum(1)
        else:
            positions = nxt[:, None] + torch.arange(T, device=nxt.device)
            added = T
        if rows is None:
            self.next_pos += added
        else:
            self.next_pos[rows] = nxt + added
        return positions

    @staticmethod
    def _mask(valid: torch.Tensor, cols: torch.Tensor, L: int) -> torch.Tensor:
        """(b, 1, T, L): a query at column c reads the real keys at columns ≤ c, and always its own (a
        padding query never gets an empty row, whose NaN would poison real tokens through V)."""
        kc = torch.arange(L, device=cols.device)
        c = cols[..., None]
        return (((kc <= c) & valid[:, None, :L]) | (kc == c))[:, None]

    def _refresh_uniform(self) -> None:
        lens = self.host_lengths
        self.uniform = lens[0] if all(n == lens[0] for n in lens) else None
        if self.uniform is None:
            self.check_coda = False

    def _host_rows(self, rows) -> list[int]:
        """The selected rows on the host: every row, the list select_rows was given, or (one transfer) the tensor's."""
        if rows is None:
            return list(range(self.batch_size))
        if self.selected_host is not None and rows is self.selected:
            return self.selected_host
        return rows.tolist()

    def revisit(self, T: int, positions: torch.Tensor) -> None:
        """Make the Step cover each selected row's last T registered columns again (a speculative verify re-runs
        the draft's positions through the deeper loops without registering them twice)."""
        rows = self.selected
        if self.static or self.uniform is None or rows is not None:
            lens = self.lengths if rows is None else self.lengths[rows]
            cols = (lens - T)[:, None] + torch.arange(T, device=lens.device)
            lens_host = None if self.static else [self.host_lengths[r] for r in self._host_rows(rows)]
            L = self.max_len if self.static else max(lens_host)
            start = lens_host[0] - T if not self.static and all(n == lens_host[0] for n in lens_host) else None
            mask = self._mask(self.valid[self.all_rows if rows is None else rows, :L], cols, L)
        else:
            start, L = self.uniform - T, self.uniform
            cols = (start + torch.arange(T, device=self.lengths.device)).expand(self.batch_size, T)
            mask = self._mask(self.valid[:, :L], cols, L) if self.has_padding or (T > 1 and start > 0) else None
        self.step = Step(positions, cols, rows, start, L, mask, T)

    @contextlib.contextmanager
    def restrict(self, idx: torch.Tensor | None):
        """For the body of the with-block the current call covers only rows idx (indices into its rows)."""
        if idx is None:
            yield
            return
        full = self.step
        self.step = full.subset(idx)
        try:
            yield
        finally:
            self.step = full

    @contextlib.contextmanager
    def select_rows(self, rows: torch.Tensor | None, host: list[int] | None = None):
        """Calls inside the with-block register and write only these rows (b,) of the batch. host: the same rows as a
        list, when the caller has it (else an eager cache reads the tensor once, a transfer)."""
        prev = self.selected, self.selected_host
        self.selected, self.selected_host = rows, (list(host) if host is not None else None)
        try:
            yield
        finally:
            self.selected, self.selected_host = prev

    def check_filled(self, key, entry) -> None:
        """A coda entry below the last loop is filled only by calls that read per-depth outputs, so one cache
        is used with them on every call or on none: refuse a call that would read a stale entry."""
        st = self.step
        if self.static or not self.check_coda or st.start is None:
            return
        if st.rows is None and entry.upto != st.start:
            r = key[0]
            raise ValueError(
                f"the coda cache of loop {r + 1} holds {entry.upto} tokens but the cache {st.start}: the coda runs "
                "at every depth only in calls that read per-depth outputs (return_all_loops, exit thresholds, "
                "exit_at_step, expected exits), so use one cache with such outputs on every call or on none")
        entry.upto = st.start + st.T

    # ------------------------------------------------------------------ the contract, batch-wide
    def checkpoint(self) -> None:
        """Mark every row's length; tokens written after it can be taken back, row by row."""
        self.mark = (self.lengths.clone(), self.next_pos.clone())
        for entry in self.entries.values():
            entry.checkpoint()

    def rollback(self, keep: torch.Tensor | int) -> None:
        """Row b keeps the first keep[b] tokens written since checkpoint() in every entry, and forgets the rest.
        Only for tokens registered without a new attention mask (decoding steps)."""
        start, next_pos = self.mark
        keep = torch.as_tensor(keep, device=start.device).expand_as(start)
        # one transfer: which lengths each row keeps (speculation decides it on the device)
        keep_host, start_host, lens_host = torch.stack([keep, start, self.lengths]).tolist()
        if any(k < 0 or s + k > n for k, s, n in zip(keep_host, start_host, lens_host)):
            raise ValueError(f"rollback(keep={keep_host}): rows wrote {[n - s for s, n in zip(start_host, lens_host)]} "
                             "tokens since checkpoint()")
        for entry in self.entries.values():
            entry.rollback(keep)
        self.lengths = start + keep
        self.next_pos = next_pos + keep
        self.mark = None
        if not self.static:
            self.host_lengths = [s + k for s, k in zip(start_host, keep_host)]
            self._refresh_uniform()
            if self.uniform is not None:
                for entry in self.entries.values():
                    if hasattr(entry, "upto"):
                        entry.upto = min(entry.upto, self.uniform)

    def reset_rows(self, rows: torch.Tensor, host: list[int] | None = None) -> None:
        """Empty rows (b,) for new requests: lengths, positions, padding, every entry's state and the carry. host: the
        same rows as a list, when the caller has it."""
        if not self.static:
            for r in (host if host is not None else rows.tolist()):
                self.host_lengths[r] = 0
        self.lengths[rows] = 0
        self.next_pos[rows] = 0
        self.valid[rows] = True
        for entry in self.entries.values():
            entry.reset_rows(rows)
        for t in self.carry.values():
            t[rows] = 0
        if not self.static:
            self._refresh_uniform()


class RoutedKVCache:
    """depth_router decoding (models/router.py, docs/decoding.md#routed-decoding): one (loop, layer)'s
    keys/values of ONLY the tokens that ran that loop, so each depth has its own per-row lengths (MoR's
    recursion-wise caching).

    Row b holds its own `lengths[b]` tokens in columns 0..lengths[b]−1, in causal (original) order, and
    `valid` (B, max_len) marks the columns that hold a real key (written, and not left padding). `length`
    = max over rows: the used prefix, which `nbytes` counts. A query sees the valid columns up to its own
    (causal by original position, since every row is written in order), and always its own column. Under
    kv=share_first only loop 0's entries exist; `read_shared` hands later loops' queries loop 0's keys,
    each query up to the column its own token wrote at loop 0 (`cols`). A call covers the rows of the
    owner's Step (decoding gathers the rows whose token runs the loop). No rollback: speculation does not
    route."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.length = 0
        self.owner: LoopCache | None = None
        self.cols: torch.Tensor | None = None  # (B, T) the column each token of the last call wrote (−1: none)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def _rows(self):
        step = self.owner.step if self.owner is not None else None
        return step.rows if step is not None else None

    def write(self, k, v, tok, live, valid, n_call: int):
        """k, v (b, Hkv, n, hd): the n gathered slots of this call's rows; tok (b, n) their indices in the call
        (None = 0..n−1); live (b, n): the slots whose token runs this loop (None = all; the others come after
        every live one of their row, are computed and discarded, and write nothing); valid (b, n): real tokens
        (None = all). → (keys, values, mask (b, 1, n, L))."""
        b, _, n, _ = k.shape
        sel = self._rows()
        rows = torch.arange(b, device=k.device) if sel is None else sel
        live = torch.ones(b, n, dtype=torch.bool, device=k.device) if live is None else live
        count = live.sum(1)
        lens = self.lengths[rows]
        cols = lens[:, None] + live.long().cumsum(1) - 1  # a non-live slot: its row's last live column
        end = int((lens + count).max())
        if end > self.max_len:
            raise RuntimeError(f"KV cache full: {end} tokens > max_len={self.max_len}; allocate a longer cache")
        rr, js = live.nonzero(as_tuple=True)
        c, at = cols[rr, js], rows[rr]
        self.k[at, :, c] = k[rr, :, js].to(self.k.dtype)
        self.v[at, :, c] = v[rr, :, js].to(self.v.dtype)
        self.valid[at, c] = True if valid is None else valid[rr, js]
        self.lengths[rows] = lens + count
        self.length = max(self.length, end)
        tok = torch.arange(n, device=k.device).expand(b, n) if tok is None else tok
        mine = torch.full((b, n_call), -1, dtype=torch.long, device=k.device).scatter(1, tok, torch.where(live, cols, -1))
        if self.cols is None or self.cols.shape[1] != n_call:
            self.cols = torch.full((self.k.shape[0], n_call), -1, dtype=torch.long, device=k.device)
        self.cols[rows] = mine
        return self._read(sel, cols)

    def read_shared(self, tok, n: int):
        """kv=share_first, a later loop: its n query slots (tokens tok of the last call, None = 0..n−1) read
        the keys/values this loop-0 entry holds, each up to the column its own token wrote."""
        sel = self._rows()
        cols = self.cols if sel is None else self.cols[sel]
        q = cols[:, :n] if tok is None else cols.gather(1, tok)
        return self._read(sel, q)

    def _read(self, sel, q: torch.Tensor):
        L = self.length
        if sel is None:
            k, v, valid = self.k[:, :, :L], self.v[:, :, :L], self.valid[:, :L]
        else:
            k, v, valid = self.k[sel, :, :L], self.v[sel, :, :L], self.valid[sel, :L]
        kc = torch.arange(L, device=q.device)
        own = kc == q[..., None]
        m = ((kc <= q[..., None]) & valid[:, None, :]) | own
        m = m | (~m.any(-1, keepdim=True) & (kc == 0))  # a discarded slot that sees nothing: no NaN row
        return k, v, m[:, None]

    def checkpoint(self) -> None:
        raise ValueError("a depth_router cache takes nothing back (self-speculation does not route)")

    def rollback(self, keep) -> None:
        self.checkpoint()

    def reset_rows(self, rows: torch.Tensor) -> None:
        self.lengths[rows] = 0
        self.valid[rows] = False

    def nbytes(self, used_only: bool = True) -> int:
        n = self.length if used_only else self.max_len
        return 2 * self.k[:, :, :n].numel() * self.k.element_size()


@dataclass
class RoutedSSMCache(SSMCache):
    """depth_router decoding in a Mamba-2 layer (or a StateLoop Mamba-2 mixer): one loop's conv history
    and SSM state over ONLY the tokens that ran that loop, the recurrent counterpart of RoutedKVCache
    (models/router.py: a token that stopped is absent from the deeper loops' scans and conv windows).

    Before each call the routed loop hands the entry `live` (b, n): which of the call's n gathered slots
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

    def _counts(self, b: int, n: int) -> torch.Tensor:
        if self.live is None:
            return torch.full((b,), n, dtype=torch.long, device=self.lengths.device)
        return self.live.sum(1)

    def write_conv(self, window: torch.Tensor) -> None:
        K1 = self.conv_state.shape[-1]
        b, n = window.shape[0], window.shape[1] - K1
        cols = self._counts(b, n)[:, None] + torch.arange(K1, device=window.device)  # (b, K−1): up to the last live input
        kept = window.gather(1, cols[..., None].expand(-1, -1, window.shape[2])).transpose(1, 2)
        rows = self.rows
        if rows is None:
            self.conv_state.copy_(kept)
        else:
            self.conv_state[rows] = kept.to(self.conv_state.dtype)

    def write_state(self, state: torch.Tensor, T: int) -> None:
        rows = self.rows
        count = self._counts(state.shape[0], T)
        ran = (count > 0)[:, None, None, None]  # a row whose token stopped keeps its state bit for bit
        if rows is None:
            self.ssm_state.copy_(torch.where(ran, state, self.ssm_state))
            self.lengths += count
        else:
            self.ssm_state[rows] = torch.where(ran, state, self.ssm_state[rows]).to(self.ssm_state.dtype)
            self.lengths[rows] += count

    @property
    def length(self) -> int:
        return int(self.lengths.max())

    def checkpoint(self) -> None:
        raise ValueError("a depth_router cache takes nothing back (self-speculation does not route)")

    def rollback(self, keep) -> None:
        self.checkpoint()

    def reset_rows(self, rows: torch.Tensor) -> None:
        super().reset_rows(rows)
        self.lengths[rows] = 0
