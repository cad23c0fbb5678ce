"""α-spending across restarts of a sequential-seeds design (docs/tables.md#sequential-seeds): the α a design has
spent at the looks it made, a new design on the same runs calibrated at the α left (the false-sign rate of a
restarted build stays ≤ α, a naive restart at the full α exceeds it), and `run N --seeds auto` refusing a silent
reset, with `--restart` recording the account in alpha_ledger.json."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import special

from looplab import stats
from looplab.stats import SequentialDesign
from looplab.tables import runner, sequential
from looplab.tables.__main__ import main as tables_main
from test_tables_sequential import FakeTrainer, _fixed_build_on_disk

ALPHA = stats.ALPHA
ROUNDS_9 = [3, 5, 7, 9]  # the runner's rounds of a cap-9 design: 3 seeds, then 2 at a time
LATER_20 = [11, 13, 15, 17, 19, 20]  # the looks a cap-20 design restarted after them makes on the same paths


# ----------------------------------------------------------------------------- the α a design spent
def test_alpha_spent_at_the_looks_made_lies_between_one_look_and_alpha():
    d = SequentialDesign(9)
    spent = d.alpha_spent(ROUNDS_9)
    one = d.alpha_spent([5])  # a single look at the nominal level α′ spends α′ (up to the simulation's error)
    assert abs(one - d.nominal) < 4 * (d.nominal / d.simulations) ** 0.5
    assert d.nominal < spent < ALPHA and 0.035 < spent < 0.045  # ≈ 0.0396: four of the seven looks
    steps = [d.alpha_spent(ROUNDS_9[:k]) for k in range(1, 5)]
    assert steps == sorted(steps) and len(set(steps)) == 4  # every look made spends more
    every = d.alpha_spent(range(3, 10))  # every n = 3..9: all of α, up to the calibration's step
    assert ALPHA - 1 / d.simulations <= every < ALPHA
    assert d.alpha_spent([]) == 0.0 and d.alpha_spent([2, 10, 12]) == 0.0  # outside 3..cap: no look of this design
    # the same null paths as the calibration (one RandomState): over every look the two samples are one
    low = stats._min_p_at_looks(9, tuple(range(3, 10)), d.simulations, d.seed)
    assert np.array_equal(np.sort(low), stats._min_p_sample(9, 3, d.simulations, d.seed))


def test_a_restarted_design_holds_the_alpha_left_and_records_the_earlier_one():
    d = SequentialDesign(9)
    spent = d.alpha_spent(ROUNDS_9)
    r = d.restarted(20, ROUNDS_9, last_round=4)
    assert r.cap == 20 and r.alpha == pytest.approx(ALPHA - spent) and r.spent == pytest.approx(spent)
    assert r.overall == pytest.approx(ALPHA) and r.nominal < SequentialDesign(20).nominal
    (h,) = r.history
    assert (h["cap"], h["looks"], h["alpha_spent"], h["last_round"]) == (9, ROUNDS_9, spent, 4)
    assert h["nominal_alpha"] == d.nominal and "history" not in h
    # the dict records it and reads back; a first design's dict is as before, and old dicts still load
    dd = json.loads(json.dumps(r.as_dict()))
    assert dd["spent_alpha"] == r.spent and dd["overall_alpha"] == r.overall and dd["history"][0]["looks"] == ROUNDS_9
    assert SequentialDesign.from_dict(dd) == r and hash(r) == hash(SequentialDesign.from_dict(dd))
    assert not {"spent_alpha", "history"} & set(d.as_dict())
    old = {"method": "pocock-rci", "alpha": 0.05, "cap": 9, "first_look": 3, "simulations": 200000, "seed": 49}
    assert SequentialDesign.from_dict(old).spent == 0.0 and SequentialDesign.from_dict(old).history == ()
    # its repeated p-values are on the overall scale: below α exactly when its own interval decides
    assert r.repeated_p(r.nominal) >= ALPHA > r.repeated_p(r.nominal * (1 - 1e-9))
    assert r.repeated_p(1.0) == 1.0 and r.repeated_p(0.0) == 0.0
    # a second restart is charged both: the α left shrinks again
    r2 = r.restarted(30, [11, 13])
    assert r2.spent == pytest.approx(spent + r.alpha_spent([11, 13])) and r2.overall == pytest.approx(ALPHA)
    assert [e["cap"] for e in r2.history] == [9, 20]
    # a design that looked at every n spent all of α: nothing left for another
    with pytest.raises(ValueError, match="too little"):
        SequentialDesign(5).restarted(20, range(3, 6))


# ----------------------------------------------------------------------------- simulation: restarts on the same paths
def _nominal_p(z: np.ndarray) -> dict[int, np.ndarray]:
    """Each look's two-sided t-test p-value (n = 3..20) of every null path (rows of i.i.d. normal differences)."""
    s1, s2 = np.cumsum(z, axis=1), np.cumsum(z * z, axis=1)
    out = {}
    for n in range(3, z.shape[1] + 1):
        m = s1[:, n - 1] / n
        var = np.maximum((s2[:, n - 1] - n * m * m) / (n - 1), 1e-300)
        out[n] = 2 * special.stdtr(n - 1, -np.abs(m) * np.sqrt(n / var))
    return out


