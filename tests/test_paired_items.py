"""Paired item noise for zero-shot: the eval logs each item's outcome, looplab.stats.paired_item_interval pools the
seed and item variance of the paired per-item differences, and the findings use it (docs/tables.md#method)."""

from __future__ import annotations

import copy
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pytest

from looplab.stats import SequentialDesign, paired_item_interval, t_quantile, z_quantile
from looplab.tables.load import Unit, zeroshot_items, zeroshot_outcomes


def independent_half(a: np.ndarray, b: np.ndarray) -> float:
    """The conservative rule the findings used before (and still use without per-item outcomes): z·√(Σ_arms p(1−p)/n)."""
    n = a.shape[1]
    return z_quantile() * math.sqrt(sum(p * (1 - p) for p in (a.mean(), b.mean())) / n)


# ----------------------------------------------------------------------------- the estimator
def test_balanced_single_task_is_the_two_way_anova_estimator_of_the_grand_mean():
    """One task, equal weights: V = (MS_seeds + MS_items − MS_res)/(n·S), split into the seed part MS_seeds/(nS) (the
    paired t over seeds) and the item part (MS_items − MS_res)/(nS) — not var(d̄_i)/n, which would count the
    seed × item noise MS_res/(nS) a second time."""
    rng = np.random.default_rng(11)
    S, n = 6, 40
    a = (rng.random((S, n)) < rng.uniform(0.2, 0.8, n)).astype(int)
    b = (rng.random((S, n)) < rng.uniform(0.2, 0.8, n)).astype(int)
    d = (a - b).astype(float)
    g = d.mean()
    ms_seeds = n * ((d.mean(1) - g) ** 2).sum() / (S - 1)
    ms_items = S * ((d.mean(0) - g) ** 2).sum() / (n - 1)
    ms_res = ((d - d.mean(0) - d.mean(1)[:, None] + g) ** 2).sum() / ((S - 1) * (n - 1))
    assert ms_items > ms_res  # the item part is not truncated here
    r = paired_item_interval(a.tolist(), b.tolist())
    assert r.mean == pytest.approx(g) and (r.n_seeds, r.n_items) == (S, n)
    assert (r.h_seeds / t_quantile(S - 1)) ** 2 == pytest.approx(ms_seeds / (n * S))
    assert (r.h_items / z_quantile()) ** 2 == pytest.approx((ms_items - ms_res) / (n * S))
    assert r.half == pytest.approx(math.hypot(r.h_seeds, r.h_items)) and r.lo == pytest.approx(g - r.half)
    assert r.disagree == pytest.approx((d != 0).mean())
    # b omitted: a holds the differences; the seed part takes a sequential look's critical value, the item part not
    assert paired_item_interval(d.tolist()) == r
    c = paired_item_interval(a.tolist(), b.tolist(), critical=3.5)
    assert c.h_seeds == pytest.approx(r.h_seeds * 3.5 / t_quantile(S - 1)) and c.h_items == r.h_items
    # nothing to estimate from
    assert paired_item_interval([[1, 0, 1]], [[0, 0, 1]]) is None
    assert paired_item_interval([[1, 0], [1, 1]], [[0, 0], [1]]) is None
    assert paired_item_interval([[1, 0], [1, 1]], [[0, 0], [1, 0]], groups=["x", "y"]) is None  # a task of 1 item


def test_tasks_weigh_equally_as_the_zero_shot_average_does():
    """Groups: the mean is the average over tasks of each task's mean (not the pooled item mean), and each task's item
    variance enters with weight 1/(k² n_g)."""
    rng = np.random.default_rng(5)
    S, sizes = 4, (10, 30)
    a = (rng.random((S, sum(sizes))) < 0.5).astype(int)
    b = (rng.random((S, sum(sizes))) < 0.4).astype(int)
    groups = ["t1"] * sizes[0] + ["t2"] * sizes[1]
    r = paired_item_interval(a.tolist(), b.tolist(), groups=groups)
    d = a - b
    per_seed = (d[:, :10].mean(1) + d[:, 10:].mean(1)) / 2
    assert r.mean == pytest.approx(per_seed.mean())
    assert r.h_seeds == pytest.approx(t_quantile(S - 1) * per_seed.std(ddof=1) / math.sqrt(S))
    parts = [paired_item_interval(a[:, s].tolist(), b[:, s].tolist()) for s in (slice(0, 10), slice(10, None))]
    assert r.h_items == pytest.approx(math.sqrt(sum(p.h_items ** 2 for p in parts)) / 2)


