"""depth_router: LoopedLM.flops_per_token counts each loop at the fraction of tokens
that runs it, checked against torch's FlopCounterMode on real routed forwards (as tests/test_model.py
does for the plain model): the reduced-length block, the reduced attention (recursion_wise: among the
active tokens; share_first: against loop 0's keys), the StateLoop branch, the router (and aux router)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.config import RouterConfig

V = 40


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def make(router, **kw):
    torch.manual_seed(0)
    fields = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=3, ffn_hidden=64, max_seq_len=64)
    fields.update(kw)
    fields["depth_router"] = router if isinstance(router, dict) else {"name": router}
    return LoopedLM(LoopedLMConfig(**fields)).eval()


def measure(model, B, T, **kw):
    """FlopCounterMode's FLOPs per token of one forward (the math SDPA backend: counted bmm's), and the
    fraction of the T tokens each loop really gathered (token choice pads rows to the longest)."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        out = model(ids, **kw)
    gathered = [1.0 if idx is None else idx.shape[1] / T for idx in out.routing.selected]
    return counter.get_total_flops() / (B * T), gathered


@pytest.mark.parametrize("kv", ["recursion_wise", "share_first"])
@pytest.mark.parametrize("extra", [{}, {"state_mode": "stateloop", "injection": "add"}, {"aux_router": True}])
def test_expert_choice_flops_match_flop_counter(kv, extra):
    """T = 12, R = 3: MoR's capacities 1, 2/3, 1/3 gather 12, 8 and 4 tokens; the default count is exact."""
    aux = {"aux_router": True} if extra.get("aux_router") else {}
    model_kw = {k: v for k, v in extra.items() if k != "aux_router"}
    model = make({"name": "expert_choice", "kv": kv, **aux}, **model_kw)
    T = 12
    measured, gathered = measure(model, 2, T)
    assert gathered == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert model.config.depth_router.loop_fractions(3, T) == pytest.approx(gathered)
    # FlopCounterMode counts matmuls only: exact without the state branch; its gate's elementwise terms < 1%
    assert measured == pytest.approx(model.flops_per_token(T), rel=0.01 if model.state is not None else 1e-4)
    plain = LoopedLM(LoopedLMConfig(**{**model.config.__dict__, "depth_router": RouterConfig()}))
    assert model.flops_per_token(T) < plain.flops_per_token(T)


def test_expert_choice_capacities_below_one_at_the_first_loop_share_first():
    """kv=share_first with capacity 0.75 at loop 0: later queries attend to loop 0's 9 keys, not all 12."""
    model = make({"name": "expert_choice", "kv": "share_first", "capacity": [0.75, 0.5, 0.25]}, n_kv_heads=2)
    measured, gathered = measure(model, 2, 12)
    assert gathered == pytest.approx([0.75, 0.5, 0.25])
    assert measured == pytest.approx(model.flops_per_token(12), rel=1e-4)


@pytest.mark.parametrize("kv", ["recursion_wise", "share_first"])
def test_token_choice_flops_match_flop_counter_at_the_gathered_fractions(kv):
    """Token choice's depths are the router's: the count at the fractions a forward gathered (rows padded
    to the longest) equals FlopCounterMode; the default is the balanced (R − r)/R."""
    model = make({"name": "token_choice", "kv": kv})
    T = 16
    measured, gathered = measure(model, 1, T)
    assert gathered[0] == 1.0 and any(g < 1 for g in gathered)
    assert measured == pytest.approx(model.flops_per_token(T, loop_fractions=gathered), rel=1e-4)
    assert model.config.depth_router.loop_fractions(3) == pytest.approx([1, 2 / 3, 1 / 3])


def test_none_is_unchanged_and_routed_training_counts():
    plain = make("none")
    T = 32
    assert plain.flops_per_token(T, loop_fractions=None) == plain.flops_per_token(T)
    with pytest.raises(ValueError, match="depth_router=none"):
        plain.flops_per_token(T, loop_fractions=[1, 1, 1])
    routed = make("expert_choice")
    # every token at every loop: the plain count plus the router's linears (forward and backward)
    full = routed.flops_per_token(T, loop_fractions=[1, 1, 1])
    assert full == plain.flops_per_token(T) + 3 * 2 * 32
    assert routed.flops_per_token(T, training=True, loop_fractions=[1, 1, 1]) == 3 * full
    assert routed.flops_per_token(T, training=True) == 3 * routed.flops_per_token(T)
    # truncated backprop: the last loop's backward only (the smallest, at capacity 1/3)
    fwd = routed.flops_per_token(T)
    one = routed.flops_per_token(T, training=True, backprop_loops=1)
    assert fwd < one < routed.flops_per_token(T, training=True)
    with pytest.raises(ValueError, match="loops"):
        routed.flops_per_token(T, loops=2)


def test_results_json_counts_routed_loops():
    """train.py's analytic_flops (results.json's flops_per_token, Lightning's flops_per_batch): the plain
    model's count as before; a routed model's at its loop fractions, under truncated backprop too."""
    from looplab.train import analytic_flops
    from looplab.training.depth import DepthSampler

    T = 32
    plain, routed = make("none"), make("expert_choice")
    assert analytic_flops(plain, DepthSampler(loops=3), T) == (plain.flops_per_token(T), plain.flops_per_token(T, training=True))
    fwd, train = analytic_flops(routed, DepthSampler(loops=3), T)
    assert (fwd, train) == (routed.flops_per_token(T), routed.flops_per_token(T, training=True))
    assert fwd < plain.flops_per_token(T) and train < plain.flops_per_token(T, training=True)
    _, trunc = analytic_flops(routed, DepthSampler(loops=3, backprop_loops=1), T)
    assert trunc == routed.flops_per_token(T, training=True, backprop_loops=1) < train
