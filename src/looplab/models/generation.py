"""Cached decoding in gpt-fast's shape (docs/decoding.md): three functions over one LoopCache, and generation
around them.

    prefill(model, ids, cache, ...)              the prompt through every loop (under a skip handling each
                                                 token's up to its exit), filling every entry
    decode_one_token(model, tokens, cache, ...)  one token per row: plain, exit read-out, or skip handling
                                                 (exit_compute.SkipDecoding: a row whose token has exited
                                                 runs no deeper loop); optionally compiled over a static cache
    speculative_round(model, token, cache, ...)  loops 1..k draft γ tokens, loops k+1..R verify them in one
                                                 call; each row keeps its own agreeing prefix
    generate / stream                            sampling, eos and the options, as keyword-only groups

Every one of them runs its loops through `LoopedLM.run_loops` and reads depths through `LoopedLM.logits_at`.

Self-speculation is exact. Loops 1..k of a token read only loops 1..k of itself and the tokens before it,
so when the tokens so far are the full model's own, the draft's loops 1..k ARE the full model's loops 1..k
(and their cache entries are reused as they are); loops k+1..R then run exactly as in plain decoding, only
over γ+1 positions at once. Greedy: every emitted token is the full depth's argmax on a prefix of the full
model's tokens, so the output is plain greedy decoding's, token for token (up to the float rounding of a
γ+1-token call against one-token calls, as for prefill against steps). Sampling (temperature > 0): the draft
samples d_i from q_i (loop k's distribution after temperature, top-k and top-p), the verify gives p_i; d_i is
accepted with probability min(1, p_i/q_i); at the first rejection the token is drawn from the normalised
max(0, p_i − q_i), and after a fully accepted round the extra token from p_{γ+1}. The output distribution is
then exactly the full model's (Leviathan et al.; Chen et al.), though not seed-identical to plain sampling.

Batches: caches keep per-row lengths, so each row keeps its own agreeing prefix and the rows of a batch stand
at different lengths; a round runs the rows that still need tokens (finished rows and rows that have their
`max_new_tokens` drop out). Rollback (models/cache.py): key/values move each row's length back, Mamba-2
entries restore each row's recorded state; the StateLoop per-token state is not cached across tokens.

`draft_tokens="auto"` adapts γ: start at 4; +1 (up to 8) after a round in which at least half the rows kept
every draft token, −1 (down to 1) otherwise (the additive schedule of transformers' assistant, per batch).
"""

from __future__ import annotations

import itertools
import numbers
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from looplab.models.cache import LoopCache
from looplab.models.exit_compute import SkipDecoding
from looplab.models.exits import ExitPolicy
from looplab.models.inputs import check_inputs
from looplab.models.registry import named_option as _named
from looplab.models.stream import Stream

__all__ = ["GenerationOutput", "Sampling", "Speculation", "StepOutput", "check_options", "decode_one_token", "draw",
           "generate", "prefill", "speculative_round", "stream"]

AUTO_DRAFT = (4, 1, 8)  # draft_tokens="auto": initial γ, smallest, largest
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
MAX_COMPILED = 4  # compiled decoders kept per model (least recently used dropped first)
LENGTH_BUCKET = 64  # a compiled step's cache length is rounded up to this: one compile serves nearby lengths
COMPILE_BACKEND = "inductor"  # tests trace with "eager" (Dynamo's graph capture without inductor's minutes of codegen)


