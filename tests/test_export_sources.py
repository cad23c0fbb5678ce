"""A variant brings its own export code (docs/extending.md#bring-your-export-code).

The GRU state update is exported through the mechanism (its computation is its export_source, state_gru_export.py,
not written into modeling_looplab.py), a researcher's state update in a package on PYTHONPATH ships its own file and
passes the same export check (logits equal, also in a process where looplab is not importable), an export_source
that is missing or broken is refused at to-hf naming the variant, and a folder's shipped file runs only under
transformers' trust_remote_code, never in looplab's own loaders.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

pytest.importorskip("transformers")

from looplab import convert  # noqa: E402
from looplab.checkpoint import looplab_meta  # noqa: E402
from looplab.models import LoopedLM, LoopedLMConfig, registry  # noqa: E402
from looplab.models.registry import REGISTRIES  # noqa: E402
from looplab.testing.conformance import checks  # noqa: E402

TINY = dict(vocab_size=61, d_model=32, n_heads=4, n_layers=1, n_loops=2, max_seq_len=32)
GRU_FILE = "looplab_variant_state_update_gru.py"


@pytest.fixture(autouse=True)
def _isolated(one_thread_module, monkeypatch):
    """What a test registers, imports or trusts is gone after it."""
    for reg in REGISTRIES.values():
        monkeypatch.setattr(reg, "_classes", dict(reg._classes))
        monkeypatch.setattr(reg, "_order", list(reg._order))
        monkeypatch.setattr(reg, "_lazy", dict(reg._lazy))
    monkeypatch.setattr(registry, "_TRUSTED", set(registry._TRUSTED))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0].startswith("export_ideas"):
            del sys.modules[name]


def on_path(monkeypatch, root: Path, package: str, files: dict[str, str]) -> None:
    """A researcher's package under root, on PYTHONPATH (as docs/extending.md#from-the-command-line has it)."""
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    for name, code in files.items():
        (root / package / name).write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))


def checkpoint_of(model, path: Path) -> Path:
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "looplab": looplab_meta(model.config, {})}, path)
    return path


def perturbed(cfg: LoopedLMConfig, seed: int = 0) -> LoopedLM:
    torch.manual_seed(seed)
    model = LoopedLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def run_export_check(name: str) -> int:
    """The conformance kit's export check of state update `name` (its first context: gate, prelude, coda, GQA)."""
    (check,) = checks("state_update", name, only=("export",))
    return check()


# ------------------------------------------------------------------ the GRU, moved onto the mechanism
def test_the_gru_ships_its_export_code_and_passes_the_export_check_without_looplab():
    import looplab.models.state_gru_export as gru_export
    import looplab.remote_code as remote_code
    from looplab.models.state_gru import GRUState

    # its computation is its export source, which looplab runs too, and is not hand-written into the exported code
    assert GRUState.export_source == gru_export.__name__
    assert GRUState.update is gru_export.StateUpdate.update and GRUState.build_update is gru_export.StateUpdate.build_update
    modeling = (Path(remote_code.__file__).parent / "modeling_looplab.py").read_text()
    assert "gate_in" not in modeling and "cand_state" not in modeling
    # logits equal in-process and in a process where looplab is not importable (the check counts both comparisons)
    assert run_export_check("gru") >= 2


def test_a_folder_records_what_it_ships(tmp_path):
    """GRU with the attention mixer and a non-default option: to-hf's own check compares the folder's logits."""
    from looplab.models.state_gru_export import __file__ as gru_source
    cfg = LoopedLMConfig(**TINY, state_mode="gru", state_mixer="attn", options={"state_update": {"update_bias": -2.0}})
    gru = tmp_path / "gru"
    convert.to_hf(str(checkpoint_of(perturbed(cfg), tmp_path / "last.ckpt")), gru, log=lambda *a: None)
    assert (gru / GRU_FILE).read_bytes() == Path(gru_source).read_bytes()
    record = json.loads((gru / "config.json").read_text())["looplab_variants"]
    assert record == {"state_update": {"name": "gru", "file": GRU_FILE, "options": {"update_bias": -2.0}}}
    table = (gru / "looplab_variants.py").read_text()
    assert f"from .{GRU_FILE[:-3]} import StateUpdate as" in table  # the static import transformers follows
    # a model with nothing to ship gets an empty table (modeling_looplab.py always imports it)
    from looplab.remote_code import write_folder

    vanilla = write_folder(perturbed(LoopedLMConfig(**TINY)), tmp_path / "vanilla")
    assert "VARIANTS = {}" in (vanilla / "looplab_variants.py").read_text()
    assert "looplab_variants" not in json.loads((vanilla / "config.json").read_text())
    assert not list(vanilla.glob("looplab_variant_*.py"))


