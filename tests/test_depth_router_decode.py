"""depth_router cached decoding (docs/decoding.md#routed-decoding): causal routing per token, per-depth KV caches.

Decoding one token at a time routes each token with the inference router (expert choice: the auxiliary
router or a threshold on the main router; token choice: its own depth) and writes each (loop, layer)
cache only for the tokens that reached that loop. It must equal a cache-free forward GIVEN the same
per-token depths (`model(ids, depths=D)`), which must in turn equal a slow per-token implementation
(attention written out per query, test_depth_router.slow_layer).
"""

from __future__ import annotations

import pytest
import torch

from looplab.models.exits import ExitPolicy
from looplab.models.stream import Stream
from looplab.models.generation import Speculation, decode_one_token
from looplab.models import ConfigError, LoopedLM, LoopedLMConfig
from looplab.models.cache import RoutedKVCache
from test_depth_router import slow_layer

V, R = 40, 3
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def make(router, seed=0, **kw):
    torch.manual_seed(seed)
    fields = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=R, ffn_hidden=64, max_seq_len=64,
                  depth_router=router)
    fields.update(kw)
    model = LoopedLM(LoopedLMConfig(**fields)).eval()
    with torch.no_grad():
        if model.state is not None:  # W_o is zero at init: make the state visible in the logits
            model.state.state_out.weight.normal_(0, 0.2)
        for p in (model.router.parameters() if model.router is not None else ()):  # sharper scores: varied decisions
            p.mul_(8.0)
    return model


def ids_for(B, T, seed=1):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def decode(model, ids, prompt_len, attention_mask=None, on_step=None):
    """Prefill ids[:, :prompt_len], then one cached step per remaining token (teacher forcing) →
    (logits (B, T, V), depths (B, T), cache). on_step(before, cache, depth): after each step, with the
    Mamba-2 entries' (conv, SSM) states from before it (tests/test_depth_router_ssm.py)."""
    from looplab.models.cache import RoutedSSMCache

    B, T = ids.shape
    cache = model.allocate_cache(B, T)
    with torch.no_grad():
        out = model(ids[:, :prompt_len], attention_mask=attention_mask, cache=cache)
        logits, depths = [out.logits], [out.routing.depth]
        for t in range(prompt_len, T):
            before = {k: (e.conv_state.clone(), e.ssm_state.clone()) for k, e in cache.entries.items()
                      if isinstance(e, RoutedSSMCache)} if on_step is not None else None
            out = model(ids[:, t:t + 1], cache=cache)
            if on_step is not None:
                on_step(before, cache, out.routing.depth[:, 0])
            logits.append(out.logits)
            depths.append(out.routing.depth)
    return torch.cat(logits, 1), torch.cat(depths, 1), cache


CASES = {
    "ec_aux_router": {"name": "expert_choice", "aux_router": True},
    "ec_threshold": {"name": "expert_choice", "inference": "threshold", "inference_threshold": 0.5},
    "token_choice": {"name": "token_choice"},
    "ec_aux_share_first": {"name": "expert_choice", "aux_router": True, "kv": "share_first"},
    "tc_share_first": {"name": "token_choice", "kv": "share_first"},
}


@pytest.mark.parametrize("state_mode", ["vanilla", "stateloop"])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_equals_the_reference_given_its_decisions(case, state_mode):
    model = make(CASES[case], state_mode=state_mode)
    ids = ids_for(1, 12)
    logits, depths, _ = decode(model, ids, prompt_len=4)
    assert len(set(depths.flatten().tolist())) > 1, "the router should stop tokens at different loops"
    with torch.no_grad():
        ref = model(ids, depths=depths)
        causal = model(ids, depths="inference")  # the same rule, cache-free: the same decisions
    torch.testing.assert_close(logits, ref.logits, **TOL)
    assert torch.equal(ref.routing.depth, depths) and torch.equal(causal.routing.depth, depths)
    torch.testing.assert_close(causal.logits, ref.logits, **TOL)


def test_stateloop_attention_mixer_decodes():
    model = make(CASES["ec_aux_router"], state_mode="stateloop_attn")
    ids = ids_for(1, 10)
    logits, depths, cache = decode(model, ids, prompt_len=3)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids, depths=depths).logits, **TOL)
    for r in range(R):  # the mixer's entry of loop r holds the tokens that ran loop r
        assert int(cache[r, "state"].lengths[0]) == int((depths > r).sum())


