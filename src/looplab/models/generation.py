"""Cached decoding (docs/decoding.md): plain, exit rules with skip handling, self-speculation.

    prefill:  one pass over the (left-padded) prompt fills every (loop, layer) cache
    decode:   a strategy over the same LoopCache, producing the next token(s)

The strategies are siblings, each a function over the model and its cache:
    plain / exit rule   `decode_step`: a T = 1 cached forward through the R loops (with
                        exit_threshold, the logits of each token's exit depth)
    skip handling       `exit_compute.skip_compute_step`: stops running loops for a token once its
                        exit rule fires and fills the deeper loops' caches (kv_copy, ssm_skip,
                        ssm_propagate); `decode_step` calls it when skip_compute is set
    speculation         `speculative.speculative_round`: loops 1..k draft γ tokens, loops k+1..R
                        verify them in one call, the cache rolls back what was rejected
`stream` runs one of them and yields one StepOutput per token (the CLI prints from it as tokens
arrive); `generate` collects what `stream` yields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from looplab.models.cache import LoopCache
from looplab.models.exit_compute import resolve_handling, skip_compute_step, skip_compute_unsupported
from looplab.models.exit_rules import check_rule
from looplab.models.exits import ExitPolicy
from looplab.models.speculative import DraftSchedule, SpeculationStats, check_speculation, prefill, speculative_round

__all__ = ["decode_step", "generate", "sample_next", "skip_compute_unsupported", "stream"]


@dataclass
class StepOutput:
    tokens: torch.Tensor  # (B,) the token chosen at this step (eos for finished rows)
    logits: torch.Tensor  # (B, V) the logits it was chosen from (threshold-selected depth if any)
    exit_steps: torch.Tensor | None = None  # (B,) 1-based depth used, when exit_threshold is set
    speculation: SpeculationStats | None = None  # the running counts, with speculative_loops


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (B, T + n): prompt (with its padding) followed by n new tokens
    logits: torch.Tensor  # (B, n, V)
    exit_steps: torch.Tensor | None = None  # (B, n)
    speculation: SpeculationStats | None = None  # with speculative_loops: drafted / accepted tokens

    @property
    def acceptance_rate(self) -> float | None:
        """Kept draft tokens / proposed draft tokens (speculative_loops), else None."""
        return self.speculation.acceptance_rate if self.speculation is not None else None


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


# --------------------------------------------------------------- decode step
def decode_step(
    model,
    input_ids: torch.Tensor,  # (B, 1)
    cache: LoopCache,
    *,
    exit_threshold: float | None = None,
    skip_compute: bool | str = False,
    exit_rule: str | None = None,
    exit_min_loops: int = 1,
    n_loops: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One cached decoding step → (logits (B, V), exit_steps (B,) or None).

    exit_rule (default: the gate) and exit_threshold pick each token's depth as forward() does;
    skip_compute (true = kv_copy, ssm_skip, ssm_propagate; models/exit_compute.py) stops running
    loops after it; n_loops runs R′ loops (the cache must have been allocated for R′)."""
    handling = resolve_handling(skip_compute)
    if handling is not None:
        _check_skip(model.config, handling, exit_rule, exit_threshold)
        return skip_compute_step(model, input_ids, cache, exit_threshold, exit_rule or "gate", exit_min_loops, handling,
                                 n_loops=n_loops)
    out = model(input_ids, cache=cache, n_loops=n_loops,
                exits=ExitPolicy.from_kwargs(exit_threshold, exit_rule, exit_min_loops))
    return out.logits[:, -1], (out.exit_steps[:, -1] if out.exit_steps is not None else None)


