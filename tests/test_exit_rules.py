"""Exit rules (models/exit_rules.py): each rule's decision on hand-built loop outputs at known
thresholds, and `model(ids, exits=ExitPolicy(threshold=..., rule=...))` reading logits at those depths."""

from __future__ import annotations

import math

import pytest
import torch

from looplab.models.exits import ExitPolicy
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exit_gate import logits_at_depth, threshold_exit_steps
from looplab.models.exit_rules import first_exit


def _logits(*rows):
    """Loop logits (R, B=1, T=1, V) from one probability row per loop."""
    return torch.tensor(rows, dtype=torch.float64).log()[:, None, None, :]


def test_entropy_stops_at_the_first_confident_loop():
    lg = _logits([0.25] * 4, [0.7, 0.1, 0.1, 0.1], [0.97, 0.01, 0.01, 0.01])
    h2 = -(0.7 * math.log(0.7) + 3 * 0.1 * math.log(0.1))  # 0.940 nats; loop 1: log 4 = 1.386
    assert first_exit("entropy", h2 + 1e-6, 3, logits=lg).item() == 2
    assert first_exit("entropy", h2 - 1e-6, 3, logits=lg).item() == 3  # loop 3 is below, but R is where it ends anyway
    assert first_exit("entropy", math.log(4) + 1e-6, 3, logits=lg).item() == 1
    assert first_exit("entropy", math.log(4) + 1e-6, 3, logits=lg, min_loops=2).item() == 2
    assert first_exit("entropy", 0.0, 3, logits=lg).item() == 3  # a threshold that never fires: all loops


def test_kl_compares_successive_loops():
    p1, p2 = [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]
    lg = _logits(p1, p2, p2, p2)
    kl21 = sum(a * math.log(a / b) for a, b in zip(p2, p1))  # KL(p2 ‖ p1) = 0.456
    assert first_exit("kl", 1e-9, 4, logits=lg).item() == 3  # loop 3 repeats loop 2: KL 0
    assert first_exit("kl", kl21 + 1e-6, 4, logits=lg).item() == 2
    assert first_exit("kl", kl21 - 1e-6, 4, logits=lg).item() == 3
    assert first_exit("kl", 1e9, 4, logits=lg).item() == 2  # never at loop 1: nothing to compare with


def test_hidden_delta_is_the_relative_change_of_the_readout():
    h = torch.tensor([[3.0, 4.0], [3.0, 4.5], [3.0, 4.6], [3.0, 4.6]])[:, None, None, :]  # (R, 1, 1, d)
    d2 = 0.5 / math.hypot(3.0, 4.5)  # 0.0925
    d3 = 0.1 / math.hypot(3.0, 4.6)  # 0.0182
    assert first_exit("hidden_delta", d2 + 1e-6, 4, hidden=h).item() == 2
    assert first_exit("hidden_delta", (d2 + d3) / 2, 4, hidden=h).item() == 3
    assert first_exit("hidden_delta", d3 / 2, 4, hidden=h).item() == 4  # loop 4 repeats 3: delta 0 < d3/2, and R anyway
    assert first_exit("hidden_delta", 0.0, 4, hidden=h).item() == 4


def test_argmax_stable_counts_loops_without_a_change():
    a, b = [0.6, 0.2, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1]
    lg = _logits(a, b, b, b, b)
    assert first_exit("argmax_stable", 1, 5, logits=lg).item() == 3  # loops 2, 3 agree
    assert first_exit("argmax_stable", 2, 5, logits=lg).item() == 4  # loops 2, 3, 4 agree
    assert first_exit("argmax_stable", 9, 5, logits=lg).item() == 5
    with pytest.raises(ValueError, match="1.5"):
        first_exit("argmax_stable", 1.5, 5, logits=lg)


def test_gate_rule_is_the_ouro_threshold():
    p = torch.softmax(torch.randn(3, 7, 4, generator=torch.Generator().manual_seed(0)), -1)  # (B, T, R)
    for q in (0.1, 0.3, 0.5, 0.9, 1.01):
        assert torch.equal(first_exit("gate", q, 4, exit_probs=p), threshold_exit_steps(p, q))