@pytest.mark.parametrize("case", ["ec_aux_router", "ec_threshold", "token_choice", "tc_share_first"])
def test_left_padded_batch_rows_stop_at_different_loops(case):
    model = make(CASES[case], state_mode="stateloop")
    B, P, T = 3, 5, 12
    ids = ids_for(B, T, seed=2)
    lens = [5, 3, 2]
    mask = torch.ones(B, T, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :P - n] = 0
        mask[b, :P - n] = 0
    logits, depths, cache = decode(model, ids, P, attention_mask=mask[:, :P])
    step_depths = depths[:, P:]
    assert any(len(set(step_depths[:, i].tolist())) > 1 for i in range(T - P)), "rows should stop at different loops"
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, depths=depths)
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref.logits[real], **TOL)
    # each row alone (no padding) decodes what it decodes in the batch, with the same decisions
    for b, n in enumerate(lens):
        alone, d_alone, _ = decode(model, ids[b:b + 1, P - n:], n)
        torch.testing.assert_close(alone[0], logits[b, P - n:], **TOL)
        assert torch.equal(d_alone[0], depths[b, P - n:])
    # per-row lengths in the shared buffers: each row holds the tokens (padding included) that reached the loop
    for (r, l), entry in cache.entries.items():
        if isinstance(entry, RoutedKVCache):
            assert torch.equal(entry.lengths, (depths > r).sum(1))
            assert entry.length == int(entry.lengths.max())
            assert int(entry.valid.sum()) == int(((depths > r) & real).sum())


def slow_given(model, ids, D):
    """Given depths, token by token: loop r runs the tokens with D > r, attention written out per query
    (recursion_wise: over the tokens active at loop r; share_first: over loop 0's keys/values)."""
    rc = model.config.depth_router
    x = model.embed(ids)
    pos = torch.arange(ids.shape[1])[None]
    s = model.state.initial_state(x) if model.state is not None else None
    h, first_kv = x, {}
    if rc.name == "token_choice":
        p = rc.scale * model.router.router(x / rc.temperature).softmax(-1)
        w_tok = p.gather(-1, (D - 1).clamp_min(0)[..., None]).squeeze(-1)
    for r in range(R):
        new = D > r
        if rc.name == "expert_choice":
            w = rc.scale * torch.sigmoid(model.router.routers[r](x / rc.temperature).squeeze(-1))
        else:
            w = w_tok
        y = x
        for l, layer in enumerate(model.block):
            y, kv = slow_layer(layer, y, new, first_kv.get(l) if rc.kv == "share_first" and r > 0 else None)
            if r == 0:
                first_kv[l] = kv
        hn = xn = x + w[..., None] * y
        if s is not None:
            sn, xn, _ = model.state(hn, s, pos)
            s = torch.where(new[..., None], sn, s)
        h = torch.where(new[..., None], hn, h)
        x = torch.where(new[..., None], xn, x)
    return model.head(model.final_norm(model.readout(Stream(x, x, s, h, pos, None))))


@pytest.mark.parametrize("case, state_mode", [("ec_aux_router", "stateloop"), ("tc_share_first", "vanilla")])
def test_a_cached_step_runs_each_loop_on_the_rows_routed_to_it(case, state_mode):
    """At one token per row, loop r runs on the rows whose token the router sends to loop r, and no others: the
    shared block's layers receive exactly those rows, while the logits stay the routed reference's."""
    model = make(CASES[case], state_mode=state_mode)
    B, P, T = 4, 3, 10
    ids = ids_for(B, T, seed=5)
    seen = []  # (rows, tokens) of every call of the block's first layer
    hook = model.block[0].register_forward_pre_hook(lambda layer, args: seen.append(tuple(args[0].shape[:2])))
    cache = model.allocate_cache(B, T)
    try:
        with torch.no_grad():
            out = model(ids[:, :P], cache=cache)
            logits, depths, fewer = [out.logits], [out.routing.depth], False
            for t in range(P, T):
                seen.clear()
                out = model(ids[:, t:t + 1], cache=cache)
                d = out.routing.depth[:, 0]
                assert seen == [(n, 1) for n in (int((d > r).sum()) for r in range(R)) if n > 0], t
                fewer |= max((n for n, _ in seen[1:]), default=0) < B  # loops after the first
                logits.append(out.logits)
                depths.append(out.routing.depth)
    finally:
        hook.remove()
    assert fewer, "some step should send fewer rows than the batch to the deeper loops"
    logits, depths = torch.cat(logits, 1), torch.cat(depths, 1)
    with torch.no_grad():
        ref = model(ids, depths=depths)
        causal = model(ids, depths="inference")
    torch.testing.assert_close(logits, ref.logits, **TOL)
    assert torch.equal(causal.routing.depth, depths)


@pytest.mark.parametrize("case, state_mode", [("ec_threshold", "vanilla"), ("token_choice", "stateloop"),
                                              ("ec_aux_share_first", "stateloop"), ("tc_share_first", "vanilla")])