def _check_skip(config, handling: str, exit_rule: str | None, exit_threshold: float | None) -> None:
    reason = skip_compute_unsupported(config, exit_rule, handling)
    if reason:
        raise ValueError(reason)
    if exit_threshold is None:
        raise ValueError(f"skip_compute={handling} needs exit_threshold=q (the depth at which a token stops)")


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
    skip_compute: bool | str = False,
    generator: torch.Generator | None = None,
    exit_rule: str | None = None,
    exit_min_loops: int = 1,
    n_loops: int | None = None,
    speculative_loops: int | None = None,
    draft_tokens: int | str = 4,
    static_cache: bool | str = False,
) -> Iterator[StepOutput]:
    """Yield one StepOutput per generated token; stops early once every row has emitted eos.
    speculative_loops=k: self-speculative greedy decoding, loops 1..k drafting draft_tokens
    tokens per round (an int, or "auto"; models/speculative.py), output identical to plain greedy.
    static_cache: plain decoding steps with static shapes (models/static_decode.py): "eager" (or true),
    "compile", "reduce-overhead" (CUDA graphs) or "max-autotune"; the step compiles once per batch size."""
    cfg = model.config
    R = model.loops(n_loops)  # test-time depth R′ (default: the configured R)
    if getattr(model, "router", None) is not None:  # depth_router: plain cached steps only (models/router.py)
        model.router.check_generate(speculative_loops=speculative_loops, static_cache=static_cache,
                                    exit_threshold=exit_threshold, exit_rule=exit_rule, skip_compute=skip_compute)
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
    if speculative_loops is not None:
        check_speculation(model, R, speculative_loops, draft_tokens, temperature, exit_threshold, exit_rule,
                          skip_compute)
    handling = resolve_handling(skip_compute)
    if handling is not None:
        _check_skip(cfg, handling, exit_rule, exit_threshold)
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

    if static_cache:
        mode = "eager" if static_cache is True else static_cache
        others = {"exit_threshold": exit_threshold, "speculative_loops": speculative_loops,
                  "skip_compute": handling}
        bad = [f"{k}={v!r}" for k, v in others.items() if v is not None]
        if bad:
            raise ValueError(f"static_cache={mode!r} decodes plain steps; it does not combine with {', '.join(bad)}")
        yield from _stream_static(model, input_ids, attention_mask, max_new_tokens, eos, mode, R,
                                  temperature, top_k, top_p, generator)
        return
    cache = model.allocate_cache(B, T + max_new_tokens, n_loops=R)
    if speculative_loops is not None:
        yield from _stream_speculative(model, input_ids, attention_mask, cache, max_new_tokens, eos,
                                       speculative_loops, draft_tokens, R)
        return
    # prefill is parallel over the prompt, so it runs every loop even under skip_compute
    out = model(input_ids, attention_mask=attention_mask, cache=cache, n_loops=R,
                exits=ExitPolicy.from_kwargs(exit_threshold, exit_rule, exit_min_loops))
    exit_steps = out.exit_steps[:, -1] if out.exit_steps is not None else None

    def step(tokens):
        return decode_step(model, tokens[:, None], cache, exit_threshold=exit_threshold, skip_compute=skip_compute,
                           exit_rule=exit_rule, exit_min_loops=exit_min_loops, n_loops=R)

    yield from _sample_steps(out.logits[:, -1], exit_steps, step, max_new_tokens, eos, temperature, top_k, top_p,
                             generator)


def _sample_steps(logits, exit_steps, step, max_new_tokens: int, eos: torch.Tensor | None, temperature, top_k, top_p,
                  generator) -> Iterator[StepOutput]:
    """Sample from `logits`, yield, and ask `step(tokens)` for the next (logits, exit_steps); rows that emitted eos
    keep emitting it, and the loop ends once every row has (the plain and static decoders' common tail)."""
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    for i in range(max_new_tokens):
        tokens = sample_next(logits, temperature, top_k, top_p, generator)
        if eos is not None:
            tokens = torch.where(finished, eos[0], tokens)
            finished |= torch.isin(tokens, eos)
        yield StepOutput(tokens, logits, exit_steps)
        if i == max_new_tokens - 1 or (eos is not None and bool(finished.all())):
            return
        logits, exit_steps = step(tokens)