# ------------------------------------------------------------------ options
@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else sampled after top-k and top-p."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = field(default=None, compare=False)

    def __post_init__(self):
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not 0 <= self.temperature < float("inf")):  # nan passes `< 0` and would sample token 0
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 1 (or None)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must lie in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits → the distribution sampling draws from (after temperature, top-k, top-p), float."""
        logits = logits.float() / self.temperature
        if self.top_k is not None:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            p = sorted_logits.softmax(-1)
            drop = p.cumsum(-1) - p >= self.top_p  # drop a token once the mass before it reaches top_p
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.softmax(-1)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits → (B,) tokens."""
        if self.greedy:
            return logits.argmax(-1)
        return draw(self.probs(logits), self.generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from (..., V) probabilities: argmax of p / E, E ~ Exponential(1) independently per entry —
    exactly a draw from p (gpt-fast's multinomial_sample_one_no_sync), with no host sync where torch.multinomial
    checks its input on the host."""
    e = torch.empty_like(probs).exponential_(1, generator=generator).clamp_min_(1e-30)
    return (probs / e).argmax(-1)


@dataclass(frozen=True)
class Speculation:
    """Self-speculative decoding: loops 1..`loops` draft `draft_tokens` tokens a round (an int, or "auto")."""

    loops: int
    draft_tokens: int | str = 4

    def check(self, R: int) -> None:
        k = self.loops
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < R:
            raise ValueError(f"speculation loops={k!r} must be an integer in 1..{R - 1} (the draft's depth, below the "
                             f"n_loops={R} that verifies)")
        g = self.draft_tokens
        if g != "auto" and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"draft_tokens={g!r} must be an integer >= 1 or 'auto'")


@dataclass
class SpeculationStats:
    """Running counts of one speculative generation."""

    drafted: int = 0  # draft tokens proposed, over rows
    accepted: int = 0  # draft tokens kept, over rows
    rounds: int = 0
    agreed: torch.Tensor | None = None  # (B,) draft tokens each row kept
    row_drafted: torch.Tensor | None = None  # (B,) draft tokens each row was proposed
    draft_sizes: list[int] = field(default_factory=list)  # γ of each round (changes with draft_tokens="auto")

    @property
    def acceptance_rate(self) -> float:
        """Kept draft tokens / proposed draft tokens."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def row_acceptance(self) -> torch.Tensor | None:
        """(B,) per row: draft tokens kept / proposed."""
        if self.agreed is None or self.row_drafted is None:
            return None
        return self.agreed.float() / self.row_drafted.clamp_min(1).float()

    def summary(self) -> str:
        return (f"acceptance {self.acceptance_rate:.2f} ({self.accepted}/{self.drafted} draft tokens, "
                f"{self.rounds} rounds, mean draft {sum(self.draft_sizes) / max(1, len(self.draft_sizes)):.1f})")


class DraftSchedule:
    """γ per round: fixed, or adapted with draft_tokens="auto" (see the module docstring)."""

    def __init__(self, draft_tokens: int | str):
        self.auto = draft_tokens == "auto"
        self.gamma = AUTO_DRAFT[0] if self.auto else int(draft_tokens)

    def update(self, gamma: int, all_kept_share: float) -> None:
        if self.auto and gamma > 0:
            lo, hi = AUTO_DRAFT[1:]
            self.gamma = min(hi, self.gamma + 1) if all_kept_share >= 0.5 else max(lo, self.gamma - 1)


@dataclass
class StepOutput:
    tokens: torch.Tensor  # (B,) the token chosen at this step (eos for finished rows)
    logits: torch.Tensor  # (B, V) the logits it was chosen from (the exit depth's, with exits)
    exit_steps: torch.Tensor | None = None  # (B,) 1-based depth used, with an exit threshold
    speculation: SpeculationStats | None = None  # the running counts, with speculation


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (B, T + n): prompt (with its padding) followed by n new tokens
    logits: torch.Tensor  # (B, n, V)
    exit_steps: torch.Tensor | None = None  # (B, n)
    speculation: SpeculationStats | None = None

    @property
    def acceptance_rate(self) -> float | None:
        """Kept draft tokens / proposed draft tokens (with speculation), else None."""
        return self.speculation.acceptance_rate if self.speculation is not None else None


# ------------------------------------------------------------------ the three steps
@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: LoopCache, n_loops: int,
            exits: ExitPolicy | None = None, draft_loops: int | None = None):
    """The prompt through all loops (left-padded rows: attention_mask) → (last position's logits (B, V), exit
    steps (B,) or None). exits: read each token at its exit depth (every depth's coda is filled, as the decoding
    steps will read them). draft_loops=k: speculation's draft also reads depth k, whose coda entries are filled."""
    if exits is not None or draft_loops is None or not len(model.coda):
        # with a skip handling the prompt's tokens stop at their exits too, as decoded ones do (exit_compute.py)
        read = None if exits is None or exits.skip is not None else ExitPolicy(exits.threshold, exits.rule,
                                                                                exits.min_loops)
        out = model(input_ids, attention_mask=attention_mask, cache=cache, n_loops=n_loops,
                    exits=exits if read is None else read)
        return out.logits[:, -1], (out.exit_steps[:, -1] if out.exit_steps is not None else None)
    positions, valid = model.positions(input_ids, attention_mask, cache)
    st = model.start(input_ids, positions, valid, cache)
    st = model.run_loops(st, range(draft_loops), cache)
    model.coda_at(model.readout(st), draft_loops - 1, positions, valid, cache)  # depth k's coda caches hold the prompt
    st = model.run_loops(st, range(draft_loops, n_loops), cache)
    return model.logits_at(model.readout(st), n_loops - 1, positions, valid, cache)[:, -1], None


@torch.no_grad()
def decode_one_token(model, tokens: torch.Tensor, cache: LoopCache, *, exits: ExitPolicy | None = None,
                     n_loops: int | None = None, skip: SkipDecoding | None = None):
    """tokens (B,) or (B, 1), the last chosen tokens → (logits (B, V), exit steps (B,) or None). exits: each row
    read at its exit depth; with exits.skip the loops after it do not run for that row (a SkipDecoding, built
    here unless given)."""
    tokens = tokens.reshape(-1, 1)
    R = model.loops(n_loops)
    if skip is None and exits is not None and exits.skip is not None:
        skip = SkipDecoding(model, exits, R)
    if skip is not None:
        return skip(tokens, cache)
    out = model(tokens, cache=cache, n_loops=R, exits=exits)
    return out.logits[:, -1], (out.exit_steps[:, -1] if out.exit_steps is not None else None)


@torch.no_grad()
def speculative_round(model, token: torch.Tensor, cache: LoopCache, k: int, gamma: int, n_loops: int,
                      sampling: Sampling | None = None):
    """One draft-verify round for the cache's selected rows (all by default) from `token` (b, 1), each row's last
    emitted token, not yet in the cache.

    → (tokens (b, γ+1), counts (b,), logits (b, γ+1, V), agreed (b,)): row i emits tokens[i, :counts[i]] (its
    accepted drafts, then the full depth's own token), agreed[i] = counts[i] − 1 draft tokens kept; the cache
    keeps the counts[i] positions each row wrote (its token and its accepted drafts) and forgets the rest."""
    sampling = sampling or Sampling()
    rows = cache.selected
    cache.checkpoint()
    streams, drafts, q_probs = [], [], []
    tok = token
    for i in range(gamma + 1):  # the draft: one token at a time through loops 1..k
        positions, valid = model.positions(tok, None, cache)
        st = model.run_loops(model.start(tok, positions, valid, cache), range(k), cache)
        z = model.readout(st)
        if i < gamma:
            lg = model.logits_at(z, k - 1, positions, valid, cache)[:, -1]
            if sampling.greedy:
                tok = lg.argmax(-1, keepdim=True)
            else:
                q = sampling.probs(lg)
                tok = draw(q, sampling.generator)[:, None]
                q_probs.append(q)
            drafts.append(tok)
        elif len(model.coda):  # nothing reads this position's draft, but depth k's coda cache must hold it
            model.coda_at(z, k - 1, positions, valid, cache)
        streams.append(st)

    # the verify: loops k+1..R over the γ+1 positions at once, from the draft's loop-k stream
    st = Stream(
        x=torch.cat([s.x for s in streams], 1), e=torch.cat([s.e for s in streams], 1),
        s=torch.cat([s.s for s in streams], 1) if model.state is not None else None, h=None,
        positions=torch.cat([s.positions for s in streams], 1), valid=None)
    cache.revisit(gamma + 1, st.positions)
    st = model.run_loops(st, range(k, n_loops), cache)
    logits = model.logits_at(model.readout(st), n_loops - 1, st.positions, None, cache)  # (b, γ+1, V)
    b = logits.shape[0]
    d = torch.cat(drafts, 1) if gamma else logits.new_zeros(b, 0, dtype=torch.long)  # (b, γ)
    if sampling.greedy:
        full = logits.argmax(-1)  # (b, γ+1): f_1..f_{γ+1}
        agreed = (d == full[:, :gamma]).long().cumprod(1).sum(1) if gamma else full.new_zeros(b)
        out = full
    else:
        p = sampling.probs(logits)  # (b, γ+1, V)
        if gamma:
            q = torch.stack(q_probs, 1)  # (b, γ, V)
            p_d, q_d = p[:, :gamma].gather(-1, d[..., None])[..., 0], q.gather(-1, d[..., None])[..., 0]
            u = torch.rand(b, gamma, device=p.device, generator=sampling.generator)
            agreed = (u * q_d <= p_d).long().cumprod(1).sum(1)  # accept d_i with probability min(1, p_i / q_i)
            resid = torch.cat([(p[:, :gamma] - q).clamp_min(0), p[:, gamma:]], 1)  # (b, γ+1, V); position γ: p itself
        else:
            agreed, resid = p.new_zeros(b, dtype=torch.long), p
        at = agreed[:, None, None].expand(b, 1, p.shape[-1])
        dist = resid.gather(1, at)[:, 0]
        mass = dist.sum(-1, keepdim=True)
        dist = torch.where(mass > 0, dist / mass.clamp_min(1e-30), p.gather(1, at)[:, 0])  # p = q exactly: draw from p
        extra = draw(dist, sampling.generator)[:, None]  # (b, 1)
        out = torch.cat([d, extra], 1).scatter(1, agreed[:, None], extra)
    counts = agreed + 1
    keep = counts if rows is None else torch.zeros_like(cache.lengths).index_copy(0, rows, counts)
    cache.rollback(keep)
    return out, counts, logits, agreed


# ------------------------------------------------------------------ compiled steps
class CompiledDecoder:
    """Plain decoding steps over a static cache (fixed shapes: whole buffers read under a mask), the step
    compiled by torch.compile; mode "reduce-overhead" captures it in a CUDA graph. Built once per
    (batch, length bucket, depth, mode, device, dtype) and reused by later calls (`compiled_decoder`).

    Each decoder compiles its own copy of the step's code: Dynamo keeps a code object's compiled variants (and counts
    them against its recompile limit, 8) per code object, so decoders sharing one failed with FailOnRecompileLimitHit
    at the ninth (batch, length, depth, mode) — and dropping a decoder now drops its variants with its code. The
    cache's buffers are static addresses (`torch._dynamo.mark_static_address`): the step mutates them in place, and
    CUDA-graph trees capture a step only when what it mutates stays put; the logits it returns are cloned out of the
    graph's memory."""

    def __init__(self, model, batch_size: int, max_len: int, n_loops: int, mode: str):
        reason = compile_unsupported(model.config)
        if reason:
            raise ValueError(reason)
        self.model, self.R = model, n_loops
        self.cache = model.allocate_cache(batch_size, max_len, n_loops=n_loops, static=True)
        for t in self.cache.buffers():
            torch._dynamo.mark_static_address(t)
        options = {"mode": None if mode == "default" else mode} if COMPILE_BACKEND == "inductor" else {}
        step = types.MethodType(_own_code(CompiledDecoder._step), self)
        self.step = torch.compile(step, backend=COMPILE_BACKEND, fullgraph=True, dynamic=False, **options)

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, cache=self.cache, n_loops=self.R).logits[:, -1]

    def reset(self) -> None:
        self.cache.reset_rows(self.cache.all_rows)

    @torch.no_grad()
    def prefill(self, input_ids, attention_mask=None) -> torch.Tensor:
        self.reset()
        return prefill(self.model, input_ids, attention_mask, self.cache, self.R)[0]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.step(tokens.reshape(-1, 1)).clone()  # out of the graph's memory, which the next replay reuses


