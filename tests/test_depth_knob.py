"""Depth as a knob (docs/formulations.md#depth-as-a-knob): test-time depth n_loops=R′, randomized training depth with
truncated backprop, eval_loops, and FLOPs at the expected depth."""

from __future__ import annotations

import json

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.config import ConfigError
from looplab.models.exits import ExitPolicy
from looplab.training.depth import DepthSampler

V = 64
ATOL = 2e-5


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


def make_config(backbone="llama", state_mode="vanilla", exit_gate="none", n_loops=3, **kw) -> LoopedLMConfig:
    return LoopedLMConfig(vocab_size=V, d_model=32, n_heads=4, n_layers=2 if backbone == "hybrid" else 1,
                          n_loops=n_loops, backbone=backbone, hybrid_pattern="MA", state_mode=state_mode,
                          exit_gate=exit_gate, max_seq_len=32, d_state=8, headdim=16, chunk_size=4, kernel="torch", **kw)


def make_model(backbone="llama", state_mode="vanilla", exit_gate="none", n_loops=3, seed=0, **kw) -> LoopedLM:
    torch.manual_seed(seed)
    model = LoopedLM(make_config(backbone, state_mode, exit_gate, n_loops, **kw)).eval()
    with torch.no_grad():  # W_o is zero at init: StateLoop would test nothing beyond vanilla
        if model.state is not None:
            model.state.state_out.weight.normal_(0, 0.2)
        if model.exit_gate is not None:
            model.exit_gate.proj.weight.normal_(0, 1 / 32**0.5)
    return model