# ----------------------------------------------------------------------------- (a) coverage by simulation
def simulate(tables: int, seeds: int = 5, tasks: int = 3, per_task: int = 100, delta: float = 0.02, seed: int = 7):
    """Tables of two arms scored on the same items: item i of task g has difficulty q_i (uniform, a band per task),
    an item effect on the difference ±f_i (arm A gets +f_i, B −f_i), each arm a seed effect g_s; an outcome is
    1[U_si < p] with one uniform U_si for both arms (the arms agree on most items, as two similar models do).
    E over items and seeds of p_A − p_B is exactly `delta` (every effect has mean 0, no p is clipped)."""
    rng = np.random.default_rng(seed)
    n = tasks * per_task
    lo = np.repeat(np.linspace(0.15, 0.45, tasks), per_task)
    q = lo + 0.4 * rng.random((tables, 1, n))
    f = rng.uniform(-0.06, 0.06, (tables, 1, n))
    ga, gb = rng.uniform(-0.03, 0.03, (2, tables, seeds, 1))
    u = rng.random((tables, seeds, n))
    a = (u < q + delta / 2 + f + ga).astype(np.int8)
    b = (u < q - delta / 2 - f + gb).astype(np.int8)
    return a, b, [g for g in range(tasks) for _ in range(per_task)]


def test_paired_item_interval_covers_the_true_difference_95_percent_of_the_time():
    """2,000 simulated tables (5 seeds, 3 tasks × 100 items, seed and item effects, correlated arms): the paired
    interval covers the true difference in 0.93–0.97 of them (measured: 0.9535); the independent-arms rule covers
    nearly always (1.000), being ~2.5× wider here."""
    delta = 0.02
    a, b, groups = simulate(2000, delta=delta)
    cover = cover_ind = 0
    half, half_ind = [], []
    for t in range(a.shape[0]):
        r = paired_item_interval(a[t].tolist(), b[t].tolist(), groups=groups)
        cover += r.lo <= delta <= r.hi
        h = math.hypot(r.h_seeds, independent_half(a[t], b[t]))
        cover_ind += r.mean - h <= delta <= r.mean + h
        half.append(r.half)
        half_ind.append(h)
    cover, cover_ind = cover / a.shape[0], cover_ind / a.shape[0]
    assert 0.93 <= cover <= 0.97, cover
    assert cover_ind > 0.99 and np.mean(half_ind) > 2 * np.mean(half)