_CODE_IDS = itertools.count()


def _own_code(fn):
    """fn with a code object of its own (the same bytecode under another name)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_CODE_IDS)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def compiled_decoder(model, batch_size: int, max_len: int, n_loops: int, mode: str) -> CompiledDecoder:
    """The model's compiled decoder for what it depends on: batch, length bucket, depth, mode, device, dtype;
    at most MAX_COMPILED per model, least recently used dropped first. They live on the model (a plain attribute, no
    state-dict key), so they go when it goes."""
    p = model.head.weight
    length = min(model.config.max_seq_len, -(-max_len // LENGTH_BUCKET) * LENGTH_BUCKET)
    key = (batch_size, length, n_loops, mode, p.device, p.dtype)
    table = model.__dict__.setdefault("_compiled_decoders", OrderedDict())
    if key in table:
        table.move_to_end(key)
    else:
        table[key] = CompiledDecoder(model, batch_size, length, n_loops, mode)
        while len(table) > MAX_COMPILED:
            table.popitem(last=False)
    return table[key]


def compile_unsupported(config) -> str | None:
    """Why a compiled (static-shape) step cannot decode this model, or None (the variants' declared `compile`)."""
    reason = config.unsupported("compile")
    return None if reason is None else f"compile=... with {reason}"


# ------------------------------------------------------------------ generate
def _check_request(model, input_ids, max_new_tokens, attention_mask, sampling, exits, speculation, compile, R) -> None:
    """Every refusal of a generation request, each naming the option, before anything runs."""
    cfg = model.config
    check_inputs(input_ids, attention_mask, cfg.vocab_size)  # dtype, shape, ids inside the vocabulary: once, here
    if input_ids.shape[1] == 0:
        raise ValueError("generate needs a prompt of at least one token (e.g. BOS)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if input_ids.shape[1] + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len="
                         f"{cfg.max_seq_len}; shorten the prompt or lower max_new_tokens")
    if attention_mask is not None:
        m = attention_mask.to(torch.long)
        if bool((m[:, 1:] < m[:, :-1]).any()) or not bool(m[:, -1].all()):
            raise ValueError("attention_mask must be left-padded (zeros only before the first real token, last column "
                             "all ones); pad prompts on the left for batched generation")
    check_options(model, R, sampling=sampling, exits=exits, speculation=speculation, compile=compile)


def check_options(model, n_loops: int, *, sampling=None, exits=None, speculation=None, compile=False) -> None:
    """Refuse, naming the option, a decoding option or combination this model cannot run at depth n_loops
    (generate calls it; so do the lm-eval adapter and the CLIs, before any work)."""
    R, cfg = n_loops, model.config
    sampling = Sampling() if sampling is None else sampling
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling={sampling!r}: give looplab.models.Sampling(temperature, top_k, top_p, generator)")
    for feature, value in (("exits", exits), ("speculation", speculation), ("compile", compile)):
        if value not in (None, False):
            reason = cfg.unsupported(feature)
            if reason:
                raise ValueError(f"{_named(feature, value)} with {reason}")
    if exits is not None:
        if not isinstance(exits, ExitPolicy):
            raise TypeError(f"exits={exits!r}: give looplab.models.ExitPolicy(threshold=..., rule=..., skip=...)")
        bad = [f"{k}={v!r}" for k, v in (("at_step", exits.at_step), ("expected", exits.expected),
                                        ("steps", exits.steps)) if v not in (None, False)]
        if bad:
            raise ValueError(f"generate exits by a threshold rule; ExitPolicy({', '.join(bad)}) is forward's read-out, "
                             "not a decoding policy")
        exits.check(model, R)
        if exits.threshold is None:
            raise ValueError("exits=ExitPolicy(...) needs threshold=q (exit_threshold: the depth at which a token stops)")
    if speculation is not None:
        if not isinstance(speculation, Speculation):
            raise TypeError(f"speculation={speculation!r}: give looplab.models.Speculation(loops=k, draft_tokens=γ)")
        speculation.check(R)
        if exits is not None:
            raise ValueError("speculation verifies every token at the full depth, so it does not combine with exits "
                             "(which choose shallower depths); drop one of them")
    if compile not in (False, True, *COMPILE_MODES):
        raise ValueError(f"compile={compile!r} is unknown; choose False, True (= 'default'), {', '.join(COMPILE_MODES)}")
    if compile:
        bad = [name for name, v in (("exits", exits), ("speculation", speculation)) if v is not None]
        if bad:
            raise ValueError(f"compile={compile!r} decodes plain steps; it does not combine with {', '.join(bad)}")


@torch.no_grad()
def stream(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
           eos_token_id: int | Sequence[int] | None = None, sampling: Sampling | None = None,
           exits: ExitPolicy | None = None, speculation: Speculation | None = None, n_loops: int | None = None,
           compile: bool | str = False) -> Iterator[StepOutput]:
    """Yield one StepOutput per generated position; stops early once every row has emitted eos. The options are
    `generate`'s."""
    sampling = Sampling() if sampling is None else sampling
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    R = model.loops(n_loops)  # test-time depth R′ (default: the configured R)
    _check_request(model, input_ids, max_new_tokens, attention_mask, sampling, exits, speculation, compile, R)
    if max_new_tokens <= 0:
        return
    B, T = input_ids.shape
    eos = None
    if eos_token_id is not None:
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=input_ids.device)
    if compile:
        dec = compiled_decoder(model, B, T + max_new_tokens, R, "default" if compile is True else compile)
        logits = dec.prefill(input_ids, attention_mask)
        yield from _sample_steps(logits, None, lambda tok: (dec.decode(tok), None), max_new_tokens, eos, sampling)
        return
    if speculation is not None:
        yield from _stream_speculative(model, input_ids, attention_mask, max_new_tokens, eos, speculation, R, sampling)
        return
    cache = model.allocate_cache(B, T + max_new_tokens, n_loops=R)
    # under a skip handling the prefill freezes each prompt token at its exit, as decoding does (exit_compute.py)
    logits, exit_steps = prefill(model, input_ids, attention_mask, cache, R, exits)
    skip = SkipDecoding(model, exits, R) if exits is not None and exits.skip is not None else None
    read = None if exits is None else ExitPolicy(exits.threshold, exits.rule, exits.min_loops)
    yield from _sample_steps(logits, exit_steps, lambda tok: decode_one_token(model, tok, cache, exits=read, n_loops=R, skip=skip),
                             max_new_tokens, eos, sampling)


