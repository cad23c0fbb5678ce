"""The extension points keep their promises, and their errors say what to do (docs/extending.md, docs/training.md).

A. A researcher's variant is registered from a module outside looplab:
   - a subclass that declares no `supports` claims no capability it did not declare: it is not exportable and does
     not run under parallel loops, and the export and the parallel schedule refuse it naming it and what to declare;
     looplab's own variants keep what they declare;
   - every `*_options` key reaches its variant (an injection's constructor, a state update's, the config a backbone,
     mixer or schedule is handed), or is refused naming the key;
   - `python -m looplab.models capabilities --import MODULE` lists the variants MODULE registers;
   - docs/extending.md's injection example takes its option and computes the un-injected model at init, and an exit
     rule's "hidden" is the final-normed readout the page says it is.
B. Bad input is one line (looplab/cli_errors.py), naming the value and the fix: a typo in a dotted variant name (the
   closest names), a module that is not found or raises ImportError (told apart, the import error shown), an option
   typo (before and after Hydra's `+`), exit thresholds out of range in generate and eval.

Everything runs in this process through the CLIs' own `clean_errors` / `main`, except one `python -m looplab.train`
that shows the wiring of train's entry point (its variant check runs before Hydra, outside any run folder).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import ROOT, compose
from looplab import cli_errors
from looplab.cli_errors import clean_errors
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models import registry
from looplab.models.backbone import Backbone
from looplab.models.exit_gate import ExitGate
from looplab.models.exit_rules import ExitRule, check_rule
from looplab.models.injection import Injection
from looplab.models.llama import AttentionLayer
from looplab.models.registry import (BACKBONES, EXIT_GATES, EXIT_RULES, INJECTIONS, LAYERS, LOOP_SCHEDULES, REGISTRIES,
                                     STATE_MIXERS, STATE_UPDATES, ConfigError, Supports, options_of)
from looplab.models.schedule import Sequential
from looplab.models.state import SelectiveState, StateBranch, StateMixer
from looplab.training.compose import model_config_from_cfg

pytestmark = pytest.mark.usefixtures("one_thread_module")

PROG = "python -m looplab.x"
TINY = dict(vocab_size=16, d_model=32, n_heads=2, n_layers=1, n_loops=2, max_seq_len=32)
HYDRA_TINY = ["backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64", "loop_depth=1x2"]


@pytest.fixture(autouse=True)
def registries(monkeypatch):
    """What a test registers, imports or trusts is gone after it (other modules build parameter lists from the
    registries)."""
    for reg in REGISTRIES.values():
        monkeypatch.setattr(reg, "_classes", dict(reg._classes))
        monkeypatch.setattr(reg, "_order", list(reg._order))
        monkeypatch.setattr(reg, "_lazy", dict(reg._lazy))  # a built-in first used here moves out of _lazy
    monkeypatch.setattr(registry, "_TRUSTED", set(registry._TRUSTED))
    for k in cli_errors.FULL_ERROR_ENV:
        monkeypatch.delenv(k, raising=False)
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0].startswith("promise_"):
            del sys.modules[name]


def error_line(fn, capsys, tmp_path) -> str:
    """Run fn as a looplab CLI runs its main: one `PROG: error: ...` line on stderr, exit 1, the traceback logged."""
    log = tmp_path / "traceback.log"
    with pytest.raises(SystemExit) as info, clean_errors(PROG, log):
        fn()
    assert info.value.code == cli_errors.EXIT_CODE
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), err
    assert "Traceback (most recent call last)" in log.read_text()
    return lines[0]


def package(root: Path, name: str, files: dict[str, str]) -> Path:
    """A researcher's package `name` under root (put root on sys.path to import it)."""
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "__init__.py").write_text("")
    for rel, code in files.items():
        (root / name / rel).write_text(textwrap.dedent(code))
    return root


