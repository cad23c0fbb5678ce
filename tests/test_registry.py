"""The variant registries (models/registry.py, docs/extending.md): names, aliases, options, capabilities, lookup.

What every built-in supports is checked against its behaviour by the conformance kit (tests/test_conformance.py);
here: that existing configs keep their architecture hash, how names and options are resolved, and that a
declared capability is what every entry point reads.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from looplab.checkpoint import architecture_hash
from looplab.models import ConfigError, LoopedLM, LoopedLMConfig
from looplab.models.registry import EXIT_RULES, LAYERS, REGISTRIES, STATE_UPDATES, Registry, Supports

BASE = dict(vocab_size=64, d_model=32, n_heads=4, n_layers=2, n_loops=3, d_state=16, headdim=16, chunk_size=8)

# architecture hashes computed before the registries existed: a checkpoint of any of these loads unchanged
GOLDEN = {
    "vanilla": ({}, "379b4b91c92fee60"),
    "stateloop": ({"state_mode": "stateloop"}, "229387c7d5808d2b"),
    "stateloop_attn": ({"state_mode": "stateloop_attn"}, "eb1100875cbd5548"),
    "stateloop_mamba2": ({"state_mode": "stateloop_mamba2"}, "4181c173516a2bcf"),
    "stateloop_reset": ({"state_mode": "stateloop_reset"}, "2931b24b78cd20b4"),
    "mamba2_gate": ({"backbone": "mamba2", "exit_gate": "ouro"}, "5f3ed7fdf08ea4ec"),
    "hybrid_inject": ({"backbone": "hybrid", "injection": "concat", "hybrid_pattern": "MA"}, "4b15da5f331b9677"),
    "prelude_coda_gqa": ({"prelude_layers": 1, "coda_layers": 1, "n_kv_heads": 2, "injection": "diag",
                          "state_mode": "stateloop", "state_init": "learned", "state_dim": 16}, "6e7874197dda6de5"),
    "router_ec": ({"depth_router": {"name": "expert_choice", "aux_router": True}}, "a7d23de6a679b26e"),
    "router_tc": ({"depth_router": "token_choice", "state_mode": "stateloop"}, "a9eb55b84298e05c"),
    "parallel_gswa": ({"loop_schedule": "parallel", "loop_kv": "gswa", "loop_window": 8}, "fb19f21f5f3b5805"),
    "parallel_own": ({"loop_schedule": "parallel"}, "9f4061b377fabc2b"),
    "add_inject": ({"injection": "add", "exit_gate": "ouro"}, "8fe41631238a46ea"),
}


@pytest.mark.parametrize("name", GOLDEN)
def test_existing_configs_keep_their_architecture_hash(name):
    kw, want = GOLDEN[name]
    cfg = LoopedLMConfig(**BASE, **kw)
    assert architecture_hash(cfg) == want
    assert LoopedLMConfig.from_dict(cfg.to_dict()) == cfg


def test_state_mode_aliases_are_one_config():
    """stateloop_attn is stateloop + the attention mixer: both spellings give one config, dict, hash and model."""
    a = LoopedLMConfig(**BASE, state_mode="stateloop_attn")
    b = LoopedLMConfig(**BASE, state_mode="stateloop", state_mixer="attn")
    assert a == b and a.state_mode == "stateloop_attn" and a.state_update == "stateloop" and a.state_mixer == "attn"
    assert "state_mixer" not in a.to_dict() and architecture_hash(a) == architecture_hash(b)
    torch.manual_seed(0)
    ma = LoopedLM(a)
    torch.manual_seed(0)
    mb = LoopedLM(b)
    assert all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values()))
    # a pair without an alias keeps both fields (and so its own hash)
    c = LoopedLMConfig(**BASE, state_mode="stateloop_reset", state_mixer="attn")
    assert c.state_mode == "stateloop_reset" and c.to_dict()["state_mixer"] == "attn"
    with pytest.raises(ConfigError, match="state_mode='stateloop_attn'.*state_mixer='mamba2'"):
        LoopedLMConfig(**BASE, state_mode="stateloop_attn", state_mixer="mamba2")
    with pytest.raises(ConfigError, match="state_mixer='attn' with state_mode='vanilla'"):
        LoopedLMConfig(**BASE, state_mixer="attn")


def test_unknown_names_are_refused_naming_the_field_and_the_choices():
    for kw, words in ((dict(state_mode="gru2"), "state_mode='gru2' is unknown"),
                      (dict(backbone="rwkv"), "backbone='rwkv' is unknown"),
                      (dict(state_mode="stateloop", state_mixer="conv"), "state_mixer='conv' is unknown"),
                      (dict(injection="mul"), "injection (loop_depth.injection)='mul' is unknown"),
                      (dict(loop_schedule="diagonal"), "loop_schedule (loop_depth.schedule)='diagonal'"),
                      (dict(hybrid_pattern="MX", backbone="hybrid"), "hybrid_pattern='MX'")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            LoopedLMConfig(**BASE, **kw)
    # a dotted name whose package is nowhere on the path says so (tests/test_extension_promises.py: the other cases)
    with pytest.raises(ConfigError, match="module not found: no module named 'no_such_pkg'"):
        LoopedLMConfig(**BASE, state_mode="no_such_pkg.gru")


def test_options_are_checked_and_enter_the_hash_only_when_set(tmp_path, monkeypatch):
    """A variant's own hyperparameters: an unknown key is refused by name; a default value is dropped."""
    pkg = tmp_path / "opt_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from looplab.models.registry import STATE_UPDATES
        from looplab.models.state import SelectiveState

        @STATE_UPDATES.register("opt_pkg.tuned")
        class Tuned(SelectiveState):
            @dataclass
            class Options:
                scale: float = 1.0
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    plain = LoopedLMConfig(**BASE, state_mode="opt_pkg.tuned")
    at_default = LoopedLMConfig(**BASE, state_mode="opt_pkg.tuned", options={"state_update": {"scale": 1.0}})
    changed = LoopedLMConfig(**BASE, state_mode="opt_pkg.tuned", options={"state_update": {"scale": 2.0}})
    assert at_default.options == {} and architecture_hash(at_default) == architecture_hash(plain)
    assert architecture_hash(changed) != architecture_hash(plain) and changed.to_dict()["options"] == {
        "state_update": {"scale": 2.0}}
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['scal'\]; its options: \['scale'\]"):
        LoopedLMConfig(**BASE, state_mode="opt_pkg.tuned", options={"state_update": {"scal": 2.0}})
    with pytest.raises(ConfigError, match="state_mode='stateloop' takes no options"):
        LoopedLMConfig(**BASE, state_mode="stateloop", options={"state_update": {"scale": 2.0}})
    with pytest.raises(ConfigError, match="options\\['colour'\\]: unknown axis"):
        LoopedLMConfig(**BASE, options={"colour": {"x": 1}})


