"""A table of one's own with sequential seeds, its plot and its W&B summary (tables/own_sequential.py, own.py,
compare.py, plots.py: plot_compare, wandb_summary.py).

Two kinds of build:
  - the rounds' logic on runs whose numbers the test chooses (the training step replaced by one that writes
    results.json): the seeds of each round, a line frozen at the look that decided it with the design's repeated
    interval (checked against scipy), the stop (decided / cap), the state and the α ledger, resume, the refusal of
    a larger cap without --restart and the restart at the α left, the plot and the offline W&B run;
  - the real build is tests/test_extending.py's `test_a_table_of_your_own_from_the_pages_spec`: docs/extending.md's
    spec of an out-of-tree state update on PYTHONPATH, trained (4 steps a run), resumed after one run is removed,
    then judged with `--seeds auto` on the same runs (its interval recomputed from their results.json, the CSV, the
    plot, the rounds) and a larger cap refused without --restart.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats as sps

from looplab.stats import Rule, SequentialDesign, judge
from looplab.tables import own, own_sequential
from looplab.tables.__main__ import main as tables_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- the rounds, on chosen numbers
def chosen_loss(arm: str, seed: int) -> float:
    """vanilla: the seed's own level; good: 1.0 below it, nearly the same each seed (decided at 3 seeds); null:
    ±0.3 around it, alternating (never decided by 7 seeds: the interval straddles 0 and is wider than δ)."""
    base = 5.0 + 0.5 * math.sin(seed)
    return {"vanilla": base, "good": base - 1.0 + 0.01 * math.cos(3 * seed),
            "null": base + 0.3 * (-1) ** seed + 0.02 * seed}[arm]


@pytest.fixture
def fake_training(monkeypatch):
    """own.train replaced by a writer of results.json (the numbers of chosen_loss); returns the argv of each job."""
    trained = []

    def train(todo, jobs=1, tag=""):
        out = []
        for argv in todo:
            kv = dict(a.split("=", 1) for a in argv[3:] if "=" in a)
            folder, seed, arm = Path(kv["hydra.run.dir"]), int(kv["seed"]), kv["state_mode"]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "results.json").write_text(json.dumps({
                "status": "ok", "seed": seed, "loss": chosen_loss(arm, seed), "config": {"dataset": {"seed": seed}},
                "overrides": [f"state_mode={arm}", f"seed={seed}"]}))
            trained.append(argv)
            out.append({"argv": argv, "returncode": 0})
        return out

    monkeypatch.setattr(own, "train", train)
    return trained


def offline_run(folder: Path):
    """An offline W&B run's (run record, summary, config) read from its run-*.wandb file: wandb 0.31 keeps them
    there (its files/wandb-summary.json is written at sync). The file is a LevelDB-style log (a 7-byte header, then
    32 KiB blocks of records: crc, length, type — full, first, middle, last) of wandb's protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = folder.glob("run-*.wandb")
    data, pos, buf, block = path.read_bytes(), 7, b"", 32768
    assert data[:4] == b":W&B"
    info, summary, config = None, {}, {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf = data[pos + 7:pos + 7 + n] if kind in (1, 2) else buf + data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind not in (1, 4):
            continue
        r = pb.Record()
        r.ParseFromString(buf)
        which = r.WhichOneof("record_type")
        if which == "run":
            info = r.run
            config.update({i.key: i.value_json for i in r.run.config.update})
        elif which == "config":
            config.update({i.key: i.value_json for i in r.config.update})
        elif which == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update})
    return info, summary, config


def write_spec(tmp_path: Path, **kw) -> Path:
    spec = {"name": "mine", "train": ["dataset=phop"], "pair": "state_mode", "arms": ["vanilla", "good", "null"],
            "metric": "loss", "claim": {"sign": -1, "delta": 0.05}} | kw
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in spec.items() if v is not None}))
    return path


def seeds_of(trained) -> list[int]:
    return [int(next(a for a in argv if a.startswith("seed=")).split("=")[1]) for argv in trained]


