"""notebooks/analysis.ipynb: on a fresh clone it shows every committed table (rows, findings, verdicts, plots), with
paths resolved from the repository root wherever the kernel starts; with fresh runs it shows those instead.

Each test executes the whole notebook in a Jupyter kernel (nbclient) and checks what it printed against the
committed experiments/tables/*.csv and *.findings.json, so a notebook that shows 0 rows again fails here."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from conftest import ROOT
from looplab.tables import spec

NOTEBOOK = ROOT / "notebooks" / "analysis.ipynb"
TABLE_DIR = ROOT / "experiments" / "tables"
LINE = re.compile(r"^table (\d+): (committed|fresh runs) \((.+?)\) — (\d+) row\(s\).*?; (\d+) finding\(s\)", re.M)
SETTINGS = ("LOOPLAB_TABLES_SOURCE", "LOOPLAB_TABLES_SCALE", "LOOPLAB_TABLES_ROOT", "LOOPLAB_TABLE_DIR",
            "LOOPLAB_TABLES_FIGDIR", "LOOPLAB_DECODE_JSON", "LOOPLAB_REPO_ROOT")


def committed_counts() -> dict[int, tuple[int, list[str]]]:
    """tableN -> (rows of tableN.csv, verdicts of tableN.findings.json), as committed."""
    out = {}
    for p in TABLE_DIR.glob("table*.csv"):
        m = re.fullmatch(r"table(\d+)\.csv", p.name)
        if m:
            with p.open(newline="") as f:
                rows = sum(1 for _ in csv.DictReader(f))
            findings = json.loads(p.with_suffix(".findings.json").read_text())["findings"]
            out[int(m.group(1))] = (rows, [f["verdict"] for f in findings])
    return out


def execute(cwd: Path, monkeypatch, **env: str):
    """Run the notebook in a kernel started in `cwd`; (its printed text, its outputs)."""
    import nbformat
    from nbclient import NotebookClient
    from traitlets.config import Config

    for k in SETTINGS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # the kernel inherits the environment
    nb = nbformat.read(cwd / "analysis.ipynb" if (cwd / "analysis.ipynb").exists() else NOTEBOOK, as_version=4)
    # The kernel talks over Unix sockets in a folder of its own, not TCP ports: a port is picked by binding port 0
    # and releasing it, so two suites starting kernels in the same second (two clones' `make test` at once) could
    # both take it and wait forever on a kernel that never answered them.
    with tempfile.TemporaryDirectory(prefix="nbk") as sockets:  # short: a socket path has at most 107 bytes
        config = Config()
        config.KernelManager.transport = "ipc"
        config.KernelManager.connection_file = os.path.join(sockets, "kernel.json")
        NotebookClient(nb, timeout=600, kernel_name="python3", config=config,
                       resources={"metadata": {"path": str(cwd)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream"), outputs


def shown_lines(text: str) -> dict[int, tuple[str, str, int, int]]:
    return {int(m[1]): (m[2], m[3], int(m[4]), int(m[5])) for m in LINE.finditer(text)}


def test_notebook_fresh_clone_shows_committed_tables(tmp_path, monkeypatch):
    """A clone with no runs: the kernel starts in notebooks/ (as Jupyter does); every table shows its committed
    rows (as many as its csv, > 0), its findings and verdicts, and its committed PNG; nothing is written."""
    repo = tmp_path / "clone"
    (repo / "notebooks").mkdir(parents=True)
    shutil.copy(NOTEBOOK, repo / "notebooks")
    shutil.copytree(TABLE_DIR, repo / "experiments" / "tables")
    before = sorted(p.relative_to(repo) for p in repo.rglob("*"))

    text, outputs = execute(repo / "notebooks", monkeypatch)

    assert f"repository root: {repo.resolve()}" in text  # found from the kernel's cwd, not the installed checkout
    expected = committed_counts()
    assert expected and set(expected) <= set(spec.TABLES)
    shown = shown_lines(text)
    assert set(shown) == set(expected), text
    for n in set(spec.TABLES) - set(expected):  # a table not built yet says so
        assert f"table {n}: nothing to show" in text
    for n, (rows, verdicts) in expected.items():
        source, where, n_rows, n_findings = shown[n]
        assert (source, where) == ("committed", f"experiments/tables/table{n}.csv")
        assert n_rows == rows > 0, (n, text)
        assert n_findings == len(verdicts), n
    all_verdicts = [v for _, vs in expected.values() for v in vs]
    from looplab.stats import VERDICTS as kinds  # reproduced, contradicted, negligible, inconclusive, not tested
    assert len(all_verdicts) > 0
    assert (f"verdicts shown: {len(all_verdicts)} finding(s) — "
            + ", ".join(f"{all_verdicts.count(v)} {v}" for v in kinds)) in text
    assert " 0 row(s)" not in text
    # each table's rows and (where it checks findings) its verdict table are displayed, then every committed PNG
    frames = [o for o in outputs if o.get("output_type") == "display_data" and "text/html" in o.get("data", {})]
    assert len(frames) == 1 + len(expected) + sum(bool(vs) for _, vs in expected.values())
    pngs = sorted(TABLE_DIR.glob("table*.png"))
    assert pngs and sum("image/png" in o.get("data", {}) for o in outputs) == len(pngs)
    for p in pngs:
        assert f"(committed): {repo.resolve() / 'experiments' / 'tables' / p.name}" in text
    assert "table 6 phop_tiny (committed): N=1: R=1 acc" in text
    assert sorted(p.relative_to(repo) for p in repo.rglob("*")) == before  # read only: no outputs/, no figure rewritten


def _task_result(sweep: spec.Sweep, combo: dict[str, str], acc: float, seed: int) -> dict:
    layers, loops = (int(x) for x in combo["loop_depth"].split("x"))
    per_depth = [acc * (k + 1) / loops for k in range(loops)]
    return {"status": "ok", "task_name": sweep.experiment, "seed": seed,
            "overrides": [f"+experiment={sweep.experiment}", *sweep.combo_overrides(combo), f"seed={seed}"],
            "model": {"backbone": "llama", "layers": layers, "loops": loops, "state_mode": "vanilla", "exit_gate": "none",
                      "exit_stage": None, "d_model": 32},
            "accuracy": acc, "loss": 1.0 - acc / 2, "perplexity": None,
            "per_depth": {"acc": per_depth, "loss": [2.0 - a for a in per_depth]}, "exit": {},
            "params": {"total": 1000 * layers, "state_branch": 0, "exit_gate": 0}, "state_branch_overhead": 0.0,
            "flops_per_token": {"forward": 100 * layers * loops, "training": 300 * layers * loops, "seq_len": 33},
            "global_step": 20, "checkpoint": "ckpt", "final_split": "test", "config": {}}


def test_notebook_shows_fresh_runs_where_there_are_some(tmp_path, monkeypatch):
    """Runs of table 6's first sweep under LOOPLAB_TABLES_ROOT, the kernel started outside any checkout (the root is
    then the checkout looplab is installed from): table 6 shows the fresh runs (its rows, missing runs, its figure
    drawn into LOOPLAB_TABLES_FIGDIR), the tables without runs their committed files, untouched."""
    out = tmp_path / "runs"
    phop = spec.get(6).sweeps_for("tiny")[0]
    grid = phop.grid()
    for i, combo in enumerate(grid):
        folder = out / "table6" / "tiny" / phop.folder / str(i)
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(_task_result(phop, combo, 0.3 + 0.2 * i, seed=1)))
    committed_png = (TABLE_DIR / "table6.png").read_bytes()
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()

    text, outputs = execute(cwd, monkeypatch, LOOPLAB_TABLES_ROOT=str(out), LOOPLAB_TABLES_FIGDIR=str(tmp_path / "figs"),
                            LOOPLAB_DECODE_JSON=str(tmp_path / "none.json"))

    assert f"repository root: {ROOT.resolve()}" in text
    shown = shown_lines(text)
    source, where, n_rows, _ = shown[6]
    assert (source, Path(where)) == ("fresh runs", out / "table6" / "tiny")
    assert n_rows == len({c["loop_depth"] for c in grid}) > 0
    assert "phop_tiny" in text and "Missing runs" in text  # the full report of fresh runs, its missing seeds listed
    assert (tmp_path / "figs" / "table6.png").exists() and (TABLE_DIR / "table6.png").read_bytes() == committed_png
    assert f"table 6 phop_tiny (fresh runs): N=1: R=1 acc 0.300 -> R={max(int(c['loop_depth'][2:]) for c in grid)}" in text
    expected = committed_counts()
    for n in (1, 2, 3, 5, 7, 8, 9):  # trained tables without runs under `out`: the committed ones
        assert shown[n][0] == "committed" and shown[n][2] == expected[n][0] > 0, (n, text)
