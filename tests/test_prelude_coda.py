"""Prelude and coda (docs/formulations.md#prelude-and-coda): non-shared layers before and after the looped block.

Defaults unchanged; the forward equals a hand construction from its parts; per-depth readouts, gates and
StateLoop readouts pass through the coda; cached decoding (prelude cache, one coda cache per depth)
equals recomputation with and without exits and at R′ ≠ R; skip_compute with the coda equals its online
reference; FLOPs match FlopCounterMode; training composes `loop_depth.prelude/coda`.
"""

from __future__ import annotations

import json

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.config import ConfigError
from looplab.models.exit_compute import forward_with_exits
from looplab.models.exits import ExitPolicy
from looplab.models.generation import decode_one_token
from looplab.models.registry import BACKBONES as BACKBONE_REGISTRY

V, R, ATOL = 64, 3, 3e-5
BACKBONES = BACKBONE_REGISTRY.names()


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


def make_config(backbone="llama", state_mode="vanilla", exit_gate="ouro", n_loops=R, **kw) -> LoopedLMConfig:
    return LoopedLMConfig(vocab_size=V, d_model=32, n_heads=4, n_layers=2 if backbone == "hybrid" else 1,
                          n_loops=n_loops, backbone=backbone, hybrid_pattern="MA", state_mode=state_mode,
                          exit_gate=exit_gate, max_seq_len=32, d_state=8, headdim=16, chunk_size=4, kernel="torch", **kw)


def make_model(backbone="llama", state_mode="vanilla", exit_gate="ouro", seed=0, **kw) -> LoopedLM:
    torch.manual_seed(seed)
    model = LoopedLM(make_config(backbone, state_mode, exit_gate, **kw)).eval()
    with torch.no_grad():  # W_o is zero at init: StateLoop would test nothing beyond vanilla
        if model.state is not None:
            model.state.state_out.weight.normal_(0, 0.2)
        if model.exit_gate is not None:
            model.exit_gate.proj.weight.normal_(0, 1 / 32**0.5)  # mixed exit depths at q = 0.5
    return model


