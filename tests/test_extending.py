"""docs/extending.md, run: a researcher's variants in a package outside looplab, through looplab's own tools.

The page's `<!-- file: ... -->` blocks are written to a package in a temporary folder, exactly as printed. Nothing
here names the variants: what the package registers is read off the registries after importing it. Then, with the
package on PYTHONPATH only:
  - the conformance kit runs on every variant it registers, from the page's own test file (as a researcher would);
  - `python -m looplab.train` trains a model with its state update and reads its exit rule at test time, resumes
    the run, and trains its backbone block under its loop schedule;
  - `python -m looplab.eval` scores the checkpoint with the rule, and the checkpoint decodes and serves (skip
    handling, depth-wise engine) in a fresh process;
and the page's table of what combines with what is the registries' own.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending.md"
BLOCK = re.compile(r"<!-- file: (?P<path>[\w/.]+) -->\n```python\n(?P<code>.*?)```", re.S)

pytestmark = pytest.mark.slow


def test_capability_table_is_the_registries():
    from looplab.models.registry import capability_table

    text = PAGE.read_text()
    table = text.split("<!-- capabilities table: begin -->\n", 1)[1].split("\n<!-- capabilities table: end -->", 1)[0]
    assert table.strip() == capability_table().strip(), \
        "docs/extending.md's table is stale: regenerate it with `python -m looplab.models capabilities --builtins`"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The page's files in a folder of their own, and what they register: {axis: [names]}."""
    root = tmp_path_factory.mktemp("researcher")
    files = BLOCK.findall(PAGE.read_text())
    assert len(files) >= 6, "the page lost its example files"
    for rel, code in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(code)
    modules = sorted({rel[:-3].replace("/", ".").removesuffix(".__init__") for rel, _ in files
                      if "/" in rel and rel.endswith(".py")})
    probe = ("import json, importlib\nfrom looplab.models.registry import REGISTRIES\n"
             "before = {a: set(r.names()) for a, r in REGISTRIES.items()}\n"
             f"for m in {modules!r}: importlib.import_module(m)\n"
             "print(json.dumps({a: sorted(set(r.names()) - before[a]) for a, r in REGISTRIES.items()}))")
    new = json.loads(_run([sys.executable, "-c", probe], root).stdout.strip().splitlines()[-1])
    return root, {a: n for a, n in new.items() if n}


def _env(root: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
            "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}


def _run(cmd, root: Path, timeout: int = 600, cwd=None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd or root, env=_env(root), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))[:300]}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def test_the_page_registers_a_variant_on_every_axis_it_shows(package):
    _, new = package
    assert {"state_update", "exit_rule", "backbone", "layer", "loop_schedule", "injection"} <= set(new), new
    assert not any(name.startswith("looplab") for names in new.values() for name in names)


def test_conformance_kit_passes_on_the_researchers_variants(package):
    """The page's own test file (parametrize_checks over its variants), run by pytest in the researcher's folder."""
    root, new = package
    tests = [rel for rel, _ in BLOCK.findall(PAGE.read_text()) if Path(rel).name.startswith("test_")]
    assert tests, "the page shows no test file for the conformance kit"
    p = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *tests], root, timeout=1800)
    summary = p.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert "failed" not in summary and "error" not in summary, p.stdout[-3000:]
    assert passed >= 30, summary  # every variant's checks ran, not only skips
    for names in new.values():  # every variant the page registers was checked
        for name in names:
            assert f"={name}-" in p.stdout or name in (p.stdout + _collected(root, tests)), name


def _collected(root, tests) -> str:
    return _run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *tests], root).stdout


TINY = ["dataset=phop", "dataset.task_args.n=12", "dataset.task_args.p=2", "dataset.batch_size=8",
        "dataset.val_size=16", "dataset.test_size=16", "backbone.d_model=32", "backbone.n_heads=4", "logger=csv",
        "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "checkpoint_every_n_steps=3",
        "hardware=cpu", "loop_depth=1x3"]