MINLSTM = '''
    from dataclasses import dataclass

    import torch
    import torch.nn as nn

    from looplab.models.registry import STATE_UPDATES
    from looplab.models.state import StateBranch


    @STATE_UPDATES.register("promise_ideas.minlstm")
    class MinLSTM(StateBranch):
        @dataclass
        class Options:
            forget_bias: float = 1.0

        def build_update(self, d, ds):
            self.forget = nn.Linear(d, ds)
            self.cand = nn.Linear(d, ds, bias=False)

        def update(self, h, s_prev):
            f = torch.sigmoid(self.forget(h))
            return f * s_prev + (1 - f) * self.cand(h), f
'''


# ------------------------------------------------------------------ A1. no capability a subclass did not declare
class OwnInjection(Injection):
    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(d))

    def forward(self, x, e):
        return x + self.gain * e


class OwnState(StateBranch):
    def build_update(self, d, ds):
        self.proj = nn.Linear(d, ds)

    def update(self, h, s_prev):
        return 0.5 * s_prev + 0.5 * self.proj(h), torch.full_like(s_prev, 0.5)


class OwnSelective(SelectiveState):
    pass


class OwnBackbone(Backbone):
    @classmethod
    def layer_kinds(cls, config, n):
        return "A" * n


class OwnLayer(AttentionLayer):
    kind = "Q"


class OwnMixer(StateMixer):
    @classmethod
    def build(cls, cfg):
        return None


class OwnGate(ExitGate):
    pass


class OwnSchedule(Sequential):
    pass


# (registry, name, subclass, its base): a subclass of every base a variant is written against, none declaring supports
OWN = [(INJECTIONS, "promise_test.injection", OwnInjection, Injection),
       (STATE_UPDATES, "promise_test.state", OwnState, StateBranch),
       (STATE_UPDATES, "promise_test.selective", OwnSelective, SelectiveState),
       (BACKBONES, "promise_test.backbone", OwnBackbone, Backbone),
       (LAYERS, "Q", OwnLayer, AttentionLayer),
       (STATE_MIXERS, "promise_test.mixer", OwnMixer, StateMixer),
       (EXIT_GATES, "promise_test.gate", OwnGate, ExitGate),
       (LOOP_SCHEDULES, "promise_test.schedule", OwnSchedule, Sequential)]


@pytest.mark.parametrize("reg,name,cls,base", OWN, ids=[base.__name__ for *_, base in OWN])
def test_a_subclass_that_declares_nothing_claims_neither_export_nor_parallel_loops(reg, name, cls, base):
    reg.register(name)(cls)
    sup = cls.supports
    for feature in registry.OPT_IN:
        assert getattr(sup, feature) is not True, f"{name} ({base.__name__} subclass) claims {feature}"
    export = sup.why_not("export")
    assert "declare export=True in the class's own `supports`" in export and "exported code" in export
    assert sup.why_not("parallel_loops") is not None
    # the rest of the base's declarations are kept (a Layer's cache kind, which decoding needs)
    assert sup.cache == base.supports.cache


def test_export_and_parallel_loops_refuse_an_undeclared_variant_naming_it_and_the_fix(tmp_path):
    from looplab.remote_code import write_folder

    INJECTIONS.register("promise_test.injection")(OwnInjection)
    LOOP_SCHEDULES.register("promise_test.schedule")(OwnSchedule)
    model = LoopedLM(LoopedLMConfig(**TINY, injection="promise_test.injection"))
    with pytest.raises(ValueError) as err:  # the export itself: nothing is written
        write_folder(model, tmp_path / "out")
    msg = str(err.value)
    assert "injection=promise_test.injection: does not declare support for the transformers remote-code export" in msg
    assert "declare export=True" in msg and not (tmp_path / "out").exists()
    reason = LoopedLMConfig(**TINY, loop_schedule="promise_test.schedule").unsupported("export")
    assert reason.startswith("loop_schedule=promise_test.schedule: does not declare support") and "export=True" in reason
    with pytest.raises(ConfigError, match="injection=promise_test.injection: the parallel schedule has its own"):
        LoopedLMConfig(**TINY, injection="promise_test.injection", loop_schedule="parallel")
    BACKBONES.register("promise_test.backbone")(OwnBackbone)
    with pytest.raises(ConfigError, match=r"backbone=promise_test.backbone: does not declare support for parallel "
                                          r"loops .*declare parallel_loops=True"):
        LoopedLMConfig(**TINY, backbone="promise_test.backbone", loop_schedule="parallel")


