"""Lossless self-speculative decoding (docs/decoding.md#self-speculative-decoding): the first k loops draft, the full depth verifies.

    prefill   the prompt through all R loops; the coda also runs at depth k, whose cache the draft reads
    round     draft   the last emitted token and then γ greedy draft tokens, one at a time, through
                      loops 1..k, the coda at depth k and the head: γ+1 new positions, γ draft tokens
              verify  loops k+1..R, the coda at depth R and the head over those γ+1 positions in ONE
                      call, starting from the draft's own loop-k stream x, StateLoop state s and
                      prelude output e (the injection re-reads e), with the caches the draft left
              accept  f_1..f_{γ+1}, the full depth's greedy tokens at the γ+1 positions: the draft
                      agreed on the first n (d_i = f_i for i ≤ n), so f_1..f_{n+1} are emitted
              roll back what the positions after the first n+1 wrote, in every cache entry

Why it is exact: loops 1..k of a token read only loops 1..k of itself and the tokens before it,
so when the tokens so far are the full model's own, the draft's loops 1..k ARE the full model's
loops 1..k (and their cache entries are reused as they are); loops k+1..R then run exactly as in
plain decoding, only over γ+1 positions at once. Every emitted token is the full depth's argmax
on a prefix of the full model's tokens, so the output is plain greedy decoding's, token for token
(up to the float rounding of a γ+1-token call against one-token calls, as for prefill vs steps).

Batches: the caches hold one length for all rows, so a round keeps m = 1 + the shortest agreeing
prefix over the rows still running (finished rows, which emit eos whatever they compute, do not
hold the others back); a row that agreed further only drafts those tokens again. Each round emits
1..γ+1 tokens per row and costs γ+1 draft steps at depth k plus one (R−k)-loop call over γ+1 tokens.

Rollback (models/cache.py): attention key/values move their length back (free). Mamba-2 entries
(backbone, prelude, coda, the stateloop_mamba2 mixer) record the state after every position
they write during the round — the draft's one-token steps already compute it; the verify runs its
γ+1 tokens through the one-token recurrence instead of the chunked scan (on every device: the fused
kernel returns only the final state) — and copy the last kept position's conv history and SSM state
back: one (B, heads, headdim, d_state) copy per entry and round, plus one at the checkpoint. The
StateLoop per-token state s is not cached across tokens (models/cache.py), so nothing of it is kept.

`draft_tokens="auto"` adapts γ to the acceptance: start at 4; +1 (up to 8) after a round in which
the batch kept every draft token, −1 (down to 1) otherwise — one more token when drafts are good,
one less wasted draft step when they are not (the additive schedule of transformers' assistant).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from looplab.models.cache import LoopCache

AUTO_DRAFT = (4, 1, 8)  # draft_tokens="auto": initial γ, smallest, largest


@dataclass
class SpeculationStats:
    """Running counts of one speculative generation (per row: every row drafts the same tokens)."""

    drafted: int = 0  # draft tokens proposed per row
    accepted: int = 0  # draft tokens kept (the batch keeps the shortest agreeing prefix of its running rows)
    rounds: int = 0
    agreed: torch.Tensor | None = None  # (B,) draft tokens each row's full depth agreed with
    draft_sizes: list[int] = field(default_factory=list)  # γ of each round (changes with draft_tokens="auto")

    @property
    def acceptance_rate(self) -> float:
        """Kept draft tokens / proposed draft tokens."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def row_acceptance(self) -> torch.Tensor | None:
        """(B,) per row: draft tokens its full depth agreed with / proposed (before the batch minimum)."""
        return None if self.agreed is None or not self.drafted else self.agreed.float() / self.drafted

    def summary(self) -> str:
        return (f"acceptance {self.acceptance_rate:.2f} ({self.accepted}/{self.drafted} draft tokens, "
                f"{self.rounds} rounds, mean draft {sum(self.draft_sizes) / max(1, len(self.draft_sizes)):.1f})")