def test_dotted_names_import_their_module_and_module_class_names_a_class(tmp_path, monkeypatch):
    (tmp_path / "rule_mod.py").write_text(textwrap.dedent('''
        from looplab.models.exit_rules import ExitRule
        from looplab.models.registry import EXIT_RULES

        @EXIT_RULES.register("rule_mod.never")
        class Never(ExitRule):
            @classmethod
            def stops(cls, t, threshold, logits):
                return cls.never(logits)

        class Always(ExitRule):
            @classmethod
            def stops(cls, t, threshold, logits):
                return ~cls.never(logits)
    '''))
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('the researcher’s own bug')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "rule_mod" not in sys.modules
    assert EXIT_RULES.get("rule_mod.never").__name__ == "Never"
    assert EXIT_RULES.get("rule_mod:Always").__name__ == "Always" and "rule_mod:Always" in EXIT_RULES.names()
    with pytest.raises(RuntimeError, match="own bug"):  # a module that exists and fails keeps its traceback
        EXIT_RULES.get("broken_mod.rule")
    with pytest.raises(ConfigError, match="cannot import 'Nope' from 'rule_mod'"):
        EXIT_RULES.get("rule_mod:Nope")


def test_registering_a_taken_name_is_refused():
    reg = Registry("test", "field")

    @reg.register("x")
    class A:
        pass

    with pytest.raises(ValueError, match="field='x' is already registered"):
        @reg.register("x")
        class B:
            pass

    assert reg.register("x", override=True)(type("C", (), {})).__name__ == "C"


def test_a_declared_capability_is_what_every_entry_point_reads(monkeypatch):
    """Declare speculation unsupported on a registered update: generate refuses it, naming that variant, and the
    config reports every refusing part."""
    from looplab.models.generation import Speculation, generate
    from looplab.models.state import SelectiveState

    class NoDraft(SelectiveState):
        supports = Supports(speculation="drafts would read a state this rule never wrote")

    monkeypatch.setitem(STATE_UPDATES._classes, "test.nodraft", NoDraft)
    monkeypatch.setattr(STATE_UPDATES, "_order", [*STATE_UPDATES._order, "test.nodraft"])
    model = LoopedLM(LoopedLMConfig(**BASE, state_mode="test.nodraft")).eval()
    with pytest.raises(ValueError, match="state_mode=test.nodraft: drafts would read a state this rule never wrote"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, speculation=Speculation(loops=1))
    cfg = LoopedLMConfig(**BASE, state_mode="stateloop_mamba2", backbone="hybrid")
    reason = cfg.unsupported("compile")
    assert "backbone=hybrid: a Mamba-2 step" in reason and "state_mode=stateloop_mamba2 (mixer mamba2)" in reason


def test_registries_hold_every_builtin_and_layers_are_letters():
    assert set(REGISTRIES) == {"backbone", "layer", "state_update", "state_mixer", "exit_gate", "injection",
                               "exit_rule", "handling", "depth_router", "loop_schedule"}
    assert {"vanilla", "stateloop", "stateloop_reset"} <= set(STATE_UPDATES.names())
    assert set(STATE_UPDATES.aliases()) == {"stateloop_attn", "stateloop_mamba2"}
    assert all(len(k) == 1 for k in LAYERS.names())