def test_given_depths_reference_equals_the_slow_per_token_loop(case, state_mode):
    model = make(CASES[case], state_mode=state_mode, n_layers=1)
    ids = ids_for(2, 8)
    D = torch.randint(1, R + 1, (2, 8), generator=torch.Generator().manual_seed(3))
    D[0, 2] = 0  # a token that runs no loop: reads its embedding, leaves no key at any depth
    with torch.no_grad():
        out = model(ids, depths=D)
        slow = slow_given(model, ids, D)
    torch.testing.assert_close(out.logits, slow, **TOL)
    assert torch.equal(out.routing.depth, D)


@pytest.mark.parametrize("case", ["token_choice", "ec_aux_router", "ec_aux_share_first"])
def test_cache_lengths_per_depth_and_memory(case):
    """recursion_wise: the entry of loop r holds exactly the tokens that reached loop r; share_first: only
    loop 0's entries exist. Either way the routed cache is smaller than the fixed-depth model's."""
    model = make(CASES[case])
    plain = make(None)
    ids = ids_for(1, 16)
    _, depths, cache = decode(model, ids, prompt_len=4)
    fixed = plain.allocate_cache(1, 16)
    with torch.no_grad():
        plain(ids[:, :4], cache=fixed)
        for t in range(4, 16):
            plain(ids[:, t:t + 1], cache=fixed)
    for r in range(R):
        for l in range(2):
            if CASES[case].get("kv") == "share_first" and r > 0:
                assert (r, l) not in cache.entries
            else:
                assert cache[r, l].length == int((depths > r).sum())
    per_token_per_loop = fixed.nbytes() // (16 * R)
    expected = sum(int((depths > r).sum()) for r in range(R if CASES[case].get("kv") != "share_first" else 1))
    assert cache.nbytes() == expected * per_token_per_loop < fixed.nbytes()


def test_generate_is_greedy_on_the_causal_forward():
    model = make(CASES["ec_aux_router"])
    prompt = ids_for(2, 4, seed=4)
    mask = torch.ones_like(prompt)
    prompt[1, 0] = 0
    mask[1, 0] = 0
    out = model.generate(prompt, 6, attention_mask=mask, return_logits=True)
    full_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.long)], 1)
    with torch.no_grad():
        ref = model(out.sequences, attention_mask=full_mask, depths="inference").logits
    torch.testing.assert_close(out.logits, ref[:, 3:-1], **TOL)
    assert torch.equal(out.sequences[:, 4:], ref[:, 3:-1].argmax(-1))
    from looplab.models.generation import generate

    torch.testing.assert_close(generate(model, prompt, 6, attention_mask=mask), out.sequences, rtol=0, atol=0)


@pytest.mark.parametrize("opts, word", [
    (dict(speculation=Speculation(loops=1)), "speculation=Speculation"),
    (dict(compile=True), "compile="),
    (dict(exits=ExitPolicy(threshold=0.5, rule="entropy")), "exits=ExitPolicy"),
    (dict(exits=ExitPolicy(threshold=0.5, rule="entropy", skip="kv_copy")), "skip='kv_copy'"),
])
def test_decoding_options_that_do_not_route_are_refused_by_name(opts, word):
    from looplab.models.generation import generate

    model = make(CASES["token_choice"])
    ids = ids_for(1, 4)
    for call in (lambda: model.generate(ids, 2, **opts), lambda: generate(model, ids, 2, **opts)):
        with pytest.raises(ValueError, match=word) as e:
            call()
        assert "depth_router=token_choice" in str(e.value)


def test_other_misuse_is_refused_by_name():
    model = make(CASES["ec_threshold"])
    ids = ids_for(1, 4)
    with pytest.raises(ValueError, match="depths"):
        model(ids, depths=torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="depths"):
        model(ids, depths="topk")
    with pytest.raises(ValueError, match="depth_router=none"):
        make(None)(ids, depths=torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="allocate_cache"):
        model(ids, cache=make(None).allocate_cache(1, 8))
    with pytest.raises(ValueError, match=r"exits=ExitPolicy\(threshold=0.5"):  # one cached step, as generate's are
        decode_one_token(model, ids[:, :1], model.allocate_cache(1, 8), exits=ExitPolicy(threshold=0.5, rule="entropy"))
    with pytest.raises(ConfigError, match="depth_router.inference=aux_router"):
        make({"name": "expert_choice", "inference": "aux_router"})
    with pytest.raises(ConfigError, match="depth_router.inference_threshold"):
        make({"name": "expert_choice", "inference_threshold": 1.5})
    with pytest.raises(ConfigError, match="kv=share_first"):  # a Mamba-2 block has no keys/values to share
        make({"name": "token_choice", "kv": "share_first"}, backbone="mamba2", d_state=8, headdim=8, chunk_size=8)


def test_prelude_coda_and_injection_decode_as_routed():
    model = make(CASES["token_choice"], prelude_layers=1, coda_layers=1, injection="add")
    ids = ids_for(1, 10)
    logits, depths, _ = decode(model, ids, prompt_len=3)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids, depths=depths).logits, **TOL)