# what looplab's own variants declare, as docs/extending.md's table shows them
EXPORTED = {"backbone": {"llama", "mamba2"}, "layer": {"A"}, "state_update": {"vanilla", "stateloop", "stateloop_reset", "gru"},
            "state_mixer": {"none", "attn"}, "exit_gate": {"none", "ouro"},
            "injection": {"none", "add", "concat", "diag"}, "depth_router": {"none"}, "loop_schedule": {"sequential"}}
PARALLEL = {"backbone": {"llama", "mamba2", "hybrid"}, "layer": {"A"}, "state_update": {"vanilla"},
            "state_mixer": {"none"}, "exit_gate": {"none"}, "injection": {"none"}, "depth_router": {"none"},
            "loop_schedule": {"sequential", "parallel"}}


def test_the_builtins_keep_what_they_declare():
    for axis in EXPORTED:
        builtins = {n: c for n, c in REGISTRIES[axis].items() if c.__module__.startswith("looplab.")}
        assert {n for n, c in builtins.items() if c.supports.export is True} == EXPORTED[axis], axis
        assert {n for n, c in builtins.items() if c.supports.parallel_loops is True} == PARALLEL[axis], axis


def test_a_skip_handling_fills_nothing_until_it_declares_it():
    from looplab.models.exit_compute import SkipHandling, skip_compute_unsupported

    class OwnHandling(SkipHandling):
        pass

    registry.HANDLINGS.register("promise_test.handling")(OwnHandling)
    reason = skip_compute_unsupported(LoopedLMConfig(**TINY), "entropy", "promise_test.handling")
    assert "skip_compute=promise_test.handling declares no cache entries it fills" in reason
    assert "declare fills = frozenset({'kv'})" in reason


# ------------------------------------------------------------------ A2. every *_options reaches its variant
class RankedInjection(Injection):
    @dataclass
    class Options:
        rank: int = 2

    def __init__(self, d, options):
        super().__init__()
        self.rank = options.rank
        self.down = nn.Parameter(torch.zeros(options.rank, d))

    def forward(self, x, e):
        return x


SEEN: dict[str, object] = {}  # what each class-level variant's hook read from the config it was handed


class ScaledMixer(StateMixer):
    @dataclass
    class Options:
        scale: float = 1.0

    @classmethod
    def build(cls, cfg):
        SEEN["state_mixer"] = options_of(cls, cfg.options.get("state_mixer")).scale
        return None


class DampedSchedule(Sequential):
    @dataclass
    class Options:
        alpha: float = 0.5

    @classmethod
    def validate(cls, config):
        SEEN["loop_schedule"] = options_of(cls, config.options.get("loop_schedule")).alpha
        super().validate(config)


class WideBackbone(Backbone):
    supports = Supports(parallel_loops=True)

    @dataclass
    class Options:
        letter: str = "A"

    @classmethod
    def layer_kinds(cls, config, n):
        SEEN["backbone"] = options_of(cls, config.options.get("backbone")).letter
        return "A" * n


def _register_option_variants():
    INJECTIONS.register("promise_test.ranked")(RankedInjection)
    STATE_MIXERS.register("promise_test.scaled")(ScaledMixer)
    LOOP_SCHEDULES.register("promise_test.damped")(DampedSchedule)
    BACKBONES.register("promise_test.wide")(WideBackbone)
    SEEN.clear()


def test_every_options_key_reaches_its_variant():
    _register_option_variants()
    cfg = compose([*HYDRA_TINY, "backbone.name=promise_test.wide", "+backbone.options.letter=B",
                   "state_mode=gru", "state_mode.update_bias=0.25",
                   "state_mode.mixer=promise_test.scaled", "+state_mode.mixer_options.scale=3.0",
                   "loop_depth.injection=promise_test.ranked", "+loop_depth.injection_options.rank=5",
                   "loop_depth.schedule=promise_test.damped", "+loop_depth.schedule_options.alpha=0.7"])
    model = LoopedLM(model_config_from_cfg(cfg, vocab_size=16))
    assert model.inject.rank == 5 and model.inject.down.shape == (5, 32)  # the injection's constructor
    assert model.state.options.update_bias == 0.25  # the state update's
    assert SEEN == {"state_mixer": 3.0, "loop_schedule": 0.7, "backbone": "B"}  # the config each hook is handed


