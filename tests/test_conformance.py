"""Every built-in variant through the conformance kit (looplab.testing.conformance; docs/extending.md#the-conformance-kit).

The variants come from the registries (models/registry.py), so a variant added to looplab is checked here with
nothing edited, exactly as a researcher's own variant is checked by the same kit: cached decoding against full
forwards in left-padded batches, prefill, test-time depth, every applicable skip handling against its reference,
speculation, both serving schedules, checkpoints, the export, compile, parallel loops and routing — or, for what
a variant declares unsupported, the refusal naming it.
"""

from __future__ import annotations

import pytest

from looplab.models.exit_rules import ExitRule
from looplab.models.registry import EXIT_RULES, STATE_UPDATES
from looplab.models.state import SelectiveState
from looplab.testing.conformance import builtin_variants, checks, parametrize_checks

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


@parametrize_checks(*builtin_variants())
def test_builtin_variant_conforms(check):
    verified = check()  # the kit's own comparisons (logits, tokens, refusals) raise on a variant that does not conform
    assert verified > 0, f"{check!r} passed without comparing or refusing anything"


def register_for_this_test(monkeypatch, registry, name: str, cls) -> None:
    """Register `cls` as `name` until the test ends (modules collected after this one build their parameter lists
    from the registry, so it must not stay)."""
    monkeypatch.setattr(registry, "_classes", dict(registry._classes))
    monkeypatch.setattr(registry, "_order", list(registry._order))
    registry.register(name)(cls)


class LeaksTheFuture(SelectiveState):
    """A broken update: each token's state reads the mean of the whole sequence, which a full forward sees and a
    cached step (one token) does not."""

    def update(self, h, s_prev):
        return super().update(h + h.mean(dim=-2, keepdim=True), s_prev)


def test_the_kit_fails_a_variant_whose_cached_decoding_differs(monkeypatch):
    register_for_this_test(monkeypatch, STATE_UPDATES, "conformance_test.leaks_the_future", LeaksTheFuture)
    found = checks("state_update", "conformance_test.leaks_the_future", only=("cached_decoding",))
    assert found
    for check in found:
        with pytest.raises(AssertionError, match="not close") as err:
            check()
        # the failure names the contract and where to look, not only torch's "Tensor-likes are not close!"
        assert "broke the contract 'decoding from the caches equals full forwards" in str(err.value)
        assert "look at the variant's cached path" in str(err.value)


class PeeksAtTheLastLoop(ExitRule):
    """A broken rule (the one a researcher wrote): it stops when the readout barely moves, but compares loop t − 1
    with the last loop run, inputs[-1], instead of loop t, inputs[t - 1]. In a forward every loop has run, so it looks
    ahead in depth; in decoding with skipped loops it cannot, and the two disagree."""

    reads = "hidden"
    example_thresholds = (0.5, 1.0)

    @classmethod
    def stops(cls, t, threshold, inputs):
        if t < 2:
            return cls.never(inputs)
        return (inputs[-1] - inputs[t - 2]).norm(dim=-1) / inputs[t - 2].norm(dim=-1) < threshold


def test_the_kit_fails_an_exit_rule_that_looks_ahead(monkeypatch):
    register_for_this_test(monkeypatch, EXIT_RULES, "conformance_test.peeks_at_the_last_loop", PeeksAtTheLastLoop)
    found = checks("exit_rule", "conformance_test.peeks_at_the_last_loop", only=("no_look_ahead",))
    assert found
    with pytest.raises(AssertionError) as err:
        found[0]()
    msg = str(err.value)
    assert "broke the contract 'an exit rule decides after loop t from loops 1..t only'" in msg, msg
    assert "PeeksAtTheLastLoop.stops(t, threshold, inputs) read loops 1..t only" in msg, msg
    # the same rule reading loop t passes
    monkeypatch.setattr(PeeksAtTheLastLoop, "stops", classmethod(
        lambda cls, t, q, x: cls.never(x) if t < 2 else (x[t - 1] - x[t - 2]).norm(dim=-1) / x[t - 2].norm(dim=-1) < q))
    assert found[0]() > 0


def test_a_check_that_compares_nothing_reports_zero():
    """What makes test_builtin_variant_conforms fail on a check that returns early: it verified nothing."""
    from dataclasses import replace

    real = checks("injection", "add", only=("cached_decoding",))[0]
    assert real() > 0
    assert replace(real, fn=lambda ctx, variant: None)() == 0


def test_every_registered_axis_has_builtins_and_every_check_is_generated():
    variants = builtin_variants()
    axes = {a for a, _ in variants}
    assert axes == {"backbone", "layer", "state_update", "state_mixer", "exit_gate", "injection", "exit_rule",
                    "handling", "depth_router", "loop_schedule"}
    names = {c.check.split(":")[0] for a, n in variants for c in checks(a, n)}
    assert names >= {"init_equivalence", "cached_decoding", "prefill", "test_time_depth", "skip", "speculation",
                     "serving", "checkpoint", "export", "compile", "parallel_loops", "routing"}
