"""looplab.serve.Engine refuses what it cannot serve: bad requests at add(), non-finite logits per request, cancelled
requests; it keeps no request that left, and run() never loops without progress
(docs/decoding.md#serving-many-requests).

No test reads the wall clock: each injects a clock that counts its reads and stops a run that spins (`Spun`)."""

from __future__ import annotations

import re
import weakref

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exits import ExitPolicy
from looplab.models.generation import Sampling, generate
from looplab.serve import Engine, solo_agreement

V = 97
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def looped(**kw) -> LoopedLM:
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=1, n_loops=3, max_seq_len=64, headdim=16, d_state=16)
    m = LoopedLM(LoopedLMConfig(**{**base, **kw})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        m.head.weight.mul_(4)
    return m


class Spun(BaseException):  # not an Exception: the engine's per-request `except Exception` must not swallow it
    pass


class Clock:
    """An engine clock that moves only when told (sleep advances it unless frozen) and stops a run after `budget`
    reads: a loop without progress fails the test instead of hanging it."""

    def __init__(self, budget: int = 5000, frozen: bool = False):
        self.t, self.reads, self.budget, self.frozen, self.slept = 0.0, 0, budget, frozen, []

    def __call__(self) -> float:
        self.reads += 1
        if self.reads > self.budget:
            raise Spun(f"{self.reads} clock reads: the engine loops without progress")
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        if not self.frozen:
            self.t += s


def engine_of(m=None, clock=None, **kw) -> Engine:
    clock = clock or Clock()
    return Engine(m or looped(), **{"max_batch": 2, "max_len": 32, **kw}, clock=clock, sleep=clock.sleep)


# ------------------------------------------------------------------ refused at add()
@pytest.mark.parametrize("arrival", [NAN, INF, -INF, -1.0, True, "5"])
def test_add_refuses_an_arrival_that_never_comes(arrival):
    """arrival=nan was queued and never admitted (nan <= t is false) and run() spun for ever; ∞ never comes; the
    clock starts at 0, so a negative time is a mistake."""
    engine = engine_of()
    good = engine.add([1, 2, 3], 2, arrival=0.0)
    with pytest.raises(ValueError, match=re.escape(f"arrival={arrival!r} must be a finite time >= 0")):
        engine.add([4, 5], 2, arrival=arrival)
    assert engine.waiting == [good]
    assert engine.run() == [good] and len(good.tokens) == 2


@pytest.mark.parametrize("temperature", [NAN, INF, -1.0])
def test_sampling_refuses_a_non_finite_temperature(temperature):
    """Sampling(temperature=nan) passed `< 0` and sampled from nan probabilities: token 0 every time. Sampling itself
    refuses it, so neither generate() nor the engine ever sees it."""
    with pytest.raises(ValueError, match=re.escape(f"temperature={temperature!r} must be a finite number >= 0")):
        Sampling(temperature=temperature)
    assert Sampling(temperature=0.7).temperature == 0.7 and Sampling().greedy


@pytest.mark.parametrize("prompt,words", [
    (torch.tensor([[1, 2, 3]]), "prompt has shape (1, 3)"),  # was flattened into one prompt
    (torch.tensor([[1, 2], [3, 4]]), "prompt has shape (2, 2)"),  # two prompts were served as one
    (torch.tensor(5), "prompt has shape ()"),
    ([[1, 2], [3, 4]], "token ids must be integers (one request's prompt is 1-D)"),
])
def test_add_refuses_a_prompt_that_is_not_1d(prompt, words):
    engine = engine_of()
    with pytest.raises(ValueError, match=re.escape(words)):
        engine.add(prompt, 2)
    assert engine.idle()
    assert engine.add(torch.tensor([1, 2, 3]), 2).prompt.shape == (3,)


@pytest.mark.parametrize("n", [2.5, NAN, True, "3"])
def test_add_refuses_a_max_new_tokens_that_is_not_an_integer(n):
    """2.5 was truncated to 2, and nan slipped past `< 1` to fail inside int() with no name."""
    with pytest.raises(ValueError, match=re.escape(f"max_new_tokens={n!r} must be an integer >= 1")):
        engine_of().add([1, 2], n)


# ------------------------------------------------------------------ non-finite logits
@pytest.mark.parametrize("schedule", ["lockstep", "depthwise"])
def test_non_finite_weights_fail_every_request_with_the_reason(schedule):
    """A model with nan weights emitted token 0 (argmax of nan) for every request, with no error."""
    m = looped()
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(NAN)
    engine = engine_of(m, schedule=schedule)
    reqs = [engine.add([1, 2, 3], 4), engine.add([4, 5], 3), engine.add([6], 2)]
    out = engine.run()
    assert out == reqs
    assert all(r.error == "non-finite logits at token 0 (loop 3 of 3)" and r.tokens == [] for r in reqs)
    assert engine.stats["failed"] == 3 and engine.idle()


CASES = {
    "lockstep": (dict(), None, "lockstep"),
    "depthwise": (dict(), None, "depthwise"),
    "lockstep_gate_kv_copy": (dict(exit_gate="ouro"), ExitPolicy(threshold=0.5, skip="kv_copy"), "lockstep"),
    "depthwise_gate_kv_copy": (dict(exit_gate="ouro"), ExitPolicy(threshold=0.5, skip="kv_copy"), "depthwise"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_non_finite_logits_fail_one_request_and_the_others_go_on(case):
    """One request meets a token whose embedding is nan (an overflow on its path alone): it fails at that token with
    the reason and keeps its tokens before it; the others, sharing its batch, get what they get alone."""
    kw, exits, schedule = CASES[case]
    m = looped(**kw)
    g = torch.Generator().manual_seed(1)
    candidates = [torch.randint(1, V, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g) for _ in range(40)]
    alone = [generate(m, p[None], 6, exits=exits)[0, p.numel():].tolist() for p in candidates]
    # victim: its 3rd token (fed to make token 3) is one it has not seen before; the others never see that token
    victim = next(i for i, (p, t) in enumerate(zip(candidates, alone)) if t[2] not in t[:2] and t[2] not in p.tolist())
    poison = alone[victim][2]
    others = [i for i, (p, t) in enumerate(zip(candidates, alone))
              if i != victim and poison not in p.tolist() and poison not in t][:4]
    assert len(others) == 4
    m.embed.register_forward_hook(lambda mod, args, out: out.masked_fill((args[0] == poison)[..., None], NAN))

    engine = engine_of(m, max_batch=3, max_len=32, exits=exits, schedule=schedule)
    bad = engine.add(candidates[victim], 6)
    good = [engine.add(candidates[i], 6) for i in others]
    out = engine.run()
    assert out == [bad, *good]  # every request handed out once, the failed one among them
    assert re.fullmatch(r"non-finite logits at token 3 \(loop [123] of 3\)", bad.error), bad.error
    assert bad.tokens == alone[victim][:3] and not bad.cancelled
    assert all(r.error is None and r.tokens == alone[i] for r, i in zip(good, others))
    assert solo_agreement(m, good, exits=exits)["equal"] == 4
    assert engine.stats["failed"] == 1 and engine.stats["finished"] == 4


# ------------------------------------------------------------------ cancel
@pytest.mark.parametrize("schedule", ["lockstep", "depthwise"])
def test_cancel_a_waiting_and_a_running_request(schedule):
    """A waiting request leaves the queue at the next step and is never admitted; a running one leaves its row free at
    the next step boundary with the tokens it had, and the row serves the next request as if fresh."""
    m = looped()
    engine = engine_of(m, max_batch=1, schedule=schedule)
    a = engine.add([1, 2, 3], 8)
    b = engine.add([4, 5], 8)
    c = engine.add([6, 7, 8, 9], 5)
    engine.step()
    assert engine.cancel(b.id) is True and engine.cancel(b.id) is True  # asked twice: handed out once
    assert b in engine.waiting  # until the step boundary
    left = engine.step()
    assert left == [b] and b.cancelled and b.error == "cancelled" and b.row is None and b.admitted_at is None
    for _ in range(4):
        assert engine.step() == []
    had = list(a.tokens)
    assert 1 <= len(had) < 8
    assert engine.cancel(a.id) is True
    left = engine.step()  # a leaves before this step's admission: c takes its row in the same step
    assert left == [a] and a.cancelled and a.error == "cancelled" and a.tokens == had
    assert c.row == 0 and engine.running == [c]
    if schedule == "depthwise":  # a's in-flight token was dropped: only c's runs
        assert engine.depthwise.in_flight == [0] and engine.depthwise.loop[0] <= 1
    assert engine.run() == [c] and c.error is None and len(c.tokens) == 5
    assert solo_agreement(m, [c])["equal"] == 1  # the reused row held nothing of a
    assert engine.cancel(c.id) is False and engine.cancel(a.id) is False  # already left: nothing to cancel
    with pytest.raises(ValueError, match=re.escape("request_id=3 is unknown: this engine issued ids 0..2")):
        engine.cancel(3)
    with pytest.raises(ValueError, match=re.escape("request_id=-1 is unknown")):
        engine.cancel(-1)
    assert engine.stats["cancelled"] == 2 and engine.stats["finished"] == 1


def test_cancel_the_only_waiting_request_ends_run_without_waiting_for_it():
    """A cancelled request whose arrival is far away must not make run() sleep until then."""
    clock = Clock()
    engine = engine_of(clock=clock)
    late = engine.add([1, 2], 3, arrival=1e6)
    engine.cancel(late.id)
    assert engine.run() == [late] and late.cancelled and clock.slept == []


# ------------------------------------------------------------------ nothing kept
@pytest.mark.parametrize("schedule", ["lockstep", "depthwise"])
def test_the_engine_keeps_no_request_that_left(schedule):
    """engine.finished held every request for the engine's life (+2.3 MiB over 2,000 requests): over 200 requests,
    served closed-loop (six in the engine), the Request objects alive are exactly the engine's running and waiting
    ones, and none once all have left and the caller let go of them."""
    engine = engine_of(clock=Clock(budget=50_000), max_batch=4, schedule=schedule)
    alive: list[weakref.ref] = []
    g = torch.Generator().manual_seed(0)

    def top_up():
        while len(alive) < 200 and len(engine.waiting) + len(engine.running) < 6:
            p = torch.randint(1, V, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
            alive.append(weakref.ref(engine.add(p, int(torch.randint(1, 4, (1,), generator=g)))))

    top_up()
    most, left = 0, 0
    while not engine.idle():
        out = engine.step()
        left += len(out)
        del out  # the caller lets go of what it was handed
        n_alive = sum(r() is not None for r in alive)
        assert n_alive == len(engine.waiting) + len(engine.running)
        most = max(most, n_alive)
        top_up()
    assert len(alive) == 200 and left == 200 and engine.stats["finished"] == 200
    assert most <= 6 and sum(r() is not None for r in alive) == 0
    with pytest.raises(AttributeError, match="step\\(\\) returns the requests that left"):
        engine.finished  # noqa: B018


# ------------------------------------------------------------------ run() terminates
def test_run_waits_for_a_late_arrival_by_sleeping_once():
    """Nothing runs and the next request arrives at t = 1e6: run() sleeps until then (one sleep, no busy loop)."""
    clock = Clock()
    engine = engine_of(clock=clock)
    now = engine.add([1, 2, 3], 2)
    late = engine.add([4, 5], 2, arrival=1e6)
    assert engine.run() == [now, late] and len(late.tokens) == 2
    assert clock.slept == [1e6] and late.admitted_at == 1e6 and engine.stats["steps"] == 2


def test_run_max_wait_returns_instead_of_sleeping_until_a_far_arrival():
    clock = Clock()
    engine = engine_of(clock=clock)
    now = engine.add([1, 2, 3], 2)
    late = engine.add([4, 5], 2, arrival=1e6)
    assert engine.run(max_wait=60.0) == [now]
    assert engine.waiting == [late] and clock.slept == []
    clock.t = 1e6
    assert engine.run(max_wait=60.0) == [late]


def test_run_refuses_to_wait_on_a_clock_that_does_not_advance():
    """An injected clock that sleeping does not move: run() slept 5 s and looked again, for ever."""
    clock = Clock(frozen=True)
    engine = engine_of(clock=clock)
    now = engine.add([1, 2, 3], 2)
    late = engine.add([4, 5], 2, arrival=5.0)
    with pytest.raises(RuntimeError, match=re.escape("request 1 has arrival=5.0 but the engine clock stays at 0.0")):
        engine.run()
    assert len(now.tokens) == 2 and engine.waiting == [late] and clock.slept == [5.0]


def test_run_refuses_an_arrival_no_clock_reaches():
    """An arrival made nan after add() (add refuses nan): the request is never admitted, and run() looped on with
    nothing to do. Now a step with nothing run, admitted or left ends the run, naming the arrival."""
    clock = Clock()
    engine = engine_of(clock=clock)
    req = engine.add([1, 2], 2, arrival=1.0)
    req.arrival = NAN
    with pytest.raises(RuntimeError, match=re.escape("requests [0] wait with arrivals [nan]")):
        engine.run()
    assert clock.reads < 100
