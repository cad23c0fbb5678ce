"""The FLOP count MFU divides by counts causal attention as causal (models/flops.py), checked against an independent
count: `torch.utils.flop_counter.FlopCounterMode` over a forward with SDPA's math backend, whose attention is two
batched matmuls (scores QKᵀ, then A·V) over all T² query-key pairs, the other matmuls being plain `mm`s. A causal
mask keeps T(T + 1)/2 of the T² pairs, so the causal count is

    Σ mm FLOPs + Σ bmm FLOPs · (T + 1) / (2T)        (forward, per call of B·T tokens)

and per token 2·(matmul weights) + 4·H·hd·(T + 1)/2 per attention layer and loop. Training: 3 × the forward."""

from __future__ import annotations

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.flops import causal_flops_per_token, causal_training_flops
from looplab.training.depth import DepthSampler

pytestmark = pytest.mark.usefixtures("one_thread_module")


def counted(model, B: int, T: int) -> tuple[float, float]:
    """(matmul FLOPs outside attention, attention FLOPs over all T² pairs) of one forward, per token."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    ops = torch.ops.aten
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)))
    flops = counter.get_flop_counts()["Global"]
    assert set(flops) <= {ops.mm, ops.addmm, ops.bmm}, flops
    attention = flops.get(ops.bmm, 0)
    return (sum(flops.values()) - attention) / (B * T), attention / (B * T)


@pytest.mark.parametrize("T", [7, 16])
def test_causal_count_equals_flop_counter_with_attention_made_causal(T):
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=40, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, n_layers=2,
                                    n_loops=3, prelude_layers=1, coda_layers=1, max_seq_len=16)).eval()
    rest, attention = counted(model, 2, T)
    assert attention > 0
    assert model.flops_per_token(T) == rest + attention  # every key: FlopCounterMode's convention, unchanged
    assert causal_flops_per_token(model, T) == rest + attention * (T + 1) / (2 * T)
    H, hd, calls = 4, 8, 1 + 2 * 3 + 1  # prelude, N·R block layers, coda
    assert attention * (T + 1) / (2 * T) == calls * 4 * H * hd * (T + 1) / 2
    assert causal_flops_per_token(model, T, training=True) == 3 * causal_flops_per_token(model, T)


def test_the_stateloop_attention_mixer_is_counted_causally_too():
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=40, d_model=32, n_heads=4, ffn_hidden=48, n_layers=1, n_loops=2,
                                    state_mode="stateloop", state_mixer="attn", max_seq_len=16)).eval()
    T = 12
    _, attention = counted(model, 2, T)  # block and mixer attention, 2 loops each
    assert model.flops_per_token(T) - causal_flops_per_token(model, T) == pytest.approx(attention * (T - 1) / (2 * T))


def test_training_flops_follow_the_depth_sampler_and_truncation():
    model = LoopedLM(LoopedLMConfig(vocab_size=40, d_model=32, n_heads=4, ffn_hidden=48, n_layers=2, n_loops=4,
                                    max_seq_len=16))
    depth = DepthSampler(loops=4, backprop_loops=2)
    fwd, train = causal_training_flops(model, depth, 16)
    assert fwd == causal_flops_per_token(model, 16) and fwd < model.flops_per_token(16)
    assert train == causal_flops_per_token(model, 16, training=True, backprop_loops=2) < 3 * fwd
    from looplab.train import analytic_flops

    assert analytic_flops(model, depth, 16, causal=True) == (fwd, train)
    assert analytic_flops(model, depth, 16) == (model.flops_per_token(16),
                                                model.flops_per_token(16, training=True, backprop_loops=2))
