"""A running batch of requests over one LoopCache: continuous batching (docs/decoding.md#serving-many-requests).

The engine keeps `max_batch` rows of one cache. Each `step()`:

  1. admission: waiting requests (first come, first served) take free rows; the row is emptied
     (`LoopCache.reset_rows`) and the request's prompt is prefilled into that row alone
     (`LoopCache.select_rows`), exactly as `generate` prefills it at batch 1 (every loop, or under a skip
     handling each prompt token's loops up to its exit); its first token comes from the prefill's logits;
  2. one decoding step for every running row that has a token to feed, in one batched call
     (`decode_one_token` under `select_rows(running)`): each row at its own length and position;
  3. a row whose request emitted eos or reached its token limit leaves; its row is free for the
     next admission.

What it cannot serve it refuses: at `add()`, a prompt that is not 1-D token ids and a non-finite or negative
arrival, with a one-line ValueError naming the value; during decoding, a request whose logits are not finite fails
alone (`Request.error`), as does one whose own work raises. `cancel(id)` takes a request out at the next step
boundary. The engine keeps only its waiting and running requests: `step()` hands out the ones that left in it, and
`run()` those of the run.

Each request gets the tokens (and, with exits, the exit depths) it would get from
`generate(prompt, max_new_tokens, exits=policy, eos_token_id=eos)` alone: greedy decoding, or sampling
from the request's own seeded generator (`add(..., sampling=Sampling(...), seed=s)`), per-row lengths,
positions and masks in the cache, and nothing shared between rows but the weights. Float
rounding can differ with the batch's composition; `solo_agreement` counts a difference as a tie
only where the solo run's top-2 logit margin at the first differing token is below 1e-4.

schedule="lockstep" runs every loop of every running row in a step (under a skip handling, a row
stops computing at its own exit while the others go on, but the step lasts until the deepest row is
done). schedule="depthwise" runs one loop of every in-flight token per step, in one block call, each
token at its own loop (looplab.serve.depthwise, docs/decoding.md#depth-wise-batching).
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from looplab.models.exit_compute import SkipDecoding
from looplab.models.exits import ExitPolicy
from looplab.models.generation import Sampling, decode_one_token, prefill
from looplab.serve.depthwise import DepthwiseDecoder

SCHEDULES = ("lockstep", "depthwise")
TIE_MARGIN = 1e-4  # a top-2 logit margin below this at the first differing token counts as a tie


@dataclass(eq=False)  # identity: a request is one object, and its prompt tensor has no truth value
class Request:
    """One prompt and its generation options; the engine fills in the result and the timings."""

    prompt: torch.Tensor  # (T,) token ids
    max_new_tokens: int
    id: int = -1
    arrival: float | None = None  # when it may be admitted (engine clock, seconds); None = at once
    tokens: list[int] = field(default_factory=list)  # generated, eos included when it came
    exit_steps: list[int] = field(default_factory=list)  # with exits: the 1-based depth each token was read at
    margins: list[float] = field(default_factory=list)  # top-2 logit margin of each chosen token
    admitted_at: float | None = None
    token_times: list[float] = field(default_factory=list)  # engine clock when each token was chosen
    row: int | None = None
    sampling: "Sampling | None" = None  # None or temperature 0: greedy; else drawn from the request's own generator
    seed: int | None = None  # the seed of that generator (solo_agreement draws again from it)

    hit_eos: bool = False
    error: str | None = None  # why the request failed (it left the engine with the tokens it had; the others went on)
    cancelled: bool = False  # it left through Engine.cancel (error "cancelled"), with the tokens it had

    @property
    def done(self) -> bool:
        return self.error is not None or (bool(self.tokens) and (len(self.tokens) >= self.max_new_tokens or self.hit_eos))


class Engine:
    """Continuous batching of requests (greedy or sampled) over one model (docs/decoding.md#serving-many-requests).

        engine = Engine(model, max_batch=8, max_len=256, exits=ExitPolicy(threshold=0.5, skip="kv_copy"))
        for prompt in prompts:
            engine.add(prompt, max_new_tokens=64)
        finished = engine.run()                  # or step() from your own loop, add() between steps

    max_len bounds prompt + new tokens of any one request (the cache's columns per row). The engine does not keep
    the requests that left it (a server runs for ever): each one is handed out once, by the `step()` it left in
    (and so by `run()`). clock / sleep: the engine clock and what `run()` waits with (a test injects both)."""

    def __init__(self, model, max_batch: int = 8, max_len: int | None = None, *, exits: ExitPolicy | None = None,
                 n_loops: int | None = None, eos_token_id: int | None = None, schedule: str = "lockstep",
                 clock=time.perf_counter, sleep=time.sleep):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is unknown; choose one of {SCHEDULES}")
        self.model = model.eval()
        self.R = model.loops(n_loops)
        self.max_len = int(max_len or model.config.max_seq_len)
        self.exits, self.eos = exits, eos_token_id
        from looplab.models.generation import check_options

        check_options(model, self.R, exits=exits)
        self.read = None if exits is None else ExitPolicy(exits.threshold, exits.rule, exits.min_loops)
        self.skip = SkipDecoding(model, exits, self.R) if exits is not None and exits.skip is not None else None
        self.cache = model.allocate_cache(max_batch, self.max_len, n_loops=self.R)
        self.max_batch, self.schedule = max_batch, schedule
        self.depthwise = DepthwiseDecoder(model, self.cache, self.R, exits) if schedule == "depthwise" else None
        self._to_start: set[int] = set()  # depthwise: the rows whose next token starts in the next step
        # each row's last chosen token, on the device: a step feeds it without copying host data there
        self._last = torch.zeros(max_batch, dtype=torch.long, device=self.cache.lengths.device)
        self._rows_t: tuple[tuple[int, ...], torch.Tensor | None] = ((), None)  # the running rows' index tensor, kept
        self.rows: list[Request | None] = [None] * max_batch
        self.waiting: list[Request] = []
        self._failed_now: list[Request] = []  # failed in the current step (step() returns them with the finished)
        self._cancel: set[int] = set()  # ids of waiting or running requests to take out at the next step boundary
        self._next_id = 0
        self._clock, self._sleep, self._t0 = clock, sleep, clock()
        # finished / failed / cancelled: counts of the requests that left (the engine keeps none of them)
        self.stats = {"steps": 0, "decode_calls": 0, "decode_rows": 0, "prefills": 0, "peak_cache_bytes": 0,
                      "prefill_s": 0.0, "decode_s": 0.0,  # clock seconds in prefills / in decoding calls
                      "finished": 0, "failed": 0, "cancelled": 0}

    def __getattr__(self, name):  # only reached for a missing attribute
        if name in ("finished", "failed"):  # removed: lists of every request that left grew for the engine's life
            raise AttributeError(f"Engine.{name} is gone (the engine keeps no request that left): step() returns the "
                                 f"requests that left in that step, run() those of the run; stats counts them")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------ requests
    def now(self) -> float:
        return self._clock() - self._t0

    def add(self, prompt: Sequence[int] | torch.Tensor, max_new_tokens: int, arrival: float | None = None,
            sampling: Sampling | None = None, seed: int | None = None) -> Request:
        """Queue a request. sampling: Sampling(temperature, top_k, top_p) (default greedy); a sampled request draws
        from its own generator seeded with `seed` (default: its id), so that it gets what
        `generate(..., sampling=Sampling(..., generator=torch.Generator().manual_seed(seed)))` gives it alone."""
        if isinstance(prompt, torch.Tensor) and (prompt.is_floating_point() or prompt.dtype == torch.bool):
            raise ValueError(f"prompt has dtype={prompt.dtype}: token ids must be integers (torch.long)")
        if isinstance(prompt, torch.Tensor) and prompt.dim() != 1:  # (1, T) or (B, T) is not one request's prompt
            raise ValueError(f"prompt has shape {tuple(prompt.shape)}: one request's prompt is 1-D token ids (T,)")
        if not isinstance(prompt, torch.Tensor) and any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
            raise ValueError(f"prompt={list(prompt)!r}: token ids must be integers (one request's prompt is 1-D)")
        prompt = torch.as_tensor(prompt, dtype=torch.long)
        if prompt.numel() == 0:
            raise ValueError("an empty prompt: give at least one token")
        V = self.model.config.vocab_size
        lo, hi = (int(v) for v in torch.stack([prompt.min(), prompt.max()]).tolist())
        if lo < 0 or hi >= V:
            raise ValueError(f"prompt holds token id {lo if lo < 0 else hi} outside the vocabulary [0, {V}) "
                             f"(vocab_size={V})")
        if isinstance(max_new_tokens, bool) or not _is_index(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        # nan is never <= the clock (never admitted: run() would spin), inf never comes, and the clock starts at 0
        if arrival is not None and (isinstance(arrival, bool) or not isinstance(arrival, (int, float))
                                    or not 0 <= arrival < float("inf")):
            raise ValueError(f"arrival={arrival!r} must be a finite time >= 0 on the engine clock (seconds since the "
                             f"engine started), or None (at once)")
        if prompt.numel() + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({prompt.numel()} tokens) + max_new_tokens={max_new_tokens} exceeds the engine's "
                             f"max_len={self.max_len}")
        req = Request(prompt.to(self.cache.lengths.device), int(max_new_tokens), id=self._next_id,
                      arrival=None if arrival is None else float(arrival))
        if sampling is not None and not sampling.greedy:  # Sampling refuses a non-finite or negative temperature
            if sampling.generator is not None:
                raise ValueError("sampling.generator: the engine seeds each request's own generator; give seed= instead")
            req.seed = self._next_id if seed is None else int(seed)
            req.sampling = replace(sampling, generator=_generator(req.seed, self.cache.lengths.device))
        self._next_id += 1
        self.waiting.append(req)
        return req

    def cancel(self, request_id: int) -> bool:
        """Take a request out at the next step boundary (the start of the next `step()`, which hands it out): a waiting
        one leaves the queue, a running one frees its row (a depth-wise in-flight token is dropped); it keeps the
        tokens it had, with cancelled=True and error "cancelled". → True; False when the request has already left
        (finished, failed or cancelled: a client may race its request's end). An id never issued: ValueError."""
        if isinstance(request_id, bool) or not _is_index(request_id) or not 0 <= request_id < self._next_id:
            raise ValueError(f"request_id={request_id!r} is unknown: this engine issued ids 0..{self._next_id - 1}")
        live = any(r.id == request_id for r in self.waiting) or any(r.id == request_id for r in self.running)
        if live:
            self._cancel.add(int(request_id))
        return live

    def _take_out_cancelled(self) -> list[Request]:
        """The step boundary's cancellations: the requests asked for leave, each with the tokens it had."""
        if not self._cancel:
            return []
        out = [r for r in self.waiting if r.id in self._cancel]
        self.waiting[:] = [r for r in self.waiting if r.id not in self._cancel]
        for req in self.running:
            if req.id in self._cancel:
                self._free(req)
                out.append(req)
        self._cancel.clear()
        for req in out:
            req.cancelled, req.error = True, "cancelled"
        self.stats["cancelled"] += len(out)
        return sorted(out, key=lambda r: r.id)

    @property
    def running(self) -> list[Request]:
        return [r for r in self.rows if r is not None]

    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ------------------------------------------------------------------ one scheduling step
    @torch.no_grad()
    def step(self) -> list[Request]:
        """Take out the cancelled, admit into free rows, decode one token for every running row; → the requests that
        left in this step (cancelled, failed, finished), each handed out once: the engine keeps none of them.

        Host syncs: a step reads the device once for what the host must know — its admissions' first tokens, then
        its decoded tokens (with margins and exit depths) — and sends it one index tensor when the running rows
        change, whatever the number of rows, loops or cache entries (tests/test_gpu_readiness.py)."""
        done: list[Request] = self._take_out_cancelled()
        now = self.now()
        admitted = []
        for row in range(self.max_batch):
            if self.rows[row] is not None:
                continue
            req = next((r for r in self.waiting if r.arrival is None or r.arrival <= now), None)
            if req is None:
                break
            self.waiting.remove(req)
            drawn = self._alone(req, self._admit, req, row)
            if drawn is not None:
                admitted.append((req, *drawn))
        done += self._take(admitted)
        if self.depthwise is not None:
            done += self._depthwise_step()
        else:
            live = [row for row, r in enumerate(self.rows) if r is not None]
            if live:
                t0 = self._clock()
                rows = self._rows_tensor(live)
                with self.cache.select_rows(rows, None if rows is None else live):
                    logits, steps = decode_one_token(self.model, self._last[live] if rows is not None else self._last,
                                                     self.cache, exits=self.read, n_loops=self.R, skip=self.skip)
                done += self._take(self._draw_rows([self.rows[b] for b in live], logits, steps, rows), t0=t0)
                self.stats["decode_calls"] += 1
                self.stats["decode_rows"] += len(live)
        self.stats["steps"] += 1
        self.stats["peak_cache_bytes"] = max(self.stats["peak_cache_bytes"], self.cache.nbytes())
        failed, self._failed_now = self._failed_now, []
        return failed + done

    def _rows_tensor(self, live: list[int]) -> torch.Tensor | None:
        """The running rows as an index tensor (None when every row runs, in order: the cache then writes and reads
        whole buffers, with no gathering copy of every row's key/value prefix); rebuilt only when they change."""
        if len(live) == self.max_batch:
            return None
        key = tuple(live)
        if self._rows_t[0] != key:
            self._rows_t = (key, torch.tensor(live, device=self._last.device))
        return self._rows_t[1]

    def run(self, max_steps: int | None = None, max_wait: float | None = None) -> list[Request]:
        """Step until every request has left (sleeping until the next arrival when nothing runs); → the requests that
        left in this run (finished, failed or cancelled), by id.

        It stops early after max_steps steps, or when nothing runs and the next arrival is more than max_wait seconds
        of engine clock away (those requests stay waiting). It never loops without progress: a clock that does not
        advance while run() sleeps (an injected clock), or an arrival no clock reaches, is a RuntimeError naming the
        arrival (the requests that left before it hold their results, on the handles add() returned)."""
        out: list[Request] = []
        n = 0
        while not self.idle():
            wait = self._wait()
            if wait > 0:
                if max_wait is not None and wait > max_wait:
                    break
                before = self.now()
                self._sleep(wait)
                if self.now() <= before:  # no step can admit anything: looping on would never end
                    first = min(self.waiting, key=lambda r: r.arrival)
                    raise RuntimeError(f"request {first.id} has arrival={first.arrival} but the engine clock stays at "
                                       f"{before} while run() waits: advance the clock and call step() yourself")
                continue
            prefills = self.stats["prefills"]
            left = self.step()
            out += left
            if not left and not self.running and self.stats["prefills"] == prefills:
                # nothing ran, arrived or left: the waiting requests' arrivals never come (nan set after add)
                raise RuntimeError(f"requests {[r.id for r in self.waiting]} wait with arrivals "
                                   f"{[r.arrival for r in self.waiting]} that the engine clock never reaches")
            n += 1
            if max_steps is not None and n >= max_steps:
                break
        return sorted(out, key=lambda r: r.id)

    def _wait(self) -> float:
        """Engine-clock seconds until a step can do anything: 0 when a row runs, a cancellation is due or a waiting
        request has arrived; else until the first arrival."""
        if self.running or self._cancel or not self.waiting:
            return 0.0
        now = self.now()
        return max(0.0, min(r.arrival if r.arrival is not None else now for r in self.waiting) - now)

    def _depthwise_step(self) -> list[Request]:
        """Start the rows whose next token is known, then one loop of every in-flight token in one block call."""
        dec = self.depthwise
        t0 = self._clock()
        for row, req in enumerate(self.rows):  # admitted in this step: their first token comes from the prefill
            if req is not None and dec.loop[row] < 0:
                self._to_start.add(row)
        if self._to_start:
            rows = sorted(self._to_start)
            dec.start(rows, self._last[rows])
            self._to_start.clear()
        if not dec.in_flight:
            return []
        rows, logits, steps = dec.step()
        self.stats["decode_calls"] += 1
        self.stats["decode_rows"] += len(dec.block_calls[-1])
        if not rows:  # no token left this loop: the step's time still counts (dec.step read its decision, a sync)
            self.stats["decode_s"] += self._clock() - t0
            return []
        reqs = [self.rows[b] for b in rows]
        taken = self._take(self._draw_rows(reqs, logits, steps if self.exits is not None else None, dec.left), t0=t0)
        self._to_start.update(req.row for req in reqs if not req.done and req.error is None)
        return taken

    # ------------------------------------------------------------------ rows
    def _admit(self, req: Request, row: int):
        """Prefill the request into its row → what its first token is drawn from (`_draw`)."""
        t0 = self._clock()
        rows = torch.tensor([row], device=self.cache.lengths.device)
        self.cache.reset_rows(rows, [row])
        with self.cache.select_rows(rows, [row]):
            logits, steps = prefill(self.model, req.prompt[None], None, self.cache, self.R, self.exits)
        self.stats["prefills"] += 1
        self.stats["prefill_s"] += self._clock() - t0
        req.row, req.admitted_at = row, self.now()
        self.rows[row] = req
        return self._draw(req, logits[0], None if steps is None else steps[0])

    def _draw(self, req: Request, logits: torch.Tensor, step):
        """The request's token from its logits (V,) on the device — greedy, or from its own generator —, the top-2
        margin and whether the logits are finite; nothing is read on the host here (`_take` reads all rows' at once)."""
        token = logits.argmax() if req.sampling is None else req.sampling.sample(logits[None])[0]
        top = logits.float().topk(2).values if logits.numel() > 1 else logits.float().expand(2)
        self._last[req.row] = token
        # step: a device scalar (lockstep), a host int (depth-wise) or None; finite: read with the token (no own sync)
        return token, top[0] - top[1], step, logits.isfinite().all()

    def _draw_rows(self, reqs: list[Request], logits: torch.Tensor, steps, rows_t: torch.Tensor | None) -> tuple:
        """The tokens of many requests at once, from logits (b, V): greedy by one argmax over the batch, a sampled
        request from its own generator (alone: if its sampling fails, it fails alone and leaves the batch); the
        margins by one top-2, finiteness by one reduction. steps: (b,) exit steps on the device, a host list, or None;
        rows_t: the requests' rows as a device index (None: every row of the batch, in order)."""
        tokens = logits.argmax(-1)
        finite = logits.isfinite().all(-1)  # nan or inf weights, or an overflow: that request fails (`_take`)
        keep = list(range(len(reqs)))
        for i, req in enumerate(reqs):
            if req.sampling is not None:
                tok = self._alone(req, lambda r=req, lg=logits[i]: r.sampling.sample(lg[None])[0])
                if tok is None:
                    keep.remove(i)
                else:
                    tokens[i] = tok
        top = logits.float().topk(2, dim=-1).values if logits.shape[-1] > 1 else logits.float().expand(-1, 2)
        margins = top[:, 0] - top[:, 1]
        if len(keep) < len(reqs):  # a failed sampling: that request is out (a transfer, on failure only)
            idx = torch.tensor(keep, device=logits.device)
            tokens, margins, finite = tokens[idx], margins[idx], finite[idx]
            rows_t = torch.tensor([reqs[i].row for i in keep], device=logits.device)
            steps = steps[idx] if isinstance(steps, torch.Tensor) else (None if steps is None else [steps[i] for i in keep])
            reqs = [reqs[i] for i in keep]
        if rows_t is None:
            self._last.copy_(tokens)
        elif reqs:
            self._last[rows_t] = tokens
        return reqs, tokens, margins, steps, finite

    def _take(self, drawn, t0: float | None = None) -> list[Request]:
        """Record the drawn tokens of many requests after ONE transfer of their (token, margin, finite, exit step); →
        the ones that left (finished, or failed on non-finite logits). drawn: `_draw_rows`' (requests, tokens, margins,
        steps, finite), or a list of `_draw`'s per-request (request, token, margin, step, finite) (admissions). t0: the
        clock when their decoding call started (its time counts up to this transfer, which waits for the device)."""
        if isinstance(drawn, list):
            if not drawn:
                return []
            reqs = [d[0] for d in drawn]
            tokens, margins = torch.stack([d[1] for d in drawn]), torch.stack([d[2] for d in drawn])
            finite = torch.stack([d[4] for d in drawn])
            given = [d[3] for d in drawn]
            steps = torch.stack(given) if all(isinstance(x, torch.Tensor) for x in given) else \
                (None if all(x is None for x in given) else given)
        else:
            reqs, tokens, margins, steps, finite = drawn
            if not reqs:
                return []
        cols = [tokens.double(), margins.double(), finite.double()]
        cols += [steps.double()] if isinstance(steps, torch.Tensor) else []
        values = torch.stack(cols, 1).tolist()  # the one transfer
        t = self.now()
        if t0 is not None:
            self.stats["decode_s"] += self._clock() - t0
        done = []
        for i, (req, row) in enumerate(zip(reqs, values)):
            token, margin = int(row[0]), row[1]
            step = row[3] if isinstance(steps, torch.Tensor) else (None if steps is None else steps[i])
            if not row[2]:  # its token would be argmax of nan (token 0): it fails, keeping the tokens before
                loop = self.R if step is None else int(step)
                done.append(self._fail(req, f"non-finite logits at token {len(req.tokens)} (loop {loop} of {self.R})"))
                continue
            req.tokens.append(token)
            req.margins.append(margin)
            req.token_times.append(t)
            if self.exits is not None:
                req.exit_steps.append(int(step))
            if self.eos is not None and token == self.eos:
                req.hit_eos = True
            if req.done:
                done.append(self._leave(req))
        return done

    def _leave(self, req: Request) -> Request:
        self.rows[req.row] = None
        self.stats["finished"] += 1
        return req  # handed out by step(); the engine keeps no reference to it

    def _free(self, req: Request) -> None:
        """Free a request's row at once (failed or cancelled): the next admission resets it; nothing of it stays in
        flight."""
        if req.row is not None and self.rows[req.row] is req:
            self.rows[req.row] = None
            self._to_start.discard(req.row)
            if self.depthwise is not None:
                self.depthwise.loop[req.row] = -1

    def _fail(self, req: Request, error: str) -> Request:
        req.error = error
        self._free(req)
        self.stats["failed"] += 1
        return req

    def _alone(self, req: Request, fn, *args):
        """fn(*args) for one request's own work (its prefill, its sampling); if it raises, that request fails alone:
        it leaves with its error and the tokens it had, its row is freed (the next admission resets it), and the
        other requests go on as if it had never come. → fn's result, or None when it failed."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 (any failure of one request's own work is that request's)
            self._failed_now.append(self._fail(req, f"{type(e).__name__}: {e}"))
            return None


def _is_index(x) -> bool:
    """An integer of any kind (int, numpy, a 0-d integer tensor), not a float that happens to be whole."""
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def solo_agreement(model, requests: Sequence[Request], *, exits: ExitPolicy | None = None, n_loops: int | None = None,
                   eos_token_id: int | None = None, tie_margin: float = TIE_MARGIN) -> dict:
    """Each request against `generate(prompt, max_new_tokens, exits=exits)` alone (batch 1; a sampled request with its
    sampling and a generator seeded as the engine seeded its own): equal, a tie (a greedy request whose first
    differing token's solo top-2 margin < tie_margin: fp32's default; bf16 rounds logits by far more), or different.
    Exit depths must agree up to that token."""
    from looplab.models.generation import generate

    equal, ties, differ = 0, 0, []
    for req in requests:
        sampling = (None if req.sampling is None
                    else replace(req.sampling, generator=_generator(req.seed, req.prompt.device)))
        out = generate(model, req.prompt[None], req.max_new_tokens, exits=exits, n_loops=n_loops,
                       eos_token_id=eos_token_id, sampling=sampling, return_logits=True)
        solo = out.sequences[0, req.prompt.numel():].tolist()[:len(req.tokens)]
        solo_steps = out.exit_steps[0].tolist()[:len(req.tokens)] if out.exit_steps is not None else []
        first = next((i for i, (a, b) in enumerate(zip(req.tokens, solo)) if a != b), None)
        n = len(req.tokens) if first is None else first
        steps_agree = req.exit_steps[:n] == solo_steps[:n]
        if first is None and len(solo) == len(req.tokens) and steps_agree:
            equal += 1
            continue
        if first is not None and steps_agree and req.sampling is None:
            top = out.logits[0, first].float().topk(2).values
            if float(top[0] - top[1]) < tie_margin:
                ties += 1
                continue
        differ.append({"id": req.id, "first_difference": first, "engine": req.tokens, "solo": solo,
                       "exit_steps_agree": steps_agree})
    return {"equal": equal, "ties": ties, "different": len(differ), "differences": differ}
