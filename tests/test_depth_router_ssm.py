"""depth_router on Mamba-2 layers (docs/formulations.md#routed-depth): backbone mamba2 / hybrid and the stateloop_mamba2 mixer.

What a token that stopped before loop r leaves for the tokens behind it: nothing. Loop r's scan and causal
conv run over the subsequence of tokens active at loop r (recursion-wise, as attention). The references run
each row's active subsequence through the layers on its own (batch 1, no gather, no padding), so the
model's gathered, padded batch must equal them; cached decoding must equal `forward(depths=D)` with the
decisions it made, and a row whose token stopped must leave that loop's conv and SSM state untouched.
"""

from __future__ import annotations

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from conftest import compose
from test_depth_router_decode import decode  # prefill + one cached step per token, with an on_step hook
from looplab.models.exits import ExitPolicy
from looplab.models.stream import Stream
from looplab.models import ConfigError, LoopedLM, LoopedLMConfig
from looplab.models.cache import RoutedKVCache, RoutedSSMCache
from looplab.models.llama import apply_rope

V, R = 64, 3
TOL = dict(rtol=1e-5, atol=1e-5)
SSM = dict(d_state=8, headdim=8, chunk_size=4, hybrid_pattern="MA")  # chunk 4 < T: the scan crosses chunks


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


ROUTERS = {
    "ec_aux_router": {"name": "expert_choice", "aux_router": True},
    "ec_threshold": {"name": "expert_choice", "inference": "threshold"},
    "token_choice": {"name": "token_choice"},
    "tc_share_first": {"name": "token_choice", "kv": "share_first"},  # hybrid: attention shares, Mamba-2 does not
}


def make(router, backbone="mamba2", state_mode="vanilla", seed=0):
    torch.manual_seed(seed)
    model = LoopedLM(LoopedLMConfig(vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=R, ffn_hidden=64,
                                    max_seq_len=32, backbone=backbone, state_mode=state_mode,
                                    depth_router=ROUTERS[router], **SSM)).eval()
    with torch.no_grad():
        if model.state is not None:  # W_o is zero at init: make the state visible in the logits
            model.state.state_out.weight.normal_(0, 0.2)
        for p in model.router.parameters():  # sharper scores: varied decisions
            p.mul_(8.0)
    return model


def ids_for(B, T, seed=1):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def weights(model, x, D, r):
    rc = model.config.depth_router
    if rc.name == "expert_choice":
        return rc.scale * torch.sigmoid(model.router.routers[r](x / rc.temperature).squeeze(-1))
    p = rc.scale * model.router.router(x / rc.temperature).softmax(-1)
    return p.gather(-1, (D - 1).clamp_min(0)[..., None]).squeeze(-1)


def slow_given(model, ids, D):
    """Given depths, row by row: loop r runs the block (and the state branch) on the row's tokens with
    D > r alone, as one short sequence at their original positions; the others keep h, x and s."""
    rc = model.config.depth_router
    x = model.embed(ids)
    s = model.state.initial_state(x) if model.state is not None else None
    h = x
    w_tok = weights(model, x, D, 0) if rc.name == "token_choice" else None  # token choice: from the first input
    first_kv: dict = {}
    for r in range(R):
        w = w_tok if w_tok is not None else weights(model, x, D, r)
        h, x, s = h.clone(), x.clone(), s.clone() if s is not None else None
        x_in = x.clone()
        for b in range(ids.shape[0]):
            sub = (D[b] > r).nonzero().squeeze(1)
            if sub.numel() == 0:
                continue
            xb, pos = x_in[b, sub][None], sub[None]
            y = xb
            for l, layer in enumerate(model.block):
                if rc.kv == "share_first" and layer.kind == "A":
                    y = shared_attention_layer(layer, y, pos, first_kv, (b, l), r)
                else:
                    y = layer(y, pos, None, None)
            hn = xn = xb + w[b, sub][None, :, None] * y
            if s is not None:
                sn, xn, _ = model.state(hn, s[b, sub][None], pos)
                s[b, sub] = sn[0]
            h[b, sub], x[b, sub] = hn[0], xn[0]
    return model.head(model.final_norm(model.readout(Stream(x, x, s, h, pos, None))))


