"""Table 14's measurement (bench/depth_under_load.py) on trained runs: kinds, operating point, quality, engine arms."""

from __future__ import annotations

import json

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from tests.conftest import compose

LM = ["dataset=lm_tiny", "dataset.tokenizer=shakespeare-bpe-1024", "dataset.seq_len=32", "dataset.val_tokens=2048",
      "backbone.max_seq_len=64", "loop_depth=1x3"]


def _train(tiny_overrides, run_dir, extra):
    from looplab.train import train

    task_only = ("dataset.val_size", "dataset.test_size")  # p-hop's keys; an LM split is sized by val_tokens
    cfg = compose([o for o in tiny_overrides if not o.startswith(task_only)] + LM + ["trainer.max_steps=4", "trainer.val_check_interval=4",
                                         "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
                                         f"hydra.run.dir={run_dir}"] + extra)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    res = train(cfg)
    assert res["status"] == "ok"
    return run_dir


@pytest.mark.slow
def test_depth_under_load_measures_each_kind_in_the_engine(tiny_overrides, tmp_path):
    from looplab.bench.depth_under_load import QUALITY_BOUND, main

    runs = tmp_path / "runs"
    _train(tiny_overrides, runs / "exit_aware", ["exit_gate.skip_train_prob=0.5", "exit_gate.skip_compute=kv_copy"])
    _train(tiny_overrides, runs / "routed", ["+arm=mor_token"])
    _train(tiny_overrides, runs / "fixed", [])
    out = tmp_path / "serving.json"
    main([str(runs), "--concurrency", "1,3", "--requests", "4", "--repeats", "2", "--windows", "8",
          "--select-windows", "4", "--prompt-len", "2,6", "--new-tokens", "2,5", "--grid", "0.01,0.5,5",
          "--out", str(out)])
    res = json.loads(out.read_text())
    by = {m["kind"]: m for m in res["models"]}
    assert set(by) == {"exit-aware", "routed", "fixed"}
    ea = by["exit-aware"]
    assert ea["arms"] == ["plain", "exits_lockstep", "exits_depthwise"] and ea["training"].startswith("exit-aware (kv_copy")
    op = ea["operating_point"]
    assert op["rule"] == "kl" and op["handling"] == "kv_copy" and [t["threshold"] for t in op["grid"]] == [0.01, 0.5, 5]
    within = [t["threshold"] for t in op["grid"] if t["ratio"] - 1 <= QUALITY_BOUND]
    assert op["threshold"] == (max(within) if within else 0.01)
    assert 1 <= ea["exits"]["mean_depth"] <= 3 and ea["all_loops"]["mean_depth"] == 3
    assert ea["exits"]["tokens"] == ea["all_loops"]["tokens"] == 8 * 32
    assert 1 <= by["routed"]["routed"]["mean_depth"] <= 3 and by["routed"]["arms"] == ["routed", "routed_depthwise"]
    for m in res["models"]:
        assert len(m["runs"]) == 2 * 2 * len(m["arms"])  # concurrencies × rounds × arms
        for r in m["runs"]:
            assert r["output_tokens_per_s"] > 0 and r["requests"] == 4
            if r["repeat"] == 0:
                assert r["solo_check"]["different"] == 0, (m["kind"], r["arm"], r["solo_check"])
    lock = [r for r in ea["runs"] if r["arm"] == "exits_lockstep" and r["repeat"] == 0]
    deep = [r for r in ea["runs"] if r["arm"] == "exits_depthwise" and r["repeat"] == 0]
    assert [r["mean_depth"] for r in lock] == [r["mean_depth"] for r in deep]  # the same exit decisions
    # the table's builder reads this file: a row per model × arm × concurrency, verdicts from the numbers
    from looplab.tables import report

    t = report.build(14, "tiny", tmp_path / "no_runs", serving_json=out)
    assert len(t.rows) == 2 * 6 and {r["arm"] for r in t.rows} == {"plain", "exits_lockstep", "exits_depthwise", "routed",
                                                                 "routed_depthwise"}
    assert any("target at c 3" in k and "routed" in k for k in t.summary)
    assert t.summary["every checked request against decoding it alone"].startswith("0 different")
    assert any("make table14" not in m for m in t.missing)  # the training runs it did not find are listed


