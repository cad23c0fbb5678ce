"""bench.depth_ceiling: what any schedule of exits could buy, from an engine's measured step costs. The closed forms
are checked against brute force and against a pass-by-pass simulation of continuous depth batching."""

from __future__ import annotations

import itertools
import random

import pytest

from looplab.bench.depth_ceiling import (ceilings, depth_counts, expected_max, fit_step_cost,
                                         simulate_across_steps)


def test_the_fit_recovers_a_linear_cost_and_refuses_one_depth():
    a, b = fit_step_cost({1: 0.7 + 0.3, 2: 0.7 + 0.6, 3: 0.7 + 0.9, 4: 0.7 + 1.2})
    assert a == pytest.approx(0.7) and b == pytest.approx(0.3)
    with pytest.raises(ValueError, match=r"at least two depths.*\[4\]"):
        fit_step_cost({4: 1.0})


@pytest.mark.parametrize("c", [1, 2, 3])
def test_expected_max_equals_enumeration(c):
    counts = {1: 3, 2: 1, 4: 2}
    pool = [d for d, k in counts.items() for _ in range(k)]
    brute = sum(max(t) for t in itertools.product(pool, repeat=c)) / len(pool) ** c
    assert expected_max(counts, c) == pytest.approx(brute)


LINEAR = {r: 0.5 + 0.25 * r for r in range(1, 5)}  # t(R') = a + b·R', a = 0.5, b = 0.25


def test_tokens_that_all_run_every_loop_leave_nothing_to_buy():
    out = ceilings(LINEAR, depth_counts={4: 10}, concurrency=8)
    assert out["perfect"]["speedup"] == pytest.approx(1.0)
    assert out["in_step"]["speedup"] == pytest.approx(1.0)
    assert out["across_steps"][4]["speedup"] == pytest.approx(1.0)
    assert all(v["speedup"] <= 1.0 + 1e-12 for v in out["across_steps"].values())
    assert out["fit"]["a"] == pytest.approx(0.5) and out["fit"]["fixed_share_of_a_step"] == pytest.approx(1 / 3)
    assert out["fit"]["max_relative_residual"] == pytest.approx(0.0, abs=1e-12)


def test_no_schedule_beats_perfect_and_a_large_batch_runs_to_the_deepest_token():
    counts = {1: 30, 2: 25, 3: 20, 4: 25}
    t = {1: 0.7, 2: 1.0, 3: 1.3, 4: 1.6}
    out = ceilings(t, counts, concurrency=32)
    assert out["mean_exit_depth"] == pytest.approx((30 + 50 + 60 + 100) / 100)
    best = out["perfect"]["speedup"]
    assert best == pytest.approx(1.6 / (0.3 * 0.7 + 0.25 * 1.0 + 0.2 * 1.3 + 0.25 * 1.6))
    assert out["in_step"]["speedup"] <= best and all(v["speedup"] <= best for v in out["across_steps"].values())
    assert out["in_step"]["expected_max_depth"] == pytest.approx(4.0, abs=1e-3)  # 32 draws: one is at 4
    assert out["in_step"]["speedup"] == pytest.approx(1.0, abs=1e-3)
    # in one token's step (c = 1) the in-step schedule is the perfect one
    one = ceilings(t, counts, concurrency=1)
    assert one["in_step"]["speedup"] == pytest.approx(one["perfect"]["speedup"])
    # a step that costs nothing beside its loops: a pass of one loop wastes nothing and depth batching is perfect
    free = ceilings({r: 0.3 * r for r in range(1, 5)}, counts, concurrency=32)
    assert free["across_steps"][1]["speedup"] == pytest.approx(free["perfect"]["speedup"]) == pytest.approx(4 / 2.4)
    with pytest.raises(ValueError, match=r"1\.\.4.*\[0, 2\]"):
        ceilings(t, {0: 1, 2: 1}, 8)
    with pytest.raises(ValueError, match=r"every R' in 1\.\.4.*\[1, 2, 4\]"):
        ceilings({1: 1.0, 2: 1.0, 4: 1.0}, {2: 1}, 8)


@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_the_closed_form_matches_a_pass_by_pass_simulation(L):
    rng = random.Random(L)
    weights = [0.3, 0.25, 0.2, 0.25]
    requests = [rng.choices([1, 2, 3, 4], weights, k=rng.randint(8, 32)) for _ in range(800)]
    counts = depth_counts(d for r in requests for d in r)
    t, c = {1: 0.03, 2: 0.04, 3: 0.055, 4: 0.06}, 8
    closed = ceilings(t, counts, c)["across_steps"][L]["seconds_per_token"]
    # 800 requests at c = 8: the closed loop's tail (fewer than c running, each pass paid in full) is under 1%
    assert simulate_across_steps(requests, c, L, t) == pytest.approx(closed, rel=0.01)
    # one request per slot and tokens of one depth: no tail, the two agree exactly
    same = [[3] * 50 for _ in range(c)]
    assert simulate_across_steps(same, c, L, t) == pytest.approx(
        ceilings(t, {3: 1}, c)["across_steps"][L]["seconds_per_token"])


def test_the_vllm_bench_takes_each_concurrency_and_sets_the_measured_skipping_beside_its_estimate():
    from looplab.bench.vllm_serve import depth_batching

    best = {(f"vllm_depth_R{k}", 8): 1 / (0.002 + 0.001 * k) for k in range(1, 5)}
    best |= {(f"vllm_depth_R{k}", 32): 1 / (0.001 + 0.0005 * k) for k in range(1, 5)}
    best[("vllm_exit_skip", 8)] = 1.1 / 0.006
    exits = {"loops": 4, "skip": {"depth_counts": {1: 2, 2: 1, 4: 1}}}
    out = depth_batching(best, exits, (8, 32))
    assert out["c8"]["fit"]["a"] == pytest.approx(0.002) and out["c8"]["fit"]["b"] == pytest.approx(0.001)
    assert out["c32"]["fit"]["b"] == pytest.approx(0.0005)
    assert out["c8"]["in_step"]["measured_speedup"] == pytest.approx(1.1)
    assert "measured_speedup" not in out["c32"]["in_step"]
    assert set(out["c8"]["adaptive"]) == {0.1, 0.2, 0.3, 0.4, 0.5}
    assert all(0.5 < x <= out["c8"]["perfect"]["speedup"] for x in out["c8"]["adaptive"].values())
    assert out["c8"]["perfect"]["speedup"] == pytest.approx(0.006 / (0.002 + 0.001 * 2.0))


def test_adaptive_passes_span_the_in_step_and_one_loop_schedules():
    from looplab.bench.depth_ceiling import simulate_adaptive

    counts, t, c = {2: 55, 3: 44, 4: 1}, {1: 1.1, 2: 1.2, 3: 1.5, 4: 1.9}, 8
    est = ceilings(t, counts, c)
    # a pass that runs until its last token exits is the in-step schedule; one that ends after a loop, L = 1
    assert simulate_adaptive(counts, c, t, 0.0) == pytest.approx(est["in_step"]["seconds_per_token"], rel=0.01)
    assert simulate_adaptive(counts, c, t, 1.01) == pytest.approx(est["across_steps"][1]["seconds_per_token"],
                                                                 rel=0.01)
    assert all(simulate_adaptive(counts, c, t, k, passes=2000) >= est["perfect"]["seconds_per_token"]
               for k in (0.1, 0.3, 0.5))