def check_speculation(model, R: int, speculative_loops, draft_tokens, temperature: float = 0.0,
                      exit_threshold=None, exit_rule=None, skip_compute=False) -> None:
    """Refuse what speculation does not do, naming the option."""
    k = speculative_loops
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < R:
        raise ValueError(f"speculative_loops={k!r} must be an integer in 1..{R - 1} (the draft's depth, below the "
                         f"n_loops={R} that verifies)")
    if draft_tokens != "auto" and (isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int)
                                   or draft_tokens < 1):
        raise ValueError(f"draft_tokens={draft_tokens!r} must be an integer >= 1 or 'auto'")
    if temperature != 0:
        raise ValueError(f"speculative_loops with temperature={temperature}: self-speculation is implemented for "
                         "greedy decoding only (temperature=0); sample without speculative_loops, or decode greedily")
    if exit_threshold is not None or exit_rule is not None or skip_compute not in (None, False, "none"):
        raise ValueError("speculative_loops verifies every token at the full depth, so it does not combine with "
                         "exit_threshold / exit_rule / skip_compute (which choose shallower depths); drop one of them")


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: LoopCache, k: int,
            R: int) -> torch.Tensor:
    """The prompt through all R loops → the last position's full-depth logits (B, V). The coda also
    runs at depth k, so that the draft's coda caches hold the prompt."""
    model._check_cache_depth(cache, R)
    positions, valid = cache.advance(attention_mask, input_ids.shape[1])
    x = e = model.run_prelude(model.embed(input_ids), positions, valid, cache)
    s = model.state.initial_state(x) if model.state is not None else None
    for r in range(R):
        h, x, s, _ = model.loop_step(x, s, e, r, positions, valid, cache)
        if r == k - 1 and len(model.coda):
            model._coda(model.readout(h, x), r, positions, valid, cache)
    z = model._coda(model.readout(h, x), R - 1, positions, valid, cache)  # every position: fills the coda cache
    return model.head(model.final_norm(z[:, -1]))


@torch.no_grad()
def speculative_round(model, token: torch.Tensor, cache: LoopCache, k: int, gamma: int, R: int,
                      running: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft-verify-accept round from `token` (B, 1), the last emitted token, not yet in the cache.

    → (tokens (B, m), logits (B, m, V), agreed (B,)): the m = n+1 tokens emitted (all the full
    depth's, with their logits), n the shortest agreeing prefix over `running` rows (B,) bool
    (default all), and each row's own agreeing prefix. The cache keeps the m positions written
    (the token and the first n draft tokens) and forgets the rest."""
    B = token.shape[0]
    cache.checkpoint()
    streams, states, prelude_out, pos, drafts = [], [], [], [], []
    tok = token
    for i in range(gamma + 1):  # the draft: one token at a time through loops 1..k
        positions, valid = cache.advance(None, 1)
        x = e = model.run_prelude(model.embed(tok), positions, valid, cache)
        s = model.state.initial_state(x) if model.state is not None else None
        for r in range(k):
            h, x, s, _ = model.loop_step(x, s, e, r, positions, valid, cache)
        z = model.readout(h, x)
        if i < gamma:
            tok = model.logits_at(z, k - 1, positions, valid, cache)[:, -1].argmax(-1, keepdim=True)
            drafts.append(tok)
        elif len(model.coda):  # nothing reads this position's draft, but depth k's coda cache must hold it
            model._coda(z, k - 1, positions, valid, cache)
        streams.append(x)
        states.append(s)
        prelude_out.append(e)
        pos.append(positions)

    # the verify: loops k+1..R over the γ+1 positions at once, from the draft's loop-k stream
    x, e, positions = torch.cat(streams, 1), torch.cat(prelude_out, 1), torch.cat(pos, 1)
    s = torch.cat(states, 1) if model.state is not None else None
    valid = cache.valid[:, : cache.length] if cache.has_padding else None
    for r in range(k, R):
        h, x, s, _ = model.loop_step(x, s, e, r, positions, valid, cache)
    logits = model.logits_at(model.readout(h, x), R - 1, positions, valid, cache)  # (B, γ+1, V)
    full = logits.argmax(-1)  # (B, γ+1): f_1..f_{γ+1}

    if gamma:
        agreed = (torch.cat(drafts, 1) == full[:, :gamma]).long().cumprod(1).sum(1)  # (B,)
    else:
        agreed = full.new_zeros(B)
    running = torch.ones(B, dtype=torch.bool, device=full.device) if running is None else running
    n = int(agreed[running].min()) if bool(running.any()) else gamma
    cache.rollback(n + 1)
    return full[:, : n + 1], logits[:, : n + 1], agreed


class DraftSchedule:
    """γ per round: fixed, or adapted to the acceptance with draft_tokens="auto" (see the module doc)."""

    def __init__(self, draft_tokens: int | str):
        self.auto = draft_tokens == "auto"
        self.gamma = AUTO_DRAFT[0] if self.auto else int(draft_tokens)

    def update(self, gamma: int, kept: int) -> None:
        if self.auto and gamma > 0:
            lo, hi = AUTO_DRAFT[1:]
            self.gamma = min(hi, self.gamma + 1) if kept == gamma else max(lo, self.gamma - 1)