def ids(B=2, T=8, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------ defaults unchanged
def test_defaults_are_todays_model():
    """n_loops=None and backprop_loops=None are today's forward: same logits, same state-dict keys."""
    model = make_model("llama", "stateloop", "ouro")
    x = ids()
    ref = model(x, return_all_loops=True)
    new = model(x, return_all_loops=True, n_loops=None, backprop_loops=None)
    assert torch.equal(ref.logits, new.logits) and torch.equal(ref.exit_probs, new.exit_probs)
    same_r = model(x, return_all_loops=True, n_loops=3)
    assert torch.equal(ref.loop_logits, same_r.loop_logits)
    twin = make_model("llama", "stateloop", "ouro")
    assert list(twin.state_dict()) == list(model.state_dict())
    assert not any("inject" in k for k in model.state_dict())
    assert model.flops_per_token(16) == model.flops_per_token(16, loops=3)
    assert model.flops_per_token(16, training=True) == 3 * model.flops_per_token(16)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_n_loops_is_refused(bad):
    model = make_model()
    with pytest.raises(ValueError, match=f"n_loops={bad!r}"):
        model(ids(), n_loops=bad)
    with pytest.raises(ValueError, match=f"n_loops={bad!r}"):
        model.allocate_cache(1, 8, n_loops=bad)


# ------------------------------------------------------------------ test-time depth
@pytest.mark.parametrize("backbone,state_mode", [("llama", "stateloop"), ("mamba2", "stateloop_attn"), ("hybrid", "vanilla")])
@pytest.mark.parametrize("r_prime", [1, 2, 5])
def test_n_loops_equals_a_model_configured_with_that_depth(backbone, state_mode, r_prime):
    model = make_model(backbone, state_mode, "ouro", n_loops=3)
    other = LoopedLM(make_config(backbone, state_mode, "ouro", n_loops=r_prime)).eval()
    other.load_state_dict(model.state_dict())
    x = ids()
    a = model(x, n_loops=r_prime, return_all_loops=True)
    b = other(x, return_all_loops=True)
    assert a.loop_logits.shape[0] == r_prime
    torch.testing.assert_close(a.loop_logits, b.loop_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(a.exit_probs, b.exit_probs, atol=ATOL, rtol=0)  # gate over the R′ loops run
    torch.testing.assert_close(a.exit_probs.sum(-1), torch.ones(2, 8), atol=1e-5, rtol=0)
    # the first min(R, R′) loops are the same computation
    k = min(3, r_prime)
    torch.testing.assert_close(model(x, return_all_loops=True).loop_logits[:k], a.loop_logits[:k], atol=ATOL, rtol=0)


def test_exit_options_range_over_r_prime():
    model = make_model("llama", "vanilla", "ouro", n_loops=3)
    x = ids()
    out = model(x, n_loops=6, exits=ExitPolicy.from_kwargs(exit_at_step=5))
    assert bool((out.exit_steps == 5).all())
    with pytest.raises(ValueError, match="exit_at_step=4 must lie in 1..2"):
        model(x, n_loops=2, exits=ExitPolicy.from_kwargs(exit_at_step=4))
    # never reached: every token takes the last step R′
    out = model(x, n_loops=6, exits=ExitPolicy.from_kwargs(exit_threshold=1.01))
    assert bool((out.exit_steps == 6).all())
    out = model(x, n_loops=6, exits=ExitPolicy.from_kwargs(exit_rule="entropy", exit_threshold=0.0, exit_min_loops=5))
    assert bool((out.exit_steps == 6).all())
    with pytest.raises(ValueError, match="exit_min_loops=5"):
        model(x, n_loops=4, exits=ExitPolicy.from_kwargs(exit_rule="entropy", exit_threshold=1.0, exit_min_loops=5))


def test_cache_serves_only_its_depth():
    model = make_model()
    cache = model.allocate_cache(1, 16, n_loops=5)
    assert sorted({r for r, _ in cache.entries}) == list(range(5))
    with pytest.raises(ValueError, match="allocated for 5 loops"):
        model(ids(B=1), cache=cache)
    from looplab.models.generation import decode_one_token

    model(ids(B=1, T=3), cache=cache, n_loops=5)
    logits, _ = decode_one_token(model, ids(B=1, T=1), cache, n_loops=5)
    torch.testing.assert_close(logits, model(torch.cat([ids(B=1, T=3), ids(B=1, T=1)], 1), n_loops=5).logits[:, -1],
                               atol=ATOL, rtol=0)


# ---------------------------------------------------------------- truncated backprop
def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


@pytest.mark.parametrize("state_mode", ["vanilla", "stateloop"])
def test_truncated_backprop_equals_hand_construction(state_mode):
    R, k = 4, 2
    model = make_model("llama", state_mode, n_loops=R).train()
    x, y = ids(), ids(seed=2)

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    got = _grads(model, loss_of(model(x, backprop_loops=k).logits))

    # hand construction: loops 1..R−k under no_grad, their output detached, then the last k loops with a graph
    pos = torch.arange(x.shape[1])[None]
    with torch.no_grad():
        h = model.embed(x)
        s = model.state.initial_state(h) if model.state is not None else None
        for r in range(R - k):
            h = model._block_forward(h, pos, None, None, r)
            if s is not None:
                s, h, _ = model.state(h, s, pos)
    h, s = h.detach(), (s.detach() if s is not None else None)
    for r in range(R - k, R):
        out = model._block_forward(h, pos, None, None, r)
        if s is not None:
            s, h, _ = model.state(out, s, pos)
        else:
            h = out
    want = _grads(model, loss_of(model.head(model.final_norm(h))))
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=1e-5, msg=n)
    assert not got["embed.weight"].any()  # nothing before the last k loops gets a gradient

    full = _grads(model, loss_of(model(x).logits))
    assert full["embed.weight"].any()
    assert any(not torch.allclose(full[n], got[n]) for n in full if n.startswith("block."))
    # k >= R is full backprop
    same = _grads(model, loss_of(model(x, backprop_loops=R).logits))
    for n in full:
        torch.testing.assert_close(same[n], full[n], atol=0, rtol=0)
    with pytest.raises(ValueError, match="backprop_loops=0"):
        model(x, backprop_loops=0)


# ---------------------------------------------------------------------- depth draws
def test_depth_draws_are_a_function_of_seed_and_step():
    for sampler in ("uniform", "poisson_lognormal"):
        a = DepthSampler(loops=4, sampler=sampler, seed=7)
        b = DepthSampler(loops=4, sampler=sampler, seed=7)  # another rank / a resumed run
        draws = [a.draw(s) for s in range(200)]
        assert draws == [b.draw(s) for s in range(200)]
        assert len(set(draws)) > 3 and all(1 <= d <= 8 for d in draws)
        assert draws != [DepthSampler(loops=4, sampler=sampler, seed=8).draw(s) for s in range(200)]
    assert {DepthSampler(loops=4, seed=7).draw(s) for s in range(50)} == {4}  # fixed


def test_poisson_lognormal_mean_is_about_r():
    for R in (4, 8):
        s = DepthSampler(loops=R, sampler="poisson_lognormal", sigma=0.5, seed=3)
        draws = [s.draw(i) for i in range(4000)]
        mean = sum(draws) / len(draws)
        assert abs(mean - R) < 0.1 * R
        assert abs(mean - s.expected_loops()) < 0.05 * R  # the analytic expectation FLOPs use
    u = DepthSampler(loops=4, sampler="uniform", min_loops=2, max_loops=6, seed=0)
    assert u.expected_loops() == pytest.approx(4.0)
    assert u.expected_backprop_loops() == pytest.approx(4.0)
    assert DepthSampler(loops=4, sampler="uniform", min_loops=2, max_loops=6, backprop_loops=3).expected_backprop_loops() \
        == pytest.approx((2 + 3 + 3 + 3 + 3) / 5)


@pytest.mark.parametrize("key,value,match", [
    ("sampler", "gaussian", "loop_depth.sampler='gaussian'"),
    ("min_loops", 5, "loop_depth.min_loops=5 > loop_depth.max_loops=3"),
    ("backprop_loops", 0, "loop_depth.backprop_loops=0"),
    ("sigma", 0.0, "loop_depth.sigma=0.0"),
    ("max_loops", -2, "loop_depth.max_loops=-2"),
])
def test_bad_depth_options_are_refused(key, value, match):
    cfg = {"loops": 2, "sampler": "uniform", "max_loops": 3, key: value}
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(".", r"\.")):
        DepthSampler.from_config(cfg, seed=0)


