"""Depth-wise batching: one call of the shared block over (row, loop) items (docs/decoding.md#depth-wise-batching).

Every running row has one token in flight, at its own loop. A scheduling step runs **one loop of every
in-flight token in one call of each block layer**: the norms, projections and MLP see all items as one
batch; each item's attention reads and writes the key/value entry of its own (loop, layer) at its row's
column (`_ItemEntries`), and each item's Mamba-2 layer advances its own (loop, layer) conv history and SSM
state at its row (`_ItemSSM`), both grouped by loop over the `LoopCache` contract. After the block, the
items that reached their exit (the exit policy's rule, from loops 1..t, as `SkipDecoding` decides it) or the
last loop leave with their logits; their deeper loops' entries are filled as the skip handling fills them
(`exit_compute.fill_exited`: attention takes the exit loop's keys and values at that column; Mamba-2 under
ssm_skip takes the exit-loop conv input and leaves the state, under ssm_propagate also writes the state).
A row whose token left starts its next token (embedding, prelude) and joins the next block call at loop 1,
while the other rows go on at their own loops.

Guarantees: a token's loops run in order, one per step; a row's next token starts only after its previous
one has left; every in-flight token is in every block call (no row waits). So each row computes exactly
what `generate(prompt, exits=ExitPolicy(q, skip=H))` computes for it alone (per-row columns, positions,
masks and recurrent states; only float rounding can depend on the batch's composition). A Mamba-2 entry
is a recurrence, so the fill of a leaving token's deeper loops must come before that row's next token runs
them: it does (the fill happens as the token leaves, the next token starts in a later step).

A depth router (MoR) schedules its tokens the same way: the router decides after each loop whether the
token runs the next one (token choice: its depth, chosen at loop 1), a stopped token leaves at once, and each
loop's items write and read that loop's recursion-wise entry (only the tokens that ran it, its own length
per row: `_ItemRoutedEntries`); nothing is filled at the deeper loops, as in routed decoding.

Supported: llama, Mamba-2 and hybrid blocks, vanilla and StateLoop without a mixer, prelude, coda,
injection, the exit gate or a zero-shot exit rule with a skip handling (kv_copy; ssm_skip / ssm_propagate
with Mamba-2 layers), or no exits; expert- and token-choice routers on llama blocks with recursion-wise
caches. Refused by name: StateLoop mixers, parallel loops, exits without skip, routers with share_first
caches, Mamba-2 layers or a StateLoop state (`unsupported`).
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch

from looplab.models.cache import RoutedKVCache, SSMCache, Step
from looplab.models.exit_compute import fill_exited
from looplab.models.exit_rules import get_rule
from looplab.models.registry import HANDLINGS


def unsupported(model, exits) -> str | None:
    """Why depth-wise batching cannot run this model and exit policy (the option and its value), or None: the
    variants' declared `depthwise` (and `depthwise_routed` under a depth router)."""
    c = model.config
    reason = c.unsupported("depthwise")
    if reason is None and getattr(model, "router", None) is not None:
        reason = c.unsupported("depthwise_routed")
        if reason is not None:
            reason = f"depth_router={c.depth_router.name} with {reason}"
    if reason is not None:
        return reason
    if exits is not None:
        if exits.threshold is None or getattr(exits, "steps", None) is not None:
            return "depth-wise batching needs exits=ExitPolicy(threshold=q, skip=handling) (or no exits)"
        if exits.skip not in HANDLINGS:
            return (f"skip={exits.skip!r}: depth-wise batching frees an exited token's place at once, which needs a "
                    f"skip handling ({', '.join(HANDLINGS.names())}); without skip every loop runs: use "
                    "schedule='lockstep'")
    return None


class _ItemEntries:
    """What one layer sees as its cache in a depth-wise call: the items, sorted by loop, in contiguous groups
    (loop, start, end); each group writes its keys/values into its own (loop, key) entry at its rows' columns
    and reads that entry's rows straight into its slice of the call's key/value batch (one copy)."""

    def __init__(self, cache, key, groups, step: Step):
        self.cache, self.key, self.groups, self.step = cache, key, groups, step

    def update(self, k: torch.Tensor, v: torch.Tensor):
        n, Hkv, _, hd = k.shape
        st = self.step
        first = self.cache[self.groups[0][0], self.key]
        keys = first.k.new_empty(n, Hkv, st.L, hd)  # the cache's dtype (under autocast k may be bf16, the cache fp32)
        values = torch.empty_like(keys)
        for r, a, b in self.groups:
            entry = self.cache[r, self.key]
            entry.write(st.rows[a:b], st.cols[a:b], k[a:b], v[a:b])
            entry.read_rows_into(st.rows[a:b], keys[a:b], values[a:b])
        return keys, values, st.mask


