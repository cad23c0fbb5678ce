"""Activation checkpointing (models/checkpointing.py, `hardware.activation_checkpointing=false|loop|layer|selective`):
per-layer checkpoints in every path that trains give the gradients of no checkpointing, and hold a fraction of the
per-loop checkpoint's activations."""

from __future__ import annotations

import pytest
import torch

from looplab.models import ConfigError, ExitPolicy, LoopedLM, LoopedLMConfig
from looplab.models.checkpointing import checkpoint_mode

MODES = (None, "loop", "layer", "selective")


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


PATHS = {  # what trains: sequential loops, prelude/coda, the state branch (and its mixer), parallel loops, routing
    "sequential": dict(n_layers=2, n_loops=3),
    "prelude_coda_stateloop": dict(n_layers=1, n_loops=3, prelude_layers=1, coda_layers=1, state_mode="stateloop",
                                   state_mixer="attn"),
    "parallel": dict(n_layers=2, n_loops=3, loop_schedule="parallel", loop_kv="gswa", loop_window=3),
    "mamba2_hybrid": dict(n_layers=2, n_loops=2, backbone="hybrid", hybrid_pattern="MA", headdim=8, d_state=8, chunk_size=4),
    "routed": dict(n_layers=1, n_loops=3, depth_router="expert_choice"),
}
CALLS = {"plain": {}, "truncated_backprop": {"backprop_loops": 1}, "all_loops": {"return_all_loops": True}}


def _grads(kw: dict, mode, call: dict, counts: dict | None = None):
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=40, d_model=16, n_heads=2, ffn_hidden=32, **kw))
    model.train()
    model.activation_checkpointing = mode
    if counts is not None:  # how often each layer runs: a checkpointed layer runs again in the backward
        for name, m in model.named_modules():
            if name.count(".") == 1 and name.split(".")[0] in ("prelude", "block", "coda") or name == "state":
                # a pre-hook: a recomputation stops after the last op whose output the backward needs
                m.register_forward_pre_hook(lambda mod, a, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
    torch.manual_seed(1)
    ids = torch.randint(0, 40, (2, 10))
    targets = torch.randint(0, 40, (2, 10))
    if "exits" in call:
        call = {"exits": ExitPolicy(skip="kv_copy", steps=torch.randint(1, kw["n_loops"] + 1, (2, 10)))}
    out = model(ids, targets=targets, **call)
    loss = out.token_loss.mean() + (out.loop_token_loss.mean() if out.loop_token_loss is not None else 0)
    if out.routing is not None:
        loss = loss + sum(out.routing.losses.values())
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_mode_gives_the_gradients_of_none(path):
    calls = dict(CALLS) if path != "parallel" else {"plain": {}, "all_loops": {"return_all_loops": True}}
    if path == "sequential":
        calls["exit_aware"] = {"exits": True}
    for call in calls.values():
        ref = _grads(PATHS[path], None, call)
        for mode in MODES[1:]:
            got = _grads(PATHS[path], mode, call)
            assert set(got) == set(ref)
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7, msg=f"{path} {mode} {k}")


@pytest.mark.parametrize("path,call", [("prelude_coda_stateloop", {}), ("parallel", {}), ("sequential", {"exits": True})])
def test_layer_checkpoints_each_layer_application(path, call):
    """Under `layer` every prelude, block and coda layer and the state update run once more (their recomputation in
    the backward); the exit reference's layers too."""
    plain, layer = {}, {}
    _grads(PATHS[path], None, call, plain)
    _grads(PATHS[path], "layer", call, layer)
    assert plain and set(layer) == set(plain)
    for name, n in plain.items():
        assert layer[name] == 2 * n, (name, n, layer[name])


def _activation_peak(mode) -> int:
    """Peak bytes of the tensors a forward + backward of a 4-layer (4⊗1) model allocates: activations, their
    recomputation, temporaries and gradients (tests/peak_bytes.py: tensor bytes, deterministic)."""
    from peak_bytes import PeakBytes

    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=64, d_model=32, n_heads=2, ffn_hidden=128, n_layers=4, n_loops=1))
    model.train()
    model.activation_checkpointing = mode
    ids = torch.randint(0, 64, (8, 64))
    with PeakBytes(exclude=model.parameters()) as pb:
        model(ids, targets=ids).token_loss.mean().backward()
    return pb.peak


def test_per_layer_holds_a_fraction_of_the_per_loop_activations():
    """4⊗1: one loop is the whole stack, so `loop` recomputes all four layers at once and keeps the peak of no
    checkpointing; `layer` recomputes one layer at a time; `selective` keeps the matmul and attention outputs only."""
    peak = {mode: _activation_peak(mode) for mode in MODES}
    assert peak["loop"] >= 0.95 * peak[None]
    assert peak["layer"] < 0.5 * peak["loop"]
    assert peak["layer"] < peak["selective"] < 0.9 * peak[None]


def test_modes_from_the_config():
    from looplab.training.module import LoopedLMModule

    assert [checkpoint_mode(v) for v in (False, None, "none", "false", True, "true", "loop", "layer", "selective")] == \
        [None, None, None, None, "layer", "layer", "loop", "layer", "selective"]
    model = LoopedLM(LoopedLMConfig(vocab_size=8, d_model=8, n_heads=2, n_layers=1, n_loops=2))
    model.checkpoint_loops = True  # the older knob
    assert model.activation_checkpointing == "loop"
    cfg = dict(vocab_size=8, d_model=8, n_heads=2, n_layers=1, n_loops=2)
    assert LoopedLMModule(cfg, {"lr": 1e-3}, {}, activation_checkpointing=True).model.activation_checkpointing == "layer"
    assert LoopedLMModule(cfg, {"lr": 1e-3}, {}, checkpoint_loops=True).model.activation_checkpointing == "loop"
    with pytest.raises(ConfigError, match="hardware.activation_checkpointing='layers' is unknown; choose false, loop, "
                                          "layer, selective"):
        LoopedLMModule(cfg, {"lr": 1e-3}, {}, activation_checkpointing="layers")