# ---------------------------------------------------------------------------- FLOPs
def test_flops_at_the_expected_depth():
    model = make_model("hybrid", "stateloop", n_loops=4)
    f = {r: model.flops_per_token(16, loops=r) for r in (1, 2, 3, 4)}
    per_loop = f[2] - f[1]
    assert f[4] == model.flops_per_token(16) and f[3] - f[2] == per_loop
    s = DepthSampler(loops=4, sampler="poisson_lognormal", seed=0)
    e = s.expected_loops()
    assert model.flops_per_token(16, loops=e) == pytest.approx(f[1] + (e - 1) * per_loop, abs=1)
    # truncated backprop: backward over E[min(k, depth)] loops only
    k = DepthSampler(loops=4, sampler="uniform", min_loops=1, max_loops=4, backprop_loops=2)
    train = model.flops_per_token(16, training=True, loops=k.expected_loops(), backprop_loops=k.expected_backprop_loops())
    assert train == pytest.approx(f[1] + 1.5 * per_loop + 2 * (f[1] + (1.75 - 1) * per_loop), abs=2)


# ------------------------------------------------------------------ training module
def _module(sampler="uniform", exit_stage=None, backprop_loops=None, seed=5):
    from looplab.training.module import LoopedLMModule

    cfg = make_config("llama", "stateloop", "ouro" if exit_stage else "none", n_loops=3).to_dict()
    objective = {"exit_stage": exit_stage, "beta": 0.1, "final_loop_weight": 0.0, "k": 50.0, "gamma": 0.005,
                 "eval_thresholds": [], "eval_per_depth": True}
    depth = {"sampler": sampler, "min_loops": 1, "max_loops": 6, "sigma": 0.5, "backprop_loops": backprop_loops, "seed": seed}
    return LoopedLMModule(cfg, {"lr": 1e-3}, objective, depth=depth)


