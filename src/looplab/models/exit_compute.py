"""Exits that save compute (docs/decoding.md#exits-that-save-compute): what a token that exited at loop e leaves in the deeper loops.

A token's exit depth e picks the loop whose readout the head uses. With `skip_compute` the loops
after e are not run for that token, but later tokens still read, at every deeper loop, what the
token left there: key/values in attention layers, the conv history and the recurrent state in
Mamba-2 layers (the Looped-SSM paper's open problem: "the state chain of all R steps must be
kept"). `exit_gate.skip_compute` chooses how those entries are filled:

    kv_copy        attention-only models (looplab's first skip_compute): each deeper loop's key/values
                   of the token are its exit loop's (Ouro reports this reuse nearly lossless).
                   Refused when the model has Mamba-2 layers or a Mamba-2 state mixer.
    ssm_skip       attention as kv_copy; a Mamba-2 layer at a deeper loop treats the token as absent
                   from its state: dt = 0, so the state neither decays nor is written at that token,
                   and the conv history takes the token's exit-loop conv input. Costs copies only.
    ssm_propagate  attention as kv_copy; a Mamba-2 layer at a deeper loop writes the token into its
                   state from its exit-loop input: this loop's conv over its own history and the
                   state decay and write run; the output path (state read, gate, norm, out-projection,
                   MLP) does not. The block is shared across loops, so the in-projection of the same
                   input is the same at every loop: the exit loop's raw conv input and dt are reused
                   and nothing is projected again.

One definition serves the reference and the decoder. In loop r, every layer (and the StateLoop
state mixer, and each coda layer at depth r) gets, for a token whose exit depth e is below r, the
input it had at loop e ("frozen"); under ssm_skip its Mamba-2 layers also get dt = 0 for that token.
Prelude and coda (docs/formulations.md#prelude-and-coda): the prelude runs once per token before the loops, with no exits and
nothing to freeze. Each loop's readout goes through the coda, with that depth's coda caches, before
the rule reads it, so the coda entries of a depth r beyond a token's exit are filled by the same
rule: the coda layer at depth r gets the token's exit-depth coda input (attention and kv_copy:
the exit depth's key/values; Mamba-2: that input under ssm_skip / ssm_propagate). With frozen inputs
attention recomputes exactly the exit loop's key/values, so kv_copy is the same rule.
`forward_with_exits` applies it to a whole sequence without caches (the reference the cached
decoder is tested against; `model(ids, exits=ExitPolicy(skip=H, steps=S))` runs it as the model's own
forward, so that what wraps the forward — FSDP2's root all-gather in exit-aware fine-tuning — runs).
`SkipDecoding` decodes one token at a time from the caches: a row whose token has exited is not computed
at the deeper loops, and their cache entries are filled directly (copies, plus the state write under
ssm_propagate) without running a layer.
"""

from __future__ import annotations

from collections import deque

import torch

from looplab.models.cache import KVCache, LoopCache, SSMCache
from looplab.models.exit_gate import logits_at_depth
from looplab.models.exit_rules import check_rule, get_rule, zero_shot_rules
from looplab.models.outputs import LoopedLMOutput
from looplab.models.registry import EXIT_GATES, HANDLINGS, Variant


class SkipHandling(Variant):
    """What an exited token leaves in the deeper loops' cache entries (a registered class: HANDLINGS).

    fills: the cache kinds (models/registry.py Supports.cache) it knows how to fill (none until a handling declares
    them); a model keeping another kind is refused. ssm_absent: at a deeper loop a Mamba-2 layer treats the token as absent (dt = 0);
    ssm_write: a deeper loop's Mamba-2 state is written from the token's exit-loop input."""

    fills: frozenset = frozenset()
    ssm_absent: bool = False
    ssm_write: bool = False

    @classmethod
    def refusal(cls, where: str, kind: str) -> str:
        """Why this handling cannot serve a model whose `where` keeps a `kind` cache entry it does not fill."""
        if not cls.fills:
            return (f"skip_compute={cls.name} declares no cache entries it fills, and {where} keeps a {kind!r} entry; "
                    f"declare fills = frozenset({{{kind!r}}}) on its class once it fills them as its reference does "
                    "(the conformance kit checks it; docs/extending.md#registries-and-capabilities)")
        return (f"skip_compute={cls.name} fills {sorted(cls.fills)} cache entries, but {where} keeps a {kind!r} entry; "
                "choose a handling that fills it, or decode without skip_compute")