def _sample_steps(logits, exit_steps, step, max_new_tokens: int, eos: torch.Tensor | None,
                  sampling: Sampling) -> Iterator[StepOutput]:
    """Sample from `logits`, yield, and ask `step(tokens)` for the next (logits, exit_steps); rows that emitted eos
    keep emitting it, and the loop ends once every row has."""
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    for i in range(max_new_tokens):
        tokens = sampling.sample(logits)
        if eos is not None:
            tokens = torch.where(finished, eos[0], tokens)
            finished |= torch.isin(tokens, eos)
        yield StepOutput(tokens, logits, exit_steps)
        if i == max_new_tokens - 1 or (eos is not None and bool(finished.all())):
            return
        logits, exit_steps = step(tokens)


def _stream_speculative(model, input_ids, attention_mask, max_new_tokens: int, eos: torch.Tensor | None,
                        spec: Speculation, R: int, sampling: Sampling) -> Iterator[StepOutput]:
    """Decoding by draft-verify rounds; rows keep their own agreeing prefixes, so each row has a queue of
    emitted tokens and a position is yielded once every row has one. eos as in plain decoding."""
    B, T = input_ids.shape
    k = spec.loops
    schedule = DraftSchedule(spec.draft_tokens)
    # room for a leading row's last round past max_new_tokens
    max_len = min(model.config.max_seq_len, T + max_new_tokens + AUTO_DRAFT[2] + 1)
    cache = model.allocate_cache(B, max_len, n_loops=R)
    dev = input_ids.device
    stats = SpeculationStats(agreed=torch.zeros(B, dtype=torch.long, device=dev),
                             row_drafted=torch.zeros(B, dtype=torch.long, device=dev))
    logits, _ = prefill(model, input_ids, attention_mask, cache, R, draft_loops=k)
    first = sampling.sample(logits)
    queues: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[(first[b], logits[b])] for b in range(B)]
    last = first.clone()  # each row's last emitted token: the next round starts from it
    produced = torch.ones(B, dtype=torch.long, device=dev)  # tokens each row has emitted into its queue
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    emitted = 0
    last_logits = logits.clone()
    while True:
        # a finished row needs no more tokens: it emits eos (with its last logits) once its queue runs dry
        while all(q or bool(finished[b]) for b, q in enumerate(queues)):
            for b, q in enumerate(queues):
                if q:
                    last_logits[b] = q[0][1]
            tokens = torch.stack([q.pop(0)[0] if q else eos[0] for q in queues])
            lg = last_logits.clone()
            if eos is not None:
                tokens = torch.where(finished, eos[0], tokens)
                finished |= torch.isin(tokens, eos)
            emitted += 1
            yield StepOutput(tokens, lg, None, stats)
            if emitted == max_new_tokens or (eos is not None and bool(finished.all())):
                return
        need = ~finished & (produced < max_new_tokens)  # rows with an empty queue always need more
        rows = None if bool(need.all()) else need.nonzero().squeeze(1)
        room = max_len - 1 - cache.used_columns()
        gamma = max(0, min(schedule.gamma, room))
        with cache.select_rows(rows):
            tok = last if rows is None else last[rows]
            new, counts, new_logits, agreed = speculative_round(model, tok[:, None], cache, k, gamma, R, sampling)
        idx = torch.arange(B, device=dev) if rows is None else rows
        for i, b in enumerate(idx.tolist()):
            c = int(counts[i])
            queues[b].extend((new[i, j], new_logits[i, j]) for j in range(c))
            last[b] = new[i, c - 1]
        produced.index_add_(0, idx, counts)
        n = idx.numel()
        stats.rounds += 1
        stats.drafted += gamma * n
        stats.accepted += int(agreed.sum())
        stats.agreed.index_add_(0, idx, agreed)
        stats.row_drafted.index_add_(0, idx, torch.full_like(agreed, gamma))
        stats.draft_sizes.append(gamma)
        schedule.update(gamma, float((agreed == gamma).float().mean()) if n else 0.0)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
             eos_token_id: int | Sequence[int] | None = None, sampling: Sampling | None = None,
             exits: ExitPolicy | None = None, speculation: Speculation | None = None, n_loops: int | None = None,
             compile: bool | str = False, return_logits: bool = False) -> torch.Tensor | GenerationOutput:
    """Cached generation → (B, T + n) sequences, or a GenerationOutput with return_logits.

    attention_mask: left-padded prompts (1 = token, 0 = padding); each row gets the tokens it would get alone.
    eos_token_id: rows that emit it keep emitting it; generation stops once every row has.
    sampling: Sampling(temperature, top_k, top_p, generator) (default greedy).
    exits: ExitPolicy(threshold, rule, min_loops, skip) — each token read at its exit depth; with skip
    (kv_copy | ssm_skip | ssm_propagate) the loops after it do not run for that row.
    speculation: Speculation(loops=k, draft_tokens=γ | "auto") — self-speculative decoding, output identical to
    plain greedy decoding (temperature 0) or distributed exactly as the full model (temperature > 0).
    n_loops: a test-time depth R′. compile: False | True | "default" | "reduce-overhead" | "max-autotune" — plain
    steps compiled over a static cache (attention-only models).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    # only what is returned is kept: each step's (B, V) logits only with return_logits (at a 49k vocabulary, batch 32
    # and 1,000 tokens they are 6 GB)
    tokens, logits, exit_steps, last = [], [], [], None
    for step in stream(model, input_ids, max_new_tokens, attention_mask=attention_mask, eos_token_id=eos_token_id,
                       sampling=sampling, exits=exits, speculation=speculation, n_loops=n_loops, compile=compile):
        tokens.append(step.tokens)
        if return_logits:
            logits.append(step.logits)
            if step.exit_steps is not None:
                exit_steps.append(step.exit_steps)
        last = step
    B = input_ids.shape[0]
    new = torch.stack(tokens, 1) if tokens else input_ids.new_zeros(B, 0)
    sequences = torch.cat([input_ids, new.to(input_ids.dtype)], 1)
    if not return_logits:
        return sequences
    V = model.config.vocab_size
    logits = torch.stack(logits, 1) if logits else input_ids.new_zeros(B, 0, V, dtype=torch.float)
    return GenerationOutput(sequences, logits, torch.stack(exit_steps, 1) if exit_steps else None,
                            last.speculation if last is not None else None)