def ids(B=2, T=8, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ defaults
@pytest.mark.parametrize("backbone", BACKBONES)
def test_zero_prelude_and_coda_is_todays_model(backbone):
    """prelude = coda = 0: the same seeded parameters, state-dict keys and logits as a model built without the
    fields, and a checkpoint of it (config without the fields) loads strictly."""
    torch.manual_seed(3)
    old = LoopedLM(make_config(backbone, "stateloop")).eval()
    torch.manual_seed(3)
    new = LoopedLM(make_config(backbone, "stateloop", prelude_layers=0, coda_layers=0)).eval()
    assert list(old.state_dict()) == list(new.state_dict())
    for k, v in old.state_dict().items():
        assert torch.equal(new.state_dict()[k], v), k
    assert not any(k.startswith(("prelude", "coda")) for k in new.state_dict())
    x = ids()
    a, b = old(x, return_all_loops=True), new(x, return_all_loops=True)
    assert torch.equal(a.loop_logits, b.loop_logits) and torch.equal(a.exit_probs, b.exit_probs)
    legacy = {k: v for k, v in new.config.to_dict().items() if k not in ("prelude_layers", "coda_layers")}
    again = LoopedLM(LoopedLMConfig.from_dict(legacy))
    again.load_state_dict(old.state_dict(), strict=True)
    assert set(new.allocate_cache(1, 4).entries) == set(old.allocate_cache(1, 4).entries)
    assert new.num_parameters()["prelude"] == new.num_parameters()["coda"] == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_counts_are_refused_with_the_value(bad):
    for field, key in (("prelude_layers", "prelude"), ("coda_layers", "coda")):
        with pytest.raises(ConfigError, match=rf"{field} \(loop_depth.{key}\)={bad!r}"):
            make_config(**{field: bad})


def test_layer_kinds_follow_the_block():
    assert make_config("llama", prelude_layers=2, coda_layers=1).all_layer_types == "AA" + "A" + "A"
    assert make_config("mamba2", prelude_layers=1, coda_layers=2).all_layer_types == "M" + "M" + "MM"
    cfg = make_config("hybrid", prelude_layers=3, coda_layers=1)  # hybrid_pattern "MA" tiled over each part
    assert (cfg.prelude_layer_types, cfg.layer_types, cfg.coda_layer_types) == ("MAM", "MA", "M")
    model = LoopedLM(cfg)
    assert [layer.kind for layer in model.prelude] == list("MAM") and [layer.kind for layer in model.coda] == ["M"]


# ------------------------------------------------------------------ forward
@pytest.mark.parametrize("state_mode", ["vanilla", "stateloop"])
@pytest.mark.parametrize("injection", ["none", "add"])
@torch.no_grad()
def test_forward_equals_hand_construction(state_mode, injection):
    """embed → prelude → R × block (+ state branch, + injection of the prelude output) → coda → norm → head;
    every depth's readout (loop_logits, the gate, loop_hidden) goes through the coda."""
    model = make_model("llama", state_mode, prelude_layers=1, coda_layers=1, injection=injection)
    if model.inject is not None:
        model.inject.weight.normal_(0, 0.1)
    x = ids()
    pos = torch.arange(x.shape[1])[None]
    e = model.prelude[0](model.embed(x), pos)
    z, s, readouts = e, (model.state.initial_state(e) if model.state is not None else None), []
    for r in range(R):
        if injection != "none" and r > 0:
            z = z + e @ model.inject.weight.T
        h = model.block[0](z, pos)
        if model.state is not None:
            s, z, _ = model.state(h, s, pos)
        else:
            z = h
        readouts.append(z)
    hidden = torch.stack([model.final_norm(model.coda[0](zr, pos)) for zr in readouts])
    want = model.head(hidden)
    torch.testing.assert_close(model(x).logits, want[-1], atol=1e-6, rtol=0)
    out = model(x, return_all_loops=True)
    torch.testing.assert_close(out.loop_logits, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.loop_hidden, hidden, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.exit_gate_logits, model.exit_gate.logit(hidden).permute(1, 2, 0), atol=1e-6, rtol=0)
    # without the coda at the shallow depths the per-depth outputs would differ
    assert not torch.allclose(out.loop_logits[0], model.head(model.final_norm(readouts[0])), atol=1e-3)


@torch.no_grad()
def test_exit_threshold_reads_coda_outputs():
    model = make_model("llama", prelude_layers=1, coda_layers=2)
    x = ids()
    full = model(x, return_all_loops=True)
    out = model(x, exits=ExitPolicy.from_kwargs(exit_threshold=0.5))
    assert len(out.exit_steps.unique()) > 1, "exits were meant to be mixed"
    want = full.loop_logits.gather(0, (out.exit_steps - 1)[None, ..., None].expand(1, *x.shape, V))[0]
    torch.testing.assert_close(out.logits, want, atol=1e-6, rtol=0)


def test_parameters_and_init_scale():
    model = make_model("llama", prelude_layers=2, coda_layers=1)
    n = model.num_parameters()
    per_layer = sum(p.numel() for p in model.block[0].parameters())
    assert n["prelude"] == 2 * per_layer and n["coda"] == per_layer and n["block"] == per_layer
    assert n["total"] == sum(p.numel() for p in model.parameters())
    # residual writers scaled by the effective depth P + N·R + C = 2 + 3 + 1
    std = (2 / (5 * 32)) ** 0.5
    torch.manual_seed(0)
    big = LoopedLM(LoopedLMConfig(vocab_size=V, d_model=32, n_heads=4, n_layers=1, n_loops=60, prelude_layers=20, coda_layers=20,
                                  max_seq_len=16))
    w = torch.cat([m.attn.out_proj.weight.flatten() for m in [*big.prelude, *big.block, *big.coda]])
    assert float(w.detach().std()) == pytest.approx(std / (2 * 100) ** 0.5 * 0.88, rel=0.1)  # trunc at ±2σ: std × 0.88


def test_prelude_and_coda_layers_are_fsdp_units():
    from looplab.training.distributed import block_layer_classes

    model = make_model("hybrid", prelude_layers=1, coda_layers=1)
    units = [name for name, m in model.named_modules() if isinstance(m, tuple(block_layer_classes()))]
    assert units == ["prelude.0", "block.0", "block.1", "coda.0"]


# ------------------------------------------------------------------ caches
def test_cache_entries():
    model = make_model("hybrid", "stateloop_mamba2", prelude_layers=2, coda_layers=1)
    cache = model.allocate_cache(1, 8, n_loops=4)
    keys = set(cache.entries)
    assert {("prelude", 0), ("prelude", 1)} <= keys
    assert {(r, ("coda", 0)) for r in range(4)} <= keys
    assert len(keys) == 2 + 4 * (2 + 1 + 1)


@pytest.mark.parametrize("backbone", BACKBONES)
@torch.no_grad()
def test_cached_decoding_equals_recomputation(backbone, state_mode="stateloop_mamba2"):
    """generate(return_logits) with prelude/coda = a full forward over each prefix: plain, with an exit
    threshold (the coda at every depth), and at R′ ≠ R."""
    model = make_model(backbone, state_mode, prelude_layers=1, coda_layers=1)
    prompt = ids(B=1, T=5)
    q = ExitPolicy(threshold=0.5)
    for kw in ({}, {"exits": q}, {"n_loops": 5}, {"n_loops": 2, "exits": q}):
        out = model.generate(prompt, 4, return_logits=True, **kw)
        for i in range(4):
            full = model(out.sequences[:, : 5 + i], **kw)
            torch.testing.assert_close(out.logits[:, i], full.logits[:, -1], atol=ATOL, rtol=0, msg=lambda m: f"{kw}: {m}")
            if "exits" in kw:
                assert torch.equal(out.exit_steps[:, i], full.exit_steps[:, -1])


@torch.no_grad()
def test_mixing_per_depth_and_plain_calls_on_one_cache_is_refused():
    model = make_model("llama", prelude_layers=1, coda_layers=1)
    cache = model.allocate_cache(1, 8)
    model(ids(B=1, T=3), cache=cache)  # plain: the coda runs at the last depth only
    with pytest.raises(ValueError, match="coda cache of loop 1"):
        model(ids(B=1, T=1), cache=cache, return_all_loops=True)


# ------------------------------------------------------------------ skip_compute
@pytest.mark.parametrize("backbone,state_mode,handling", [
    ("llama", "vanilla", "kv_copy"), ("llama", "stateloop", "kv_copy"),
    ("mamba2", "vanilla", "ssm_skip"), ("mamba2", "stateloop_mamba2", "ssm_propagate"),
    ("hybrid", "stateloop", "ssm_skip"), ("hybrid", "vanilla", "ssm_propagate")])
@pytest.mark.parametrize("rule,n_loops", [("gate", None), ("entropy", 5)])
@torch.no_grad()
def test_skip_compute_equals_online_reference(backbone, state_mode, handling, rule, n_loops):
    """Teacher-forced skip_compute decoding = forward_with_exits(rule=...) with prelude and coda: the prelude
    runs once per token, each depth's readout goes through the coda before the rule reads it, and the
    coda caches of depths beyond a token's exit are filled from its exit depth's coda inputs."""
    model = make_model(backbone, state_mode, seed=2, prelude_layers=1, coda_layers=2, injection="add")
    model.inject.weight.normal_(0, 0.1)
    model.exit_gate.proj.bias.fill_(-1.0)  # later exits: some tokens run every loop
    x = ids(B=3, T=12, seed=8)
    depth = n_loops or R
    if rule == "gate":
        threshold = 0.5
    else:  # about half the tokens stop by loop 2
        lp = torch.log_softmax(model(x, n_loops=n_loops, return_all_loops=True).loop_logits[1], -1)
        threshold = float((-(lp.exp() * lp).sum(-1)).median())
    ref = forward_with_exits(model, x, None, handling, rule=rule, threshold=threshold, n_loops=n_loops)
    assert bool((ref.exit_steps < depth).any()) and len(ref.exit_steps.unique()) > 1, "exits were meant to be mixed"
    cache = model.allocate_cache(3, 12, n_loops=depth)
    for t in range(12):
        logits, steps = decode_one_token(model, x[:, t:t + 1], cache, n_loops=n_loops, exits=ExitPolicy.from_kwargs(
            exit_threshold=threshold, exit_rule=rule, skip_compute=handling))
        assert torch.equal(steps, ref.exit_steps[:, t]), t
        torch.testing.assert_close(logits, ref.logits[:, t], atol=ATOL, rtol=1e-4)
    # never exiting, the reference is the model's own forward
    full = forward_with_exits(model, x, torch.full((3, 12), depth), handling, n_loops=n_loops)
    torch.testing.assert_close(full.loop_logits, model(x, n_loops=n_loops, return_all_loops=True).loop_logits,
                               atol=ATOL, rtol=1e-4)


@torch.no_grad()
def test_exited_tokens_leave_their_exit_depth_coda_keys():
    """kv_copy: once every row has exited at loop e, the deeper loops' coda key/values at that position are
    the exit depth's (the frozen-input rule applied to the coda)."""
    model = make_model("llama", prelude_layers=1, coda_layers=1)
    cache = model.allocate_cache(1, 8)
    model(ids(B=1, T=3), cache=cache, exits=ExitPolicy.from_kwargs(exit_threshold=0.0))  # prefill: every depth
    _, steps = decode_one_token(model, ids(B=1, T=1, seed=5), cache,
                                exits=ExitPolicy.from_kwargs(exit_threshold=0.0, skip_compute="kv_copy"))
    assert int(steps) == 1
    e = cache[0, ("coda", 0)]
    for r in (1, 2):
        deeper = cache[r, ("coda", 0)]
        assert int(cache.lengths[0]) == 4
        assert torch.equal(deeper.k[:, :, 3], e.k[:, :, 3]) and torch.equal(deeper.v[:, :, 3], e.v[:, :, 3])


# ------------------------------------------------------------------ FLOPs
@pytest.mark.parametrize("r_prime,all_loops", [(None, False), (5, True), (2, False)])
def test_flops_match_flop_counter(r_prime, all_loops):
    """Prelude once, the readout (coda + head) once, or at every depth with per-depth outputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = make_model("llama", "stateloop", exit_gate="none", prelude_layers=1, coda_layers=2, injection="add")
    T = 16
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        model(ids(T=T), n_loops=r_prime, return_all_loops=all_loops)
    measured = counter.get_total_flops() / (2 * T)
    # FlopCounterMode counts matmuls only: the elementwise terms (state gate) are below 1%
    assert measured == pytest.approx(model.flops_per_token(T, loops=r_prime, all_readouts=all_loops), rel=0.01)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_flops_add_the_prelude_once_and_the_coda_per_readout(backbone):
    T, kw = 16, dict(exit_gate="none", injection="add")
    model = make_model(backbone, "stateloop", prelude_layers=1, coda_layers=2, **kw)
    plain = make_model(backbone, "stateloop", **kw)
    prelude = model.prelude[0].flops_per_token(T)
    coda = sum(m.flops_per_token(T) for m in model.coda)
    head = 2 * 32 * V
    for loops in (None, 2, 5.5):
        depth = loops or R
        assert model.flops_per_token(T, loops=loops) == round(plain.flops_per_token(T, loops=loops) + prelude + coda)
        assert model.flops_per_token(T, loops=loops, all_readouts=True) == round(
            plain.flops_per_token(T, loops=loops) + prelude + depth * (coda + head) - head)
        assert model.flops_per_token(T, training=True, loops=loops, backprop_loops=1) == round(
            plain.flops_per_token(T, training=True, loops=loops, backprop_loops=1) + 3 * (prelude + coda))


# ------------------------------------------------------------------ conversion
def test_to_transformers_unrolls_prelude_block_and_coda(tmp_path):
    transformers = pytest.importorskip("transformers")
    from looplab import convert

    model = make_model("llama", exit_gate="none", prelude_layers=1, coda_layers=1)
    assert convert.unrolled_depth(model.config) == 1 + 3 + 1
    assert [convert.unrolled_layer(model.config, k) for k in range(5)] == ["prelude.0", "block.0", "block.0", "block.0", "coda.0"]
    diff = convert.to_transformers(model, tmp_path / "tf", log=lambda *_: None)
    assert diff < 1e-5
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tf"), dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 5


# ------------------------------------------------------------------ end to end
def run_train(overrides, run_dir):
    from test_depth_knob import run_train as run

    return run(overrides, run_dir)


def test_training_run_with_prelude_and_coda(tiny_overrides, tmp_path):
    """A training run with every depth option at tiny scale: prelude, coda, injection, a depth sampler with
    truncated backprop and test-time depths."""
    run_dir = tmp_path / "run"
    res = run_train(tiny_overrides + ["loop_depth=1x2", "loop_depth.prelude=1", "loop_depth.coda=1",
                                      "loop_depth.injection=add", "loop_depth.sampler=poisson_lognormal",
                                      "loop_depth.backprop_loops=1", "loop_depth.eval_loops=[1,4]"], run_dir)
    on_disk = json.loads((run_dir / "results.json").read_text())
    assert on_disk["status"] == "ok" and on_disk["model"]["prelude"] == 1 and on_disk["model"]["coda"] == 1
    assert set(on_disk["per_depth"]["eval_loops"]) == {"1", "4"} and (run_dir / "depth.png").exists()
    assert res["model"]["prelude"] == 1
    from looplab.checkpoint import load_model

    model, _ = load_model(run_dir / "checkpoints" / "last.ckpt")
    assert model.config.prelude_layers == 1 and model.config.coda_layers == 1 and model.config.injection == "add"
    assert on_disk["params"]["prelude"] == on_disk["params"]["coda"] == on_disk["params"]["block"] > 0
    seq, loops = on_disk["flops_per_token"]["seq_len"], on_disk["flops_per_token"]["loops"]
    assert on_disk["flops_per_token"]["forward"] == model.flops_per_token(seq, loops=loops)


@pytest.mark.parametrize("override,match", [("loop_depth.prelude=-1", "loop_depth.prelude=-1"),
                                            ("loop_depth.coda=1.5", "loop_depth.coda=1.5")])
def test_bad_prelude_or_coda_fails_before_training(override, match, tiny_overrides, tmp_path):
    with pytest.raises(ConfigError) as err:
        run_train(tiny_overrides + [override], tmp_path / "bad")
    assert match in str(err.value)
    assert not (tmp_path / "bad" / "checkpoints").exists()
