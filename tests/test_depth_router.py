"""depth_router (docs/formulations.md#routed-depth, Mixture-of-Recursions): models/router.py against slow references.

The references recompute routing on their own (full-size router scores, a Python top-k over the
candidates) and run the block either at full size under an explicit mask (the model's own masked
attention path: active keys only, causal by original position) or token by token (attention written
out per query with RoPE at the original positions). The model gathers the active tokens, runs them at
reduced length through SDPA's causal path and scatters back; all three must agree.
"""

from __future__ import annotations

import math

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from conftest import compose
from looplab.models.exits import ExitPolicy
from looplab.models.stream import Stream
from looplab.models import ConfigError, LoopedLM, LoopedLMConfig

B, T, V = 2, 12, 40


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def make(router="expert_choice", seed=0, **kw):
    torch.manual_seed(seed)
    fields = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=3, ffn_hidden=64, max_seq_len=64)
    fields.update(kw)
    if router is not None:
        fields["depth_router"] = router if isinstance(router, dict) else {"name": router}
    model = LoopedLM(LoopedLMConfig(**fields)).eval()
    if model.state is not None:  # W_o is zero at init: make the state visible in the logits
        with torch.no_grad():
            model.state.state_out.weight.normal_(0, 0.2)
    return model


def ids_for(seed=1, t=T):
    return torch.randint(0, V, (B, t), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------- references
def slow_topk(probs, active, k):
    """Python top-k of each row among its active tokens → (B, T) mask."""
    out = torch.zeros_like(active)
    for b in range(probs.shape[0]):
        cand = [t for t in range(probs.shape[1]) if active[b, t]]
        for t in sorted(cand, key=lambda t: -float(probs[b, t]))[:k]:
            out[b, t] = True
    return out


def rope(x, layer, pos):  # x (hd,), rotate-half at absolute position pos
    cos, sin = layer.attn.rope.cos[pos], layer.attn.rope.sin[pos]
    x1, x2 = x.chunk(2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


def slow_layer(layer, x, active, shared=None):
    """One llama layer, attention written out per query: an active token at original position t attends
    to the active tokens at positions <= t, RoPE at the original positions. Rows of inactive tokens: 0.
    shared (kv=share_first): None at the first loop, which returns its (k, v, active); later loops attend
    to those keys/values instead of their own."""
    att = layer.attn
    H, Hkv, hd = att.n_heads, att.n_kv_heads, att.head_dim
    xn = layer.attn_norm(x)
    q, k, v = att.qkv_proj(xn).split((H * hd, Hkv * hd, Hkv * hd), dim=-1)
    mine = (k, v, active)
    if shared is not None:
        k, v, key_active = shared
    else:
        key_active = active
    y = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if not active[b, t]:
                continue
            keys = [j for j in range(t + 1) if key_active[b, j]]
            heads = []
            for hh in range(H):
                sl = slice(hh * hd, (hh + 1) * hd)
                g = hh // (H // Hkv)  # grouped-query: the key/value head of query head hh
                kl = slice(g * hd, (g + 1) * hd)
                qt = rope(q[b, t, sl], layer, t)
                scores = torch.stack([qt @ rope(k[b, j, kl], layer, j) for j in keys]) / math.sqrt(hd)
                p = scores.softmax(0)
                heads.append(sum(p[i] * v[b, j, kl] for i, j in enumerate(keys)))
            y[b, t] = att.out_proj(torch.cat(heads))
    y = x + y
    return y + layer.mlp(layer.mlp_norm(y)), mine


def reference(model, ids, per_token=False):
    """Routed forward recomputed at full size → (per-depth logits (R, B, T, V), per-loop run masks)."""
    cfg, rc = model.config, model.config.depth_router
    R = cfg.n_loops
    x = model.embed(ids)
    pos = torch.arange(ids.shape[1])[None]
    s = model.state.initial_state(x) if model.state is not None else None
    h, active, readouts, masks = x, torch.ones(ids.shape, dtype=torch.bool), [], []
    share, first_kv = rc.kv == "share_first", {}
    if rc.name == "token_choice":
        p = model.router.router(x / rc.temperature).softmax(-1) * rc.scale
        depth = p.argmax(-1) + 1
        w_tok = p.gather(-1, (depth - 1)[..., None]).squeeze(-1)
    for r in range(R):
        if rc.name == "expert_choice":
            z = model.router.routers[r](x / rc.temperature).squeeze(-1)
            probs = rc.scale * torch.sigmoid(z)
            new = slow_topk(probs, active, max(1, int(rc.capacities(R)[r] * ids.shape[1])))
            w = probs
        else:
            new, w = depth > r, w_tok
        if rc.gating == "hard":
            w = torch.ones_like(w)
        if per_token:
            y = x
            for l, layer in enumerate(model.block):
                y, kv = slow_layer(layer, y, new, first_kv.get(l) if share and r > 0 else None)
                if r == 0:
                    first_kv[l] = kv
        else:  # the model's explicit-mask path at full size: keys = active tokens, causal by position
            y = model._block_forward(x, pos, new, None, r)
        hn = x + w[..., None] * (y if rc.update == "mor" else y - x)
        xn = hn
        if s is not None:
            sn, xn, _ = model.state(hn, s, pos)
            s = torch.where(new[..., None], sn, s)
        h = torch.where(new[..., None], hn, h)
        x = torch.where(new[..., None], xn, x)
        readouts.append(model.readout(Stream(x, x, s, h, pos, None)))
        masks.append(new)
        active = new
    logits = torch.stack([model.head(model.final_norm(z)) for z in readouts])
    return logits, masks


# -------------------------------------------------------------------- tests
def test_none_is_todays_model():
    plain, none = make(router=None), make(router="none")
    assert none.router is None and plain.router is None
    assert list(plain.state_dict()) == list(none.state_dict())
    assert not any("router" in k for k in none.state_dict())
    assert "depth_router" not in none.config.to_dict()  # config.json / checkpoint metadata / hash as before
    assert LoopedLMConfig.from_dict(none.config.to_dict()) == none.config
    ids = ids_for()
    torch.testing.assert_close(plain(ids).logits, none(ids).logits, rtol=0, atol=0)
    assert none(ids).routing is None


def test_full_capacity_hard_delta_equals_the_plain_model():
    """capacity 1 at every loop, weight 1, h = Block(x): the routed loop is the plain loop."""
    plain = make(router=None)
    routed = make(router={"name": "expert_choice", "capacity": [1.0, 1.0, 1.0], "gating": "hard", "update": "delta"})
    shared = {k: v for k, v in routed.state_dict().items() if not k.startswith("router.")}
    assert shared.keys() == plain.state_dict().keys()
    routed.load_state_dict({**routed.state_dict(), **plain.state_dict()})
    ids = ids_for()
    torch.testing.assert_close(routed(ids).logits, plain(ids).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("router", ["expert_choice", "token_choice"])
@pytest.mark.parametrize("state_mode", ["vanilla", "stateloop"])
def test_gather_scatter_equals_masked_full_size_reference(router, state_mode):
    model = make(router, state_mode=state_mode)
    ids = ids_for(t=16)
    with torch.no_grad():
        out = model(ids, return_all_loops=True)
        ref, masks = reference(model, ids)
    for r, m in enumerate(masks):
        assert torch.equal(out.routing.ran[r], m), f"loop {r + 1} ran other tokens"
    if router == "token_choice":  # the padded path: rows with different numbers of active tokens
        assert any(len(set(m.sum(1).tolist())) > 1 for m in masks)
    torch.testing.assert_close(out.loop_logits, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.routing.depth, torch.stack(masks).sum(0))


def test_recursion_wise_attention_equals_the_per_token_reference():
    """Loop r's active tokens attend only to loop r's active tokens, RoPE at the original positions."""
    model = make("expert_choice", n_layers=1)
    ids = ids_for()
    with torch.no_grad():
        out = model(ids, return_all_loops=True)
        ref, masks = reference(model, ids, per_token=True)
    assert masks[-1].sum() < masks[0].sum()
    torch.testing.assert_close(out.loop_logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("router", ["expert_choice", "token_choice"])
def test_share_first_equals_the_per_token_reference(router):
    """kv=share_first: every later loop's active tokens attend to the first loop's keys/values."""
    cfg = {"name": router, "kv": "share_first"}
    if router == "expert_choice":
        cfg["capacity"] = [0.75, 0.5, 0.25]  # the first loop runs a subset too: only its keys are shared
    model = make(cfg, n_layers=2, n_kv_heads=2)
    ids = ids_for()
    with torch.no_grad():
        out = model(ids, return_all_loops=True)
        ref, masks = reference(model, ids, per_token=True)
        plain = make({**cfg, "kv": "recursion_wise"}, n_layers=2, n_kv_heads=2)(ids, return_all_loops=True)
    torch.testing.assert_close(out.loop_logits, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out.loop_logits[-1], plain.loop_logits[-1])  # the two KV modes differ


def test_stopped_token_keeps_its_state_and_readout():
    model = make("expert_choice", state_mode="stateloop")
    with torch.no_grad():
        out = model(ids_for(), return_all_loops=True)
    depth = out.routing.depth
    for r in range(1, 3):
        stopped = depth <= r  # ran no loop after loop `depth`
        torch.testing.assert_close(out.loop_logits[r][stopped], out.loop_logits[r - 1][stopped], rtol=0, atol=0)
    assert (depth == 3).any() and (depth < 3).any()


def test_left_padding_leaves_token_choice_unchanged():
    """Token choice decides per token, so a left-padded row computes what the unpadded row does: the
    gathered valid mask and positions keep the padding out of every loop's attention."""
    model = make("token_choice", state_mode="stateloop_attn")
    ids = ids_for()
    padded = torch.cat([torch.zeros(B, 3, dtype=torch.long), ids], 1)
    mask = torch.ones_like(padded)
    mask[:, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, 3:], model(ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_capacity_and_causal_order():
    model = make({"name": "expert_choice", "capacity": [0.75, 0.5, 0.25], "capacity_warmup_steps": 10})
    ids = ids_for()
    with torch.no_grad():
        out = model(ids)
    prev = torch.ones(B, T, dtype=torch.bool)
    for r, (idx, ran) in enumerate(zip(out.routing.selected, out.routing.ran)):
        k = int([0.75, 0.5, 0.25][r] * T)
        assert idx.shape == (B, k) and (ran.sum(1) == k).all()
        assert (idx[:, 1:] > idx[:, :-1]).all(), "selected tokens must stay in causal order"
        assert not (ran & ~prev).any(), "a token stopped at an earlier loop was selected again"
        prev = ran
    model.train()  # warm-up: capacity 1 at step 0, the target after capacity_warmup_steps
    model.router.train_step = 0
    assert model.router.capacity_at(2) == 1.0
    model.router.train_step = 10
    assert model.router.capacity_at(2) == pytest.approx(0.25)


@pytest.mark.parametrize("router", ["expert_choice", "token_choice"])
def test_aux_losses_finite_nonzero_and_aux_router_sees_detached_input(router):
    cfg = {"name": router, "z_loss_coeff": 1e-3}
    if router == "expert_choice":
        cfg["aux_router"] = True
    model = make(cfg).train()
    out = model(ids_for())
    losses = out.routing.losses
    expected = {"router_bce", "aux_router_bce", "router_z"} if router == "expert_choice" else {"balance", "router_z"}
    assert set(losses) == expected
    for name, v in losses.items():
        assert torch.isfinite(v) and v > 0, name
    if router == "expert_choice":
        losses["aux_router_bce"].backward(retain_graph=True)
        assert model.embed.weight.grad is None and model.router.aux_routers[0].weight.grad is not None
    sum(losses.values()).backward()
    assert model.embed.weight.grad is not None


@pytest.mark.parametrize("kw, words", [
    (dict(backbone="mamba2", d_state=8, headdim=8, chunk_size=8,
          depth_router={"name": "expert_choice", "kv": "share_first"}),  # Mamba-2 routing: tests/test_depth_router_ssm.py
     ["depth_router.kv=share_first", "backbone=mamba2"]),
    (dict(exit_gate="ouro"), ["depth_router", "exit_gate=ouro"]),
    (dict(depth_router={"name": "expert_choice", "kv": "shared"}), ["depth_router.kv"]),
    (dict(depth_router={"name": "expert_choice", "capacity": [0.3, 0.6, 1.0]}), ["depth_router.capacity"]),
    (dict(depth_router={"name": "token_choice", "activation": "tanh"}), ["depth_router.activation"]),
    (dict(depth_router={"name": "expert_choice", "aux_router": True, "aux_router_coeff": 0.0}),
     ["depth_router.aux_router"]),
])
def test_unsupported_combinations_are_refused_naming_the_option(kw, words):
    kw.setdefault("depth_router", {"name": "expert_choice"})
    with pytest.raises(ConfigError) as e:
        make(router=kw.pop("depth_router"), **kw)
    for w in words:
        assert w in str(e.value)


def test_other_depths_and_decoding_options_are_refused():
    """Cached decoding routes (tests/test_depth_router_decode.py); other depths and exit options do not, and the
    refusal names the option."""
    model = make("token_choice")
    ids = ids_for()
    for word, call in (("n_loops=2", lambda: model(ids, n_loops=2)),
                       ("exits=ExitPolicy", lambda: model.generate(ids, 2, exits=ExitPolicy(threshold=0.5, rule="entropy"))),
                       ("at_step=1", lambda: model(ids, cache=model.allocate_cache(B, 32), exits=ExitPolicy(at_step=1)))):
        with pytest.raises(ValueError, match="depth_router=token_choice") as e:
            call()
        assert word in str(e.value)


def test_depth_router_group_composes():
    from looplab.training.compose import model_config_from_cfg

    assert model_config_from_cfg(compose(["loop_depth=1x3"]), vocab_size=V).depth_router.name == "none"
    mc = model_config_from_cfg(compose(["loop_depth=1x3", "depth_router=expert_choice", "trainer.max_steps=500"]), vocab_size=V)
    rc = mc.depth_router
    assert (rc.activation, rc.scale, rc.aux_loss_coeff, rc.capacity_warmup_steps) == ("sigmoid", 0.1, 0.001, 10)
    assert rc.capacities(3) == pytest.approx([1.0, 2 / 3, 1 / 3])
    tc = model_config_from_cfg(compose(["loop_depth=1x3", "depth_router=token_choice"]), vocab_size=V).depth_router
    assert (tc.activation, tc.scale, tc.balancing_loss_coeff) == ("softmax", 1.0, 0.1)
    with pytest.raises(ConfigError, match="depth_router=expert_choice"):
        model_config_from_cfg(compose(["loop_depth=1x3", "depth_router=expert_choice", "loop_depth.sampler=uniform"]),
                              vocab_size=V)


@pytest.mark.parametrize("router", ["expert_choice", "token_choice"])
def test_train_runs_with_a_router(router, tiny_overrides, tmp_path):
    from looplab.train import train

    run_dir = tmp_path / router
    cfg = compose(tiny_overrides + [f"depth_router={router}", "loop_depth=1x3", "trainer.max_steps=5",
                                    "trainer.val_check_interval=5", "trainer.limit_val_batches=1",
                                    "trainer.limit_test_batches=1", "trainer.log_every_n_steps=1",
                                    "logger=csv", f"hydra.run.dir={run_dir}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    res = train(cfg)
    assert res["status"] == "ok" and res["global_step"] == 5 and res["model"]["depth_router"] == router
    import csv

    rows = list(csv.DictReader(open(next(run_dir.rglob("metrics.csv")))))
    logged = {k for row in rows for k, v in row.items() if v}
    assert "train/router_mean_depth" in logged
    assert ("train/router_router_bce" if router == "expert_choice" else "train/router_balance") in logged
    # the test split is scored twice: routed as in training, and causally (each token on its own, as decoding)
    routing = res["routing"]
    assert 1.0 <= routing["mean_depth"] <= 3.0 and 1.0 <= routing["causal_mean_depth"] <= 3.0
    assert routing["causal_perplexity"] == pytest.approx(math.exp(routing["causal_loss"]), rel=1e-6)
    assert 1.0 < routing["causal_perplexity"] < 1e4
    if router == "token_choice":  # token choice routes causally in training too: both scorings agree
        assert routing["causal_loss"] == pytest.approx(res["loss"], rel=1e-5)
        assert routing["causal_mean_depth"] == pytest.approx(routing["mean_depth"], rel=1e-6)


def test_pretrained_round_trip_and_warm_start_from_a_plain_model(tmp_path):
    from looplab.train import load_warm_start

    routed = make({"name": "expert_choice", "aux_router": True})
    routed.save_pretrained(tmp_path / "routed")
    again = LoopedLM.from_pretrained(str(tmp_path / "routed")).eval()
    assert again.config.depth_router == routed.config.depth_router
    ids = ids_for()
    torch.testing.assert_close(again(ids).logits, routed(ids).logits, rtol=0, atol=0)
    plain = make(router=None, seed=5)
    plain.save_pretrained(tmp_path / "plain")
    missing = load_warm_start(routed, str(tmp_path / "plain"))
    assert missing and all(k.startswith("router.") for k in missing)
    torch.testing.assert_close(routed.block[0].attn.qkv_proj.weight, plain.block[0].attn.qkv_proj.weight)