@pytest.mark.parametrize("override,typed,valid", [
    ("+loop_depth.injection_options.rnk=5", "loop_depth.injection_options.rnk", "loop_depth.injection_options.rank"),
    ("+state_mode.mixer_options.scal=3.0", "state_mode.mixer_options.scal", "state_mode.mixer_options.scale"),
    ("+loop_depth.schedule_options.alfa=0.7", "loop_depth.schedule_options.alfa", "loop_depth.schedule_options.alpha"),
    ("+backbone.options.leter=B", "backbone.options.leter", "backbone.options.letter"),
])
def test_an_option_typo_is_refused_naming_the_key_and_the_valid_one(override, typed, valid):
    _register_option_variants()
    cfg = compose([*HYDRA_TINY, "backbone.name=promise_test.wide", "state_mode=stateloop",
                   "state_mode.mixer=promise_test.scaled", "loop_depth.injection=promise_test.ranked",
                   "loop_depth.schedule=promise_test.damped", override])
    with pytest.raises(ConfigError) as err:
        model_config_from_cfg(cfg, vocab_size=16)
    assert str(err.value).startswith(f"{typed} is not an option of "), err.value
    assert f"(did you mean {valid}?)" in str(err.value)


def test_an_option_for_a_variant_without_options_is_refused():
    cfg = compose([*HYDRA_TINY, "loop_depth.injection=add", "+loop_depth.injection_options.rank=5"])
    with pytest.raises(ConfigError, match=r"^loop_depth.injection_options.rank is not an option of injection='add'; "
                                          r"it takes no options"):
        model_config_from_cfg(cfg, vocab_size=16)


# ------------------------------------------------------------------ A3. the capability table lists outside variants
def test_the_capability_table_lists_the_variants_an_imported_module_registers(tmp_path, monkeypatch, capsys):
    from looplab.models.__main__ import main

    monkeypatch.syspath_prepend(str(package(tmp_path, "promise_ideas", {"minlstm.py": MINLSTM})))
    assert main(["capabilities", "--builtins"]) == 0
    builtins = capsys.readouterr().out
    assert "promise_ideas" not in builtins and builtins.strip() == registry.capability_table().strip()
    assert main(["capabilities", "--import", "promise_ideas.minlstm"]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if "`promise_ideas.minlstm`" in ln)
    assert row.startswith("| state_update | `promise_ideas.minlstm` |") and row.count("✗") == 2  # parallel, export
    assert "state_update `promise_ideas.minlstm`, export: does not declare support" in out
    line = error_line(lambda: main(["capabilities", "--import", "promise_nowhere.mod"]), capsys, tmp_path)
    assert "--import promise_nowhere.mod: module not found" in line


# ------------------------------------------------------------------ A4. what docs/extending.md says
def test_the_pages_injection_takes_its_option_and_starts_as_the_model_without_it(tmp_path, monkeypatch):
    import re

    from looplab.testing.conformance import checks

    page = (ROOT / "docs" / "extending.md").read_text()
    files = dict(re.findall(r"<!-- file: (?P<path>[\w/.]+) -->\n```python\n(?P<code>.*?)```", page, re.S))
    injection = [p for p, code in files.items() if "@INJECTIONS.register(" in code]
    assert injection, "docs/extending.md shows no injection"
    for rel, code in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = re.search(r'@INJECTIONS.register\("([\w.]+)"\)', files[injection[0]]).group(1)
    cls = INJECTIONS.get(name)  # imports the page's module
    try:
        model = LoopedLM(LoopedLMConfig(**TINY, injection=name, options={"injection": {"rank": 3}}))
        assert sum(p.numel() for p in model.inject.parameters()) == 2 * 3 * 32
        (check,) = checks("injection", name, only=("init_equivalence",))[:1]
        assert check() > 0
        assert "declare export=True" in LoopedLMConfig(**TINY, injection=name).unsupported("export")
    finally:
        for mod in [m for m in sys.modules if m.split(".")[0] == cls.__module__.split(".")[0]]:
            del sys.modules[mod]
    # the page says what each hook receives, an exit rule's "hidden" included
    hooks = page.split("## What each hook receives", 1)[1].split("\n## ", 1)[0]
    for hook in ("build_update(d, ds)", "stops(t, threshold, inputs)", "forward(x, e)", "layer_kinds(config, n)",
                 "build(config)", "step(model, stream, r, cache"):
        assert hook in hooks, hook
    assert "final-normed readouts" in hooks and "not the raw stream" in hooks


