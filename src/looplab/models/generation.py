"""Cached decoding (SPEC §7) and exit-gate skip_compute decoding (SPEC §4).

    prefill:  one forward pass over the (left-padded) prompt fills every (loop, layer) cache
    decode:   one token at a time, each step a T = 1 forward through the R loops

`generate` collects what `stream` yields step by step (the CLI prints from
`stream` as tokens arrive). `decode_step` is the one place where a step is
computed: an ordinary cached forward, or — with `skip_compute` — the
early-exit step of models/exit_compute.py, which stops running loops for a
token once its exit rule fires and fills the deeper loops' caches by the
chosen handling (kv_copy, ssm_skip, ssm_propagate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from looplab.models.cache import LoopCache
from looplab.models.exit_compute import resolve_handling, skip_compute_step, skip_compute_unsupported
from looplab.models.exit_rules import check_rule

__all__ = ["decode_step", "generate", "sample_next", "skip_compute_unsupported", "stream"]


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
    out = model(input_ids, cache=cache, exit_threshold=exit_threshold, exit_rule=exit_rule, exit_min_loops=exit_min_loops,
                n_loops=n_loops)
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
    skip_compute: bool | str = False,
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
    depth (any R′ ≥ 1, caches sized for R′; skip_compute included).
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
