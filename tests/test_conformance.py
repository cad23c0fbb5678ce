"""Every built-in variant through the conformance kit (looplab.testing.conformance; docs/extending.md#the-conformance-kit).

The variants come from the registries (models/registry.py), so a variant added to looplab is checked here with
nothing edited, exactly as a researcher's own variant is checked by the same kit: cached decoding against full
forwards in left-padded batches, prefill, test-time depth, every applicable skip handling against its reference,
speculation, both serving schedules, checkpoints, the export, compile, parallel loops and routing — or, for what
a variant declares unsupported, the refusal naming it.
"""

from __future__ import annotations

import pytest

from looplab.testing.conformance import builtin_variants, checks, parametrize_checks

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


@parametrize_checks(*builtin_variants())
def test_builtin_variant_conforms(check):
    check()


def test_every_registered_axis_has_builtins_and_every_check_is_generated():
    variants = builtin_variants()
    axes = {a for a, _ in variants}
    assert axes == {"backbone", "layer", "state_update", "state_mixer", "exit_gate", "injection", "exit_rule",
                    "handling", "depth_router", "loop_schedule"}
    names = {c.check.split(":")[0] for a, n in variants for c in checks(a, n)}
    assert names >= {"init_equivalence", "cached_decoding", "prefill", "test_time_depth", "skip", "speculation",
                     "serving", "checkpoint", "export", "compile", "parallel_loops", "routing"}