class _Steps:
    """A stand-in trainer that only knows the optimizer step (what the depth draw reads)."""

    def __init__(self, step):
        self.global_step = step


def _drawn_depths(module, steps, monkeypatch):
    seen = []
    forward = module.model.forward

    def spy(*args, **kwargs):
        seen.append((kwargs.get("n_loops"), kwargs.get("backprop_loops")))
        return forward(*args, **kwargs)

    monkeypatch.setattr(module.model, "forward", spy)
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    batch = {"input_ids": ids(), "targets": ids(seed=3)}
    for step in steps:
        monkeypatch.setattr(type(module), "global_step", property(lambda self, s=step: s), raising=True)
        loss = module.training_step(batch, 0)
        assert torch.isfinite(loss)
    return seen


@pytest.mark.parametrize("exit_stage", [None, "stage1"])
def test_training_steps_draw_the_same_depths_on_every_rank_and_after_resume(exit_stage, monkeypatch):
    rank0 = _drawn_depths(_module(exit_stage=exit_stage, backprop_loops=2), range(10), monkeypatch)
    rank1 = _drawn_depths(_module(exit_stage=exit_stage, backprop_loops=2), range(10), monkeypatch)
    resumed = _drawn_depths(_module(exit_stage=exit_stage, backprop_loops=2), range(5, 10), monkeypatch)
    assert rank0 == rank1 and resumed == rank0[5:]
    depths = [d for d, _ in rank0]
    assert 1 in depths and max(depths) > 3 and all(1 <= d <= 6 for d in depths)  # depth 1 and beyond R train too
    assert {k for _, k in rank0} == {2}
    assert depths == [DepthSampler(loops=3, sampler="uniform", max_loops=6, seed=5).draw(s) for s in range(10)]


def test_stage2_refuses_a_depth_sampler():
    with pytest.raises(ConfigError, match="loop_depth.sampler='uniform' with exit_gate.stage=stage2"):
        _module(exit_stage="stage2")


def test_fixed_sampler_trains_at_r_with_every_loop(monkeypatch):
    assert _drawn_depths(_module(sampler="fixed"), range(3), monkeypatch) == [(3, None)] * 3


def test_old_module_hyperparameters_still_build():
    """A checkpoint written before the depth knobs has no `depth` hyper-parameter: fixed depth R."""
    from looplab.training.module import LoopedLMModule

    m = LoopedLMModule(make_config(n_loops=3).to_dict(), {"lr": 1e-3}, {"exit_stage": None})
    assert m.depth.sampler == "fixed" and m.depth.draw(17) == 3 and m.depth.backprop_loops is None


