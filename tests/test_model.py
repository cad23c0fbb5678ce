"""LoopedLM (llama backbone): shapes, looping semantics, init, config errors, FLOP count."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from looplab.models import ConfigError, LoopedLM, LoopedLMConfig


def tiny(**kw) -> LoopedLMConfig:
    base = dict(vocab_size=37, d_model=32, n_heads=4, n_layers=2, n_loops=3, ffn_hidden=64, max_seq_len=64)
    base.update(kw)
    return LoopedLMConfig(**base)


def test_shapes_and_all_loops():
    torch.manual_seed(0)
    model = LoopedLM(tiny())
    ids = torch.randint(0, 37, (2, 11))
    out = model(ids, return_all_loops=True)
    assert out.logits.shape == (2, 11, 37)
    assert out.loop_logits.shape == (3, 2, 11, 37)
    assert out.loop_hidden.shape == (3, 2, 11, 32)
    assert out.exit_probs is None
    # the last loop's logits are the model's logits, and equal the plain forward
    torch.testing.assert_close(out.loop_logits[-1], out.logits)
    torch.testing.assert_close(model(ids).logits, out.logits)


def test_looping_applies_the_same_block_r_times():
    """An N⊗R model equals its block applied by hand R times (shared weights, x_{r+1} = h_r)."""
    torch.manual_seed(0)
    model = LoopedLM(tiny(n_loops=4))
    ids = torch.randint(0, 37, (2, 9))
    pos = torch.arange(9)[None]
    x = model.embed(ids)
    per_loop = []
    for _ in range(4):
        for layer in model.block:
            x = layer(x, pos)
        per_loop.append(model.head(model.final_norm(x)))
    out = model(ids, return_all_loops=True)
    for r in range(4):
        torch.testing.assert_close(out.loop_logits[r], per_loop[r])
    # a 2⊗3 model has the parameters of a 2⊗1 model: looping adds depth, not weights
    assert LoopedLM(tiny(n_loops=3)).num_parameters()["total"] == LoopedLM(tiny(n_loops=1)).num_parameters()["total"]


def test_causal():
    torch.manual_seed(0)
    model = LoopedLM(tiny(n_kv_heads=2))
    ids = torch.randint(0, 37, (1, 12))
    ids2 = ids.clone()
    ids2[0, 8:] = (ids2[0, 8:] + 5) % 37
    a, b = model(ids).logits, model(ids2).logits
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_left_padding_matches_unpadded():
    torch.manual_seed(0)
    model = LoopedLM(tiny())
    ids = torch.randint(1, 37, (1, 7))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 7)], 1)
    torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, 3:], model(ids).logits, rtol=1e-5, atol=1e-5)


def test_init_std_and_residual_scaling():
    torch.manual_seed(0)
    cfg = tiny(d_model=256, n_heads=4, ffn_hidden=512, n_layers=2, n_loops=8)
    model = LoopedLM(cfg)
    std = math.sqrt(2 / (5 * 256))
    qkv = model.block[0].attn.qkv_proj.weight
    out = model.block[0].attn.out_proj.weight
    # truncated at 2σ, so the empirical std is ≈ 0.88σ
    assert abs(qkv.std().item() / std - 0.88) < 0.05
    assert abs(out.std().item() / (std / math.sqrt(2 * 2 * 8)) - 0.88) < 0.05
    assert qkv.abs().max() <= 2 * std + 1e-6


def test_tied_embeddings_and_gqa():
    model = LoopedLM(tiny(tie_embeddings=True, n_kv_heads=1))
    assert model.head.weight is model.embed.weight
    assert model.block[0].attn.qkv_proj.weight.shape[0] == (4 + 2) * 8
    model(torch.randint(0, 37, (2, 5))).logits.sum().backward()


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(d_model=30, n_heads=4), "n_heads"),
        (dict(n_loops=0), "n_loops"),
        (dict(n_layers=0), "n_layers"),
        (dict(backbone="transformer"), "backbone"),
        (dict(state_mode="carry"), "state_mode"),
        (dict(exit_gate="act"), "exit_gate"),
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(vocab_size=-1), "vocab_size"),
    ],
)
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        tiny(**kw)


@pytest.mark.parametrize("n_layers,n_loops,T", [(1, 1, 16), (2, 3, 24), (1, 4, 8)])
def test_flops_match_flop_counter(n_layers, n_loops, T):
    """Analytic FLOPs/token counting loops equal torch's FlopCounterMode on a real forward."""
    model = LoopedLM(tiny(n_layers=n_layers, n_loops=n_loops))
    ids = torch.randint(0, 37, (2, T))
    counter = FlopCounterMode(display=False)
    # the math backend runs attention as counted bmm's (the fused CPU kernel has no FLOP formula)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(ids)
    measured = counter.get_total_flops() / (2 * T)
    assert measured == pytest.approx(model.flops_per_token(T), rel=0.01)
    # looping multiplies the block's FLOPs, not its parameters
    assert model.flops_per_token(T, training=True) == 3 * model.flops_per_token(T)