# ----------------------------------------------------------------------------- (b) the width the issue expects
def test_arms_disagreeing_on_4_5_percent_of_items_give_a_third_of_the_independent_width():
    """table 1's suite: 3 tasks × 300 items, 9 seeds, accuracy ≈ 0.3; the arms differ on 4.5% of the items (the same
    ones every seed) and single items flip between seeds: the independent-arms rule's ±0.042 becomes ≈ ±0.014."""
    rng = np.random.default_rng(3)
    S, n = 9, 900
    b = np.tile((rng.random(n) < 0.29).astype(int), (S, 1))
    b ^= (rng.random((S, n)) < 0.005).astype(int)
    a = b.copy()
    a[:, rng.choice(n, size=int(0.045 * n), replace=False)] ^= 1
    r = paired_item_interval(a.tolist(), b.tolist(), groups=[i // 300 for i in range(n)])
    h_ind = independent_half(a, b)
    assert r.disagree == pytest.approx(0.045, abs=0.002)
    assert h_ind == pytest.approx(0.042, abs=0.002)
    assert 2.7 < h_ind / r.h_items < 3.3 and 2.7 < math.hypot(r.h_seeds, h_ind) / r.half < 3.3


# ----------------------------------------------------------------------------- (c) the eval logs items, the findings read them
def test_item_outcomes_are_compact_and_in_document_order():
    from looplab.eval import item_outcomes

    rows = lambda task_ids, vals, flt="none": [{"doc_id": i, "acc": v, "acc_norm": 0.0, "filter": flt} for i, v in zip(task_ids, vals)]
    samples = {"t1": rows([2, 0, 1], [1.0, 0.0, True]), "t2": rows([5, 9], [0, 1]) + rows([5, 9], [1, 1], "other"),
               "t3": rows([0, 1], [0.5, 1.0]), "t4": []}
    out = item_outcomes(samples)
    assert out == {"t1": {"doc_ids": "0:3", "acc": "011"}, "t2": {"doc_ids": [5, 9], "acc": "01"}}  # t3: not 0/1
    z = {"results": {"t1": {"acc": 2 / 3}, "t2": {"acc": 0.5}}, "items": out}
    assert zeroshot_outcomes(z) == {"t1": ((0, 1, 2), [0, 1, 1]), "t2": ((5, 9), [0, 1])}
    # an older zeroshot.json (no items), or items missing for a task of the average, gives None
    assert zeroshot_outcomes({"results": {"t1": {"acc": 0.5}}, "average_acc": 0.5, "n_samples": {"t1": 3}}) is None
    assert zeroshot_outcomes({**z, "results": {**z["results"], "t3": {"acc": 0.1}}}) is None
    assert zeroshot_items({"n_samples": {"t1": 3, "t2": 2}}) == 5


def _variant(z: dict, flips: list[tuple[str, int]]) -> dict:
    """A copy of a zeroshot.json with some items' outcomes flipped, its per-task acc and average_acc recomputed."""
    z = copy.deepcopy(z)
    for task, i in flips:
        s = z["items"][task]["acc"]
        z["items"][task]["acc"] = s[:i] + ("0" if s[i] == "1" else "1") + s[i + 1:]
    for task, it in z["items"].items():
        z["results"][task]["acc"] = it["acc"].count("1") / len(it["acc"])
    accs = [r["acc"] for r in z["results"].values() if "acc" in r]
    z["average_acc"] = sum(accs) / len(accs)
    return z


def test_eval_writes_per_item_outcomes_and_the_findings_pair_them(tmp_path):
    """`python -m looplab.tables zeroshot 1` (evaluate_table) on a tiny checkpoint, 4 items per looplab_tiny task: its
    zeroshot.json holds each item's 0/1 outcome in document order, and a zero-shot finding over such files uses the
    paired seed × item interval (an older file without items: the independent-arms rule, said in the reason)."""
    import torch

    from looplab.checkpoint import looplab_meta
    from looplab.eval import tiny_suite
    from looplab.models import LoopedLM, LoopedLMConfig
    from looplab.tables import spec
    from looplab.tables import zeroshot as tz
    from looplab.tables.findings import evaluate_finding

    torch.manual_seed(0)  # the smallest model the zero-shot tests use (tests/test_lm_eval.py::tiny_model)
    model = LoopedLM(LoopedLMConfig(vocab_size=4096, d_model=32, n_heads=2, n_layers=1, n_loops=2, max_seq_len=256)).eval()
    with torch.no_grad():
        model.head.weight.mul_(20)
    ds = {"_target_": "looplab.data.lm.LMDataModule", "name": "lm_tiny", "source": "shakespeare",
          "tokenizer": "shakespeare-bpe-4096", "seq_len": 64}
    ckpt = tmp_path / "lm.ckpt"
    torch.save({"state_dict": {"model." + k: v for k, v in model.state_dict().items()},
                "looplab": looplab_meta(model.config, dataset=ds)}, ckpt)
    run = tmp_path / "out" / "table1" / "tiny" / spec.get(1).sweeps_for("tiny")[0].folder / "0"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"status": "ok", "checkpoint": str(ckpt), "overrides": []}))
    limit = 4
    written = tz.evaluate_table(1, "tiny", tmp_path / "out", limit=limit, batch_size=16)
    assert written == [run / "zeroshot.json"]
    text = written[0].read_text()
    zs = json.loads(text)
    assert sorted(zs["items"]) == sorted(zs["results"]) == sorted(tiny_suite.TASKS)
    for task, it in zs["items"].items():
        assert it["doc_ids"] == f"0:{limit}" and len(it["acc"]) == limit and set(it["acc"]) <= {"0", "1"}
        assert it["acc"].count("1") / limit == pytest.approx(zs["results"][task]["acc"])
    assert len(text) < 5000  # compact: a character per item, no logged documents or responses
    assert _variant(zs, [])["average_acc"] == pytest.approx(zs["average_acc"])

    # two arms × 3 seeds over these 12 items: B flips one item per seed, A differs from B on two fixed items and one
    # that changes with the seed
    fd = spec.finding("A − B", "A raises the zero-shot average", "zero-shot", {"arm": "a"}, {"arm": "b"}, +1)
    tasks = sorted(zs["items"])
    units = []
    for s in range(3):
        zb = _variant(zs, [(tasks[s], s)])
        za = _variant(zb, [(tasks[0], 3), (tasks[1], 3), (tasks[2], (s + 1) % limit)])
        units += [Unit({"arm": "a"}, str(s + 1), {}, zeroshot=za), Unit({"arm": "b"}, str(s + 1), {}, zeroshot=zb)]
    (v,) = evaluate_finding(fd, units)
    outcomes = {arm: [[x for t in tasks for x in zeroshot_outcomes(u.zeroshot)[t][1]] for u in units if u.facets["arm"] == arm]
                for arm in ("a", "b")}
    want = paired_item_interval(outcomes["a"], outcomes["b"], groups=[t for t in tasks for _ in range(limit)])
    assert v.mean == pytest.approx(want.mean) and (v.lo, v.hi) == pytest.approx((want.lo, want.hi))
    assert v.h_ex == pytest.approx(want.h_items) and "item noise paired over 12 items" in v.reason

    # a sequential look: the seed part takes the look's critical t, the item part stays at the plain 95% level
    design = SequentialDesign(cap=4, simulations=20_000)
    (w,) = evaluate_finding(fd, units, design)
    h_seeds = want.h_seeds / t_quantile(2) * design.critical(3)
    assert w.h_ex == pytest.approx(want.h_items) and w.hi - w.mean == pytest.approx(math.hypot(h_seeds, want.h_items))

    # one older zeroshot.json without items: the conservative rule, and the reason says so
    units[0].zeroshot = {k: val for k, val in units[0].zeroshot.items() if k != "items"}
    (old,) = evaluate_finding(fd, units)
    n = zeroshot_items(zs)
    p = [np.mean([u.zeroshot["average_acc"] for u in units if u.facets["arm"] == arm]) for arm in ("a", "b")]
    assert old.h_ex == pytest.approx(z_quantile() * math.sqrt(sum(x * (1 - x) for x in p) / n))
    assert "without per-item outcomes" in old.reason and "conservative" in old.reason
    assert old.mean == pytest.approx(v.mean) and old.hi - old.lo > v.hi - v.lo