def test_a_restart_at_the_alpha_left_keeps_the_false_sign_rate_and_a_naive_restart_does_not():
    """10,000 null experiments: a cap-9 design looked at 3, 5, 7, 9 seeds, then a cap-20 design on the same paths
    looked at 11, 13, …, 19, 20. At the α left the false-sign rate (any look excludes 0) stays ≤ α; the naive
    restart at the full α raises it above the first design's rate and above α."""
    sims = 10_000
    p = _nominal_p(np.random.RandomState(2024).standard_normal((sims, 20)))
    first = SequentialDesign(9)
    restarted, naive = first.restarted(20, ROUNDS_9), SequentialDesign(20)
    err_first = np.min([p[n] for n in ROUNDS_9], axis=0) < first.nominal
    later = np.min([p[n] for n in LATER_20], axis=0)
    rate_first = err_first.mean()
    rate_spent = (err_first | (later < restarted.nominal)).mean()
    rate_naive = (err_first | (later < naive.nominal)).mean()
    slack = 3 * (ALPHA * (1 - ALPHA) / sims) ** 0.5  # Monte-Carlo: ±3 sd of 10,000 paths
    assert rate_first <= ALPHA + slack and rate_first <= rate_spent <= ALPHA + slack, (rate_first, rate_spent)
    assert rate_spent <= first.alpha_spent(ROUNDS_9) + restarted.alpha + slack  # the union bound
    assert rate_naive > rate_spent + 0.005 and rate_naive > ALPHA, (rate_naive, rate_spent)  # ≈ 0.053 vs ≈ 0.041


# ----------------------------------------------------------------------------- the build: no silent reset
class Noisy(FakeTrainer):  # an effect of 0.3 with sd ≈ 0.9: undecided at a cap of 5
    EFFECT, NOISE = 0.3, {s: 0.9 * (-1) ** s * (1 + s % 3) / 2 for s in range(1, 11)}


def _cli(out, tables, *more):
    return tables_main(["run", "3", "--seeds", "auto", "--out-root", str(out), "--table-dir", str(tables), "--logger", "none",
                        "--jobs", "1", *more])