def test_trains_resumes_evaluates_decodes_and_serves_from_the_command_line(package, tmp_path):
    root, new = package
    update, rule = new["state_update"][0], new["exit_rule"][0]
    run = tmp_path / "run"
    common = [sys.executable, "-m", "looplab.train", f"state_mode={update}", "state_mode.gate_bias=-2.0",
              f"exit_gate.eval_rule={rule}",
              "exit_gate.eval_thresholds=[0.05,0.2]", f"hydra.run.dir={run}", *TINY]
    _run([*common, "trainer.max_steps=6"], root)
    first = json.loads((run / "results.json").read_text())
    assert first["status"] == "ok" and first["global_step"] == 6
    assert first["model"]["state_mode"] == update and first["exit_rule"] == rule
    assert set(first["exit"]) == {"0.05", "0.2"} and all(v["mean_step"] is not None for v in first["exit"].values())
    ckpt = run / "checkpoints" / "last.ckpt"
    from looplab.checkpoint import read_checkpoint_meta

    assert read_checkpoint_meta(ckpt)["model_config"]["options"] == {"state_update": {"gate_bias": -2.0}}
    # resume=auto: the same run folder continues from its last checkpoint to the new max_steps
    p = _run([*common, "trainer.max_steps=12"], root)
    second = json.loads((run / "results.json").read_text())
    assert second["global_step"] == 12 and "resuming from" in (p.stdout + p.stderr)

    out = tmp_path / "eval"
    _run([sys.executable, "-m", "looplab.eval", str(ckpt), "--exit-rule", rule, "--rule-thresholds", "0.05", "0.2",
          "--max-batches", "1", "--out", str(out), "--device", "cpu"], root)
    report = json.loads((out / "eval.json").read_text())
    assert rule in json.dumps(report["sweep"])  # its rows are the rule's, at each threshold

    decode = (
        "import torch\nfrom looplab.checkpoint import load_model\nfrom looplab.models import ExitPolicy\n"
        "from looplab.serve import Engine, solo_agreement\n"
        f"model, _ = load_model({str(ckpt)!r})\nmodel.eval()\n"
        f"pol = ExitPolicy(threshold=0.2, rule={rule!r}, skip='kv_copy')\n"
        "ids = torch.randint(1, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))\n"
        "out = model.generate(ids, 5, exits=pol, return_logits=True)\nassert out.exit_steps.shape == (2, 5)\n"
        "eng = Engine(model, max_batch=2, max_len=32, exits=pol, schedule='depthwise')\n"
        "reqs = [eng.add(ids[i % 2], 4 + i) for i in range(3)]\neng.run()\n"
        "a = solo_agreement(model, reqs, exits=pol)\nassert a['equal'] + a['ties'] == 3, a\nprint('served', a)\n")
    # a fresh process that names no variant itself: the checkpoint's names import nothing until the package is trusted
    refused = subprocess.run([sys.executable, "-c", decode], cwd=root, env=_env(root), capture_output=True, text=True)
    assert refused.returncode != 0 and f"--trust-variants {update.split('.')[0]}" in refused.stderr, refused.stderr[-2000:]
    trusted = {**_env(root), "LOOPLAB_TRUST_VARIANTS": update.split(".")[0]}
    p = subprocess.run([sys.executable, "-c", decode], cwd=root, env=trusted, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0 and "served" in p.stdout, p.stderr[-3000:]


def test_trains_the_backbone_block_under_the_loop_schedule(package, tmp_path):
    root, new = package
    backbone, schedule = new["backbone"][0], new["loop_schedule"][0]
    run = tmp_path / "run"
    _run([sys.executable, "-m", "looplab.train", f"backbone={backbone}", "+backbone.d_model=32", "+backbone.n_heads=4",
          "+backbone.max_seq_len=64", f"loop_depth.schedule={schedule}", "+loop_depth.schedule_options.alpha=0.7",
          f"hydra.run.dir={run}", "trainer.max_steps=6", *[t for t in TINY if not t.startswith("backbone.")]], root)
    res = json.loads((run / "results.json").read_text())
    from looplab.checkpoint import read_checkpoint_meta

    cfg = read_checkpoint_meta(run / "checkpoints" / "last.ckpt")["model_config"]
    assert cfg["backbone"] == backbone and cfg["loop_schedule"] == schedule
    assert cfg["options"] == {"loop_schedule": {"alpha": 0.7}}
    assert res["accuracy"] is not None


def test_looplab_options_with_a_dot_are_not_taken_for_variants():
    """`backbone=llama_1.4b` (table 1's sweep, `+experiment=stateloop_main backbone=llama_1.4b`) is looplab's yaml
    option, not a module `llama_1` to import: it was refused as an unknown variant before Hydra composed."""
    from looplab.training.variants import _values, register_cli_variants

    assert register_cli_variants(["+experiment=stateloop_main", "backbone=llama_410m,llama_1.4b",
                                  "backbone=mamba2_370m"]) == []
    assert _values(["backbone=llama_1.4b,my_pkg.wide", "state_mode=my_pkg.gru"]) == [
        ("backbone", "my_pkg.wide"), ("state_mode", "my_pkg.gru")]


SPEC = re.compile(r"<!-- spec: (?P<name>[\w.]+) -->\n```yaml\n(?P<text>.*?)```", re.S)


def test_a_table_of_your_own_from_the_pages_spec(package, tmp_path):
    """The page's spec, run as printed by `python -m looplab.tables run SPEC.yaml` (4 steps a run: --extra): its
    arms train per seed with the package on PYTHONPATH, the folder is judged with the spec's claim (one line, 3
    paired seeds, a verdict computed from the numbers and its precondition), and a build run again after one run's
    folder is removed trains that run alone."""
    import shutil

    root, _ = package
    (name, text), = SPEC.findall(PAGE.read_text())
    spec = tmp_path / name
    spec.write_text(text)
    out = tmp_path / "own"
    smoke = ["--extra", "trainer.max_steps=4", "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
             "trainer.limit_test_batches=1", "dataset.task_args.n=12", "dataset.batch_size=8", "dataset.val_size=16",
             "dataset.test_size=16", "backbone.d_model=32", "backbone.n_heads=4", "trainer.enable_progress_bar=false"]
    cmd = [sys.executable, "-m", "looplab.tables", "run", str(spec), "--out-root", str(out), "--jobs", "2", *smoke]
    _run(cmd, root)
    folder = out / name.removesuffix(".yaml")
    rows = (folder / "compare_accuracy.csv").read_text().splitlines()
    assert len(rows) == 2, rows
    stratum, a, b, n, *_, verdict, reason = rows[1].split(",")
    assert (stratum, a, b, n) == ("(all)", "my_looped_ideas.mingru", "stateloop", "3"), rows
    runs = [json.loads(f.read_text()) for f in folder.rglob("results.json")]
    acc = {r["model"]["state_mode"]: r["accuracy"] for r in runs}
    if min(acc.values()) < 0.55:  # 4 steps rarely clear the shortcut: the precondition says so
        assert verdict == "not tested" and "misses accuracy >= 0.55" in reason, rows
    else:
        assert verdict in ("confirmed", "contradicted", "negligible", "inconclusive"), rows
    shutil.rmtree(folder / "stateloop_s2")
    p = _run(cmd, root)
    assert p.stdout.count("[mingru_vs_stateloop] ") == 1 and "seed=2" in p.stdout, p.stdout[-2000:]

    # the same spec with sequential seeds, capped at its 3 (one look): it trains nothing (every run is on disk), and
    # judges them with the design's repeated interval, recomputed here from the runs' results.json; then the plot
    from looplab.stats import SequentialDesign

    p = _run([*cmd, "--seeds", "auto", "--max-seeds", "3"], root)
    assert "looplab.train" not in p.stdout, p.stdout[-2000:]
    state = json.loads((folder / "sequential.json").read_text())
    assert [r["seeds"] for r in state["rounds"]] == [[1, 2, 3]] and state["design"]["cap"] == 3
    (row,) = csv.DictReader((folder / "compare_accuracy.csv").open())
    runs = [json.loads(f.read_text()) for f in folder.rglob("results.json")]
    acc = {(r["model"]["state_mode"], r["seed"]): r["accuracy"] for r in runs}
    d = [acc[("my_looped_ideas.mingru", s)] - acc[("stateloop", s)] for s in (1, 2, 3)]
    if min(acc.values()) < 0.55:  # as above: the precondition decides, before any interval is judged
        assert row["verdict"] == "not tested" and "misses accuracy >= 0.55" in row["reason"], row
    else:  # (the rounds' arithmetic on chosen numbers, against scipy: tests/test_own_tables.py)
        lo, hi = SequentialDesign(3).interval(d)
        assert (float(row["ci_lo"]), float(row["ci_hi"])) == pytest.approx((lo, hi), abs=1e-9), row
    assert float(row["mean_diff"]) == pytest.approx(sum(d) / 3, abs=1e-9), row
    assert (folder / "compare_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a larger cap on runs this design has looked at: refused before anything trains, unless --restart
    r = subprocess.run([*cmd, "--seeds", "auto", "--max-seeds", "5"], cwd=root, env=_env(root), capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 1 and "--restart" in r.stderr and "looplab.train" not in r.stdout, r.stderr[-2000:]