def test_bad_rules_name_the_value():
    lg = _logits([0.5, 0.5], [0.5, 0.5])
    with pytest.raises(ValueError, match="'confidence'"):
        first_exit("confidence", 0.1, 2, logits=lg)
    with pytest.raises(ValueError, match="-0.5"):
        first_exit("entropy", -0.5, 2, logits=lg)
    with pytest.raises(ValueError, match="exit_min_loops=3"):
        first_exit("entropy", 0.5, 2, logits=lg, min_loops=3)


@pytest.mark.parametrize("backbone, state_mode", [("llama", "vanilla"), ("llama", "stateloop"), ("hybrid", "vanilla")])
@pytest.mark.parametrize("rule, threshold", [("kl", 0.05), ("entropy", 3.0), ("hidden_delta", 0.3), ("argmax_stable", 1)])
def test_model_reads_each_token_at_its_rules_depth(backbone, state_mode, rule, threshold):
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=32, d_model=32, n_heads=4, n_layers=1, n_loops=4, ffn_hidden=64,
                                    d_state=8, headdim=16, hybrid_pattern="A", backbone=backbone, state_mode=state_mode,
                                    max_seq_len=32)).eval()
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, return_all_loops=True)
        out = model(ids, exits=ExitPolicy(threshold=threshold, rule=rule, min_loops=2))
    steps = first_exit(rule, threshold, 4, min_loops=2, logits=full.loop_logits, hidden=full.loop_hidden)
    assert torch.equal(out.exit_steps, steps) and int(steps.min()) >= 2
    torch.testing.assert_close(out.logits, logits_at_depth(full.loop_logits, steps), rtol=0, atol=0)
    with torch.no_grad():  # a threshold that never fires reads every token at R: the plain forward pass
        never = model(ids, exits=ExitPolicy(threshold=0.0 if rule != "argmax_stable" else 99, rule=rule))
    assert bool((never.exit_steps == 4).all())
    torch.testing.assert_close(never.logits, full.logits, rtol=0, atol=0)


def test_gate_rule_without_a_gate_and_rule_without_threshold_are_refused():
    model = LoopedLM(LoopedLMConfig(vocab_size=16, d_model=16, n_heads=2, n_layers=1, n_loops=2, max_seq_len=8)).eval()
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="exit gate"):
        model(ids, exits=ExitPolicy(threshold=0.5))
    with pytest.raises(ValueError, match="needs exit_threshold"):
        model(ids, exits=ExitPolicy(rule="kl"))


def test_forward_reads_depths_through_an_exit_policy():
    """ExitPolicy.from_kwargs (the flat keys of the CLIs and the lm-eval adapter) builds the policy the grouped
    form gives; forward takes no flat exit keywords, and a misspelt keyword is refused by name."""
    from looplab.models import ExitPolicy

    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=1, n_loops=3, exit_gate="ouro")).eval()
    ids = torch.randint(0, 32, (2, 6))
    for policy, legacy in [(ExitPolicy(threshold=0.5), dict(exit_threshold=0.5)),
                           (ExitPolicy(threshold=0.1, rule="entropy", min_loops=2),
                            dict(exit_threshold=0.1, exit_rule="entropy", exit_min_loops=2)),
                           (ExitPolicy(at_step=2), dict(exit_at_step=2)),
                           (ExitPolicy(expected=True), dict(expected_exit=True)),
                           (ExitPolicy(skip="kv_copy", steps=torch.full((2, 6), 2)),
                            dict(skip_compute="kv_copy", exit_steps=torch.full((2, 6), 2)))]:
        a, b = model(ids, exits=policy), model(ids, exits=ExitPolicy.from_kwargs(**legacy))
        assert torch.equal(a.logits, b.logits)
        assert (a.exit_steps is None) == (b.exit_steps is None) and (a.exit_steps is None or torch.equal(a.exit_steps, b.exit_steps))
    assert torch.equal(model(ids).logits, model(ids, exits=None).logits)
    assert ExitPolicy.from_kwargs() is None
    with pytest.raises(TypeError, match="exit_threshold"):
        model(ids, exit_threshold=0.5)
    with pytest.raises(TypeError, match="exit_treshold"):
        model(ids, exit_treshold=0.5)
    with pytest.raises(ValueError, match="needs exit_threshold"):
        ExitPolicy(rule="kl")
    with pytest.raises(ValueError, match="needs skip_compute"):
        ExitPolicy(steps=torch.ones(2, 6, dtype=torch.long))
