"""The fourteen paper tables as yaml specs (src/looplab/tables/specs/tableN.yaml, looplab.tables.paper_specs): they are
what the code uses, they round-trip byte for byte, a bad field is refused by name, the numbers they share with the
code's constants agree, and the tables built from them regenerate the golden fixed-seed outputs."""

from __future__ import annotations

import fnmatch
import json
import shutil
import tomllib
from pathlib import Path

import pytest
import yaml

import tables_synthetic
from looplab.tables import paper_specs, report, retrofit, spec
from looplab.tables.paper_specs.__main__ import main as paper_specs_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n", paper_specs.NUMBERS)
def test_each_spec_is_the_table_the_code_uses_and_round_trips(n):
    path = paper_specs.path_of(n)
    loaded = paper_specs.load(path)
    assert loaded == spec.get(n)  # dataclass equality: sweeps, notes, findings with their preconditions
    assert paper_specs.dump(loaded) == path.read_text(encoding="utf-8")  # the file is in canonical form


def test_the_specs_are_package_data_and_the_only_ones():
    assert sorted(p.name for p in paper_specs.SPEC_DIR.glob("*.yaml")) == sorted(f"table{n}.yaml" for n in range(1, 15))
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["looplab"]
    src = ROOT / "src" / "looplab"
    for p in paper_specs.SPEC_DIR.glob("*.yaml"):
        assert any(fnmatch.fnmatch(p.relative_to(src).as_posix(), g) for g in globs), f"{p.name} would not ship"


def _edited(tmp_path: Path, n: int, edit) -> Path:
    """A copy of table n's spec with `edit(data)` applied (the data as the yaml holds it)."""
    data = yaml.safe_load(paper_specs.path_of(n).read_text(encoding="utf-8"))
    edit(data)
    out = tmp_path / f"table{n}.yaml"
    out.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return out


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(data):
        d = data
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return edit


def _drop(*keys):
    def edit(data):
        d = data
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
    return edit


@pytest.mark.parametrize("edit, field", [
    (_set("findings", 0, "colour", "red"), "unknown key(s) ['colour']"),
    (_set("colour", "red"), "unknown key(s) ['colour']"),
    (_set("findings", 0, "claim", "sign", 0), "findings[0] ('reset − carry').claim.sign=0"),
    (_drop("findings", 0, "claim", "delta_why"), "delta_why"),
    (_set("findings", 0, "require", ["LM_LEARNT"]), "findings[0] ('reset − carry').require[0]='LM_LEARNT'"),
    (_set("findings", 0, "require", [{"metric": "perplexity", "op": "<=", "threshold": 1}]), "op must be < or >="),
    (_set("findings", 0, "contrast", "product"), "contrast diff|ratio"),
    (_set("findings", 0, "claim", "kind", "about"), "findings[0] ('reset − carry')"),
    (_set("sweeps", "tiny", 0, "per_seed", "yes"), "sweeps.tiny[0].per_seed='yes'"),
    (_drop("sweeps", "paper"), "missing ['paper']"),
    (_set("number", 4), "number=4 does not match the file name"),
])
def test_a_bad_field_is_refused_naming_the_file_and_the_field(tmp_path, edit, field):
    path = _edited(tmp_path, 3, edit)
    with pytest.raises(ValueError) as e:
        paper_specs.load(path)
    assert str(path) in str(e.value) and field in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_an_inline_precondition_round_trips_and_an_unedited_copy_loads_equal(tmp_path):
    assert paper_specs.load(_edited(tmp_path, 3, lambda d: None)) == spec.get(3)
    inline = {"metric": "accuracy", "op": ">=", "threshold": 0.7, "arms": "a", "why": "arm A must learn the task"}
    t = paper_specs.load(_edited(tmp_path, 3, _set("findings", 0, "require", ["LM_LEARNED", inline])))
    assert [p.arms for p in t.findings[0].requires] == ["each", "a"] and t.findings[0].requires[1].threshold == 0.7
    assert paper_specs.load(_write_text(tmp_path / "again" / "table3.yaml", paper_specs.dump(t))) == t


def test_require_reads_an_own_specs_precondition_strings(tmp_path):
    """`require` in a paper spec takes what an own spec's `require` says (docs/extending.md), as every arm's bar."""
    t = paper_specs.load(_edited(tmp_path, 3, _set("findings", 0, "require",
                                                   ["perplexity<unigram_perplexity", "accuracy>=0.55"])))
    lm, acc = t.findings[0].requires
    assert (lm.metric, lm.op, lm.threshold, lm.arms) == ("perplexity", "<", "unigram", "each")
    assert (acc.metric, acc.op, acc.threshold, acc.arms) == ("accuracy", ">=", 0.55, "each")
    text = paper_specs.dump(t)
    assert "require: [perplexity<unigram_perplexity, accuracy>=0.55]" in text
    assert paper_specs.load(_write_text(tmp_path / "again" / "table3.yaml", text)) == t
    # the own spec's grammar (compare.Requirement), which the paper specs do not import
    from looplab.tables.compare import Requirement

    for text, p in zip(["perplexity<unigram_perplexity", "accuracy>=0.55"], (lm, acc)):
        r = Requirement.parse(text)
        assert (r.metric, r.op, "unigram" if r.threshold == "unigram_perplexity" else r.threshold) == (
            p.metric, p.op, p.threshold)
    with pytest.raises(ValueError, match=r"require\[0\]='accuracy<=0.5': precondition .*op must be < or >="):
        paper_specs.load(_edited(tmp_path, 3, _set("findings", 0, "require", ["accuracy<=0.5"])))


