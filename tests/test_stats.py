"""looplab.stats: verdict rules that weigh size, p-values that agree with them, Holm, and preconditions."""

from __future__ import annotations

import json
import random

import pytest

from looplab import stats
from looplab.stats import Rule, adjusted_verdict, decisive_p, holm, judge
from looplab.tables import report, spec


def test_sign_rule():
    r = Rule("sign", +1)
    assert judge(r, 0.1, 0.5) == "reproduced" and judge(r, -0.5, -0.1) == "contradicted"
    assert judge(r, -0.1, 0.5) == "inconclusive" and judge(r, None, None) == "inconclusive"
    assert judge(Rule("sign", -1), -0.5, -0.1) == "reproduced"


def test_at_most_is_judged_against_the_size_not_the_sign():
    """"Adds at most 1.42%": a +35% overhead is contradicted (the sign rule would have called it reproduced)."""
    r = Rule("at_most", +1, size=0.0142)
    assert judge(r, 0.30, 0.40) == "contradicted"
    assert judge(r, 0.005, 0.012) == "reproduced"
    assert judge(r, 0.01, 0.02) == "inconclusive"
    assert judge(r, -0.01, 0.0142) == "reproduced"  # the bound itself is inside "at most"


def test_near_is_an_equivalence_band():
    r = Rule("near", -1, size=-0.25, tolerance=0.125)
    assert judge(r, -0.30, -0.20) == "reproduced"
    assert judge(r, -0.05, 0.0) == "contradicted" and judge(r, -0.60, -0.40) == "contradicted"
    assert judge(r, -0.40, -0.20) == "inconclusive"  # straddles the band's edge


@pytest.mark.parametrize("kind", ["sign", "at_most", "near"])
def test_decisive_p_agrees_with_the_plain_rule(kind):
    """p < 0.05 exactly when the interval-based rule decides, for intervals of every width and place."""
    rule = {"sign": Rule("sign", 1), "at_most": Rule("at_most", 1, 0.02), "near": Rule("near", -1, -0.25, 0.125)}[kind]
    rng = random.Random(0)
    for _ in range(400):
        df = rng.choice([1, 2, 4, 9])
        mean, half = rng.uniform(-0.6, 0.4), rng.uniform(1e-3, 0.3)
        plain = judge(rule, mean - half, mean + half)
        p = decisive_p(rule, mean, half, df)
        if abs(p - 0.05) < 1e-6:
            continue  # on the edge either way
        assert (p < 0.05) == (plain in ("reproduced", "contradicted")), (kind, mean, half, df, p, plain)


def test_holm_step_down():
    # four p-values: adjusted = max over the running (m − rank)·p, capped at 1; None stays outside the family
    adj = holm([0.01, 0.04, None, 0.03, 0.005])
    assert adj[2] is None
    assert adj[4] == pytest.approx(4 * 0.005) and adj[0] == pytest.approx(3 * 0.01)
    assert adj[3] == pytest.approx(max(3 * 0.01, 2 * 0.03)) and adj[1] == pytest.approx(max(0.06, 0.04))
    assert adjusted_verdict("reproduced", 0.02) == "reproduced" and adjusted_verdict("reproduced", 0.06) == "inconclusive"
    assert adjusted_verdict("not tested", None) == "not tested"


def test_t_functions_without_scipy_match_scipy(monkeypatch):
    sp = pytest.importorskip("scipy.stats")
    monkeypatch.setattr(stats, "_scipy_stats", lambda: None)
    for df in (1, 2, 5, 30):
        for t in (0.3, 1.5, 4.0):
            assert stats.t_sf(t, df) == pytest.approx(float(sp.t.sf(t, df)), abs=1e-6)
    assert stats.t_quantile(4) == pytest.approx(2.776)


def test_rule_refuses_an_incomplete_claim():
    with pytest.raises(ValueError, match="needs the paper's size"):
        Rule("at_most", 1)
    with pytest.raises(ValueError, match="positive tolerance"):
        Rule("near", 1, size=0.5)
    with pytest.raises(ValueError, match="unknown"):
        Rule("roughly", 1)
    with pytest.raises(ValueError, match="needs the paper's size"):
        spec.finding("x", "y", "latency", {}, {}, 1, kind="at_most")