def test_an_exit_rules_hidden_input_is_the_final_normed_readout():
    seen = []

    class Records(ExitRule):
        reads = "hidden"

        @classmethod
        def stops(cls, t, threshold, inputs):
            seen.append(inputs)
            return cls.never(inputs)

    EXIT_RULES.register("promise_test.records")(Records)
    from looplab.models.exits import ExitPolicy

    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(**TINY, coda_layers=1)).eval()
    ids = torch.randint(0, 16, (2, 5))
    with torch.no_grad():
        out = model(ids, exits=ExitPolicy(threshold=0.1, rule="promise_test.records"))
        model.final_norm.weight.mul_(3)  # a norm weight that is not one: the readouts are visibly normed by it
        model(ids, exits=ExitPolicy(threshold=0.1, rule="promise_test.records"))
    torch.testing.assert_close(seen[0], out.loop_hidden)  # what the head reads at each loop
    rms = seen[0].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=1e-3)  # RMS-normed, weight 1
    torch.testing.assert_close(seen[-1], 3 * seen[0])


# ------------------------------------------------------------------ B1-B3. variant names and options
def test_a_typo_in_a_dotted_variant_name_is_one_line_with_the_closest_names(tmp_path, monkeypatch, capsys):
    from looplab.training.variants import register_cli_variants

    monkeypatch.syspath_prepend(str(package(tmp_path, "promise_ideas", {"minlstm.py": MINLSTM})))
    line = error_line(lambda: register_cli_variants(["state_mode=promise_ideas.minlstmm"]), capsys, tmp_path)
    # the package's __init__ does not import minlstm: its module named like the typo is found all the same
    assert "state_mode='promise_ideas.minlstmm' is unknown (did you mean promise_ideas.minlstm?)" in line


def test_a_module_not_found_and_a_module_that_raises_are_told_apart(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(package(tmp_path, "promise_broken", {
        "rule.py": "import promise_dependency_not_installed\n"})))
    line = error_line(lambda: STATE_UPDATES.get("promise_absent.minlstm"), capsys, tmp_path)
    assert "state_mode='promise_absent.minlstm': module not found: no module named 'promise_absent'" in line
    assert "PYTHONPATH" in line
    line = error_line(lambda: EXIT_RULES.get("promise_broken.rule.margin"), capsys, tmp_path)
    assert ("exit_rule='promise_broken.rule.margin': module 'promise_broken.rule' was found but raised "
            "ModuleNotFoundError while importing: No module named 'promise_dependency_not_installed'") in line
    assert "promise_dependency_not_installed" in (tmp_path / "traceback.log").read_text()  # its own traceback
    line = error_line(lambda: EXIT_RULES.get("promise_broken.rule:Margin"), capsys, tmp_path)
    assert "module 'promise_broken.rule' was found but raised ModuleNotFoundError" in line


def test_an_option_typo_names_the_key_and_the_valid_ones_before_and_after_the_plus(tmp_path, monkeypatch, capsys):
    from looplab.training.variants import register_cli_variants

    monkeypatch.syspath_prepend(str(package(tmp_path, "promise_ideas", {"minlstm.py": MINLSTM})))
    # without +: refused before Hydra would say "use +state_mode.forget_bais", which only moves the refusal
    line = error_line(lambda: register_cli_variants(["state_mode=promise_ideas.minlstm", "state_mode.forget_bais=1.0"]),
                      capsys, tmp_path)
    assert ("state_mode.forget_bais is not an option of state_mode='promise_ideas.minlstm' (did you mean "
            "state_mode.forget_bias?); its options: forget_bias;") in line
    # with +: the key typed, not every key the node holds, is the unknown one (a built-in with options: gru)
    cfg = compose([*HYDRA_TINY, "state_mode=gru", "+state_mode.update_bais=0.5"])
    with pytest.raises(ConfigError) as err:
        model_config_from_cfg(cfg, vocab_size=16)
    msg = str(err.value)
    assert msg.startswith("state_mode.update_bais is not an option of state_mode='gru' (did you mean "
                          "state_mode.update_bias?); its options: update_bias; every state_mode also takes "), msg
    assert "update_bias is" not in msg and "update_bias is not" not in msg