def _write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_cli_check_names_a_file_out_of_canonical_form_and_write_restores_it(tmp_path, capsys):
    shutil.copytree(paper_specs.SPEC_DIR, tmp_path / "specs")
    assert paper_specs_main(["check", "--dir", str(tmp_path / "specs")]) == 0
    t5 = tmp_path / "specs" / "table5.yaml"
    t5.write_text(t5.read_text(encoding="utf-8") + "# a comment the canonical form does not keep\n", encoding="utf-8")
    assert paper_specs_main(["check", "--dir", str(tmp_path / "specs")]) == 1
    assert "table5.yaml: not in canonical form" in capsys.readouterr().err
    assert paper_specs_main(["write", "--dir", str(tmp_path / "specs")]) == 0
    assert t5.read_text(encoding="utf-8") == paper_specs.path_of(5).read_text(encoding="utf-8")
    assert paper_specs_main(["check", "--dir", str(tmp_path / "specs")]) == 0


def test_numbers_the_specs_share_with_the_code_agree():
    """A step count, a window or a bound is written both in a spec and as a constant the runner, the builders or the
    tests read: they must agree."""
    def sweep(n, name):
        return next(sw for sw in spec.get(n).sweeps_for("tiny") if sw.folder == name)

    for sw in spec.get(8).sweeps_for("tiny"):  # every arm at T8's 1,600 steps
        assert f"trainer.max_steps={spec.TABLE8_STEPS_TINY}" in sw.fixed, sw.folder
    for e, steps in spec.MOR_STEPS_TINY.items():
        assert f"trainer.max_steps={steps}" in sweep(12, f"{e}_mor").fixed
    assert f"trainer.max_steps={spec.MOR_STEPS_TINY['mor_lm_tiny']}" in sweep(14, "mor_lm_tiny_mor").fixed
    for e, w in spec.PLT_WINDOW_TINY.items():
        par = sweep(13, f"{e}_parallel")
        assert f"loop_depth.window={w}" in par.fixed and dict(par.params)["loop_depth.kv"] == spec.PLT_KV
    skip = f"exit_gate.skip_train_prob={spec.SKIP_TRAIN_PROB}"
    assert skip in sweep(10, "exit_gate_hybrid_tiny_skiptrain").fixed
    assert skip in sweep(11, "speculation_tiny_exit_aware").fixed and skip in sweep(14, "speculation_tiny_exit_aware").fixed
    assert sweep(11, "speculation_tiny_retrofit").fixed == (
        *retrofit.looped_overrides(spec.RETROFIT_FOLDER), f"trainer.max_steps={retrofit.TRAIN_STEPS}",
        f"optim.lr={retrofit.TRAIN_LR:g}")
    f12, f13 = spec.get(12).findings, spec.get(13).findings
    assert {f.size for f in f12 if f.kind == "at_most"} == {spec.MOR_PARITY}
    assert {f.size for f in f13 if f.kind == "at_most" and f.metric in ("perplexity", "accuracy")} == {spec.PLT_PARITY}
    assert {f.size for f in f13 if f.kind == "at_most" and f.metric.startswith("decode")} == {spec.PLT_DECODE_BOUND}
    kv = {f.label: f.size for f in f13 if f.by_construction and f.kind == "at_most"}
    assert kv == {f"parallel gswa 1⊗{R} KV bytes / 1⊗1 − 1":
                  (R - 1) * spec.PLT_WINDOW_TINY["plt_lm_tiny"] / spec.PLT_DECODE_TOKENS + 1e-9 for R in (2, 4)}


def test_tables_built_from_the_yaml_files_regenerate_the_golden_outputs(tmp_path, monkeypatch):
    """Every table loaded from a copy of the yaml files (not from the module's TABLES) builds the golden Markdown, CSV
    and findings.json byte for byte; and an edit of a copy's claim changes what the report says: the files are the source."""
    monkeypatch.chdir(tmp_path)  # no bench/*.json of the checkout can leak in
    shutil.copytree(paper_specs.SPEC_DIR, tmp_path / "specs")
    for n, t in paper_specs.load_all(tmp_path / "specs").items():
        monkeypatch.setitem(spec.TABLES, n, t)  # in place: render.py and looplab.tables hold the same dict
    tables_synthetic.write_runs(tmp_path / "out")
    texts = tables_synthetic.build_all(tmp_path / "out", tmp_path / "tables")
    golden = {p.name: p.read_text() for p in tables_synthetic.GOLDEN.iterdir()}
    assert sorted(texts) == sorted(golden)
    for name in sorted(golden):
        assert texts[name] == golden[name], f"{name} built from the yaml specs differs from the golden file"

    def flip(data):  # the paper said +0.21: a claim of the other sign
        data["findings"][0]["claim"].update(sign=-1, size=-0.21)
    flipped = _edited(tmp_path / "specs", 3, flip)
    monkeypatch.setitem(spec.TABLES, 3, paper_specs.load(flipped))
    table = report.build(3, "tiny", tmp_path / "out")
    paths = report.write(table, tmp_path / "flipped", plot=False)
    got = json.loads(next(p for p in paths if p.name == "table3.findings.json").read_text())["findings"][0]
    want = json.loads(golden["table3.findings.json"])["findings"][0]
    assert (want["expected_sign"], got["expected_sign"]) == (1, -1) and got["claimed"] == -want["claimed"] != 0
    assert got["diffs"] == want["diffs"]  # the same runs, judged by the edited claim