@HANDLINGS.register("kv_copy")
class KVCopy(SkipHandling):
    fills = frozenset({"kv"})

    @classmethod
    def refusal(cls, where, kind):
        if kind != "ssm":
            return super().refusal(where, kind)
        return ("skip_compute=kv_copy (or true) needs an attention-only model, but {where}: a Mamba-2 layer's "
                "recurrent state at each loop depends on every earlier token at that loop, so copying key/values "
                "does not say what an exited token leaves there. Choose skip_compute=ssm_skip (the token is absent "
                "from the deeper loops' states) or ssm_propagate (the deeper loops write it from its exit-loop "
                "input), or decode without skip_compute (every loop runs, the exit only picks the depth)."
                ).format(where=where)


@HANDLINGS.register("ssm_skip")
class SSMSkip(SkipHandling):
    fills = frozenset({"kv", "ssm"})
    ssm_absent = True


@HANDLINGS.register("ssm_propagate")
class SSMPropagate(SkipHandling):
    fills = frozenset({"kv", "ssm"})
    ssm_write = True


def handling_names() -> tuple[str, ...]:
    return HANDLINGS.names()


def resolve_handling(skip_compute: bool | str | None) -> str | None:
    """skip_compute as given by users (False/None/'none', True = 'kv_copy', or a handling) → handling or None."""
    if skip_compute is None or skip_compute is False or skip_compute == "none":
        return None
    if skip_compute is True:
        return "kv_copy"
    if isinstance(skip_compute, str) and skip_compute in HANDLINGS:
        return skip_compute
    raise ValueError(f"skip_compute={skip_compute!r} is unknown; choose none, {', '.join(HANDLINGS.names())} "
                     "(true = kv_copy)")


def has_ssm(config) -> bool:
    """Whether the model keeps a recurrent (Mamba-2) cache entry anywhere: its block, prelude, coda or state mixer."""
    return "ssm" in config.cache_kinds()


def skip_compute_unsupported(config, exit_rule: str | None = None, skip_compute: bool | str = True) -> str | None:
    """Why skip_compute (with this handling and exit rule) cannot be used with this model, or None."""
    handling = resolve_handling(skip_compute)
    if handling is not None:
        cls = HANDLINGS.get(handling)
        for where, kind in config.cache_owners():
            if kind not in cls.fills:
                return cls.refusal(where, kind)
    if not issubclass(EXIT_GATES.get(config.exit_gate), torch.nn.Module) and get_rule(exit_rule).reads == "exit_probs":
        return ("exit_gate.skip_compute needs a model with an exit gate (exit_gate=ouro), "
                f"or a zero-shot exit_rule ({', '.join(zero_shot_rules())})")
    return None


class FrozenInputs:
    """Inside one forward: each token that has exited feeds every deeper layer its exit-loop input."""

    def __init__(self, handling: str, run=None):
        self.handling = HANDLINGS.get(handling)
        # how a layer is applied: run(module, *args, **kw) (LoopedLM.apply_layer: per-layer activation checkpointing
        # of the module alone — never of this call, whose bookkeeping a recomputation must not repeat)
        self.run = run
        self.inputs: dict = {}  # key (layer index, "state" or ("coda", l)) → (B, T, d) input at each token's last run loop
        self.gone: torch.Tensor | None = None  # (B, T) bool: tokens whose exit depth is below this loop

    def set_loop(self, gone: torch.Tensor | None) -> None:
        self.gone = gone if gone is not None and bool(gone.any()) else None

    def call(self, module, key, x, positions, valid, cache):
        """module(x, …) with the exited tokens' x replaced by their frozen input (ssm_skip: and dt = 0)."""
        prev = self.inputs.get(key)
        if prev is not None and self.gone is not None:
            x = torch.where(self.gone[..., None], prev, x)
        self.inputs[key] = x
        run = self.run if self.run is not None and cache is None else (lambda m, *a, **kw: m(*a, **kw))
        if self.handling.ssm_absent and self.gone is not None and _is_ssm(module):
            return run(module, x, positions, valid, cache, skip=self.gone)
        return run(module, x, positions, valid, cache)


