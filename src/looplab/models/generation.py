"""Cached decoding (SPEC §7) and exit-gate skip_compute decoding (SPEC §4).

    prefill:  one forward pass over the (left-padded) prompt fills every (loop, layer) cache
    decode:   one token at a time, each step a T = 1 forward through the R loops

`generate` collects what `stream` yields step by step (the CLI prints from
`stream` as tokens arrive). `decode_step` is the one place where a step is
computed: an ordinary cached forward, or — with `skip_compute` — the
early-exit loop below, which stops running loops for a token once the exit
gate's cumulative probability reaches the threshold and reuses that depth's
key/values for the deeper loops (Ouro reports this reuse nearly lossless).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from looplab.models.cache import KVCache, LoopCache
from looplab.models.exit_rules import check_rule, stops_at


@dataclass
class StepOutput:
    tokens: torch.Tensor  # (B,) the token chosen at this step (eos for finished rows)
    logits: torch.Tensor  # (B, V) the logits it was chosen from (threshold-selected depth if any)
    exit_steps: torch.Tensor | None = None  # (B,) 1-based depth used, when exit_threshold is set


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (B, T + n): prompt (with its padding) followed by n new tokens
    logits: torch.Tensor  # (B, n, V)
    exit_steps: torch.Tensor | None = None  # (B, n)


# ------------------------------------------------------------------- sampling
def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, V) logits → (B,) tokens: argmax when temperature == 0, else top-k/top-p sampling."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must lie in (0, 1]")
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ------------------------------------------------------------- skip_compute
def skip_compute_unsupported(config, exit_rule: str | None = None) -> str | None:
    """Why skip_compute cannot be used with this model (and exit rule), or None when it can."""
    if "M" in config.layer_types or config.state_mode == "stateloop_mamba2":
        where = "the state mixer is Mamba-2" if "M" not in config.layer_types else f"backbone={config.backbone!r} has Mamba-2 layers"
        return (
            f"exit_gate.skip_compute needs an attention-only model, but {where}: each loop's recurrent "
            "(SSM) state depends on every earlier token at that loop, so a token that skipped loops would "
            "leave those states without its contribution and every later token would read a wrong state. "
            "In SSM/hybrid models every loop must still run and the exit only selects the depth "
            "(use exit_threshold without skip_compute)."
        )
    if config.exit_gate == "none" and (exit_rule or "gate") == "gate":
        return ("exit_gate.skip_compute needs a model with an exit gate (exit_gate=ouro), "
                "or a zero-shot exit_rule (kl, entropy, hidden_delta, argmax_stable)")
    return None


def _reuse_exit_kv(cache: LoopCache, r: int, exit_loop: torch.Tensor, rows: torch.Tensor, pos: int, keys) -> None:
    """Overwrite loop r's key/values at `pos` for `rows` with those of each row's exit loop."""
    for e in exit_loop[rows].unique().tolist():
        sel = rows & (exit_loop == e)
        sel = None if bool(sel.all()) else sel  # whole batch: plain slice copy, no gather
        for key in keys:
            dst = cache[r, key]
            dst.copy_position_from(cache[e, key], pos, sel)
            dst.length = max(dst.length, pos + 1)


def _skip_compute_step(model, input_ids: torch.Tensor, cache: LoopCache, threshold: float, rule: str = "gate",
                       min_loops: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One T = 1 decoding step that stops running loops for rows that have exited.

    The exit decision is forward(exit_rule=rule, exit_threshold=threshold)'s, taken online after
    each loop from loops 1..t (`exit_rules.stops_at`); for the gate, p(t) = λ_t S_{t−1} with
    S_t = S_{t−1}(1 − λ_t) and p(R) = S_{R−1}. While some rows still run, the whole batch is
    computed (caches are batched) and the exited rows' deeper key/values are then overwritten with
    their exit-depth key/values, so the result is exactly what a per-row skip would give; once
    every row has exited the remaining loops only copy.
    """
    cfg, R = model.config, model.config.n_loops
    check_rule(rule, threshold, min_loops, R)
    B = input_ids.shape[0]
    positions, valid = cache.advance(None, 1)
    pos = cache.length - 1
    kv_keys = [k for (r, k), e in cache.entries.items() if r == 0 and isinstance(e, KVCache)]

    x = model.embed(input_ids)
    s = model.state.initial_state(x) if model.state is not None else None
    exit_loop = torch.full((B,), -1, dtype=torch.long, device=input_ids.device)  # 0-based, −1 = running
    logits = None
    survival = x.new_ones(B)
    probs, seen_logits, seen_hidden = [], [], []  # loops 1..t: what the rule reads
    for r in range(R):
        running = exit_loop < 0
        if not bool(running.any()):
            _reuse_exit_kv(cache, r, exit_loop, ~running, pos, kv_keys)
            continue
        h = model._block_forward(x, positions, valid, cache, r)
        if model.state is not None:
            s, x, _ = model.state(h, s, positions, valid, cache.get((r, "state")))
            readout = x if cfg.state_in_output else h
        else:
            x = readout = h
        if not bool(running.all()):
            _reuse_exit_kv(cache, r, exit_loop, ~running, pos, kv_keys)

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
            if t >= min_loops:
                new = running & stops_at(rule, t, threshold, exit_probs=torch.stack(probs, -1) if probs else None,
                                         logits=torch.stack(seen_logits) if seen_logits else None,
                                         hidden=torch.stack(seen_hidden) if seen_hidden else None)
            else:
                new = torch.zeros_like(running)
        if bool(new.any()):
            if seen_logits and t < R:  # the rule already read this loop's logits
                step_logits = seen_logits[-1][new] if not bool(new.all()) else seen_logits[-1]
            else:
                step_logits = model.head(normed[new] if not bool(new.all()) else normed)
            if logits is None:
                logits = step_logits.new_zeros(B, step_logits.shape[-1])
            logits[new] = step_logits
            exit_loop[new] = r
    return logits, exit_loop + 1