# ----------------------------------------------------------------------------- preconditions
def _lm_runs(tmp_path, table, ppl_a, ppl_b, unigram, arms=("stateloop_reset", "stateloop")):
    from test_tables import fake_result, table_root, write_run

    sw = spec.get(table).sweeps_for("tiny")[0]
    for s in (1, 2, 3):
        for arm, ppl in zip(arms, (ppl_a, ppl_b)):
            d = fake_result(sw, {"arm": arm, "seed": str(s)}, loops=3, ppl=ppl + 0.1 * s + (0.05 * s * s if arm == arms[0] else 0),
                            seed=s)
            d["unigram_perplexity"] = unigram
            write_run(table_root(tmp_path, table, sw) / f"{arm}_{s}", d)


def test_an_lm_arm_above_its_unigram_perplexity_is_not_tested(tmp_path):
    _lm_runs(tmp_path, 3, ppl_a=400.0, ppl_b=30.0, unigram=320.0)
    t = report.build(3, "tiny", tmp_path)
    (v,) = t.verdicts
    assert v.verdict == "not tested" and v.holm_verdict == "not tested" and v.p is None
    assert v.not_tested == "A = stateloop_reset 1⊗3: perplexity 400.4, needs < its unigram perplexity 320"
    assert v.mean == pytest.approx(370.2, abs=0.1) and "not tested: A = stateloop_reset" in v.line()  # still shown
    data = t.findings_json()["findings"][0]
    assert data["verdict"] == "not tested" and data["requires"] == [spec.LM_LEARNED.describe()]


def test_both_arms_below_the_unigram_perplexity_are_judged(tmp_path):
    _lm_runs(tmp_path, 3, ppl_a=31.0, ppl_b=30.0, unigram=320.0)
    (v,) = report.build(3, "tiny", tmp_path).verdicts
    assert v.verdict == "reproduced" and not v.not_tested and v.family == 1 and v.p < 0.05
    # the paper's +0.21 of 9.04 ppl, carried to this setting's ≈ 44 ppl as δ is (docs/tables.md#verdicts)
    assert "the paper's +0.210 × 4.87 = +1.022 in this setting's units is inside the interval" in v.line()


def test_a_run_without_a_unigram_figure_is_not_tested(tmp_path):
    from test_tables import table_root

    _lm_runs(tmp_path, 3, ppl_a=31.0, ppl_b=30.0, unigram=320.0)
    for p in table_root(tmp_path, 3, spec.get(3).sweeps_for("tiny")[0]).rglob("results.json"):
        d = json.loads(p.read_text())
        del d["unigram_perplexity"]
        p.write_text(json.dumps(d))
    (v,) = report.build(3, "tiny", tmp_path).verdicts
    assert v.verdict == "not tested" and "not measured" in v.not_tested


def test_extrapolation_needs_each_arm_to_learn_at_its_trained_depth(tmp_path):
    """Table 9: a randomized-depth arm at chance at R is not compared at 2R (the old table's four 'contradicted')."""
    from test_tables import fake_result, table_root, write_run

    sw = spec.get(9).sweeps_for("tiny")[0]
    at_r = {"depth_fixed": 1.0, "depth_random": 0.34, "depth_random_truncated": 0.95}
    at_2r = {"depth_fixed": 0.6, "depth_random": 0.33, "depth_random_truncated": 0.9}
    for combo in sw.grid(seeds=[1, 2, 3]):
        arm, s = combo["arm"], int(combo["seed"])
        d = fake_result(sw, combo, loops=4, acc=at_r[arm], seed=s, config={"dataset": {"task": "phop", "test_size": 2048,
                                                                                     "batch_size": 64}})
        d["per_depth"]["eval_loops"] = {"4": {"accuracy": at_r[arm]}, "8": {"accuracy": at_2r[arm] + 0.01 * s}}
        write_run(table_root(tmp_path, 9, sw) / "_".join(combo.values()), d)
    t = report.build(9, "tiny", tmp_path)
    by = {(v.finding.label, v.stratum): v for v in t.verdicts}
    rnd = by[("randomized depth − fixed depth", "injection = none")]
    assert rnd.verdict == "not tested" and "depth_random 1⊗4: accuracy at R 0.34, needs >= 0.9" in rnd.not_tested
    trunc = by[("randomized depth, truncated backprop − fixed depth", "injection = none")]
    assert trunc.verdict == "reproduced"  # 0.9 vs 0.6 at 2R, both arms learned at R
    assert all(v.family == sum(x.verdict != "not tested" for x in t.verdicts) for v in t.verdicts if v.verdict != "not tested")
