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
forward, so that what wraps the forward — FSDP2's root all-gather in exit-aware fine-tuning — runs); `skip_compute_step` applies it one token at a time from the caches,
and once every row of the batch has exited it advances the deeper loops' caches directly (copies,
plus the state write under ssm_propagate) without running a layer.
"""

from __future__ import annotations

import torch

from looplab.models.cache import KVCache, LoopCache, SSMCache
from looplab.models.exit_gate import logits_at_depth
from looplab.models.exit_rules import check_rule, stops_at
from looplab.models.outputs import LoopedLMOutput

HANDLINGS = ("kv_copy", "ssm_skip", "ssm_propagate")


def resolve_handling(skip_compute: bool | str | None) -> str | None:
    """skip_compute as given by users (False/None/'none', True = 'kv_copy', or a handling) → handling or None."""
    if skip_compute is None or skip_compute is False or skip_compute == "none":
        return None
    if skip_compute is True:
        return "kv_copy"
    if isinstance(skip_compute, str) and skip_compute in HANDLINGS:
        return skip_compute
    raise ValueError(f"skip_compute={skip_compute!r} is unknown; choose none, {', '.join(HANDLINGS)} (true = kv_copy)")


def has_ssm(config) -> bool:
    return "M" in config.all_layer_types or config.state_mode == "stateloop_mamba2"


def skip_compute_unsupported(config, exit_rule: str | None = None, skip_compute: bool | str = True) -> str | None:
    """Why skip_compute (with this handling and exit rule) cannot be used with this model, or None."""
    handling = resolve_handling(skip_compute)
    if handling == "kv_copy" and has_ssm(config):
        where = "the state mixer is Mamba-2" if "M" not in config.all_layer_types else f"backbone={config.backbone!r} has Mamba-2 layers"
        return (
            f"skip_compute=kv_copy (or true) needs an attention-only model, but {where}: a Mamba-2 layer's "
            "recurrent state at each loop depends on every earlier token at that loop, so copying key/values "
            "does not say what an exited token leaves there. Choose skip_compute=ssm_skip (the token is absent "
            "from the deeper loops' states) or ssm_propagate (the deeper loops write it from its exit-loop input), "
            "or decode without skip_compute (every loop runs, the exit only picks the depth)."
        )
    if config.exit_gate == "none" and (exit_rule or "gate") == "gate":
        return ("exit_gate.skip_compute needs a model with an exit gate (exit_gate=ouro), "
                "or a zero-shot exit_rule (kl, entropy, hidden_delta, argmax_stable)")
    return None


class FrozenInputs:
    """Inside one forward: each token that has exited feeds every deeper layer its exit-loop input."""

    def __init__(self, handling: str):
        self.handling = handling
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
        if self.handling == "ssm_skip" and self.gone is not None and _is_ssm(module):
            return module(x, positions, valid, cache, skip=self.gone)
        return module(x, positions, valid, cache)


def _is_ssm(module) -> bool:
    from looplab.models.mamba2 import Mamba2Layer, Mamba2Mixer

    return isinstance(module, (Mamba2Layer, Mamba2Mixer))


def run_loop(model, x, s, r: int, positions, valid, cache: LoopCache | None, frozen: FrozenInputs, e=None):
    """One application of the block (loop r, 0-based), the state branch and the coda with frozen inputs
    → (x, s, readout), the readout after the coda (what the final norm reads).
    e: the prelude output, re-injected before every loop after the first when the model has input injection."""
    if model.inject is not None and r > 0:
        x = model.inject(x, e)
    for l, layer in enumerate(model.block):
        x = frozen.call(layer, l, x, positions, valid, cache[r, l] if cache is not None else None)
    h = x
    if model.state is not None:
        s, x, _ = model.state(h, s, positions, valid, cache.get((r, "state")) if cache is not None else None, frozen=frozen)
    readout = model.readout(h, x)
    for l, layer in enumerate(model.coda):
        key = ("coda", l)
        readout = frozen.call(layer, key, readout, positions, valid, cache[r, key] if cache is not None else None)
    return x, s, readout


def forward_with_exits(model, input_ids: torch.Tensor, exit_steps: torch.Tensor | None, handling: str,
                       attention_mask: torch.Tensor | None = None, *, rule: str | None = None,
                       threshold: float | None = None, min_loops: int = 1, n_loops: int | None = None):
    """The reference: a full forward pass (no cache) in which each token stops at its exit step.

    exit_steps: (B, T) 1-based loop after which each token exits; or None with `rule`/`threshold`
    (and `min_loops`): each token's exit is decided online after each loop by the rule, from its own
    loops 1..t, as skip_compute decoding decides it (later loops of a token read the frozen inputs of
    tokens that left earlier, so these exits can differ from forward(exit_rule=...)'s). Returns a
    LoopedLMOutput with loop_logits (R, B, T, V) and loop_hidden — a token's loops up to its exit are
    ordinary, the deeper ones meaningless — logits (B, T, V) read at each token's exit step, and exit_steps.
    n_loops: the depth R′ to run (test-time depth; default the configured R).
    """
    if handling not in HANDLINGS:
        raise ValueError(f"handling={handling!r} is unknown; choose one of {HANDLINGS}")
    R = model.loops(n_loops)
    online = exit_steps is None
    if online:
        if rule is None or threshold is None:
            raise ValueError("forward_with_exits needs exit_steps, or an exit rule and its threshold")
        check_rule(rule, threshold, min_loops, R)
        if rule == "gate" and model.exit_gate is None:
            raise ValueError("exit rule 'gate' needs a model with an exit gate (exit_gate=ouro)")
        exit_steps = torch.full(input_ids.shape, R, dtype=torch.long, device=input_ids.device)
        decided = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    positions, valid = model._positions(input_ids, attention_mask, None)
    x = e = model.run_prelude(model.embed(input_ids), positions, valid, None)
    s = model.state.initial_state(x) if model.state is not None else None
    frozen = FrozenInputs(handling)
    readouts, hidden, probs = [], [], []
    survival = None
    for r in range(R):
        gone = exit_steps <= r  # exited after loops 1..r, so absent from loop r + 1
        frozen.set_loop(gone & decided if online else gone)
        x, s, readout = run_loop(model, x, s, r, positions, valid, None, frozen, e)
        readouts.append(readout)
        t = r + 1
        if online and t < R:
            hidden.append(model.final_norm(readout))
            if rule == "gate":
                lam = model.exit_gate(hidden[-1])
                survival = torch.ones_like(lam) if survival is None else survival
                probs.append(lam * survival)
                survival = survival * (1 - lam)
            if t >= min_loops:
                h = torch.stack(hidden)
                stop = stops_at(rule, t, threshold, exit_probs=torch.stack(probs, -1) if probs else None,
                                logits=model.head(h) if rule in ("kl", "entropy", "argmax_stable") else None, hidden=h)
                new = stop & ~decided
                exit_steps = torch.where(new, torch.full_like(exit_steps, t), exit_steps)
                decided |= new
    loop_hidden = model.final_norm(torch.stack(readouts))  # (R, B, T, d)
    loop_logits = model.head(loop_hidden)
    return LoopedLMOutput(logits=logits_at_depth(loop_logits, exit_steps), loop_logits=loop_logits,
                          loop_hidden=loop_hidden, exit_steps=exit_steps)


def _advance_exited(model, cache: LoopCache, r: int, exit_loop: torch.Tensor, pos: int, handling: str) -> None:
    """Every row has exited: fill loop r's caches at `pos` from each row's exit loop without running a layer."""
    keys = [k for (rr, k) in cache.entries if rr == r]
    for e in exit_loop.unique().tolist():
        rows = exit_loop == e
        sel = None if bool(rows.all()) else rows
        for key in keys:
            dst, src = cache[r, key], cache[e, key]
            if isinstance(dst, KVCache):
                dst.copy_position_from(src, pos, sel)
                dst.length = max(dst.length, pos + 1)
            elif isinstance(dst, SSMCache):
                if key == "state":
                    mixer = model.state.mixer
                else:
                    mixer = (model.coda[key[1]] if isinstance(key, tuple) else model.block[key]).mixer
                mixer.step_from(dst, src, sel, write=handling == "ssm_propagate")
                dst.length = max(dst.length, src.length)


def skip_compute_step(model, input_ids: torch.Tensor, cache: LoopCache, threshold: float, rule: str = "gate",
                      min_loops: int = 1, handling: str = "kv_copy", n_loops: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One T = 1 decoding step that stops running loops for rows that have exited → (logits (B, V), exit steps (B,)).

    The exit decision is forward(exit_rule=rule, exit_threshold=threshold)'s, taken online after
    each loop from loops 1..t (`exit_rules.stops_at`); for the gate, p(t) = λ_t S_{t−1} with
    S_t = S_{t−1}(1 − λ_t) and p(R) = S_{R−1}. While some rows still run, the whole batch is
    computed (caches are batched) with the exited rows' inputs frozen, which is exactly what a
    per-row skip leaves in the caches; once every row has exited the remaining loops only fill caches.
    """
    R = model.loops(n_loops)
    model._check_cache_depth(cache, R)
    check_rule(rule, threshold, min_loops, R)
    B = input_ids.shape[0]
    positions, valid = cache.advance(None, 1)
    pos = cache.length - 1

    x = e = model.run_prelude(model.embed(input_ids), positions, valid, cache)
    s = model.state.initial_state(x) if model.state is not None else None
    frozen = FrozenInputs(handling)
    exit_loop = torch.full((B,), -1, dtype=torch.long, device=input_ids.device)  # 0-based, −1 = running
    logits = None
    survival = x.new_ones(B)
    probs, seen_logits, seen_hidden = [], [], []  # loops 1..t: what the rule reads
    none_exited = True  # the common case, kept in Python: no mask ops or syncs until some row exits
    for r in range(R):
        running = None if none_exited else exit_loop < 0
        if running is not None and not bool(running.any()):
            _advance_exited(model, cache, r, exit_loop, pos, handling)
            continue
        frozen.set_loop(None if running is None else ~running[:, None])
        x, s, readout = run_loop(model, x, s, r, positions, valid, cache, frozen, e)

        normed = model.final_norm(readout[:, -1])  # (B, d)
        t = r + 1
        if t == R:
            new = running
        else:
            if rule == "gate":
                lam = model.exit_gate(normed)
                probs.append(lam * survival)
                survival = survival * (1 - lam)
            elif rule == "hidden_delta":
                seen_hidden.append(normed)
            else:
                seen_logits.append(model.head(normed))
            new = None  # (B,) bool: the rows that stop at t (None: none can, t < min_loops)
            if t >= min_loops:
                new = stops_at(rule, t, threshold, exit_probs=torch.stack(probs, -1) if probs else None,
                               logits=torch.stack(seen_logits) if seen_logits else None,
                               hidden=torch.stack(seen_hidden) if seen_hidden else None)
                new = new if running is None else running & new
        if t == R and none_exited:  # every row ran every loop: no masked writes
            return model.head(normed), exit_loop.fill_(R)
        if new is not None and bool(new.any()):
            none_exited = False
            if seen_logits and t < R:  # the rule already read this loop's logits
                step_logits = seen_logits[-1][new] if not bool(new.all()) else seen_logits[-1]
            else:
                step_logits = model.head(normed[new] if not bool(new.all()) else normed)
            if logits is None:
                logits = step_logits.new_zeros(B, step_logits.shape[-1])
            logits[new] = step_logits
            exit_loop[new] = r
    return logits, exit_loop + 1