def _fake_model(kind, ppl, served, tps, depth, arms, n_loops=4):
    runs = [{"arm": a, "concurrency": c, "repeat": k, "output_tokens_per_s": tps[a][c][k], "decode_tokens_per_s": 1.0,
             "mean_depth": depth if a != "plain" else n_loops, "ttft_p50_s": 0.01, "token_latency_p50_s": 0.001,
             "token_latency_p99_s": 0.002, "peak_cache_bytes": 2048,
             **({"solo_check": {"equal": 4, "ties": 0, "different": 0}} if k == 0 else {})}
            for a in arms for c in (1, 8) for k in range(3)]
    m = {"kind": kind, "training": "standard", "backbone": "llama", "n_layers": 1, "n_loops": n_loops, "d_model": 32,
         "depth_router": "token_choice" if kind == "routed" else "none", "arms": arms, "runs": runs,
         "all_loops": {"perplexity": ppl, "mean_depth": n_loops}}
    if kind == "exit-aware":
        m["exits"] = {"perplexity": served, "mean_depth": depth}
        m["operating_point"] = {"rule": "kl", "threshold": 0.05, "handling": "kv_copy"}
    if kind == "routed":
        m["routed"] = {"perplexity": served, "mean_depth": depth}
    return m


def test_table14_judges_the_targets_from_paired_ratios(tmp_path):
    """Target at c 8: depth-wise ≥ 1.5× plain (or 80% of an ideal below 1.9) with perplexity within 2%, judged on the
    95% interval of the paired ratios over rounds; MoR ≥ the fixed model; a quality miss fails the target."""
    from looplab.tables import report
    from looplab.tables.builders.measured import serving_target

    assert serving_target(2.0) == 1.5 and serving_target(1.5) == pytest.approx(1.2)
    ea = ["plain", "exits_lockstep", "exits_depthwise"]
    flat = {c: [100.0, 110.0, 90.0] for c in (1, 8)}
    fast = {c: [160.0, 178.0, 143.0] for c in (1, 8)}  # 1.6× in every round: interval [1.6, 1.6] (up to rounding)
    models = [_fake_model("exit-aware", 40.0, 40.4, {"plain": flat, "exits_lockstep": flat, "exits_depthwise": fast}, 2.0, ea),
              _fake_model("exit-aware", 40.0, 44.0, {"plain": flat, "exits_lockstep": flat, "exits_depthwise": fast}, 2.0, ea),
              _fake_model("routed", 41.0, 42.0, {"routed": {c: [90.0, 100.0, 80.0] for c in (1, 8)}}, 2.5, ["routed"], 3),
              _fake_model("fixed", 40.0, None, {"plain": flat}, 3, ["plain"], 3)]
    models[1]["training"] = "exit-aware (kv_copy, p=0.5)"
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({"concurrency": [1, 8], "requests": 4, "repeats": 3, "trace": {"prompt_len": [2, 4],
                                "new_tokens": [2, 4]}, "models": models}))
    t = report.build(14, "tiny", tmp_path, serving_json=path)
    verdicts = {k: v for k, v in t.summary.items() if k.startswith("target at c 8")}
    ok = next(v for k, v in verdicts.items() if "(standard)" in k and "depth-wise" in k)
    bad_quality = next(v for k, v in verdicts.items() if "exit-aware (kv_copy" in k)
    mor = next(v for k, v in verdicts.items() if "routed" in k)
    assert ok.startswith("**met**") and "1.60×" in ok  # perplexity +1%, 1.6× ≥ 1.5×
    assert bad_quality.startswith("**not met**") and "+10.00%" in bad_quality  # fast, but 10% worse perplexity
    assert mor.startswith("**not met** (its faster schedule, routed)") and "0.90× [0.87, 0.92]" in mor  # 0.89–0.91×
    t.summary.clear()
    report.write(t, tmp_path / "tables", plot=True)
    assert (tmp_path / "tables" / "table14.png").stat().st_size > 0
