"""A researcher's table in the paper tables' format (docs/extending.md "A table in the paper tables' format"): the
same yaml schema as tables/specs/table1..14.yaml, loaded by the same loader, run, reported and judged by the same
runner, builders and rules, under a number of its own."""

from __future__ import annotations

import json

import pytest

from looplab.tables import spec
from looplab.tables.__main__ import main
from tables_synthetic import _dir, _lm, _result, _write

TABLE = """\
number: 101
title: 'My ablation: StateLoop vs Vanilla Looped at 1⊗3'
kind: lm
metric: perplexity
sweeps:
  tiny:
  - experiment: stateloop_main_tiny
    params:
      +arm: [looped, stateloop]
  paper: []
notes:
  tiny: table 1's setting, two of its arms
findings:
- label: StateLoop − Vanilla Looped
  paper: my hypothesis, that the state lowers perplexity by about 1
  metric: perplexity
  a: {arm: stateloop}
  b: {arm: looped}
  claim:
    sign: -1
    delta: 0.3
    delta_why: the smallest gain I would act on
  require: [LM_LEARNED]
"""


@pytest.fixture
def table_file(tmp_path, monkeypatch):
    """The researcher's file; whatever loading it adds to the table registries is taken out again afterwards."""
    for registry in (spec.TABLES, spec.FINDINGS, spec.SOURCES):
        monkeypatch.setitem(registry, 101, None)
        monkeypatch.delitem(registry, 101)
    path = tmp_path / "my_table.yaml"
    path.write_text(TABLE, encoding="utf-8")
    return path


def test_a_table_of_ones_own_runs_and_is_judged_like_the_papers(table_file, tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(["run", str(table_file), "--dry-run", "--seeds", "1,2,3", "--out-root", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"hydra.sweep.dir={out / 'table101' / 'tiny' / 'stateloop_main_tiny'}" in printed
    assert "+experiment=stateloop_main_tiny" in printed and "+arm=looped,stateloop" in printed
    assert "group=table101-tiny" in printed
    assert "zeroshot" not in printed  # its findings read no zero-shot accuracy, so none is planned
    # the runs the sweep would write: StateLoop 1.0 below Vanilla Looped on every seed (a paired effect past δ)
    table = spec.TABLES[101]
    sw = table.sweeps_for("tiny")[0]
    assert [c["arm"] for c in sw.grid()] == ["looped", "stateloop"]
    for combo in sw.grid():
        for s in (1, 2, 3):
            ppl = 44.0 + 0.7 * s + (-1.0 + 0.05 * s if combo["arm"] == "stateloop" else 0.0)
            state = "stateloop" if combo["arm"] == "stateloop" else "vanilla"
            _write(_dir(out, 101, sw) / f"{combo['arm']}_{s}",
                   _result(sw, {**combo, "seed": str(s)}, s, layers=1, loops=3, state=state, **_lm(ppl)))
    assert main(["report", str(table_file), "--seeds", "1,2,3", "--out-root", str(out), "--no-plot"]) == 0
    folder = out / "table101"  # its report beside its runs, not in the paper tables' experiments/tables
    findings = json.loads((folder / "table101.findings.json").read_text())
    (line,) = findings["findings"]
    assert line["verdict"] == "reproduced" and line["reps"] == ["1", "2", "3"]
    assert line["mean"] == pytest.approx(-0.9, abs=1e-6)
    md = (folder / "table101.md").read_text()
    assert md.startswith("# Table 101 — My ablation") and "**reproduced**" in md
    summary = (folder / "README.md").read_text()
    assert "[101](table101.md)" in summary and "not built yet" not in summary  # no paper table listed as unbuilt


def test_an_arm_that_did_not_learn_leaves_the_line_not_tested(table_file, tmp_path):
    out = tmp_path / "runs"
    spec.load_file(table_file)
    sw = spec.TABLES[101].sweeps_for("tiny")[0]
    for combo in sw.grid():
        for s in (1, 2, 3):
            ppl = 500.0 if combo["arm"] == "stateloop" else 44.0 + s  # above the unigram perplexity (400)
            _write(_dir(out, 101, sw) / f"{combo['arm']}_{s}",
                   _result(sw, {**combo, "seed": str(s)}, s, layers=1, loops=3, **_lm(ppl)))
    assert main(["report", str(table_file), "--seeds", "1,2,3", "--out-root", str(out), "--no-plot"]) == 0
    (line,) = json.loads((out / "table101" / "table101.findings.json").read_text())["findings"]
    assert line["verdict"] == "not tested"


def test_a_table_file_that_cannot_be_one_is_refused_by_name(table_file, tmp_path):
    clash = tmp_path / "clash.yaml"
    clash.write_text(TABLE.replace("number: 101", "number: 2"), encoding="utf-8")
    with pytest.raises(SystemExit, match="number=2 is paper table 2; give your table a number above 14"):
        main(["run", str(clash), "--dry-run"])
    other = tmp_path / "other.yaml"
    other.write_text(TABLE, encoding="utf-8")
    spec.load_file(table_file)
    with pytest.raises(SystemExit, match="number=101 is already .*my_table.yaml's"):
        main(["report", str(other)])
    bad = tmp_path / "bad.yaml"
    bad.write_text(TABLE.replace("    sign: -1\n", "    sign: -2\n"), encoding="utf-8")
    with pytest.raises(SystemExit, match="bad.yaml: findings\\[0\\]"):
        main(["run", str(bad), "--dry-run"])
