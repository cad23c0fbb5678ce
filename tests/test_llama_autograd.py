"""llama.py's hand-written CPU backward passes (RMSNorm, RoPE, silu·up) equal autograd's."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from looplab.models import llama
from looplab.models.config import LoopedLMConfig


def test_hand_backward_gradcheck_double():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.double, requires_grad=True)
    w = torch.randn(8, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: llama._RMSNormFn.apply(x, w, 1e-5), (x, w))
    gu = torch.randn(2, 5, 8, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(llama._SiluMulFn.apply, (gu,))
    cos, sin = torch.randn(1, 1, 5, 4, dtype=torch.double), torch.randn(1, 1, 5, 4, dtype=torch.double)
    q = torch.randn(2, 5, 3, 8, dtype=torch.double).transpose(1, 2).requires_grad_()  # strided, as from qkv
    assert torch.autograd.gradcheck(lambda q: llama._RoPEFn.apply(q, cos, sin), (q,))


def _reference_layer_forward(layer, x, positions):
    """The same layer computed with plain autograd ops (the pre-optimisation formulas)."""
    a = layer.attn
    B, T, _ = x.shape
    H, Hkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    h = F.rms_norm(x, (x.shape[-1],), layer.attn_norm.weight, layer.attn_norm.eps)
    q, k, v = a.qkv_proj(h).split((H * hd, Hkv * hd, Hkv * hd), dim=-1)
    q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
    cos, sin = a.rope(positions)

    def rope(t):
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)

    y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=Hkv != H)
    x = x + a.out_proj(y.transpose(1, 2).reshape(B, T, H * hd))
    h = F.rms_norm(x, (x.shape[-1],), layer.mlp_norm.weight, layer.mlp_norm.eps)
    gate, up = layer.mlp.gate_up_proj(h).chunk(2, dim=-1)
    return x + layer.mlp.down_proj(F.silu(gate) * up)


def test_layer_matches_plain_autograd():
    torch.manual_seed(0)
    cfg = LoopedLMConfig(vocab_size=32, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=32)
    layer = llama.AttentionLayer(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 16, 64, requires_grad=True)
    pos = torch.arange(16)[None]
    params = [x, *layer.parameters()]
    y = layer(x, pos)
    g = torch.autograd.grad(y.pow(2).sum(), params)
    y_ref = _reference_layer_forward(layer, x, pos)
    g_ref = torch.autograd.grad(y_ref.pow(2).sum(), params)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _tiny_looped(seed: int = 0, backbone: str = "llama"):
    from looplab.models import LoopedLM

    torch.manual_seed(seed)
    extra = dict(backbone="hybrid", hybrid_pattern="MA", d_state=8, headdim=8, chunk_size=4, kernel="torch") \
        if backbone == "hybrid" else {}
    cfg = LoopedLMConfig(vocab_size=48, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, n_layers=2, n_loops=3,
                         max_seq_len=16, **extra)
    return LoopedLM(cfg)


def test_compiled_layer_is_one_graph():
    """`compile=true` compiles each block layer once: the hand-written CPU autograd steps aside
    under torch.compile, so the whole layer is one graph that inductor can fuse (a graph break
    per custom Function cost 7 graphs per layer and most of compile's gain)."""
    import torch._dynamo

    model = _tiny_looped()
    x = torch.randn(2, 8, 32)
    pos = torch.arange(8)[None]
    torch._dynamo.reset()
    info = torch._dynamo.explain(model.block[0])(x, pos)
    assert info.graph_count == 1 and info.graph_break_count == 0, info.break_reasons


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on CPU needs a C++ compiler (inductor)")
@pytest.mark.parametrize("backbone", ["llama", "hybrid"])  # hybrid: a Mamba-2 and an attention layer
def test_compiled_model_matches_eager(backbone):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager, compiled = _tiny_looped(backbone=backbone), _tiny_looped(backbone=backbone)
    compiled.compile_block(dynamic=False)
    assert compiled.is_compiled and not eager.is_compiled
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (eager, compiled):
        logits = m(ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        outs.append((logits, {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    for n, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][n], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    assert set(compiled.state_dict()) == set(eager.state_dict())  # checkpoints keep their keys

    # evaluation and cached decoding stay eager: no new compilation for their changing shapes
    frames = counters["stats"]["unique_graphs"]
    assert frames >= 1  # the training forward above did run compiled
    compiled.eval()
    with torch.no_grad():
        cache = compiled.allocate_cache(2, 16)
        for t in range(3):
            step = compiled(ids[:, t : t + 1], cache=cache).logits
        full = compiled(ids[:, :3]).logits
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == frames


@pytest.mark.parametrize(
    ("value", "d_model", "accelerator", "expected"),
    [(True, 64, "cpu", True), (False, 1024, "cpu", False), ("auto", 64, "cpu", False),
     ("auto", 1024, "gpu", True), ("auto", 64, "cuda", True), ("auto", 1024, "mps", False),
     ("auto", 512, "cpu", shutil.which("c++") or shutil.which("g++"))],
)
def test_resolve_compile(value, d_model, accelerator, expected):
    from looplab.training.run_utils import resolve_compile

    on, why = resolve_compile(value, d_model, accelerator)
    assert on == bool(expected) and why.startswith("compile=")


def test_resolve_compile_rejects_unknown_value():
    from looplab.models.config import ConfigError
    from looplab.training.run_utils import resolve_compile

    with pytest.raises(ConfigError, match="compile='fast'"):
        resolve_compile("fast", 512, "cpu")
