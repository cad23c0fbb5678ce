"""Exit gate (docs/formulations.md#exit-gate): distribution, threshold rule, stage-1 and stage-2 objectives, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from looplab.models.exits import ExitPolicy
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exit_gate import (
    entropy,
    exit_distribution,
    stage1_loss,
    stage2_loss,
    stage2_targets,
    threshold_exit_steps,
)


def test_distribution_by_hand():
    lam = torch.tensor([0.2, 0.5, 0.25, 0.9])
    p = exit_distribution(lam)
    # p1 = .2; p2 = .5·.8 = .4; p3 = .25·.8·.5 = .1; p4 = S3 = .8·.5·.75 = .3 (λ_4 unused)
    torch.testing.assert_close(p, torch.tensor([0.2, 0.4, 0.1, 0.3]))
    assert exit_distribution(torch.tensor([0.7])).item() == 1.0


def test_distribution_sums_to_one_and_last_is_survival():
    lam = torch.rand(5, 7, 6)
    p = exit_distribution(lam)
    torch.testing.assert_close(p.sum(-1), torch.ones(5, 7))
    survival = torch.cumprod(1 - lam, -1)
    torch.testing.assert_close(p[..., -1], survival[..., -2])
    assert bool((p >= 0).all())


@pytest.mark.parametrize(
    "q, expected",
    [(0.0, 1), (0.2, 1), (0.21, 2), (0.6, 2), (0.65, 3), (0.7, 3), (0.71, 4), (1.0, 4), (1.5, 4)],
)
def test_threshold_picks_first_depth_with_cdf_at_least_q(q, expected):
    p = torch.tensor([[0.2, 0.4, 0.1, 0.3]])  # CDF .2 .6 .7 1.0
    assert threshold_exit_steps(p, q).item() == expected


def test_stage1_loss_by_hand_and_entropy_sign():
    losses = torch.tensor([[2.0, 1.0], [1.0, 3.0], [0.5, 0.5]])  # (R=3, N=2)
    p = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])  # (N, R)
    beta = 0.1
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    h1 = -(2 * 0.1 * math.log(0.1) + 0.8 * math.log(0.8))
    e0 = 0.5 * 2 + 0.25 * 1 + 0.25 * 0.5
    e1 = 0.1 * 1 + 0.1 * 3 + 0.8 * 0.5
    expected = ((e0 - beta * h0) + (e1 - beta * h1)) / 2
    assert stage1_loss(losses, p, beta).item() == pytest.approx(expected, rel=1e-6)
    # a higher-entropy distribution lowers the loss: the entropy term is a bonus, not a penalty
    assert entropy(torch.tensor([0.5, 0.5])) > entropy(torch.tensor([0.9, 0.1]))
    assert stage1_loss(losses, p, 1.0) < stage1_loss(losses, p, 0.0)
    # final_loop_weight w adds w·L^(R) per token (the deepest loop's loss at full weight)
    w = 0.7
    assert stage1_loss(losses, p, beta, w).item() == pytest.approx(expected + w * (0.5 + 0.5) / 2, rel=1e-6)


def test_final_loop_weight_gives_the_last_loop_gradient_the_gate_withholds():
    """A gate that has put all mass on loop 1 passes the deepest loop no gradient under Ouro's
    objective; with final_loop_weight it gets w times the plain loss's gradient."""
    losses = torch.tensor([[1.0], [2.0], [3.0]], requires_grad=True)  # (R=3, N=1)
    p = torch.tensor([[1.0, 0.0, 0.0]])
    stage1_loss(losses, p, 0.0).backward()
    assert losses.grad[-1].item() == 0.0
    losses.grad = None
    stage1_loss(losses, p, 0.0, final_loop_weight=2.0).backward()
    assert losses.grad[-1].item() == pytest.approx(2.0)


def test_stage2_targets_and_which_gate_decides_which_step():
    losses = torch.tensor([[2.0], [1.0], [0.998]])  # L1, L2, L3 for one token
    w = stage2_targets(losses, k=50, gamma=0.005)
    # I_2 = 1.0 → w_2 = σ(50·0.995); I_3 = 0.002 → w_3 = σ(50·(−0.003))
    torch.testing.assert_close(w, torch.tensor([[1 / (1 + math.exp(-50 * 0.995))], [1 / (1 + math.exp(-50 * (0.002 - 0.005)))]]))
    # the gate after loop t−1 (logit column t−2) is trained so that 1 − λ_{t−1} ≈ w_t; λ_R's column is never used
    gate_logits = torch.tensor([[0.3, -1.2, 7.0]])  # (N=1, R=3)
    expected = (F.binary_cross_entropy(torch.sigmoid(torch.tensor(-0.3)), w[0, 0])
                + F.binary_cross_entropy(torch.sigmoid(torch.tensor(1.2)), w[1, 0])) / 2
    assert stage2_loss(losses, gate_logits).item() == pytest.approx(expected.item(), rel=1e-5)
    changed = gate_logits.clone()
    changed[0, 2] = -50.0
    assert stage2_loss(losses, changed).item() == pytest.approx(expected.item(), rel=1e-5)
    # improvement is clamped at zero: a worse deeper loop asks to stop
    assert stage2_targets(torch.tensor([[1.0], [2.0]])).item() == pytest.approx(1 / (1 + math.exp(50 * 0.005)))


def test_model_exit_outputs():
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=23, d_model=32, n_heads=4, n_layers=1, n_loops=4, exit_gate="ouro"))
    ids = torch.randint(0, 23, (2, 6))
    out = model(ids, return_all_loops=True)
    assert out.exit_probs.shape == (2, 6, 4)
    torch.testing.assert_close(out.exit_probs.sum(-1), torch.ones(2, 6))
    for q in (0.0, 0.5, 1.01):
        o = model(ids, exits=ExitPolicy(threshold=q))
        assert o.exit_steps.shape == (2, 6)
        torch.testing.assert_close(o.exit_steps, threshold_exit_steps(out.exit_probs, q))
        picked = out.loop_logits.permute(1, 2, 0, 3)[torch.arange(2)[:, None], torch.arange(6)[None], o.exit_steps - 1]
        torch.testing.assert_close(o.logits, picked)
    assert bool((model(ids, exits=ExitPolicy(threshold=0.0)).exit_steps == 1).all())
    assert bool((model(ids, exits=ExitPolicy(threshold=1.01)).exit_steps == 4).all())
    torch.testing.assert_close(model(ids, exits=ExitPolicy(at_step=2)).logits, out.loop_logits[1])
    expected = torch.einsum("btr,rbtv->btv", out.exit_probs, out.loop_logits)
    torch.testing.assert_close(model(ids, exits=ExitPolicy(expected=True)).logits, expected)
    with pytest.raises(ValueError, match="exit_at_step"):
        model(ids, exits=ExitPolicy(at_step=5))
    with pytest.raises(ValueError, match="exit gate"):
        LoopedLM(LoopedLMConfig(vocab_size=23, d_model=32, n_heads=4))(ids, exits=ExitPolicy(threshold=0.5))