def test_train_reports_a_bad_variant_name_in_one_line(tmp_path):
    """The one end-to-end run: `python -m looplab.train` checks the names it is given before Hydra composes."""
    root = package(tmp_path, "promise_ideas", {"minlstm.py": MINLSTM})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for k in cli_errors.FULL_ERROR_ENV:
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "looplab.train", "state_mode=promise_ideas.minlstmm", "logger=none",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == cli_errors.EXIT_CODE, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert lines[0].startswith("python -m looplab.train: error: state_mode='promise_ideas.minlstmm' is unknown (did "
                               "you mean promise_ideas.minlstm?)"), lines[0]


# ------------------------------------------------------------------ B4. CLI values
@pytest.mark.parametrize("args,words", [
    (["exit_threshold=-1"], "exit_threshold=-1.0 must be >= 0: the gate's q"),
    (["exit_rule=kl", "exit_threshold=-0.5"], "exit_threshold=-0.5: rule 'kl' takes a threshold >= 0"),
    (["exit_threshold=1.5", "exit_rule=argmax_stable"], "exit_threshold=1.5: argmax_stable takes an integer k >= 1"),
    (["exit_threshold=abc"], "exit_threshold='abc' must be a number"),
    (["max_new_tokens=ten"], "max_new_tokens='ten' must be an integer"),
    (["exit_min_loops=0"], "exit_min_loops=0 must be an integer >= 1"),
    (["exit_threshold=0.5", "exit_rule=entrpy"], "exit_rule='entrpy' is unknown (did you mean entropy?)"),
])
def test_generate_values_are_one_line_naming_the_value_and_its_range(args, words, tmp_path, capsys):
    from looplab.generate import main

    # refused before the checkpoint is read: there is none
    line = error_line(lambda: main([f"ckpt={tmp_path / 'none.ckpt'}", *args]), capsys, tmp_path)
    assert words in line, line


@pytest.mark.parametrize("args,words", [
    (["--thresholds", "0.5", "-1"], "--thresholds -1: exit_threshold=-1.0 must be >= 0"),
    (["--exit-rule", "entropy", "--rule-thresholds", "-2"], "--rule-thresholds -2: exit_threshold=-2.0: rule 'entropy'"),
    (["--min-loops", "0"], "--min-loops 0 must be an integer >= 1"),
])
def test_eval_values_are_one_line_naming_the_value_and_its_range(args, words, tmp_path, capsys):
    from looplab.eval.__main__ import main

    line = error_line(lambda: main([str(tmp_path / "none.ckpt"), *args]), capsys, tmp_path)
    assert words in line, line


class PlainValueErrorRule(ExitRule):
    """A researcher's rule refusing a threshold the way docs/extending.md's margin rule does: a plain ValueError,
    raised outside looplab."""

    @classmethod
    def check_threshold(cls, threshold):
        if not 0 <= threshold <= 1:
            raise ValueError("the margin takes a probability in [0, 1]")

    @classmethod
    def stops(cls, t, threshold, logits):
        return cls.never(logits)


def test_a_researchers_threshold_check_is_bad_input_not_a_bug(tmp_path, capsys):
    EXIT_RULES.register("promise_test.margin")(PlainValueErrorRule)
    line = error_line(lambda: check_rule("promise_test.margin", -1.0, 1, 2), capsys, tmp_path)
    assert "exit_threshold=-1.0 with exit_rule='promise_test.margin': the margin takes a probability in [0, 1]" in line