def test_two_folders_of_one_name_run_their_own_variant_code_in_one_process(tmp_path):
    """transformers reuses the model class it registered for a config class, and names a folder's code by the folder's
    name: the config file imports the variant table, so a GRU folder loaded after a vanilla one of the same name
    runs the GRU."""
    from transformers import AutoModelForCausalLM

    from looplab.remote_code import write_folder

    ids = torch.randint(1, 61, (1, 6), generator=torch.Generator().manual_seed(2))
    for i, mode in enumerate(("vanilla", "gru", "stateloop")):
        model = perturbed(LoopedLMConfig(**TINY, state_mode=mode), seed=i)
        folder = write_folder(model, tmp_path / mode / "same_name")
        hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(hf(input_ids=ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ a researcher's variant


def variant(name: str, computation: str, export_source: str | None) -> str:
    """A researcher's state update `export_ideas.<name>`: looplab runs `computation`'s StateUpdate (the module that
    is, or should be, its export_source)."""
    declared = f"export_source = {export_source!r}" if export_source else "# no export_source"
    return f'''
from dataclasses import dataclass, replace

from looplab.models.registry import STATE_UPDATES
from looplab.models.state import StateBranch

from {computation} import StateUpdate


@STATE_UPDATES.register("export_ideas.{name}")
class Variant(StateUpdate, StateBranch):
    supports = replace(StateBranch.supports, export=True)
    {declared}

    @dataclass
    class Options:
        leak: float = 0.5
'''


SCALED = variant("scaled", "export_ideas.scaled_export", "export_ideas.scaled_export")
# the exported computation reads an option: the recorded options must reach it
SCALED_EXPORT = '''
    import torch
    import torch.nn as nn


    class StateUpdate:
        def build_update(self, d, ds):
            self.in_proj = nn.Linear(d, ds, bias=False)
            self.keep = nn.Linear(d, ds)

        def update(self, h, s_prev):
            a = torch.sigmoid(self.keep(h)) * self.options.leak
            return a * s_prev + (1 - a) * torch.tanh(self.in_proj(h)), a
    '''


def test_an_out_of_tree_variant_brings_its_export_code_and_passes_the_same_check(tmp_path, monkeypatch):
    on_path(monkeypatch, tmp_path / "code", "export_ideas", {"scaled.py": SCALED, "scaled_export.py": SCALED_EXPORT})
    assert run_export_check("export_ideas.scaled") >= 2

    # a non-default option is what the exported code computes with
    cfg = LoopedLMConfig(**TINY, state_mode="export_ideas.scaled", options={"state_update": {"leak": 0.9}})
    model = perturbed(cfg)
    ckpt = checkpoint_of(model, tmp_path / "last.ckpt")
    convert.to_hf(str(ckpt), tmp_path / "hf", log=lambda *a: None)  # its own check: logits within 1e-4
    record = json.loads((tmp_path / "hf" / "config.json").read_text())["looplab_variants"]["state_update"]
    assert record == {"name": "export_ideas.scaled", "file": "looplab_variant_state_update_export_ideas_scaled.py",
                      "options": {"leak": 0.9}}
    from looplab.testing.without_looplab import logits_without_looplab

    ids = torch.randint(1, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        differs = not torch.allclose(perturbed(LoopedLMConfig(**TINY, state_mode="export_ideas.scaled"))(ids).logits,
                                     model(ids).logits, atol=1e-3)
    assert differs  # the option matters: a folder that dropped it would compute the default's logits
    got = logits_without_looplab(tmp_path / "hf", ids, mask)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4)


BROKEN = {
    "missing": ("", "was not found as a .py file"),
    "syntax": ("class StateUpdate(:\n", "does not parse: line 1"),
    "imports_looplab": ("import torch\nfrom looplab.models.state import StateBranch\nclass StateUpdate: pass\n",
                        "imports 'looplab.models.state' on line 2"),
    "relative": ("from . import helpers\nclass StateUpdate: pass\n", "has a relative import on line 1"),
    "no_class": ("import torch\nclass Update:\n    pass\n", "defines no class 'StateUpdate'"),
    "no_update": ("class StateUpdate:\n    def build_update(self, d, ds):\n        pass\n", "does not define update"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_missing_or_broken_export_source_is_refused_by_name_at_to_hf(case, tmp_path, monkeypatch):
    source, words = BROKEN[case]
    files = {"broken.py": variant("broken", "export_ideas.good", "export_ideas.broken_export"), "good.py": SCALED_EXPORT}
    if case != "missing":
        files["broken_export.py"] = source
    on_path(monkeypatch, tmp_path / "code", "export_ideas", files)
    ckpt = checkpoint_of(perturbed(LoopedLMConfig(**TINY, state_mode="export_ideas.broken")), tmp_path / "last.ckpt")
    with pytest.raises(convert.ConversionError) as err:
        convert.to_hf(str(ckpt), tmp_path / "out", log=lambda *a: None)
    msg = str(err.value)
    assert "state_mode=export_ideas.broken" in msg and "export_source='export_ideas.broken_export'" in msg, msg
    assert words in msg, msg
    assert "\n" not in msg and not (tmp_path / "out" / "config.json").exists()


def test_a_researchers_exported_variant_without_export_source_is_refused_by_name(tmp_path, monkeypatch):
    code = variant("scaled", "export_ideas.scaled_export", None)
    on_path(monkeypatch, tmp_path / "code", "export_ideas", {"scaled.py": code, "scaled_export.py": SCALED_EXPORT})
    from looplab.remote_code import unsupported

    reason = unsupported(LoopedLMConfig(**TINY, state_mode="export_ideas.scaled"))
    assert reason.startswith("state_mode=export_ideas.scaled: declares export=True but names no export_source"), reason


# ------------------------------------------------------------------ nothing of a folder runs in looplab's loaders
def test_a_shipped_variant_file_runs_only_under_trust_remote_code(tmp_path):
    marker = tmp_path / "PWNED"
    model = perturbed(LoopedLMConfig(**TINY, state_mode="gru"))
    folder = tmp_path / "exported_gru"
    convert.to_hf(str(checkpoint_of(model, tmp_path / "last.ckpt")), folder, log=lambda *a: None)
    shipped = folder / GRU_FILE
    shipped.write_text(f"open({str(marker)!r}, 'w').close()\n" + shipped.read_text())

    LoopedLM.from_pretrained(str(folder))
    assert convert.main(["from-hf", str(folder), "--out", str(tmp_path / "a")]) == 0  # checked by looplab's copy
    assert not marker.exists()
    assert convert.main(["from-hf", str(folder), "--out", str(tmp_path / "b"), "--trust-remote-code"]) == 0
    assert marker.exists()  # the payload is live: transformers runs it when the user says so