def _is_ssm(module) -> bool:
    from looplab.models.mamba2 import Mamba2Layer, Mamba2Mixer

    return isinstance(module, (Mamba2Layer, Mamba2Mixer))


def frozen_loop(model, frozen: FrozenInputs):
    """The loop step of the reference: model.loop_step with every layer (and the StateLoop mixer) fed its
    frozen inputs."""
    def step(st, r, cache):
        return model.loop_step(st, r, cache, call=frozen.call)
    return step


def forward_with_exits(model, input_ids: torch.Tensor, exit_steps: torch.Tensor | None, handling: str,
                       attention_mask: torch.Tensor | None = None, *, rule: str | None = None,
                       threshold: float | None = None, min_loops: int = 1, n_loops: int | None = None,
                       targets: torch.Tensor | None = None, cache: LoopCache | None = None):
    """The reference: a full forward pass (no cache) in which each token stops at its exit step.

    exit_steps: (B, T) 1-based loop after which each token exits; or None with `rule`/`threshold`
    (and `min_loops`): each token's exit is decided online after each loop by the rule, from its own
    loops 1..t, as skip_compute decoding decides it (later loops of a token read the frozen inputs of
    tokens that left earlier, so these exits can differ from forward(exit_rule=...)'s). Returns a
    LoopedLMOutput with loop_logits (R, B, T, V) and loop_hidden — a token's loops up to its exit are
    ordinary, the deeper ones meaningless — logits (B, T, V) read at each token's exit step, and exit_steps.
    n_loops: the depth R′ to run (test-time depth; default the configured R). targets (B, T): exit-aware training's
    loss, each token's cross-entropy at its exit step (`token_loss`, models/loss.py) instead of any logits.
    cache: a prefill under the same rule (generation.prefill with a skip handling): every loop's and depth's
    entries are written from the frozen inputs, which is what the handling's copies leave there, so a prompt's
    tokens are treated as decoded ones are (and as vLLM's plugin treats every token, chunked or cached).
    """
    if handling not in HANDLINGS:
        raise ValueError(f"handling={handling!r} is unknown; choose one of {HANDLINGS.names()}")
    R = model.loops(n_loops)
    online = exit_steps is None
    if online:
        if rule is None or threshold is None:
            raise ValueError("forward_with_exits needs exit_steps, or an exit rule and its threshold")
        check_rule(rule, threshold, min_loops, R)
        reads = get_rule(rule).reads
        if reads == "exit_probs" and model.exit_gate is None:
            raise ValueError(f"exit rule {rule!r} needs a model with an exit gate (exit_gate=ouro)")
        exit_steps = torch.full(input_ids.shape, R, dtype=torch.long, device=input_ids.device)
        decided = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    if cache is not None:
        if targets is not None:
            raise ValueError("forward_with_exits(targets=...) is a training loss; a prefill (cache=) reads logits")
        cache.check_depth(R)
    positions, valid = model.positions(input_ids, attention_mask, cache)
    stream = model.start(input_ids, positions, valid, cache)
    frozen = FrozenInputs(handling, run=model.apply_layer)
    readouts, hidden, probs = [], [], []
    survival = None
    state = {"steps": exit_steps, "decided": decided if online else None}

    def rows(r, st):  # every row computes; the frozen inputs say who left (exited after loops 1..r)
        gone = state["steps"] <= r
        frozen.set_loop(gone & state["decided"] if online else gone)
        return None

    def after(r, st, idx):
        nonlocal survival
        readout = model.coda_at(model.readout(st), r, st.positions, st.valid, cache, call=frozen.call)
        readouts.append(readout)
        t = r + 1
        if online and t < R:
            hidden.append(model.final_norm(readout))
            if reads == "exit_probs":
                lam = model.exit_gate(hidden[-1])
                survival = torch.ones_like(lam) if survival is None else survival
                probs.append(lam * survival)
                survival = survival * (1 - lam)
            if t >= min_loops:
                h = torch.stack(hidden)
                inputs = {"exit_probs": lambda: torch.stack(probs, -1), "logits": lambda: model.head(h),
                          "hidden": lambda: h}[reads]()
                stop = get_rule(rule).stops(t, threshold, inputs)
                new = stop & ~state["decided"]
                state["steps"] = torch.where(new, torch.full_like(state["steps"], t), state["steps"])
                state["decided"] = state["decided"] | new

    model.run_loops(stream, range(R), cache, step=frozen_loop(model, frozen), rows=rows, after=after)
    exit_steps = state["steps"]
    loop_hidden = model.final_norm(torch.stack(readouts))  # (R, B, T, d)
    if targets is not None:
        token_loss = model.token_losses(logits_at_depth(loop_hidden, exit_steps), targets)
        return LoopedLMOutput(logits=None, loop_hidden=loop_hidden, exit_steps=exit_steps, token_loss=token_loss)
    loop_logits = model.head(loop_hidden)
    return LoopedLMOutput(logits=logits_at_depth(loop_logits, exit_steps), loop_logits=loop_logits,
                          loop_hidden=loop_hidden, exit_steps=exit_steps)


