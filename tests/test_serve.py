"""looplab.serve.Engine: a running batch whose requests join and leave mid-run, each decoded as it would be alone."""

from __future__ import annotations

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exits import ExitPolicy
from looplab.models.generation import generate
from looplab.serve import Engine, solo_agreement

V = 97


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def looped(**kw) -> LoopedLM:
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=1, n_loops=3, max_seq_len=128, headdim=16, d_state=16)
    m = LoopedLM(LoopedLMConfig(**{**base, **kw})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        m.head.weight.mul_(4)
        if m.exit_gate is not None:
            torch.nn.init.normal_(m.exit_gate.proj.weight, std=2.0)  # spread the exits over the loops
    return m


def trace(n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, V, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g),
             int(torch.randint(1, 14, (1,), generator=g))) for _ in range(n)]


CASES = {
    "llama": (dict(), None),
    "llama_gate_kv_copy": (dict(exit_gate="ouro"), ExitPolicy(threshold=0.5, skip="kv_copy")),
    "llama_gate_read_only": (dict(exit_gate="ouro", coda_layers=1), ExitPolicy(threshold=0.6)),
    "hybrid_gate_ssm_skip": (dict(backbone="hybrid", hybrid_pattern="MA", n_layers=2, exit_gate="ouro"),
                             ExitPolicy(threshold=0.5, skip="ssm_skip")),
    "mamba2_gate_ssm_propagate": (dict(backbone="mamba2", exit_gate="ouro"), ExitPolicy(threshold=0.5, skip="ssm_propagate")),
    "stateloop_attn_prelude_coda": (dict(state_mode="stateloop_attn", prelude_layers=1, coda_layers=1), None),
    "router_expert_choice": (dict(depth_router={"name": "expert_choice"}), None),
    "router_token_choice": (dict(depth_router={"name": "token_choice"}), None),
    "parallel_gswa": (dict(loop_schedule="parallel", loop_kv="gswa", loop_window=4), None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_equals_solo_decoding(case):
    """9 requests through 3 rows: rows are reused, requests join while others decode and leave at eos or at their
    limit; every request's tokens and exit depths equal generate() of that request alone."""
    kw, exits = CASES[case]
    m = looped(**kw)
    reqs = trace()
    # an eos that some request meets before its limit: the third token request 0 decodes alone
    eos = int(generate(m, reqs[0][0][None], 3, exits=exits)[0, -1])
    engine = Engine(m, max_batch=3, max_len=40, exits=exits, eos_token_id=eos)
    handles = [engine.add(p, n) for p, n in reqs]
    joined_mid_run = 0
    while not engine.idle():
        before = {r.id for r in engine.running}
        engine.step()
        joined_mid_run += bool(before) and any(r.id not in before and r.row is not None for r in engine.running)
    assert all(h.done for h in handles) and engine.stats["prefills"] == 9
    assert joined_mid_run >= 2  # admissions into freed rows while other rows were mid-generation
    assert any(h.hit_eos and len(h.tokens) < h.max_new_tokens for h in handles)
    assert any(not h.hit_eos and len(h.tokens) == h.max_new_tokens for h in handles)
    if exits is not None:
        assert all(len(h.exit_steps) == len(h.tokens) for h in handles)
        assert len({s for h in handles for s in h.exit_steps}) > 1  # the exits bind
    agree = solo_agreement(m, handles, exits=exits, eos_token_id=eos)
    assert agree["equal"] == 9, agree["differences"]


def test_arrivals_wait_and_errors_name_the_value():
    m = looped()
    clock = {"t": 0.0}
    engine = Engine(m, max_batch=2, max_len=32, clock=lambda: clock["t"])
    late = engine.add([3, 4, 5], 4, arrival=5.0)
    early = engine.add([6, 7], 4)
    engine.step()
    assert early.row is not None and late.row is None  # not arrived yet
    clock["t"] = 6.0
    engine.step()
    assert late.row is not None and len(late.tokens) == 2
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        engine.add([1], 0)
    with pytest.raises(ValueError, match="max_len=32"):
        engine.add(list(range(1, 30)), 8)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add([], 3)


# ------------------------------------------------------------------ depth-wise batching
DEPTHWISE = {
    "llama": (dict(), None),
    "llama_gate_kv_copy": (dict(exit_gate="ouro"), ExitPolicy(threshold=0.5, skip="kv_copy")),
    "stateloop_prelude_coda_concat_gate": (dict(exit_gate="ouro", coda_layers=1, prelude_layers=1, injection="concat",
                                                state_mode="stateloop", n_layers=2), ExitPolicy(threshold=0.5, skip="kv_copy")),
    "gqa_kl_rule_min_loops": (dict(n_kv_heads=2), ExitPolicy(threshold=0.05, rule="kl", min_loops=2, skip="kv_copy")),
}


@pytest.mark.parametrize("case", sorted(DEPTHWISE))
def test_depthwise_batching_equals_solo_decoding(case):
    """schedule='depthwise': each step is one call of every block layer over the in-flight tokens, each at its own
    loop; requests join and leave mid-run; every request's tokens and exit depths equal generate() alone."""
    kw, exits = DEPTHWISE[case]
    m = looped(**kw)
    reqs = trace()
    eos = int(generate(m, reqs[0][0][None], 3, exits=exits)[0, -1])
    engine = Engine(m, max_batch=3, max_len=40, exits=exits, eos_token_id=eos, schedule="depthwise")
    calls = []
    hook = m.block[0].register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    handles = [engine.add(p, n) for p, n in reqs]
    per_step = []
    while not engine.idle():
        before = len(calls)
        prefills = engine.stats["prefills"]
        engine.step()
        if engine.stats["prefills"] == prefills:  # a prefill runs the block R times over one prompt
            per_step.append(len(calls) - before)
    hook.remove()
    assert set(per_step) <= {0, 1} and 1 in per_step  # one block call per step (0: nothing in flight)
    loops = engine.depthwise.block_calls
    assert sum(len(set(c)) > 1 for c in loops) >= 3  # calls holding items of two or more different loops
    assert all(h.done for h in handles) and engine.stats["prefills"] == 9
    if exits is not None:
        assert len({s for h in handles for s in h.exit_steps}) > 1
    agree = solo_agreement(m, handles, exits=exits, eos_token_id=eos)
    assert agree["equal"] == 9, agree["differences"]


@pytest.mark.parametrize("kw,exits,named", [
    (dict(backbone="mamba2"), None, "backbone='mamba2'"),
    (dict(backbone="hybrid", hybrid_pattern="MA", n_layers=2), None, "backbone='hybrid'"),
    (dict(state_mode="stateloop_attn"), None, "state_mode='stateloop_attn'"),
    (dict(depth_router={"name": "expert_choice"}), None, "depth_router='expert_choice'"),
    (dict(loop_schedule="parallel"), None, "loop_schedule='parallel'"),
    (dict(exit_gate="ouro"), ExitPolicy(threshold=0.5), "skip='kv_copy'"),
])
def test_depthwise_refuses_by_name(kw, exits, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        Engine(looped(**kw), max_batch=2, max_len=32, exits=exits, schedule="depthwise")
    with pytest.raises(ValueError, match="schedule='diagonal'"):
        Engine(looped(), schedule="diagonal")