def shared_attention_layer(layer, y, pos, first_kv, key, r):
    """kv=share_first for one row: loop 0 records the layer's keys/values of its tokens; a later loop's
    queries attend to those at original positions <= their own."""
    att = layer.attn
    H, Hkv, hd = att.n_heads, att.n_kv_heads, att.head_dim
    q, k, v = att.qkv_proj(layer.attn_norm(y)).split((H * hd, Hkv * hd, Hkv * hd), dim=-1)
    cos, sin = att.rope(pos)
    q = apply_rope(q.unflatten(-1, (H, hd)).transpose(1, 2), cos, sin)
    k = apply_rope(k.unflatten(-1, (Hkv, hd)).transpose(1, 2), cos, sin)
    v = v.unflatten(-1, (Hkv, hd)).transpose(1, 2)
    if r == 0:
        first_kv[key] = (k, v, pos)
    k0, v0, pos0 = first_kv[key]
    mask = pos0[0][None, :] <= pos[0][:, None]
    a = torch.nn.functional.scaled_dot_product_attention(q, k0.repeat_interleave(H // Hkv, 1),
                                                         v0.repeat_interleave(H // Hkv, 1), attn_mask=mask)
    y = y + att.out_proj(a.transpose(1, 2).flatten(-2))
    return y + layer.mlp(layer.mlp_norm(y))


# ------------------------------------------------------------------ (a) the routed forward
@pytest.mark.parametrize("router, backbone, state_mode", [
    ("ec_threshold", "mamba2", "vanilla"), ("token_choice", "mamba2", "stateloop"),
    ("ec_aux_router", "hybrid", "vanilla"), ("tc_share_first", "hybrid", "vanilla"),
    ("token_choice", "hybrid", "stateloop_mamba2"),
])
def test_given_depths_equal_each_rows_active_subsequence_alone(router, backbone, state_mode):
    model = make(router, backbone, state_mode)
    B, T = 2, 10
    ids = ids_for(B, T)
    D = torch.randint(1, R + 1, (B, T), generator=torch.Generator().manual_seed(3))
    D[0, 2] = 0  # runs no loop: reads its embedding, absent from every loop's state
    D[1] = R  # row 1 runs every token everywhere, row 0 does not: row 0 is padded at every loop
    D[1, -1] = 1
    with torch.no_grad():
        out = model(ids, depths=D)
        slow = slow_given(model, ids, D)
        rows = [model(ids[b:b + 1], depths=D[b:b + 1]).logits for b in range(B)]
    torch.testing.assert_close(out.logits, slow, **TOL)
    assert torch.equal(out.routing.depth, D)
    # padding (inactive slots after each row's active ones) leaks into nothing: each row alone is the same
    torch.testing.assert_close(out.logits, torch.cat(rows), **TOL)


@pytest.mark.parametrize("router", ["ec_threshold", "token_choice"])
def test_training_routing_equals_the_reference_given_its_depths(router):
    """Training's routing (expert choice top-k, token choice argmax, rows padded to the longest) computes
    what the per-row reference computes with the depths it chose."""
    model = make(router, "hybrid")
    ids = ids_for(2, 12, seed=5)
    with torch.no_grad():
        out = model(ids)
        slow = slow_given(model, ids, out.routing.depth)
    assert len(set(out.routing.depth.flatten().tolist())) > 1
    if router == "token_choice":
        assert any(len(set(m.sum(1).tolist())) > 1 for m in out.routing.ran), "rows should be padded"
    torch.testing.assert_close(out.logits, slow, **TOL)


def test_gradients_reach_the_mamba_parameters_and_the_router():
    model = make("ec_aux_router", "hybrid").train()
    out = model(ids_for(2, 12))
    (out.logits.square().mean() + sum(out.routing.losses.values())).backward()
    mixer = model.block[0].mixer
    for p in (mixer.A_log, mixer.dt_bias, mixer.conv1d.weight, model.router.routers[1].weight,
              model.router.aux_routers[0].weight):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


# ------------------------------------------------------------------ (b) cached decoding
@pytest.mark.parametrize("router, backbone, state_mode", [
    ("ec_aux_router", "mamba2", "vanilla"), ("ec_threshold", "hybrid", "stateloop"),
    ("token_choice", "hybrid", "vanilla"), ("tc_share_first", "hybrid", "vanilla"),
    ("ec_aux_router", "mamba2", "stateloop_mamba2"),
])
def test_decode_equals_the_forward_given_its_decisions(router, backbone, state_mode):
    model = make(router, backbone, state_mode)
    ids = ids_for(1, 12)
    logits, depths, cache = decode(model, ids, prompt_len=5)
    assert len(set(depths[0, 5:].tolist())) > 1, "steps should stop at different loops"
    with torch.no_grad():
        ref = model(ids, depths=depths)
    torch.testing.assert_close(logits, ref.logits, **TOL)
    assert torch.equal(ref.routing.depth, depths)
    for key, entry in cache.entries.items():  # each loop's state holds the tokens that reached it
        if isinstance(entry, RoutedSSMCache):
            assert torch.equal(entry.lengths, (depths > key[0]).sum(1))


@pytest.mark.parametrize("router, backbone", [("ec_threshold", "mamba2"), ("token_choice", "hybrid")])
def test_left_padded_batch_decodes_and_stopped_rows_keep_their_state(router, backbone):
    model = make(router, backbone)
    B, P, T = 2, 6, 14
    ids = ids_for(B, T, seed=2)
    mask = torch.ones(B, T, dtype=torch.long)
    ids[1, :2], mask[1, :2] = 0, 0  # row 1: a prompt of 4 after 2 padding tokens
    seen = []

    def check(before, cache, depth):  # loop r's state of a row whose token stopped before r: bit for bit
        for (r, l), (conv, ssm) in before.items():
            entry, stopped = cache[r, l], depth <= r
            seen.append(bool(stopped.any()) and not bool(stopped.all()))
            assert torch.equal(entry.conv_state[stopped], conv[stopped])
            assert torch.equal(entry.ssm_state[stopped], ssm[stopped])
            if not bool(stopped.all()):
                assert not torch.equal(entry.ssm_state[~stopped], ssm[~stopped])

    logits, depths, cache = decode(model, ids, P, attention_mask=mask[:, :P], on_step=check)
    assert any(seen), "some step should stop one row's token and run the other's"
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, depths=depths)
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref.logits[real], **TOL)
    alone, d_alone, _ = decode(model, ids[1:, 2:], P - 2)  # the padded row without its padding
    torch.testing.assert_close(alone[0], logits[1, 2:], **TOL)
    assert torch.equal(d_alone[0], depths[1, 2:])
    for (r, l), entry in cache.entries.items():
        if isinstance(entry, (RoutedKVCache, RoutedSSMCache)):
            assert torch.equal(entry.lengths, (depths > r).sum(1))


# ------------------------------------------------------------------ (c) training, (d) refusals
@pytest.mark.parametrize("backbone, router", [("mamba2_tiny", "expert_choice"), ("hybrid_tiny", "token_choice")])
def test_train_runs_with_a_router_on_mamba_backbones(backbone, router, tiny_overrides, tmp_path):
    from looplab.train import train

    run_dir = tmp_path / router
    cfg = compose(tiny_overrides + [f"backbone={backbone}", f"depth_router={router}", "loop_depth=2x3",
                                    "backbone.d_state=8", "backbone.headdim=8",
                                    "dataset.batch_size=4", "trainer.max_steps=2", "trainer.val_check_interval=2",
                                    "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
                                    f"hydra.run.dir={run_dir}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    res = train(cfg)
    assert res["status"] == "ok" and res["global_step"] == 2 and res["model"]["depth_router"] == router


@pytest.mark.parametrize("kw, words", [
    (dict(backbone="mamba2", depth_router={"name": "expert_choice", "kv": "share_first"}),
     ["depth_router.kv=share_first", "backbone=mamba2", "recursion_wise"]),
    (dict(backbone="hybrid", hybrid_pattern="MMMA", depth_router={"name": "token_choice", "kv": "share_first"}),
     ["depth_router.kv=share_first", "backbone=hybrid"]),  # 2 layers of MMMA: no attention layer
    (dict(backbone="hybrid", exit_gate="ouro", depth_router={"name": "token_choice"}),
     ["depth_router", "exit_gate=ouro"]),
])
def test_still_unsupported_combinations_are_refused_naming_the_option(kw, words):
    fields = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=R, ffn_hidden=64, **SSM)
    fields.update(kw)
    with pytest.raises(ConfigError) as e:
        LoopedLMConfig(**fields)
    for w in words:
        assert w in str(e.value)


def test_exit_skip_handling_is_refused_with_a_router():
    model = make("token_choice", "hybrid")
    ids = ids_for(1, 4)
    with pytest.raises(ValueError, match="skip='ssm_skip'"):
        model.generate(ids, 2, exits=ExitPolicy(threshold=0.5, rule="entropy", skip="ssm_skip"))