def test_rounds_freeze_each_line_at_its_deciding_look_and_stop_at_the_cap(tmp_path, fake_training):
    spec, out = write_spec(tmp_path), tmp_path / "own"
    folder = out / "mine"
    assert tables_main(["run", str(spec), "--seeds", "auto", "--max-seeds", "7", "--out-root", str(out),
                        "--logger", "wandb"]) == 0
    # rounds: the spec's seeds, then 2 more a round up to the cap of 7; every arm trains every seed once
    assert sorted(seeds_of(fake_training)) == sorted([s for s in range(1, 8) for _ in range(3)])
    state = json.loads((folder / "sequential.json").read_text())
    assert [r["seeds"] for r in state["rounds"]] == [[1, 2, 3], [4, 5], [6, 7]]
    assert state["stop"]["code"] == "cap" and state["table"] == "mine"
    assert [r["look"] for r in state["rounds"]] == [{"decided": 1, "open": 1}] * 3

    design = SequentialDesign(7)
    rows = {r["a"]: r for r in csv.DictReader((folder / "compare_loss.csv").open())}
    # good: decided at round 1 on seeds 1..3 with the design's repeated interval; seeds 4..7 do not move it
    d = np.array([chosen_loss("good", s) - chosen_loss("vanilla", s) for s in (1, 2, 3)])
    h = sps.t.ppf(1 - design.nominal / 2, 2) * d.std(ddof=1) / math.sqrt(3)
    good = rows["good"]
    assert (good["n_seeds"], good["look"], good["status"], good["verdict"]) == ("3", "1", "decided", "confirmed")
    assert float(good["ci_lo"]) == pytest.approx(d.mean() - h, abs=1e-9)
    assert float(good["ci_hi"]) == pytest.approx(d.mean() + h, abs=1e-9)
    # null: open to the cap, read at the last look (7 seeds), inconclusive; its interval is wider than the δ band
    d = np.array([chosen_loss("null", s) - chosen_loss("vanilla", s) for s in range(1, 8)])
    h = sps.t.ppf(1 - design.nominal / 2, 6) * d.std(ddof=1) / math.sqrt(7)
    null = rows["null"]
    assert (null["n_seeds"], null["look"], null["status"], null["verdict"]) == ("7", "3", "open", "inconclusive")
    assert float(null["ci_lo"]) == pytest.approx(d.mean() - h, abs=1e-9)
    assert judge(Rule("sign", -1, delta=0.05), d.mean() - h, d.mean() + h) == "inconclusive"
    # Holm over the two repeated p-values
    p = sorted([float(good["p"]), float(null["p"])])
    assert float(good["p_holm"]) == pytest.approx(min(1, 2 * p[0]), abs=1e-12)
    assert float(good["p"]) < 0.05 / 2 < float(null["p"])
    md = (folder / "compare_loss.md").read_text()
    assert "Sequential seeds: repeated confidence intervals (Pocock)" in md and "1: seeds 1, 2, 3; 2: seeds 4, 5" in md

    # the α ledger: the design's looks at 3, 5 and 7 seeds and what they spent
    ledger = json.loads((folder / "alpha_ledger.json").read_text())
    assert [e["looks"] for e in ledger["designs"]] == [[3, 5, 7]]
    assert ledger["alpha_spent"] == pytest.approx(design.alpha_spent([3, 5, 7]))

    # the plot: a PNG with ink on it
    png = folder / "compare_loss.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    from matplotlib.image import imread

    img = imread(png)
    assert img.shape[0] > 100 and img.shape[1] > 100 and img[..., :3].std() > 0.05

    # the W&B summary, offline beside the runs (make sync-wandb finds offline-run-* folders)
    (run,) = (folder / "wandb").glob("offline-run-*")
    info, summary, config = offline_run(run)
    assert (info.display_name, info.run_group) == ("mine-verdicts", "mine")
    assert summary["verdict/good"] == "confirmed" and summary["verdict/null"] == "inconclusive"
    assert summary["mean_diff/good"] == pytest.approx(float(good["mean_diff"]))
    assert summary["verdict_counts"] == {"confirmed": 1, "inconclusive": 1}
    assert summary["verdicts/_type"] == "table-file" and summary["plot/_type"] == "image-file"
    table = json.loads((run / "files" / summary["verdicts/path"]).read_text())
    assert [r[:4] + r[7:8] for r in table["data"]] == [["good", "vanilla", "(all)", 3, "confirmed"],
                                                        ["null", "vanilla", "(all)", 7, "inconclusive"]]
    assert (run / "files" / summary["plot/path"]).read_bytes()[:8] == PNG_MAGIC
    assert "Pocock" in config["sequential"]  # the design travels in the run's config

    # run again: nothing to train, the same lines; remove one run: only it trains again
    fake_training.clear()
    assert tables_main(["run", str(spec), "--seeds", "auto", "--out-root", str(out), "--logger", "none"]) == 0
    assert fake_training == []
    shutil.rmtree(folder / "null_s5")
    assert tables_main(["run", str(spec), "--seeds", "auto", "--out-root", str(out), "--logger", "none"]) == 0
    assert [a for a in fake_training[0] if a.startswith(("state_mode=", "seed="))] == ["state_mode=null", "seed=5"]
    assert len(fake_training) == 1

    # a larger cap is a new design: refused without --restart, at the α left with it
    with pytest.raises(ValueError, match=r"capped at 7 seeds.*pass --restart"):
        own_sequential.run(spec, out, max_seeds=9)
    (folder / "sequential.json").rename(folder / "moved.json")  # moving the state away does not reset the α spent
    with pytest.raises(ValueError, match=r"spent α = .*Pass --restart"):
        own_sequential.run(spec, out, max_seeds=9)
    (folder / "moved.json").rename(folder / "sequential.json")
    fake_training.clear()
    res = own_sequential.run(spec, out, max_seeds=9, restart=True)
    assert sorted(seeds_of(fake_training)) == [8, 8, 8, 9, 9, 9]
    ledger = json.loads((folder / "alpha_ledger.json").read_text())
    assert len(ledger["designs"]) == 2 and ledger["designs"][1]["alpha"] == pytest.approx(0.05 - design.alpha_spent([3, 5, 7]))
    assert {x.a: x.look for x in res["lines"]} == {"good": 1, "null": 4}