def fill_exited(model, cache: LoopCache, r: int, groups, handling: str, entries=None) -> None:
    """Loop r's entries of the call's tokens that exited at an earlier loop, without running a layer. groups: (e, idx)
    pairs, idx (b,) the call's rows whose token exited after loop e (0-based, e < r). Attention entries take the exit
    loop's key/values at the token's column (kv_copy — what recomputing from the frozen input gives), Mamba-2 entries
    its exit-loop conv input, and under ssm_propagate also the state write (Mamba2Mixer.step_from). entries: the
    ((loop, key), entry) pairs to look at (default: all of the cache's; a caller that fills often passes loop r's).
    The caller groups the tokens on the host: nothing here reads a device value."""
    st = cache.step
    write = HANDLINGS.get(handling).ssm_write
    for e, sel in groups:
        rows = sel if st.rows is None else st.rows[sel]  # the batch rows of these tokens
        cols = st.cols[sel, -1]
        for (rr, key), dst in (cache.entries.items() if entries is None else entries):
            if rr != r:
                continue
            src = cache[e, key]
            if isinstance(dst, KVCache):
                dst.copy_columns_from(src, rows, cols)
            elif isinstance(dst, SSMCache):
                if key == "state":
                    mixer = model.state.mixer
                else:
                    mixer = (model.coda[key[1]] if isinstance(key, tuple) else model.block[key]).mixer
                mixer.step_from(dst, src, rows, write=write)
            if hasattr(dst, "upto") and hasattr(src, "upto"):
                # a coda entry's misuse guard (LoopCache.check_filled): the fill covers this token as a run would
                dst.upto = max(dst.upto, src.upto)