class _ItemSSM:
    """What one Mamba-2 layer sees as its cache in a depth-wise call (the T = 1 step's SSMCache reads and
    writes): each group's rows read and write the conv history, SSM state and last input of its own
    (loop, key) entry."""

    trail = None  # no speculative rollback inside the engine

    def __init__(self, cache, key, groups, step: Step):
        self.entries = [(cache[r, key], step.rows[a:b], a, b) for r, a, b in groups]

    def _read(self, name: str) -> torch.Tensor:
        parts = [getattr(e, name)[rows] for e, rows, _, _ in self.entries]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def history(self) -> torch.Tensor:
        return self._read("conv_state")

    def state(self) -> torch.Tensor:
        return self._read("ssm_state")

    def write_conv(self, window: torch.Tensor) -> None:
        for e, rows, a, b in self.entries:
            kept = window[a:b, window.shape[1] - e.conv_state.shape[-1]:].transpose(1, 2)
            e.conv_state[rows] = kept.to(e.conv_state.dtype)

    def write_state(self, state: torch.Tensor, T: int) -> None:
        for e, rows, a, b in self.entries:
            e.ssm_state[rows] = state[a:b].to(e.ssm_state.dtype)

    def write_last(self, xBC: torch.Tensor, dt_raw: torch.Tensor) -> None:
        for e, rows, a, b in self.entries:
            if e.last_xBC is None:
                B = e.conv_state.shape[0]
                e.last_xBC, e.last_dt_raw = xBC.new_zeros(B, xBC.shape[-1]), dt_raw.new_zeros(B, dt_raw.shape[-1])
            e.last_xBC[rows], e.last_dt_raw[rows] = xBC[a:b].to(e.last_xBC.dtype), dt_raw[a:b].to(e.last_dt_raw.dtype)


class _ItemRoutedEntries:
    """What one attention layer sees in a depth-wise call of a routed model: each group's items write their
    loop's RoutedKVCache (the tokens that ran that loop, its own length per row) and read it; the groups'
    key/values are padded to the longest and the padding masked out."""

    def __init__(self, cache, key, groups, step: Step):
        self.cache, self.key, self.groups, self.step = cache, key, groups, step

    def update(self, k: torch.Tensor, v: torch.Tensor):
        cache, st, parts = self.cache, self.step, []
        for r, a, b in self.groups:  # RoutedKVCache.write reads its rows from the owner's Step
            with _stepping(cache, st.positions[a:b], st.cols[a:b], st.rows[a:b]):
                parts.append((a, b, *cache[r, self.key].write(k[a:b], v[a:b], None, None, None, 1)))
        if len(parts) == 1:
            return parts[0][2:]
        n, Hkv, _, hd = k.shape
        L = max(p[2].shape[2] for p in parts)
        keys, values = k.new_zeros(n, Hkv, L, hd), v.new_zeros(n, Hkv, L, hd)
        mask = torch.zeros(n, 1, 1, L, dtype=torch.bool, device=k.device)
        for a, b, kk, vv, mm in parts:
            keys[a:b, :, :kk.shape[2]], values[a:b, :, :vv.shape[2]], mask[a:b, ..., :mm.shape[-1]] = kk, vv, mm
        return keys, values, mask


@contextlib.contextmanager
def _stepping(cache, positions: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor):
    """For the body of the with-block the cache's Step is one token of each of rows (b,) at cols (b, 1): what the
    entry methods that read their rows from the owner's Step (routed writes, exit fills) see."""
    saved, cache.step = cache.step, Step(positions, cols, rows, None, 0, None, 1)
    try:
        yield
    finally:
        cache.step = saved


def _entries(cache, key, groups, step: Step):
    """The depth-wise view of entry `key` for a call's groups: attention (key/values; routed: each loop's own
    tokens) or Mamba-2 (states)."""
    first = cache[groups[0][0], key]
    if isinstance(first, SSMCache):
        return _ItemSSM(cache, key, groups, step)
    return (_ItemRoutedEntries if isinstance(first, RoutedKVCache) else _ItemEntries)(cache, key, groups, step)