def test_a_build_stops_when_every_line_is_decided_and_two_sided_lines_decide_either_way(tmp_path, fake_training):
    spec = write_spec(tmp_path, name="twosided", arms=["vanilla", "good"], claim=None, seeds=[1, 2, 3, 4])
    res = own_sequential.run(spec, tmp_path / "own", max_seeds=10)
    assert sorted(set(seeds_of(fake_training))) == [1, 2, 3, 4]  # one round: decided at its look
    assert res["state"].stop["code"] == "decided" and len(res["state"].rounds) == 1
    (line,) = res["lines"]
    assert (line.verdict, line.look, line.status, len(line.seeds)) == ("A < B", 1, "decided", 4)
    assert [p.name for p in res["paths"]] == ["compare_loss.md", "compare_loss.csv", "compare_loss.png"]  # no W&B asked


def test_compare_writes_the_plot_beside_the_sweep(tmp_path, fake_training):
    spec, out = write_spec(tmp_path), tmp_path / "own"
    own.run(spec, out, logger="none")  # the fixed build trains the spec's seeds
    assert tables_main(["compare", str(out / "mine"), "--pair", "state_mode", "--metric", "loss", "--delta", "0.05",
                        "--out", str(tmp_path / "cmp")]) == 0
    png = tmp_path / "cmp" / "compare_loss.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000


def test_bad_sequential_options_for_a_spec_are_refused(tmp_path, fake_training):
    spec = write_spec(tmp_path)
    with pytest.raises(SystemExit, match="--seeds auto"):
        tables_main(["run", str(spec), "--max-seeds", "5", "--out-root", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--max-seeds 2 is below the first round's 3 seeds"):
        own_sequential.run(spec, tmp_path / "own", max_seeds=2)
    with pytest.raises(ValueError, match="--restart: no earlier design of mine"):
        own_sequential.run(spec, tmp_path / "own", restart=True)
    assert fake_training == []


def test_compare_on_the_runs_of_a_spec_gives_the_verdicts_run_gave(tmp_path, fake_training):
    """The two ways to judge one sweep agree: `tables run SPEC` (train, then judge with the spec's claim) and
    `tables compare FOLDER` with the same pair, metric, sign and δ on the same runs — line for line: the arms, the
    paired seeds, the interval, Holm's p and the verdict, one of them decided and one not."""
    spec, out = write_spec(tmp_path, seeds=[1, 2, 3, 4, 5]), tmp_path / "own"
    ran = own.run(spec, out, logger="none")
    # the spec's baseline is its first arm; compare's default is the sweep's first value, so it is named
    assert tables_main(["compare", str(out / "mine"), "--pair", "state_mode", "--metric", "loss", "--sign", "-1",
                        "--delta", "0.05", "--baseline", "vanilla", "--out", str(tmp_path / "cmp")]) == 0
    with (tmp_path / "cmp" / "compare_loss.csv").open(newline="") as f:
        compared = list(csv.DictReader(f))
    key = lambda ln: (ln.a, ln.b)
    assert len(compared) == len(ran["lines"]) == 2
    verdicts = set()
    for line, row in zip(sorted(ran["lines"], key=key), sorted(compared, key=lambda r: (r["a"], r["b"]))):
        assert (row["a"], row["b"], int(row["n_seeds"])) == (line.a, line.b, len(line.seeds)) and len(line.seeds) == 5
        assert float(row["mean_diff"]) == pytest.approx(line.mean_diff, abs=1e-9)
        assert (float(row["ci_lo"]), float(row["ci_hi"])) == pytest.approx(line.interval, abs=1e-9)
        assert float(row["p_holm"]) == pytest.approx(line.p_holm, abs=1e-9)
        assert row["verdict"] == line.verdict
        verdicts.add(line.verdict)
    assert len(verdicts) == 2, verdicts  # `good` decided, `null` not: the agreement covers both outcomes
