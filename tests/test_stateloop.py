"""StateLoop's selective update (docs/formulations.md#stateloop): the update rule by hand, the reset ablation, mixers.

That every state update and mixer equals Vanilla Looped at W_o = 0 (and warm-starts from its checkpoint) is the
conformance kit's init_equivalence (tests/test_conformance.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.registry import STATE_UPDATES
from looplab.models.state import SelectiveState

# the registered selective-update modes (StateLoop's own rule and its reset ablation), and StateLoop with each mixer
MODES = [n for n in STATE_UPDATES.names() if issubclass(STATE_UPDATES.get(n), SelectiveState)] + \
    [a for a, (u, m) in STATE_UPDATES.aliases().items() if u == "stateloop"]


def cfg(**kw) -> LoopedLMConfig:
    base = dict(vocab_size=29, d_model=32, n_heads=4, n_layers=2, n_loops=3, ffn_hidden=64, max_seq_len=64,
                headdim=16, d_state=8, chunk_size=4)
    base.update(kw)
    return LoopedLMConfig(**base)


def _mamba_available() -> bool:
    try:
        import looplab.models.mamba2  # noqa: F401

        return True
    except ImportError:
        return False


def make(mode, **kw):
    if mode == "stateloop_mamba2" and not _mamba_available():
        pytest.skip("the Mamba-2 layer (looplab.models.mamba2) is not in this checkout")
    return LoopedLM(cfg(state_mode=mode, **kw))


def test_update_rule_matches_spec_by_hand():
    torch.manual_seed(0)
    model = make("stateloop", d_model=16, n_heads=2, state_dim=8, n_loops=3)
    torch.nn.init.normal_(model.state.state_out.weight, std=0.3)
    br = model.state
    ids = torch.randint(0, 29, (1, 6))
    pos = torch.arange(6)[None]
    x = model.embed(ids)
    s = torch.zeros(1, 6, 8)
    for _ in range(3):
        h = x
        for layer in model.block:
            h = layer(h, pos)
        u = h @ br.in_proj.weight.T
        delta = F.softplus(h @ br.dt_proj.weight.T + br.dt_proj.bias)
        a = torch.exp(-delta * torch.exp(br.A_log))
        s = a * s + (1 - a) * u
        x = h + s @ br.state_out.weight.T
    expected = model.head(model.final_norm(x))
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_state_in_output_flag():
    torch.manual_seed(0)
    with_out = make("stateloop", state_in_output=True)
    torch.nn.init.normal_(with_out.state.state_out.weight, std=0.3)
    without = make("stateloop", state_in_output=False)
    without.load_state_dict(with_out.state_dict())
    ids = torch.randint(0, 29, (2, 7))
    a, b = with_out(ids, return_all_loops=True), without(ids, return_all_loops=True)
    # the last loop's prediction differs, but x_{r+1} = h_r + W_o s_r feeds the next loop either way
    assert not torch.allclose(a.logits, b.logits)


def test_reset_differs_and_does_not_carry_state():
    torch.manual_seed(0)
    carry = make("stateloop", n_loops=3)
    torch.nn.init.normal_(carry.state.state_out.weight, std=0.3)
    reset = make("stateloop_reset", n_loops=3)
    reset.load_state_dict(carry.state_dict())
    ids = torch.randint(0, 29, (2, 8))
    assert not torch.allclose(carry(ids).logits, reset(ids).logits)

    # reset: s_r depends on h_r only, never on s_{r-1}
    br = reset.state
    h = torch.randn(2, 8, 32)
    s_prev = torch.randn(2, 8, 32, requires_grad=True)
    s, _, _ = br(h, s_prev, torch.arange(8)[None])
    s.sum().backward()
    assert s_prev.grad is None or torch.count_nonzero(s_prev.grad) == 0
    s_prev2 = torch.randn(2, 8, 32, requires_grad=True)
    s2, _, _ = carry.state(h, s_prev2, torch.arange(8)[None])
    s2.sum().backward()
    assert torch.count_nonzero(s_prev2.grad) > 0


@pytest.mark.parametrize("mode", MODES)
def test_retention_in_unit_interval_and_gradients_reach_branch(mode):
    torch.manual_seed(0)
    model = make(mode, state_dim=24)  # d_s != d
    torch.nn.init.normal_(model.state.state_out.weight, std=0.1)
    ids = torch.randint(0, 29, (2, 9))
    out = model(ids, return_diagnostics=True)
    assert out.logits.shape == (2, 9, 29)
    assert all(0 < a < 1 for a in out.diagnostics["retention"])
    h = torch.randn(2, 9, 32)  # (at |h| ≫ 1 fp32 rounds the smallest decays to exactly 1)
    _, _, a = model.state(h, model.state.initial_state(h), torch.arange(9)[None])
    assert a.shape == (2, 9, 24) and bool((a > 0).all()) and bool((a < 1).all())
    F.cross_entropy(out.logits.reshape(-1, 29), ids.reshape(-1)).backward()
    br = model.state
    for name in ("in_proj.weight", "dt_proj.weight", "A_log", "state_out.weight"):
        g = dict(br.named_parameters())[name].grad
        assert g is not None and torch.count_nonzero(g) > 0, name
    if br.mixer is not None:
        assert any(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in br.mixer.parameters())


@pytest.mark.parametrize("mode", [a for a, (u, m) in STATE_UPDATES.aliases().items() if m != "none"])
def test_mixer_is_causal(mode):
    torch.manual_seed(0)
    model = make(mode)
    torch.nn.init.normal_(model.state.state_out.weight, std=0.3)
    ids = torch.randint(0, 29, (1, 12))
    ids2 = ids.clone()
    ids2[0, 9] = (ids2[0, 9] + 3) % 29
    a, b = model(ids).logits, model(ids2).logits
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_learned_initial_state_and_overhead_reported():
    model = make("stateloop", state_init="learned")
    assert model.state.s0 is not None and model.state.s0.shape == (32,)
    params = model.num_parameters()
    vanilla = LoopedLM(cfg()).num_parameters()
    assert params["state_branch"] == params["total"] - vanilla["total"]
    # W_u, W_Δ (+bias), W_o, A_log, s_0
    assert params["state_branch"] == 3 * 32 * 32 + 32 + 32 + 32


def test_diagnostics_per_loop():
    torch.manual_seed(0)
    model = make("stateloop", n_loops=4)
    out = model(torch.randint(0, 29, (2, 5)), return_diagnostics=True)
    assert set(out.diagnostics) == {"retention", "state_norm", "state_to_stream"}
    assert all(len(v) == 4 for v in out.diagnostics.values())
    assert out.diagnostics["state_to_stream"] == [0.0] * 4  # W_o = 0 at init