def split_sorted(order: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """order (n,) cut into consecutive pieces of the given sizes (known on the host: slicing reads no device value)."""
    out, a = [], 0
    for c in counts:
        out.append(order[a:a + c])
        a += c
    return out


class SkipDecoding:
    """One T = 1 decoding step in which a row stops running loops once its token has exited (skip handling).

    The exit decision is forward(exits=ExitPolicy(threshold, rule))'s, taken online after each loop from
    loops 1..t (the rule's `stops`); for the gate, p(t) = λ_t S_{t−1} with S_t = S_{t−1}(1 − λ_t) and
    p(R) = S_{R−1}. Loop r runs on the rows still going only (`LoopedLM.run_loops`' rows: gathered, their
    cache entries indexed), and the rows that have exited get loop r's entries filled by the handling
    (`fill_exited`), which is exactly what the frozen-input reference leaves there.

    Host syncs: which rows still run must reach the host to gather them, so each loop's decision is one transfer
    (R − 1 per token at most, none after the last loop); the rows are then split on the device by a stable sort,
    cut at counts the host already knows. `block_rows` keeps how many rows each of the last loops' block calls
    received (what a test counts; bounded)."""

    def __init__(self, model, policy, n_loops: int):
        self.model, self.policy, self.R = model, policy, n_loops
        self.block_rows: deque[int] = deque(maxlen=4096)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: LoopCache) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (logits (B, V) at each row's exit, exit steps (B,), 1-based)."""
        model, pol, R = self.model, self.policy, self.R
        q, handling = pol.threshold, pol.skip
        rule_cls = get_rule(pol.rule_name)
        reads = rule_cls.reads
        B = input_ids.shape[0]
        positions, valid = model.positions(input_ids, None, cache)
        stream = model.start(input_ids, positions, valid, cache)
        device = input_ids.device
        exit_loop = torch.full((B,), -1, dtype=torch.long, device=device)  # 0-based, −1 = running
        exits_host = [-1] * B  # the same, on the host (each loop's decision is transferred once)
        logits = None
        hist: list[torch.Tensor] = []  # what the rule reads, loops 1..t, full-batch rows (exited rows stale)
        survival = stream.x.new_ones(B, dtype=torch.float32)  # the gate's running product in float32 (exit_gate.py)
        live = {"idx": None, "host": list(range(B))}  # idx None: every row runs (no index ops until some row exits)

        def rows(r, st):
            idx = live["idx"]
            if idx is not None and len(live["host"]) < B:
                # the exited rows, by exit loop: a stable sort on the device, cut at the host's counts
                gone = [e for e in exits_host if e >= 0]
                loops = sorted(set(gone))
                key = torch.where(exit_loop < 0, R, exit_loop)
                order = torch.argsort(key, stable=True)
                parts = split_sorted(order, [gone.count(e) for e in loops])
                fill_exited(model, cache, r, list(zip(loops, parts)), handling)
            self.block_rows.append(B if idx is None else len(live["host"]))
            return idx

        def after(r, st, idx):
            nonlocal logits, survival
            if idx is not None and not live["host"]:  # every row has exited: loop r only filled caches
                return
            sub = st if idx is None else st.select(idx)
            with cache.restrict(idx):
                readout = model.coda_at(model.readout(sub), r, sub.positions, sub.valid, cache)
            normed = model.final_norm(readout[:, -1])  # (b, d)
            t = r + 1
            read_logits = None
            if t == R:
                new_host = [True] * len(live["host"])
            else:
                if reads == "exit_probs":
                    lam = model.exit_gate(normed)
                    s_rows = survival if idx is None else survival[idx]
                    hist.append(_put(hist, lam * s_rows, idx, B))
                    survival = (s_rows * (1 - lam)) if idx is None else survival.index_copy(0, idx, s_rows * (1 - lam))
                else:
                    read_logits = None if reads == "hidden" else model.head(normed)
                    hist.append(_put(hist, normed if reads == "hidden" else read_logits, idx, B))
                if t < pol.min_loops:
                    return
                full = torch.stack(hist, -1 if reads == "exit_probs" else 0)
                if idx is not None:
                    full = full[idx] if reads == "exit_probs" else full[:, idx]
                new = rule_cls.stops(t, q, full)
                new_host = new.tolist()  # the loop's one transfer: which rows stop here
            n_new = sum(new_host)
            if n_new == 0:
                return
            if t == R and idx is None:  # every row ran every loop
                logits = model.head(normed)
                exit_loop.fill_(r)
                return
            b = len(new_host)
            if t == R:  # every row still running stops at the last loop
                order = torch.arange(b, device=device)
            else:
                order = torch.argsort((~new).to(torch.int8), stable=True)  # the stopping rows first, in their order
            at, keep = order[:n_new], order[n_new:]
            glob = at if idx is None else idx[at]
            step_logits = read_logits[at] if read_logits is not None else model.head(normed[at])
            if logits is None:
                logits = step_logits.new_zeros(B, step_logits.shape[-1])
            logits[glob] = step_logits
            exit_loop[glob] = r
            host = live["host"]
            for i, stop in enumerate(new_host):
                if stop:
                    exits_host[host[i]] = r
            live["host"] = [row for row, stop in zip(host, new_host) if not stop]
            live["idx"] = (torch.arange(b, device=device) if idx is None else idx)[keep] if b > n_new else keep[:0]

        model.run_loops(stream, range(R), cache, rows=rows, after=after)
        return logits, exit_loop + 1


def _put(history: list, value: torch.Tensor, idx, B: int) -> torch.Tensor:
    """A loop's per-row value in a full-batch tensor: rows idx get value, the others the previous loop's."""
    if idx is None:
        return value
    prev = history[-1] if history else value.new_zeros(B, *value.shape[1:])
    return prev.index_copy(0, idx, value)