def test_a_larger_cap_is_refused_naming_the_alpha_spent_and_restart_continues_at_the_alpha_left(tmp_path, monkeypatch):
    out, tables = tmp_path / "out", tmp_path / "tables"
    monkeypatch.setattr(runner.subprocess, "run", Noisy())
    assert _cli(out, tables, "--max-seeds", "5") == 0
    state_file, ledger_file = sequential.state_path(out, 3, "tiny"), sequential.ledger_path(out, 3, "tiny")
    state = sequential.SequentialState.load(state_file)
    assert state.stop["code"] == "cap" and state.design_looks() == [3, 5]
    spent = SequentialDesign(5).alpha_spent([3, 5])
    ledger = json.loads(ledger_file.read_text())
    assert [(d["cap"], d["looks"], d["alpha_spent"], d["closed"]) for d in ledger["designs"]] == [(5, [3, 5], spent, None)]
    # a larger cap without --restart: refused, naming the α spent and the flag
    with pytest.raises(ValueError, match="--restart") as e:
        _cli(out, tables, "--max-seeds", "9")
    assert f"spent α = {spent:.4f}" in str(e.value) and "move" not in str(e.value)
    # moving the state file away does not reset the account: the ledger refuses too
    moved = state_file.rename(tmp_path / "sequential.json.away")
    with pytest.raises(ValueError, match="--restart") as e:
        _cli(out, tables, "--max-seeds", "9")
    assert f"spent α = {spent:.4f}" in str(e.value) and "n = 3, 5" in str(e.value)
    moved.rename(state_file)
    # with --restart: the rounds go on at the α left, the looks after the restart judged by the new design
    trainer = Noisy()
    monkeypatch.setattr(runner.subprocess, "run", trainer)
    assert _cli(out, tables, "--max-seeds", "9", "--restart") == 0
    state = sequential.SequentialState.load(state_file)
    assert not any(s <= 5 for _, s in trainer.calls)  # the runs on disk are reused
    d = state.design
    assert d.cap == 9 and d.alpha == pytest.approx(ALPHA - spent) and d.spent == pytest.approx(spent)
    assert [(h["cap"], h["looks"], h["last_round"]) for h in d.history] == [(5, [3, 5], 2)]
    assert state.design_at(2).cap == 5 and state.design_at(3) == d and state.design_looks() == [n for n in (7, 9)
                                                                                                 if n <= len(state.all_seeds())]
    ledger = json.loads(ledger_file.read_text())
    assert [(x["cap"], x["looks"], bool(x["closed"])) for x in ledger["designs"]] == [(5, [3, 5], True),
                                                                                     (9, state.design_looks(), False)]
    assert ledger["designs"][1]["alpha"] == pytest.approx(ALPHA - spent)
    assert ledger["alpha_spent"] == pytest.approx(spent + d.alpha_spent(state.design_looks()))
    findings = json.loads((tables / "table3.findings.json").read_text())
    assert findings["sequential"]["design"]["spent_alpha"] == pytest.approx(spent)
    assert "earlier designs on these runs spent" in (tables / "table3.md").read_text()


def test_restart_after_the_state_file_was_moved_and_a_warning_for_runs_without_an_account(tmp_path, monkeypatch, capsys):
    out, tables = tmp_path / "out", tmp_path / "tables"
    _fixed_build_on_disk(out)  # a fixed build's seeds 1-3, no state, no ledger: allowed, said loudly
    monkeypatch.setattr(runner.subprocess, "run", Noisy())
    with pytest.raises(ValueError, match="no earlier design"):
        _cli(out, tables, "--max-seeds", "5", "--restart")
    assert _cli(out, tables, "--max-seeds", "5") == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "seeds 1, 2, 3" in err and "not charged" in err
    spent = SequentialDesign(5).alpha_spent([3, 5])
    sequential.state_path(out, 3, "tiny").unlink()  # moved away
    monkeypatch.setattr(runner.subprocess, "run", Noisy())
    assert _cli(out, tables, "--max-seeds", "9", "--restart") == 0
    assert "WARNING" not in capsys.readouterr().err
    state = sequential.SequentialState.load(sequential.state_path(out, 3, "tiny"))
    d = state.design
    assert d.alpha == pytest.approx(ALPHA - spent) and [h["looks"] for h in d.history] == [[3, 5]]
    assert state.rounds[0].seeds == [1, 2, 3] and state.design_at(1) == d  # a new design: its own looks from round 1
    ledger = json.loads(sequential.ledger_path(out, 3, "tiny").read_text())
    assert [x["cap"] for x in ledger["designs"]] == [5, 9] and ledger["designs"][1]["looks"] == state.design_looks()
    # a state file from before the ledger existed gets one on its next run
    sequential.ledger_path(out, 3, "tiny").unlink()
    assert _cli(out, tables) == 0
    ledger = json.loads(sequential.ledger_path(out, 3, "tiny").read_text())
    assert [x["cap"] for x in ledger["designs"]] == [5, 9] and ledger["alpha_spent"] == pytest.approx(state.alpha_spent())
