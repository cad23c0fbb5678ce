"""Mamba-2 backbone: chunked SSD vs. an independent recurrence, cached decoding, padding,
causality, gradients, LoopedLM integration, and the fused-path plumbing with stand-in kernels.
Parity with mamba_ssm's kernels themselves (GPU): tests/test_mamba2_kernels.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.mamba2 import Mamba2Layer, Mamba2Mixer, causal_conv_silu
from looplab.models.ops.ssd import ssd_chunked, ssd_reference, ssd_step


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are small: a second OpenMP thread only adds spin-waits, which on a loaded
    2-core machine made the training test 30x slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def naive_recurrence(x, dt, A, B, C, D, state):
    """Written independently of ops.ssd: h ← exp(dt·A)·h + dt·x⊗B, y = h·C + D·x, one token at a time."""
    b, L, h, p = x.shape
    g = B.shape[2]
    ys = []
    for t in range(L):
        for head in range(h):
            grp = head // (h // g)
            decay = torch.exp(dt[:, t, head] * A[head])  # (b,)
            state[:, head] = decay[:, None, None] * state[:, head] + dt[:, t, head, None, None] * torch.einsum(
                "bp,bn->bpn", x[:, t, head], B[:, t, grp]
            )
        y = torch.stack([torch.einsum("bpn,bn->bp", state[:, hd], C[:, t, hd // (h // g)]) for hd in range(h)], 1)
        ys.append(y + D[:, None] * x[:, t])
    return torch.stack(ys, 1), state


def random_ssm(b=2, L=13, h=4, p=8, g=1, n=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, L, h, p, generator=gen)
    dt = F.softplus(torch.randn(b, L, h, generator=gen) - 1.0)  # spans ≈0.05 … 2
    A = -torch.empty(h).uniform_(1, 16, generator=gen)
    B = torch.randn(b, L, g, n, generator=gen)
    C = torch.randn(b, L, g, n, generator=gen)
    D = torch.randn(h, generator=gen)
    s0 = torch.randn(b, h, p, n, generator=gen)
    return x, dt, A, B, C, D, s0


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


# ----------------------------------------------------------------------------- SSD op
@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("L", [1, 7, 33])
@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunked_ssd_equals_recurrence(g, L, chunk):
    x, dt, A, B, C, D, s0 = random_ssm(L=L, g=g, seed=L * 10 + chunk + g)
    y_ref, s_ref = naive_recurrence(x, dt, A, B, C, D, s0.clone())
    y, s = ssd_chunked(x, dt, A, B, C, chunk, D=D, initial_state=s0, return_final_state=True)
    assert rel_err(y, y_ref) <= 1e-4
    assert rel_err(s, s_ref) <= 1e-4
    y0 = ssd_chunked(x, dt, A, B, C, chunk, D=D)  # zero initial state
    y0_ref, _ = naive_recurrence(x, dt, A, B, C, D, torch.zeros_like(s0))
    assert rel_err(y0, y0_ref) <= 1e-4


def test_step_and_reference_equal_recurrence():
    x, dt, A, B, C, D, s0 = random_ssm(L=9, g=2)
    y_ref, s_ref = naive_recurrence(x, dt, A, B, C, D, s0.clone())
    y, s = ssd_reference(x, dt, A, B, C, D, s0)
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    y1, s1 = ssd_step(s0, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
    assert rel_err(y1, y_ref[:, 0]) <= 1e-5


def test_chunked_ssd_stable_over_long_strongly_decaying_sequences():
    x, dt, A, B, C, D, s0 = random_ssm(b=1, L=600, h=2, p=4, n=8, seed=3)
    dt = dt * 4  # cumulative log-decay reaches ~−10⁴: differences of global cumsums would lose digits
    y_ref, s_ref = naive_recurrence(x, dt, A, B, C, D, s0.clone())
    y, s = ssd_chunked(x, dt, A, B, C, 64, D=D, initial_state=s0, return_final_state=True)
    assert torch.isfinite(y).all()
    assert rel_err(y, y_ref) <= 1e-4 and rel_err(s, s_ref) <= 1e-4


# ----------------------------------------------------------------------------- conv
def test_causal_conv_matches_conv1d_and_gradcheck():
    x = torch.randn(2, 9, 5, dtype=torch.double, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.double, requires_grad=True)
    b = torch.randn(5, dtype=torch.double, requires_grad=True)
    ref = F.silu(F.conv1d(x.transpose(1, 2), w[:, None], b, padding=3, groups=5)[..., :9]).transpose(1, 2)
    assert torch.allclose(causal_conv_silu(x, w, b), ref)
    assert torch.autograd.gradcheck(lambda x, w, b: causal_conv_silu(x, w, b), (x, w, b))
    hist = torch.randn(2, 3, 5, dtype=torch.double)
    full = causal_conv_silu(torch.cat([hist, x], 1), w, b)[:, 3:]  # history = the previous inputs
    assert torch.allclose(causal_conv_silu(x, w, b, hist), full)
    assert torch.autograd.gradcheck(lambda x, w: causal_conv_silu(x, w, None, hist), (x, w))


# ----------------------------------------------------------------------------- mixer
def make_mixer(ngroups=2, chunk=8, seed=0, **kw):
    torch.manual_seed(seed)
    m = Mamba2Mixer(32, d_state=16, headdim=8, ngroups=ngroups, chunk_size=chunk, kernel="torch", **kw)
    with torch.no_grad():  # non-zero conv bias: padding positions would otherwise look harmless
        m.conv1d.bias.normal_()
        m.norm.weight.uniform_(0.5, 1.5)
    return m.eval()


@pytest.mark.parametrize("ngroups", [1, 2])
def test_mixer_cached_decoding_equals_full_forward(ngroups):
    m = make_mixer(ngroups)
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        full = m(x)
        cache = m.allocate_cache(2, 64, x.device, x.dtype)
        steps = torch.cat([m(x[:, t : t + 1], None, None, cache) for t in range(21)], 1)
        assert cache.state().shape == cache.ssm_state.shape  # its length lives in a LoopCache (models/cache.py)
        cache = m.allocate_cache(2, 64, x.device, x.dtype)
        parts = [m(x[:, :9], None, None, cache), m(x[:, 9:12], None, None, cache)]  # prefill, continued prefill
        parts += [m(x[:, t : t + 1], None, None, cache) for t in range(12, 21)]
        mixed = torch.cat(parts, 1)
    assert rel_err(steps, full) <= 1e-4
    assert rel_err(mixed, full) <= 1e-4


def test_mixer_is_causal():
    m = make_mixer()
    x = torch.randn(1, 20, 32)
    x2 = x.clone()
    x2[:, 12] += 3.0
    with torch.no_grad():
        y, y2 = m(x), m(x2)
    assert torch.equal(y[:, :12], y2[:, :12])
    assert not torch.allclose(y[:, 12:], y2[:, 12:])


def test_gradients_reach_ssm_parameters():
    m = make_mixer().train()
    m(torch.randn(2, 19, 32)).square().mean().backward()
    for name in ("A_log", "dt_bias", "D", "conv1d.weight", "conv1d.bias", "in_proj.weight", "norm.weight"):
        grad = m.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_left_padding_does_not_touch_real_tokens():
    m = make_mixer()
    real = torch.randn(1, 11, 32)
    alone = m(real)
    pad = 5
    x = torch.cat([torch.randn(1, pad, 32) * 10, real], 1)  # garbage in the padding
    x = torch.cat([x, torch.randn(1, 16, 32)], 0)  # a second, unpadded row in the batch
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[0, :pad] = False
    with torch.no_grad():
        out = m(x, None, valid)
        assert rel_err(out[0, pad:], alone[0]) <= 1e-5
        # the same through a cache: padded prefill then one decoded token
        cache = m.allocate_cache(2, 32, x.device, x.dtype)
        m(x, None, valid, cache)
        nxt = torch.randn(2, 1, 32)
        step = m(nxt, None, torch.cat([valid, torch.ones(2, 1, dtype=torch.bool)], 1), cache)
        ref = m(torch.cat([real, nxt[:1]], 1))[:, -1]
    assert rel_err(step[0], ref) <= 1e-4


def test_ssm_parameters_stay_fp32_under_bf16():
    m = make_mixer().to(torch.bfloat16)
    assert m.in_proj.weight.dtype == torch.bfloat16
    assert all(getattr(m, n).dtype == torch.float32 for n in ("A_log", "dt_bias", "D"))
    y = m(torch.randn(1, 10, 32, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


def test_scan_stays_fp32_under_autocast():
    x, dt, A, B, C, D, s0 = random_ssm(L=20)
    ref = ssd_chunked(x, dt, A, B, C, 8, D=D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ssd_chunked(x, dt, A, B, C, 8, D=D)
    assert y.dtype == torch.float32 and torch.equal(y, ref)


def test_init_follows_spec():
    m = Mamba2Mixer(64, d_state=16, headdim=8, kernel="torch")  # 16 heads
    A = torch.exp(m.A_log)
    dt = F.softplus(m.dt_bias)
    assert A.min() >= 1 and A.max() <= 16
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    assert torch.equal(m.D, torch.ones_like(m.D))


def test_kernel_mamba_ssm_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    m = Mamba2Mixer(32, d_state=16, headdim=8, kernel="mamba_ssm")
    with pytest.raises(RuntimeError, match="kernel=mamba_ssm"):
        m(torch.randn(1, 4, 32))
    auto = Mamba2Mixer(32, d_state=16, headdim=8, kernel="auto")
    assert auto(torch.randn(1, 4, 32)).shape == (1, 4, 32)  # auto falls back to the torch scan


def test_flops_per_token_counts_projections_and_scan():
    m = Mamba2Mixer(64, d_state=16, headdim=8, chunk_size=32, kernel="torch")
    proj = 2 * (m.in_proj.weight.numel() + m.out_proj.weight.numel())
    assert m.flops_per_token(128) > proj
    assert m.flops_per_token(128) > m.flops_per_token(4)  # intra-chunk work grows up to the chunk length


# ----------------------------------------------------------------------------- LoopedLM
def tiny_cfg(**kw):
    base = dict(vocab_size=32, d_model=32, n_heads=2, n_layers=2, n_loops=2, d_state=16, headdim=16, chunk_size=8, kernel="torch")
    base.update(kw)
    return LoopedLMConfig(**base)


@pytest.mark.parametrize("backbone,pattern", [("mamba2", "MMMA"), ("hybrid", "MA")])
def test_looped_model_forward_backward_and_cache(backbone, pattern):
    torch.manual_seed(0)
    model = LoopedLM(tiny_cfg(backbone=backbone, hybrid_pattern=pattern, mamba_mlp=backbone == "mamba2"))
    assert [layer.kind for layer in model.block] == list(model.config.layer_types)
    ids = torch.randint(0, 32, (2, 14))
    out = model(ids)
    F.cross_entropy(out.logits.flatten(0, 1), ids.flatten()).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "block" in n)
    assert model.flops_per_token(14) > 0
    model.eval()
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_cache(2, 32)
        pre = model(ids[:, :9], cache=cache).logits
        steps = [model(ids[:, t : t + 1], cache=cache).logits for t in range(9, 14)]
    assert rel_err(torch.cat([pre, *steps], 1), full) <= 1e-4


def test_looped_model_init_keeps_ssm_special_parameters():
    model = LoopedLM(tiny_cfg(backbone="mamba2"))
    mixer = model.block[0].mixer
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))
    assert (mixer.dt_bias != 0).all()  # the generic init zeroes biases; reset_special_parameters restores dt


def test_stateloop_mamba2_state_mixer():
    torch.manual_seed(0)
    model = LoopedLM(tiny_cfg(backbone="llama", n_layers=1, state_mode="stateloop_mamba2")).eval()
    ids = torch.randint(0, 32, (1, 10))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_cache(1, 16)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(10)], 1)
    assert rel_err(steps, full) <= 1e-4


def test_tiny_looped_mamba_learns_a_copy_task():
    """Second half of each sequence repeats the first: the loss there must fall well below chance."""
    torch.manual_seed(0)
    model = LoopedLM(tiny_cfg(backbone="mamba2", n_layers=1, n_loops=2, vocab_size=8, d_model=48, headdim=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    half = 6

    def batch():
        first = torch.randint(0, 8, (32, half))
        return torch.cat([first, first], 1)

    losses = []
    for _ in range(50):
        ids = batch()
        logits = model(ids[:, :-1]).logits[:, half - 1 :]
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, half:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    start, end = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert end < 0.6 * start, (start, end)


# ----------------------------------------------------------------------------- fused-path plumbing (CPU)
def test_conv_channel_last_rule_follows_causal_conv1d_checks():
    """The rule of causal_conv1d.cpp's channel-last kernel: channel stride 1, C % 8 == 0, batch and
    time strides multiples of 8, and (unchecked there, needed by its 16-byte loads) an aligned pointer."""
    from looplab.models.mamba2 import _conv_channel_last_ok

    def xbc(width, offset, conv_dim, T=5, dtype=torch.bfloat16):  # the xBC slice of an in_proj output
        return torch.zeros(2, T, width, dtype=dtype)[..., offset : offset + conv_dim]

    assert _conv_channel_last_ok(xbc(1160, 512, 640).transpose(1, 2))  # d_model 256 defaults: no copy needed
    assert not _conv_channel_last_ok(xbc(515, 192, 320).transpose(1, 2))  # odd in_proj width: time stride 515
    assert not _conv_channel_last_ok(xbc(1160, 4, 640).transpose(1, 2))  # 8-byte aligned start only
    assert not _conv_channel_last_ok(xbc(1160, 512, 644).transpose(1, 2))  # C % 8 != 0
    assert not _conv_channel_last_ok(xbc(1160, 512, 640).transpose(1, 2).contiguous())  # channel-first
    assert _conv_channel_last_ok(xbc(1160, 512, 640, dtype=torch.float32).transpose(1, 2))
    assert _conv_channel_last_ok(torch.zeros(3, 1, 16).transpose(1, 2))  # one token
    assert not _conv_channel_last_ok(torch.zeros(16, 4))


def test_conv_input_copies_only_when_needed():
    from looplab.models.mamba2 import _conv_channel_last_ok, _conv_input

    base = torch.randn(2, 7, 1160)
    view = base[..., 512 : 512 + 640]
    x = _conv_input(view)
    assert x.data_ptr() == view.data_ptr() and torch.equal(x, view.transpose(1, 2))  # the view itself
    odd = torch.randn(2, 7, 515)[..., 192 : 192 + 320]
    x = _conv_input(odd)
    assert _conv_channel_last_ok(x) and x.data_ptr() != odd.data_ptr() and torch.equal(x, odd.transpose(1, 2))
    narrow = torch.randn(2, 7, 50)[..., 3:15]  # C = 12: channel-last impossible, channel-first copy
    x = _conv_input(narrow)
    assert x.is_contiguous() and torch.equal(x, narrow.transpose(1, 2))


@pytest.mark.parametrize("d_model,d_conv,fused_conv", [(256, 4, True), (48, 4, True), (256, 5, False), (256, 1, False)])
def test_fused_conv_plumbing_matches_torch_conv(d_model, d_conv, fused_conv):
    """`_conv` with a stand-in for causal_conv1d_fn (same contract: (B, C, T) in and out): the layout
    handed over, the transpose back, and the torch fallback for widths causal-conv1d lacks."""
    from looplab.models.mamba2 import FusedOps, _conv_channel_last_ok

    torch.manual_seed(0)
    m = Mamba2Mixer(d_model, d_state=16, headdim=16, d_conv=d_conv, kernel="torch")
    calls = []

    def fake_conv(x, weight, bias, activation):
        calls.append(_conv_channel_last_ok(x))
        K = weight.shape[1]
        y = F.silu(F.conv1d(x, weight[:, None], bias, padding=K - 1, groups=x.shape[1])[..., : x.shape[2]])
        return torch.empty_like(x).copy_(y)  # like causal_conv1d: the output takes the input's layout

    z, xBC, dt = m.in_proj(torch.randn(2, 9, d_model)).split((m.d_inner, m.conv_dim, m.nheads), dim=-1)
    out = m._conv(xBC, None, FusedOps(chunk_scan=None, causal_conv1d=fake_conv))
    ref = causal_conv_silu(xBC, m.conv1d.weight.squeeze(1), m.conv1d.bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert len(calls) == int(fused_conv)
    if fused_conv:
        assert calls == [True]  # channel-last (view or copy): the result is (B, T, C) contiguous
        assert out.is_contiguous()


def test_fused_conv_call_is_kept_out_of_the_compiled_graph():
    """Under torch.compile the fused conv (stand-in here) runs eagerly behind torch.compiler.disable:
    the layout test reads data_ptr, which a traced tensor lacks, and the result equals eager."""
    from torch._dynamo.utils import counters

    from looplab.models.mamba2 import FusedOps, _conv_channel_last_ok

    torch.manual_seed(0)
    m = Mamba2Mixer(256, d_state=16, headdim=16, kernel="torch")
    seen = []

    def fake_conv(x, weight, bias, activation):
        seen.append(_conv_channel_last_ok(x))
        y = F.silu(F.conv1d(x, weight[:, None], bias, padding=weight.shape[1] - 1, groups=x.shape[1])[..., : x.shape[2]])
        return torch.empty_like(x).copy_(y)

    ops = FusedOps(chunk_scan=None, causal_conv1d=fake_conv)
    xBC = m.in_proj(torch.randn(2, 9, 256)).split((m.d_inner, m.conv_dim, m.nheads), dim=-1)[1].detach()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda t: m._conv(t * 2, None, ops) + 1, backend="eager")
    with torch.no_grad():
        out = compiled(xBC)
        ref = causal_conv_silu(xBC * 2, m.conv1d.weight.squeeze(1), m.conv1d.bias) + 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert seen == [True] and sum(counters["graph_break"].values()) >= 1
    torch._dynamo.reset()


def test_kernel_mamba_ssm_refuses_conv_widths_causal_conv1d_lacks():
    from looplab.models import ConfigError

    for d_conv in (1, 5):
        with pytest.raises(ConfigError, match=f"d_conv={d_conv}"):
            Mamba2Mixer(32, d_state=16, headdim=8, d_conv=d_conv, kernel="mamba_ssm")
        m = Mamba2Mixer(32, d_state=16, headdim=8, d_conv=d_conv, kernel="auto").eval()  # torch conv at this width
        x = torch.randn(1, 6, 32)
        with torch.no_grad():
            full = m(x)
            cache = m.allocate_cache(1, 8, x.device, x.dtype)
            steps = torch.cat([m(x[:, t : t + 1], None, None, cache) for t in range(6)], 1)
        assert rel_err(steps, full) <= 1e-4


def test_fused_ops_are_not_imported_for_cpu_work(monkeypatch):
    """On a CPU machine neither construction nor a CPU forward imports mamba_ssm (it needs CUDA)."""
    import looplab.models.mamba2 as mamba2

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr(mamba2, "_FUSED", None)
    m = Mamba2Mixer(32, d_state=16, headdim=8, kernel="auto")
    m(torch.randn(1, 4, 32))
    assert mamba2._FUSED is None