def _stream_static(model, input_ids, attention_mask, max_new_tokens: int, eos: torch.Tensor | None, mode: str, R: int,
                   temperature, top_k, top_p, generator) -> Iterator[StepOutput]:
    """Plain decoding through a StaticDecoder (fixed shapes, optionally compiled); eos as in plain decoding."""
    from looplab.models.static_decode import static_decoder

    B, T = input_ids.shape
    dec = static_decoder(model, B, T + max_new_tokens, mode, n_loops=R)
    logits = dec.prefill(input_ids, attention_mask)
    yield from _sample_steps(logits, None, lambda tokens: (dec.step(tokens), None), max_new_tokens, eos, temperature,
                             top_k, top_p, generator)


def _stream_speculative(model, input_ids, attention_mask, cache: LoopCache, max_new_tokens: int,
                        eos: torch.Tensor | None, k: int, draft_tokens: int | str, R: int) -> Iterator[StepOutput]:
    """Greedy decoding by draft-verify rounds (models/speculative.py); eos as in plain decoding."""
    B = input_ids.shape[0]
    stats = SpeculationStats(agreed=torch.zeros(B, dtype=torch.long, device=input_ids.device))
    schedule = DraftSchedule(draft_tokens)
    logits = prefill(model, input_ids, attention_mask, cache, k, R)
    pending = [(logits.argmax(-1), logits)]  # tokens chosen but not yet yielded, with their logits
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    emitted = 0
    while True:
        for tokens, lg in pending:
            last = tokens  # the next round starts from the full depth's own token (a finished row's is never read)
            if eos is not None:
                tokens = torch.where(finished, eos[0], tokens)
                finished |= torch.isin(tokens, eos)
            emitted += 1
            yield StepOutput(tokens, lg, None, stats)
            if emitted == max_new_tokens or (eos is not None and bool(finished.all())):
                return
        # the round emits at most gamma + 1 tokens, and never runs past max_new_tokens
        gamma = min(schedule.gamma, max_new_tokens - emitted - 1)
        new, new_logits, agreed = speculative_round(model, last[:, None], cache, k, gamma, R, running=~finished)
        kept = new.shape[1] - 1
        stats.rounds += 1
        stats.drafted += gamma
        stats.accepted += kept
        stats.agreed += agreed
        stats.draft_sizes.append(gamma)
        schedule.update(gamma, kept)
        pending = [(new[:, i], new_logits[:, i]) for i in range(new.shape[1])]


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
    skip_compute: bool | str = False,
    generator: torch.Generator | None = None,
    return_logits: bool = False,
    exit_rule: str | None = None,
    exit_min_loops: int = 1,
    n_loops: int | None = None,
    speculative_loops: int | None = None,
    draft_tokens: int | str = 4,
    static_cache: bool | str = False,
) -> torch.Tensor | GenerationOutput:
    """Cached generation. Returns (B, T + n) sequences, or a GenerationOutput with return_logits.

    Batched prompts are left-padded with attention_mask (1 = token, 0 = padding); each row
    then gets the tokens it would get alone. Rows that emit eos keep emitting eos; generation
    stops early (n < max_new_tokens) once every row has finished. n_loops=R′ decodes at a test-time
    depth (any R′ ≥ 1, caches sized for R′; skip_compute included). speculative_loops=k (1..R′−1)
    decodes greedily by self-speculation (loops 1..k draft `draft_tokens` tokens a round, an int or
    "auto"; models/speculative.py) with the same output; GenerationOutput.acceptance_rate reports it.
    static_cache="eager" | "compile" | "reduce-overhead" decodes plain steps with static shapes, compiled
    once per (batch, length) (models/static_decode.py; CUDA graphs with reduce-overhead).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    steps = list(
        stream(
            model, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id,
            attention_mask, exit_threshold, skip_compute, generator, exit_rule, exit_min_loops, n_loops=n_loops,
            speculative_loops=speculative_loops, draft_tokens=draft_tokens, static_cache=static_cache,
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
    speculation = steps[-1].speculation if steps else None
    return GenerationOutput(sequences, logits, exit_steps, speculation)
