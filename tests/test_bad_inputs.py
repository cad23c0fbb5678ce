"""Bad token ids and masks are refused naming the value, in forward, generate and the serving engine; a request
that fails in the engine fails alone (the others get the tokens they would get without it)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig, Sampling
from looplab.models.generation import generate
from looplab.serve import Engine, solo_agreement

V = 50
pytestmark = pytest.mark.usefixtures("one_thread_module")


def model():
    torch.manual_seed(0)
    return LoopedLM(LoopedLMConfig(vocab_size=V, d_model=32, n_heads=4, n_layers=1, n_loops=2, max_seq_len=64)).eval()


@pytest.mark.parametrize("ids, mask, words", [
    (torch.randint(0, V, (2, 35)), torch.ones(2, 36, dtype=torch.long), r"attention_mask has shape \(2, 36\) but input_ids has shape \(2, 35\)"),
    (torch.tensor([[1, 2, V]]), None, f"token id {V} outside the vocabulary \\[0, {V}\\)"),
    (torch.tensor([[1, -3, 2]]), None, r"token id -3 outside the vocabulary"),
    (torch.tensor([[1.0, 2.0]]), None, r"dtype=torch.float32: token ids must be integers"),
    (torch.tensor([1, 2, 3]), None, r"input_ids has shape \(3,\)"),
])
def test_forward_and_generate_refuse_bad_inputs_naming_the_value(ids, mask, words):
    m = model()
    with pytest.raises(ValueError, match=words):
        m(ids, attention_mask=mask)
    if ids.dim() == 2:
        with pytest.raises(ValueError, match=words):
            generate(m, ids, 2, attention_mask=mask)


def test_engine_refuses_a_bad_request_at_add_and_serves_the_others():
    m = model()
    engine = Engine(m, max_batch=2, max_len=32)
    good = [engine.add([1, 2, 3], 4), engine.add([4, 5], 3)]
    for prompt, words in (([1, V + 7], f"token id {V + 7} outside the vocabulary"), ([-1, 2], "token id -1"),
                          (torch.tensor([1.5, 2.0]), "dtype=torch.float32"), ([1, 2.5], "must be integers")):
        with pytest.raises(ValueError, match=words):
            engine.add(prompt, 3)
    finished = engine.run()
    assert finished == good and all(r.error is None for r in finished)
    assert solo_agreement(m, finished)["equal"] == 2


@dataclass(frozen=True)
class FailsAfter(Sampling):
    """A sampling rule of one request that raises on its 3rd draw (a request's own work failing mid-run)."""

    calls: list = None

    def sample(self, logits):
        self.calls.append(1)
        if len(self.calls) == 3:
            raise RuntimeError("this request's sampler broke")
        return super().sample(logits)


@pytest.mark.parametrize("schedule", ["lockstep", "depthwise"])
def test_a_request_that_fails_mid_run_fails_alone(schedule):
    m = model()
    engine = Engine(m, max_batch=2, max_len=32, schedule=schedule)
    a = engine.add([1, 2, 3], 6)
    bad = engine.add([7, 8], 6, sampling=FailsAfter(temperature=1.0, calls=[]), seed=3)
    b = engine.add([9, 10, 11, 12], 5)  # waits for a free row: it takes the failed request's row
    finished = engine.run()
    assert bad.error == "RuntimeError: this request's sampler broke" and len(bad.tokens) == 2
    assert a.error is None and b.error is None and len(a.tokens) == 6 and len(b.tokens) == 5
    assert finished == [a, bad, b]
    assert solo_agreement(m, [a, b])["equal"] == 2  # the others got what they get alone