# ------------------------------------------------------------------ end to end
def run_train(overrides, run_dir):
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from conftest import compose
    from looplab.train import train

    cfg = compose(overrides + [f"hydra.run.dir={run_dir}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    return train(cfg)


def test_randomized_depth_run_writes_eval_loops_and_depth_plot(tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    res = run_train(tiny_overrides + ["loop_depth=1x2", "state_mode=stateloop", "loop_depth.sampler=poisson_lognormal",
                                      "loop_depth.backprop_loops=1", "loop_depth.injection=add",
                                      "loop_depth.eval_loops=[1,2,4,8]"], run_dir)
    on_disk = json.loads((run_dir / "results.json").read_text())
    sweep = on_disk["per_depth"]["eval_loops"]
    assert set(sweep) == {"1", "2", "4", "8"}
    for d in sweep:
        assert 0 <= sweep[d]["accuracy"] <= 1 and sweep[d]["loss"] > 0 and sweep[d]["perplexity"] > 1
    # R′ = the trained R is the test split itself; the per-loop arrays are untouched
    assert sweep["2"]["accuracy"] == pytest.approx(on_disk["accuracy"]) and sweep["2"]["loss"] == pytest.approx(on_disk["loss"])
    assert len(on_disk["per_depth"]["acc"]) == 2 and len(on_disk["per_depth"]["loss"]) == 2
    png = run_dir / "depth.png"
    assert png.exists() and png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    # FLOPs at the expected depth, backward over E[min(k, depth)] loops
    from looplab.checkpoint import load_model

    model, _ = load_model(run_dir / "checkpoints" / "last.ckpt")
    s = DepthSampler(loops=2, sampler="poisson_lognormal", backprop_loops=1)
    seq = on_disk["flops_per_token"]["seq_len"]
    assert on_disk["flops_per_token"]["loops"] == pytest.approx(s.expected_loops())
    assert on_disk["flops_per_token"]["forward"] == model.flops_per_token(seq, loops=s.expected_loops())
    assert on_disk["flops_per_token"]["training"] == model.flops_per_token(
        seq, training=True, loops=s.expected_loops(), backprop_loops=s.expected_backprop_loops())
    assert on_disk["depth"]["sampler"] == "poisson_lognormal" and on_disk["depth"]["eval_loops"] == [1, 2, 4, 8]
    assert res["model"]["loops"] == 2 and model.config.injection == "add" and on_disk["params"]["injection"] == 32 * 32


@pytest.mark.parametrize("override,match", [
    ("loop_depth.sampler=gaussian", "loop_depth.sampler='gaussian'"),
    ("loop_depth.eval_loops=[0,2]", "loop_depth.eval_loops=[0, 2]"),
    ("loop_depth.backprop_loops=0", "loop_depth.backprop_loops=0"),
])
def test_bad_depth_config_fails_before_training(override, match, tiny_overrides, tmp_path):
    with pytest.raises(ConfigError) as err:
        run_train(tiny_overrides + [override], tmp_path / "bad")
    assert match in str(err.value)
    assert not (tmp_path / "bad" / "checkpoints").exists()


# ------------------------------------------------------------------------ injection
INJECTIONS = ("add", "concat", "diag")


def _perturb_injection(model):
    with torch.no_grad():
        for p in model.inject.parameters():
            p.add_(torch.randn_like(p) * 0.3)


@pytest.mark.parametrize("injection", INJECTIONS)
@pytest.mark.parametrize("state_mode", ["vanilla", "stateloop"])
def test_untrained_injection_equals_the_uninjected_model(injection, state_mode):
    plain = make_model("llama", state_mode, "ouro", n_loops=3, seed=4)
    injected = make_model("llama", state_mode, "ouro", n_loops=3, seed=4, injection=injection)
    own = plain.state_dict()
    assert set(injected.state_dict()) - set(own) == {k for k in injected.state_dict() if k.startswith("inject.")} != set()
    for k, v in own.items():  # registered last: the seeded init of everything else is the same
        assert torch.equal(injected.state_dict()[k], v), k
    x = ids()
    a, b = plain(x, return_all_loops=True), injected(x, return_all_loops=True)
    torch.testing.assert_close(a.loop_logits, b.loop_logits, atol=1e-6, rtol=0)
    # a vanilla checkpoint warm-starts it: the missing keys are exactly the injection
    fresh = LoopedLM(make_config("llama", state_mode, "ouro", injection=injection))
    missing, unexpected = fresh.load_state_dict(own, strict=False)
    assert missing and all(k.startswith("inject.") for k in missing) and not unexpected


def test_injection_order_of_operations():
    """x_{r+1} = Inject(h_r + W_o s_r, e) for r < R; readouts before the injection; none after the last loop."""
    model = make_model("llama", "stateloop", n_loops=3, injection="add")
    _perturb_injection(model)
    x = ids()
    pos = torch.arange(x.shape[1])[None]
    with torch.no_grad():
        e = model.embed(x)
        z, s, readouts = e, model.state.initial_state(e), []
        for r in range(3):
            h = model._block_forward(z, pos, None, None, r)
            s, z, _ = model.state(h, s, pos)
            readouts.append(z)
            if r < 2:
                z = z + e @ model.inject.weight.T
        want = model.head(model.final_norm(torch.stack(readouts)))
        got = model(x, return_all_loops=True).loop_logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not torch.allclose(got, make_model("llama", "stateloop", n_loops=3)(x, return_all_loops=True).loop_logits)


@pytest.mark.parametrize("injection", INJECTIONS)
@pytest.mark.parametrize("backbone,state_mode", [("llama", "stateloop_attn"), ("mamba2", "stateloop"), ("hybrid", "vanilla")])
def test_cached_decoding_with_injection_equals_recomputation(injection, backbone, state_mode):
    model = make_model(backbone, state_mode, n_loops=2, injection=injection)
    _perturb_injection(model)
    prompt = ids(B=1, T=4)
    for r_prime in (None, 3):
        out = model.generate(prompt, 3, return_logits=True, n_loops=r_prime)
        for i in range(3):
            full = model(out.sequences[:, : 4 + i], n_loops=r_prime).logits[:, -1]
            torch.testing.assert_close(out.logits[:, i], full, atol=ATOL, rtol=0)


def test_injection_flops_and_errors():
    plain = make_model("llama", n_loops=3)
    for injection, per in (("add", 2 * 32 * 32 + 32), ("concat", 2 * 64 * 32), ("diag", 2 * 32)):
        m = make_model("llama", n_loops=3, injection=injection)
        assert m.flops_per_token(16) == plain.flops_per_token(16) + 2 * per  # before loops 2 and 3
        assert m.num_parameters()["injection"] == sum(p.numel() for p in m.inject.parameters())
    with pytest.raises(ConfigError, match="injection.*'gated'"):
        make_config(injection="gated")
    from conftest import compose
    from looplab.training.compose import model_config_from_cfg

    assert model_config_from_cfg(compose(["loop_depth.injection=diag"]), vocab_size=64).injection == "diag"
    assert model_config_from_cfg(compose([]), vocab_size=64).injection == "none"
    with pytest.raises(ConfigError, match="'sideways'"):
        model_config_from_cfg(compose(["loop_depth.injection=sideways"]), vocab_size=64)


@pytest.mark.parametrize("injection", INJECTIONS)
def test_injection_under_truncated_backprop_gets_gradients(injection):
    """The injection runs at the start of the next loop, inside its gradient context: with k = 1 the
    last loop's injection still trains the injection and the embedding."""
    model = make_model("llama", "vanilla", n_loops=3, injection=injection).train()
    _perturb_injection(model)
    x, y = ids(), ids(seed=2)
    loss = torch.nn.functional.cross_entropy(model(x, backprop_loops=1).logits.flatten(0, 1), y.flatten())
    grads = _grads(model, loss)
    assert grads["embed.weight"].any() and all(grads[n].any() for n in grads if n.startswith("inject."))


@pytest.mark.parametrize("injection,r_prime", [("none", 5), ("add", None), ("concat", 2), ("diag", 6)])
def test_flops_match_flop_counter_at_r_prime_and_with_injection(injection, r_prime):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = make_model("llama", "stateloop", n_loops=3, injection=injection)
    T = 16
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(ids(T=T), n_loops=r_prime)
    measured = counter.get_total_flops() / (2 * T)
    # FlopCounterMode counts matmuls only: the elementwise terms (state gate, diag gain) are below 1%
    assert measured == pytest.approx(model.flops_per_token(T, loops=r_prime), rel=0.01)