# --------------------------------------------------------------- decode step
def decode_step(
    model,
    input_ids: torch.Tensor,  # (B, 1)
    cache: LoopCache,
    *,
    exit_threshold: float | None = None,
    skip_compute: bool = False,
    exit_rule: str | None = None,
    exit_min_loops: int = 1,
    n_loops: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One cached decoding step → (logits (B, V), exit_steps (B,) or None).

    exit_rule (default: the gate) and exit_threshold pick each token's depth as forward() does;
    n_loops runs R′ loops (the cache must have been allocated for R′)."""
    if skip_compute:
        _check_skip_depth(model, n_loops)
        reason = skip_compute_unsupported(model.config, exit_rule)
        if reason:
            raise ValueError(reason)
        if exit_threshold is None:
            raise ValueError("skip_compute=True needs exit_threshold=q (the depth at which a token stops)")
        return _skip_compute_step(model, input_ids, cache, exit_threshold, exit_rule or "gate", exit_min_loops)
    out = model(input_ids, cache=cache, exit_threshold=exit_threshold, exit_rule=exit_rule, exit_min_loops=exit_min_loops,
                n_loops=n_loops)
    return out.logits[:, -1], (out.exit_steps[:, -1] if out.exit_steps is not None else None)


def _check_skip_depth(model, n_loops: int | None) -> None:
    # the skip_compute step runs the configured R loops without input injection; neither depth
    # knob is wired into it yet
    if n_loops is not None and n_loops != model.config.n_loops:
        raise ValueError(f"skip_compute with n_loops={n_loops} (!= the configured R={model.config.n_loops}) is not "
                         "supported; decode at R′ without skip_compute")
    if getattr(model.config, "injection", "none") != "none":
        raise ValueError(f"skip_compute with injection={model.config.injection!r} is not supported; "
                         "decode without skip_compute")


def _check_left_padded(attention_mask: torch.Tensor) -> None:
    m = attention_mask.to(torch.long)
    if bool((m[:, 1:] < m[:, :-1]).any()) or not bool(m[:, -1].all()):
        raise ValueError(
            "attention_mask must be left-padded (zeros only before the first real token, last column all ones); "
            "pad prompts on the left for batched generation"
        )


# ------------------------------------------------------------------ generate
@torch.no_grad()
def stream(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    exit_threshold: float | None = None,
    skip_compute: bool = False,
    generator: torch.Generator | None = None,
    exit_rule: str | None = None,
    exit_min_loops: int = 1,
    n_loops: int | None = None,
) -> Iterator[StepOutput]:
    """Yield one StepOutput per generated token; stops early once every row has emitted eos."""
    cfg = model.config
    R = model.loops(n_loops)  # test-time depth R′ (default: the configured R)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    B, T = input_ids.shape
    if T == 0:
        raise ValueError("generate needs a prompt of at least one token (e.g. BOS)")
    if max_new_tokens <= 0:
        return
    if T + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len={cfg.max_seq_len}; "
            "shorten the prompt or lower max_new_tokens"
        )
    if skip_compute:
        reason = skip_compute_unsupported(cfg, exit_rule)
        if reason:
            raise ValueError(reason)
        if exit_threshold is None:
            raise ValueError("skip_compute=True needs exit_threshold=q (the depth at which a token stops)")
        _check_skip_depth(model, n_loops)
    if exit_rule is not None and exit_threshold is None:
        raise ValueError(f"exit_rule={exit_rule!r} needs exit_threshold (the rule's threshold)")
    if exit_threshold is not None:
        if (exit_rule or "gate") == "gate" and model.exit_gate is None:
            raise ValueError("exit_threshold needs a model with an exit gate (exit_gate=ouro), or a zero-shot exit_rule")
        check_rule(exit_rule or "gate", exit_threshold, exit_min_loops, R)
    if attention_mask is not None:
        _check_left_padded(attention_mask)
    eos = None
    if eos_token_id is not None:
        eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        eos = torch.tensor(eos_ids, device=input_ids.device)

    cache = model.allocate_cache(B, T + max_new_tokens, n_loops=R)
    # prefill is parallel over the prompt, so it runs every loop even under skip_compute
    out = model(input_ids, attention_mask=attention_mask, cache=cache, exit_threshold=exit_threshold,
                exit_rule=exit_rule, exit_min_loops=exit_min_loops, n_loops=R)
    logits = out.logits[:, -1]
    exit_steps = out.exit_steps[:, -1] if out.exit_steps is not None else None
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    for i in range(max_new_tokens):
        tokens = sample_next(logits, temperature, top_k, top_p, generator)
        if eos is not None:
            tokens = torch.where(finished, eos[0], tokens)
            finished |= torch.isin(tokens, eos)
        yield StepOutput(tokens, logits, exit_steps)
        if i == max_new_tokens - 1 or (eos is not None and bool(finished.all())):
            return
        logits, exit_steps = decode_step(
            model, tokens[:, None], cache, exit_threshold=exit_threshold, skip_compute=skip_compute,
            exit_rule=exit_rule, exit_min_loops=exit_min_loops, n_loops=R,
        )


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    exit_threshold: float | None = None,
    skip_compute: bool = False,
    generator: torch.Generator | None = None,
    return_logits: bool = False,
    exit_rule: str | None = None,
    exit_min_loops: int = 1,
    n_loops: int | None = None,
) -> torch.Tensor | GenerationOutput:
    """Cached generation. Returns (B, T + n) sequences, or a GenerationOutput with return_logits.

    Batched prompts are left-padded with attention_mask (1 = token, 0 = padding); each row
    then gets the tokens it would get alone. Rows that emit eos keep emitting eos; generation
    stops early (n < max_new_tokens) once every row has finished. n_loops=R′ decodes at a test-time
    depth (any R′ ≥ 1, caches sized for R′; not with skip_compute yet).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    steps = list(
        stream(
            model, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id,
            attention_mask, exit_threshold, skip_compute, generator, exit_rule, exit_min_loops, n_loops=n_loops,
        )
    )
    B = input_ids.shape[0]
    new = torch.stack([s.tokens for s in steps], 1) if steps else input_ids.new_zeros(B, 0)
    sequences = torch.cat([input_ids, new.to(input_ids.dtype)], 1)
    if not return_logits:
        return sequences
    V = model.config.vocab_size
    logits = torch.stack([s.logits for s in steps], 1) if steps else input_ids.new_zeros(B, 0, V, dtype=torch.float)
    exit_steps = torch.stack([s.exit_steps for s in steps], 1) if steps and steps[0].exit_steps is not None else None
    return GenerationOutput(sequences, logits, exit_steps)