def _groups(loops: list[int], offset: int = 0) -> list[tuple[int, int, int]]:
    """Sorted loops (a host list) → contiguous (loop + offset, start, end) runs."""
    out = []
    for i, g in enumerate(loops):
        if out and out[-1][0] == g + offset:
            out[-1] = (out[-1][0], out[-1][1], i + 1)
        else:
            out.append((g + offset, i, i + 1))
    return out


class DepthwiseDecoder:
    """The in-flight tokens of a LoopCache's rows and the depth-wise step over them.

    What decides the schedule lives on the host — each row's next loop and its token's cache column — so a step
    sends the device one small index tensor (the items, sorted by loop) and reads back one decision (which items
    leave), whatever the number of rows, loops or cache entries (tests/test_gpu_readiness.py)."""

    def __init__(self, model, cache, n_loops: int, exits=None):
        reason = unsupported(model, exits)
        if reason:
            raise ValueError(reason)
        self.model, self.cache, self.R, self.exits = model, cache, n_loops, exits
        B, device = cache.batch_size, cache.lengths.device
        self.loop = [-1] * B  # each row's next loop to run (host); −1: none in flight
        self.col_host = [0] * B  # the cache column of each row's in-flight token (host)
        self.col = torch.zeros(B, dtype=torch.long, device=device)
        self.pos = torch.zeros(B, dtype=torch.long, device=device)
        self.survival = torch.ones(B, device=device)
        self.x = self.e = self.s = None  # (B, 1, ·), allocated at the first start
        self.probs = torch.zeros(B, n_loops, device=device)  # the gate's p(t) of the in-flight token
        self.router = getattr(model, "router", None)  # a depth router: each token's next loop is the router's
        self.route_w = torch.zeros(B, device=device)  # the router's weight of the token's next loop
        self.route_depth = torch.full((B,), n_loops, dtype=torch.long, device=device)  # token choice: its depth
        self.hist: torch.Tensor | None = None  # zero-shot rules: loops 1..t of what the rule reads, (R, B, ·)
        self.block_calls: deque[list[int]] = deque(maxlen=4096)  # the last block calls' items' loops (1-based)
        self.left: torch.Tensor | None = None  # the rows the last step's leaving tokens came from, on the device
        self._entries_of = {r: [(k, e) for k, e in cache.entries.items() if k[0] == r] for r in range(n_loops)}

    @property
    def in_flight(self) -> list[int]:
        return [b for b, r in enumerate(self.loop) if r >= 0]

    @torch.no_grad()
    def start(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Tokens (n,) enter rows (a host list): their column is registered, embedding and prelude run; loop 1 is
        next."""
        m, cache = self.model, self.cache
        rows_t = torch.tensor(rows, device=tokens.device)
        with cache.select_rows(rows_t, rows):
            positions, valid = m.positions(tokens[:, None], None, cache)
            st = m.start(tokens[:, None], positions, valid, cache)
            cols = cache.step.cols[:, -1]
        if self.x is None:
            B = cache.batch_size
            self.x = st.x.new_zeros(B, 1, st.x.shape[-1])
            self.e = torch.zeros_like(self.x)
            self.s = st.s.new_zeros(B, 1, st.s.shape[-1]) if st.s is not None else None
        self.x[rows_t], self.e[rows_t] = st.x.to(self.x.dtype), st.e.to(self.e.dtype)
        if self.s is not None:
            self.s[rows_t] = st.s.to(self.s.dtype)
        self.col[rows_t], self.pos[rows_t] = cols, positions[:, -1]
        for b in rows:
            self.loop[b] = 0
            self.col_host[b] = cache.host_lengths[b] - 1
        self.survival[rows_t] = 1.0
        self.probs[rows_t] = 0.0
        if self.router is not None:  # loop 1 runs every token (capacity 1 / depth >= 1): its weight, token choice's depth
            w, depth = self._route(0, st.x[:, -1])
            self.route_w[rows_t] = w.to(self.route_w.dtype)
            if depth is not None:
                self.route_depth[rows_t] = depth

    def _route(self, r: int, x: torch.Tensor):
        """The router at loop r (0-based) for tokens x (n, d) → (weight (n,), token choice's depth (n,) or None;
        expert choice: its weight, and whether it runs loop r, as `depth` r + 1 or r) — RoutedLoop's decisions."""
        from looplab.models.router import ExpertChoiceRouter

        router = self.router
        if isinstance(router, ExpertChoiceRouter):
            ran = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
            active, w = router.decide(r, x, ran, None)
            return w, None if r == 0 else torch.where(active, r + 1, r)
        depth, w = router.choose(router.scores(x)[1])
        return w, depth

    def _step_of(self, items: torch.Tensor, items_host: list[int]) -> Step:
        cols = self.col[items]
        L = max(self.col_host[b] for b in items_host) + 1
        ar = torch.arange(L, device=cols.device)
        mask = (self.cache.valid[items, :L] & (ar[None] <= cols[:, None]))[:, None, None, :]  # (n, 1, 1, L)
        return Step(self.pos[items][:, None], cols[:, None], items, None, L, mask, 1)

    @torch.no_grad()
    def step(self):
        """One loop of every in-flight token, in one call of each block layer → (rows that left (a host list), their
        logits (k, V), their exit steps (a host list, 1-based))."""
        m, cache, R = self.model, self.cache, self.R
        items_host = sorted(self.in_flight, key=lambda b: self.loop[b])  # by loop: each loop's items one slice
        loops = [self.loop[b] for b in items_host]
        packed = torch.tensor([items_host, loops], device=self.col.device)  # the step's one host-to-device copy
        items, r = packed[0], packed[1]
        step = self._step_of(items, items_host)
        groups = _groups(loops)
        self.block_calls.append([g + 1 for g in loops])
        positions = step.positions
        x = self.x[items]
        first_later = next((i for i, g in enumerate(loops) if g > 0), len(loops))
        if m.inject is not None and first_later < len(loops):
            x = torch.cat([x[:first_later], m.inject(x[first_later:], self.e[items][first_later:])])
        h = x
        for l, layer in enumerate(m.block):
            h = layer(h, positions, None, _entries(cache, l, groups, step))
        if self.router is not None:  # the router's weight multiplies the update (RoutedLoop.loop_step's gate)
            w = self.route_w[items][:, None, None].to(x.dtype)  # as routed decoding weighs it, in the stream's dtype
            h = x + w * (h if self.router.cfg.update == "mor" else h - x)
        if m.state is not None:
            s, x, _ = m.state(h, self.s[items], positions, None, None)
            self.s[items] = s.to(self.s.dtype)
        else:
            x = h
        self.x[items] = x.to(self.x.dtype)
        z = x if m.state is not None and m.config.state_in_output else h
        t = r + 1  # loops run, 1-based
        t_host = [g + 1 for g in loops]

        # which items read a prediction now: every one under exits, the last loop's otherwise (a tail: sorted loops)
        routed = self.router is not None
        a0 = 0 if self.exits is not None or routed else next((i for i, g in enumerate(t_host) if g == R), len(t_host))
        stop, stop_host = None, None
        if routed:  # a routed token stops where the router does not send it on
            stop = self._route_stops(items, t, x)
        elif self.exits is None:  # the last loop's items leave: known on the host
            stop_host = [g == R for g in t_host]
        read_logits, out_logits = None, None
        if a0 < len(items_host):
            zs, ts = z[a0:], t_host[a0:]
            sub = step.subset(torch.arange(a0, len(items_host), device=items.device))
            # routed decoding reads every token through depth R's coda
            sub_groups = _groups(ts, offset=-1) if not routed else [(R - 1, 0, len(ts))]
            for c, layer in enumerate(m.coda):
                zs = layer(zs, sub.positions, None, _entries(cache, ("coda", c), sub_groups, sub))
            normed = m.final_norm(zs[:, -1])  # (k, d)
            if self.exits is not None:
                decided, read_logits = self._decide(items[a0:], ts, normed)
                stop = decided | (t[a0:] == R)
                stop = torch.cat([torch.zeros(a0, dtype=torch.bool, device=stop.device), stop])
        if stop_host is None:
            stop_host = stop.tolist()  # the step's one device-to-host transfer: which items leave
        leave = [i for i, s_ in enumerate(stop_host) if s_]
        rows_host = [items_host[i] for i in leave]
        steps_host = [t_host[i] for i in leave]
        if leave:
            n = len(leave)
            if stop is None:  # the tail of the sorted items
                order = torch.arange(leave[0], leave[0] + n, device=items.device)
            else:
                order = torch.argsort((~stop).to(torch.int8), stable=True)[:n]  # the leaving items, in item order
            at = order - a0  # their places among the read items (every leaving item was read)
            out_logits = read_logits[at] if read_logits is not None else m.head(normed[at])
            self.left = items[order]
            self._fill_deeper(self.left, rows_host, [g - 1 for g in steps_host])
        for b, g, s_ in zip(items_host, t_host, stop_host):
            self.loop[b] = -1 if s_ else g
        return rows_host, out_logits, steps_host

    def _route_stops(self, items, t, x) -> torch.Tensor:
        """Whether each item's token stops after loop t (1-based): token choice at its depth; expert choice where
        the router does not run loop t + 1 (the weight of that loop is kept for the ones that go on)."""
        from looplab.models.router import ExpertChoiceRouter

        if not isinstance(self.router, ExpertChoiceRouter):
            return t >= self.route_depth[items]
        stop = t >= self.R
        for g, a, b in _groups(t.tolist()):  # t is sorted: each loop's items one slice (routed: syncs, not pinned)
            if g >= self.R:
                continue
            w, depth = self._route(g, x[a:b, -1])
            stop[a:b] = depth == g
            self.route_w[items[a:b]] = w.to(self.route_w.dtype)
        return stop

    def _decide(self, rows, t: list[int], normed):
        """The exit rule after loop t (1-based, a host list) for each item, from loops 1..t, as SkipDecoding decides
        it → (stop (k,) bool, the logits the rule read, or None when it reads no logits)."""
        pol, R = self.exits, self.R
        rule, q = get_rule(pol.rule), pol.threshold
        read_logits = None
        n_live = sum(1 for g in t if g < R)  # sorted: the items before the last loop come first
        if rule.reads == "exit_probs":  # p(t) = λ_t S_{t−1}, S_t = S_{t−1}(1 − λ_t); the last loop takes what is left
            if n_live:
                b, lam = rows[:n_live], self.model.exit_gate(normed[:n_live])
                cols = _loop_index(t[:n_live], rows.device)
                self.probs[b, cols] = lam * self.survival[b]
                self.survival[b] = self.survival[b] * (1 - lam)
        else:
            value = normed if rule.reads == "hidden" else self.model.head(normed)
            if self.hist is None:
                self.hist = value.new_zeros(R, self.cache.batch_size, value.shape[-1])
            self.hist[_loop_index(t, rows.device), rows] = value.to(self.hist.dtype)
            read_logits = value if rule.reads == "logits" else None
        stop = torch.zeros(len(t), dtype=torch.bool, device=normed.device)
        for g, a, e in _groups(t):  # t is sorted: each loop's items one slice
            if g >= R or g < pol.min_loops:
                continue
            b = rows[a:e]
            inputs = self.probs[b, :g] if rule.reads == "exit_probs" else self.hist[:g, b]
            stop[a:e] = rule.stops(g, q, inputs)
        return stop, read_logits

    def _fill_deeper(self, items: torch.Tensor, rows: list[int], exit_loop: list[int]) -> None:
        """Each leaving token's entries of the loops after its exit loop (0-based), as the skip handling fills them
        (`exit_compute.fill_exited`, what the frozen-input reference leaves there), before the row's next token.
        items (k,): the leaving rows on the device, sorted by exit loop (as `rows` and `exit_loop` on the host)."""
        if self.exits is None:
            return
        deeper = [i for i, e in enumerate(exit_loop) if e < self.R - 1]
        if not deeper:
            return
        a, b = deeper[0], deeper[-1] + 1  # sorted by exit loop: the ones below R − 1 are one slice
        items, exit_loop = items[a:b], exit_loop[a:b]
        runs = _groups(exit_loop)
        with _stepping(self.cache, self.pos[items][:, None], self.col[items][:, None], items):
            for r in range(exit_loop[0] + 1, self.R):
                groups = [(e, torch.arange(s, t, device=items.device)) for e, s, t in runs if e < r]
                fill_exited(self.model, self.cache, r, groups, self.exits.skip, self._entries_of[r])


def _loop_index(t: list[int], device) -> torch.Tensor:
    """t − 1 for a host list of 1-based loops, as a device index, built from device arithmetic on cached aranges (no
    host-to-device copy): the list is sorted, so it is a concatenation of constant runs."""
    parts = [torch.full((e - a,), g - 1, dtype=torch.long, device=device) for g, a, e in _groups(t)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
