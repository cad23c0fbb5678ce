"""Synthetic tasks (docs/formulations.md#tasks): generators vs independent solvers, splits, token layouts, and the
resumable rank-sharded training stream of TaskDataModule."""

from __future__ import annotations

import itertools
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from looplab.data import mano, phop
from looplab.data.sampler import STREAM_LENGTH, ResumableSampler
from looplab.data.tasks import IGNORE, TaskDataModule, make_task


# ----------------------------------------------------------------------------- p-hop
PHOP_SETTINGS = [dict(n=32, p=3, alphabet=4), dict(n=16, p=6, alphabet=3), dict(n=40, p=4, alphabet=8), dict(n=12, p=2, alphabet=3)]


@pytest.mark.parametrize("kw", PHOP_SETTINGS)
def test_phop_generator_matches_reference_solver(kw):
    for split in ("train", "test"):
        for i in range(250):
            ex = phop.make_example(3, split, i, **kw)
            s = ex.symbols
            assert len(s) == kw["n"] and all(0 <= c < kw["alphabet"] for c in s)
            assert all(a != b for a, b in zip(s, s[1:])), "equal neighbours"
            assert phop.solve(s, kw["p"]) == ex.answer  # every hop exists (solve returns None otherwise)


def test_phop_paper_scale_answers():
    for i in range(100):
        ex = phop.make_example(0, "train", i, n=256, p=32, alphabet=4)
        assert phop.solve(ex.symbols, 32) == ex.answer


def test_phop_per_position_targets_match_solver_on_prefixes():
    for i in range(150):
        ex = phop.make_example(1, "train", i, n=24, p=3, alphabet=4)
        for t in range(len(ex.symbols)):
            ref = phop.solve(ex.symbols[: t + 1], 3)
            assert ex.hop_targets[t] == (-1 if ref is None else ref)
        assert ex.hop_targets[-1] == ex.answer


def test_phop_solver_on_hand_example():
    # a b c a b d b : from 6 ('b') the last earlier 'b' is 4 → land 5 ('d'); no earlier 'd'
    s = [0, 1, 2, 0, 1, 3, 1]
    assert phop.solve(s, 1) == 3
    assert phop.solve(s, 2) is None
    assert phop.hop_targets(s, 1) == [-1, -1, -1, 1, 2, -1, 3]
    # from 4 ('b') → earlier 'b' at 1 → land 2 ('c'); from 2 nothing earlier
    assert phop.solve(s[:5], 1) == 2


def test_phop_deterministic_and_index_sensitive():
    kw = dict(n=32, p=3, alphabet=4)
    a = [phop.make_example(7, "train", i, **kw) for i in range(50)]
    b = [phop.make_example(7, "train", i, **kw) for i in reversed(range(50))][::-1]
    assert a == b  # pure function of (seed, split, index), order of generation irrelevant
    assert len({tuple(e.symbols) for e in a}) == 50
    other_seed = [phop.make_example(8, "train", i, **kw) for i in range(50)]
    assert all(x.symbols != y.symbols for x, y in zip(a, other_seed))


def test_phop_train_test_disjoint_on_small_space():
    # 3·2^7 = 384 strings: independent streams alone would collide constantly
    kw = dict(n=8, p=2, alphabet=3)
    train = {tuple(phop.make_example(s, "train", i, **kw).symbols) for s in (0, 1) for i in range(600)}
    test = {tuple(phop.make_example(s, "test", i, **kw).symbols) for s in (0, 1) for i in range(600)}
    assert train and test and not (train & test)
    assert len(train) > 50 and len(test) > 50


# ----------------------------------------------------------------------------- Mano
def _count(prefix):
    ops = sum(t in mano.OPS for t in prefix)
    return ops, len(prefix) - ops


def _root_left_ops(prefix):
    """Operator count of the root's left subtree (prefix-order walk)."""
    need, i = 1, 1
    ops = 0
    while need:
        tok = prefix[i]
        if tok in mano.OPS:
            ops += 1
            need += 1
        else:
            need -= 1
        i += 1
    return ops


@pytest.mark.parametrize("L,modulus", [(24, 23), (6, 5), (3, 7), (1, 2)])
def test_mano_generator_matches_reference_solver(L, modulus):
    for split in ("train", "test"):
        for i in range(250):
            ex = mano.make_example(5, split, i, L=L, modulus=modulus)
            assert mano.solve(ex.prefix, modulus) == ex.answer
            assert 0 <= ex.answer < modulus
            ops, leaves = _count(ex.prefix)
            assert ops == ex.n_ops and leaves == ex.n_ops + 1
            assert all(0 <= int(t) < modulus for t in ex.prefix if t not in mano.OPS)
            if split == "test":
                assert ex.n_ops == L
            else:
                assert 1 <= ex.n_ops <= L


def test_mano_subtree_values_match_solver_on_spans():
    """subtree_values[t] = value of the largest operator subtree ending at t: the longest well-formed
    span prefix[s..t] (any well-formed prefix span is a subtree), evaluated by the reference solver."""
    for i in range(150):
        ex = mano.make_example(0, "train", i, L=6, modulus=7)
        for t in range(len(ex.prefix)):
            ref = -1
            for s in range(t):  # s < t: spans with at least one operator
                try:
                    ref = mano.solve(ex.prefix[s : t + 1], 7)
                    break
                except ValueError:
                    continue
            assert ex.subtree_values[t] == ref
        assert ex.subtree_values[-1] == ex.answer


def test_mano_solver_on_hand_example():
    # (3 − 5) · 4 + 1 = −7 ≡ 16 (mod 23)
    prefix = ["+", "*", "-", "3", "5", "4", "1"]
    assert mano.to_infix(prefix) == "(((3-5)*4)+1)"
    assert mano.solve(prefix, 23) == 16
    with pytest.raises(ValueError, match="malformed"):
        mano.solve(["+", "1"], 23)


def test_mano_length_and_split_distributions():
    L = 5
    counts = Counter(mano.make_example(0, "train", i, L=L, modulus=7).n_ops for i in range(2000))
    assert set(counts) == set(range(1, L + 1))
    assert all(abs(c - 400) < 90 for c in counts.values()), counts  # uniform over 1..L (sd ≈ 18)
    left = Counter(_root_left_ops(mano.make_example(0, "test", i, L=4, modulus=7).prefix) for i in range(1200))
    assert set(left) == {0, 1, 2, 3} and all(abs(c - 300) < 75 for c in left.values()), left  # sd ≈ 15


def test_mano_deterministic_and_disjoint():
    a = [mano.make_example(2, "train", i, L=6, modulus=23) for i in range(40)]
    assert a == [mano.make_example(2, "train", i, L=6, modulus=23) for i in range(40)]
    # L = 1, modulus 5: only 3·25 = 75 expressions exist
    train = {tuple(mano.make_example(s, "train", i, L=1, modulus=5).prefix) for s in (0, 1) for i in range(400)}
    test = {tuple(mano.make_example(s, "test", i, L=1, modulus=5).prefix) for s in (0, 1) for i in range(400)}
    assert not (train & test)
    assert len(train | test) >= 70  # the partition covers the space, it does not drop half of it silently


# ----------------------------------------------------------------------------- tokenisation
def _item(dm, split, i):
    from looplab.data.tasks import TaskDataset

    return TaskDataset(dm.spec, split, dm.seed, 10**6)[i]


def test_phop_layout_decodes_and_targets():
    dm = TaskDataModule("phop", task_args=dict(n=20, p=3, alphabet=5), seed=4)
    assert dm.seq_len == 21 and dm.vocab_size == 2 + 5
    for i in range(30):
        ex = phop.make_example(4, "train", i, n=20, p=3, alphabet=5)
        it = _item(dm, "train", i)
        letters = " ".join("abcde"[c] for c in ex.symbols)
        assert dm.decode(it["input_ids"]) == letters + " <query>"
        assert it["answer_mask"].sum() == 1 and it["answer_mask"][20]
        assert dm.decode([it["targets"][20]]) == "abcde"[ex.answer]
        sym0 = dm.vocab["a"]
        for t, h in enumerate(ex.hop_targets):
            assert it["targets"][t] == (IGNORE if h < 0 else sym0 + h)
    off = TaskDataModule("phop", task_args=dict(n=20, p=3, alphabet=5), seed=4, per_position_loss=False)
    it = _item(off, "train", 0)
    assert (it["targets"] != IGNORE).nonzero().flatten().tolist() == [20]


def test_mano_layout_decodes_and_targets():
    dm = TaskDataModule("mano", task_args=dict(L=4, modulus=7))
    assert dm.seq_len == 12
    for i in range(30):
        ex = mano.make_example(0, "train", i, L=4, modulus=7)
        it = _item(dm, "train", i)
        assert dm.decode(it["input_ids"]) == " ".join(["<bos>", f"Q{ex.n_ops}", *ex.prefix, "<ans>"])
        pos = 2 * ex.n_ops + 3  # <bos> Q expr(2k+1) → <ans>
        assert it["answer_mask"].nonzero().flatten().tolist() == [pos]
        assert (it["targets"] != IGNORE).nonzero().flatten().tolist() == [pos]
        assert dm.decode([it["targets"][pos]]) == str(ex.answer)
        assert (it["input_ids"][pos + 1 :] == dm.pad_id).all()
        assert it["input_ids"].dtype == torch.long and it["answer_mask"].dtype == torch.bool
    sub = TaskDataModule("mano", task_args=dict(L=4, modulus=7, subtree_loss=True))
    for i in range(30):
        ex = mano.make_example(0, "train", i, L=4, modulus=7)
        it = _item(sub, "train", i)
        want = {2 + t: str(x) for t, x in enumerate(ex.subtree_values) if x >= 0} | {2 * ex.n_ops + 3: str(ex.answer)}
        got = {t: sub.vocab.names[x] for t, x in enumerate(it["targets"].tolist()) if x != IGNORE}
        assert got == want


# ----------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    "kwargs,named",
    [
        (dict(task="sudoku"), "sudoku"),
        (dict(task="phop", task_args=dict(n=4, p=3, alphabet=4)), "n=4"),
        (dict(task="phop", task_args=dict(n=32, p=0, alphabet=4)), "p=0"),
        (dict(task="phop", task_args=dict(n=32, p=3, alphabet=1)), "alphabet=1"),
        (dict(task="phop", task_args=dict(n=32, p=3, alphabet=2)), "alphabet=2"),
        (dict(task="phop", task_args=dict(n=-5, p=3, alphabet=4)), "n=-5"),
        (dict(task="phop", task_args=dict(hops=3)), "hops"),
        (dict(task="mano", task_args=dict(L=0)), "L=0"),
        (dict(task="mano", task_args=dict(L=-2)), "L=-2"),
        (dict(task="mano", task_args=dict(L=4, modulus=1)), "modulus=1"),
        (dict(task="mano", task_args=dict(L=4, test_fraction=1.5)), "test_fraction=1.5"),
        (dict(task="phop", batch_size=0), "batch_size=0"),
        (dict(task="phop", val_size=-1), "val_size=-1"),
        (dict(task="phop", seed=-3), "seed=-3"),
    ],
)
def test_bad_args_raise_naming_the_value(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")) as e:
        dm = TaskDataModule(**kwargs)
        dm.spec.make(0, "train", 0)  # test_fraction is checked when an example is made
    if kwargs["task"] == "sudoku":
        assert "phop" in str(e.value) and "mano" in str(e.value)


def test_bad_split_and_world_size():
    with pytest.raises(ValueError, match="'val'"):
        phop.make_example(0, "val", 0, n=32, p=3, alphabet=4)
    dm = TaskDataModule("phop", batch_size=64)
    with pytest.raises(ValueError, match="batch_size=64.*world size 3"):
        dm.per_rank_batch_size(3)
    assert dm.per_rank_batch_size(4) == 16


# ----------------------------------------------------------------------------- stream order
def _batches(sampler, per_rank, k):
    it = iter(sampler)
    return [list(itertools.islice(it, per_rank)) for _ in range(k)]


def test_sampler_resume_equals_uninterrupted_stream():
    B = 8
    full = _batches(ResumableSampler(B), B, 12)
    assert full[0] == list(range(8)) and full[11] == list(range(88, 96))
    for k in (1, 5, 11):
        assert _batches(ResumableSampler(B, start=k * B), B, 12 - k) == full[k:]
    with pytest.raises(ValueError, match="start=5"):
        ResumableSampler(B, start=5)
    step = [0]
    s = ResumableSampler(B, start=lambda: step[0] * B)  # read at every iter()
    assert next(iter(s)) == 0
    step[0] = 3
    assert next(iter(s)) == 24 and len(s) == STREAM_LENGTH - 24


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sampler_rank_shards_disjoint_and_complete(world):
    B, k = 16, 6
    shards = [_batches(ResumableSampler(B, r, world, start=2 * B), B // world, k) for r in range(world)]
    for b in range(k):
        got = [i for r in range(world) for i in shards[r][b]]
        assert got == list(range((b + 2) * B, (b + 3) * B))  # rank order concatenates to the global batch


def test_sampler_is_virtual():
    s = ResumableSampler(64, 1, 2)
    assert len(s) == STREAM_LENGTH // 2 and next(iter(s)) == 32
    with pytest.raises(ValueError, match="not divisible"):
        ResumableSampler(64, 0, 3)


def _fake_trainer(step, rank=0, world=1, accumulate=1):
    return SimpleNamespace(
        global_step=step,
        accumulate_grad_batches=accumulate,
        global_rank=rank,
        world_size=world,
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
    )


def _first(dl, k):
    it = iter(dl)
    return [next(it) for _ in range(k)]


def test_datamodule_resume_and_ddp_shards_match_single_stream():
    kw = dict(task="mano", task_args=dict(L=3, modulus=5), batch_size=8, seed=1)
    dm = TaskDataModule(**kw)
    full = _first(dm.train_dataloader(), 6)  # no trainer attached: start at 0
    dm.trainer = _fake_trainer(step=4)
    resumed = _first(dm.train_dataloader(), 2)
    for a, b in zip(resumed, full[4:]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    dm.trainer = _fake_trainer(step=2, accumulate=2)  # optimizer step 2's batch, as 2 micro-batches of half of it
    halves = _first(dm.train_dataloader(), 2)
    assert torch.equal(torch.cat([h["input_ids"] for h in halves]), full[2]["input_ids"])
    for step in (0, 3):
        parts = []
        for r in range(2):
            dm2 = TaskDataModule(**kw)
            dm2.trainer = _fake_trainer(step, rank=r, world=2)
            b = _first(dm2.train_dataloader(), 1)[0]
            assert b["input_ids"].shape == (4, dm.seq_len)
            parts.append(b)
        for k in full[step]:
            assert torch.equal(torch.cat([p[k] for p in parts]), full[step][k])
    # the same DataLoader iterated again later (a new Lightning epoch) continues from the current step
    dm.trainer = _fake_trainer(step=0)
    dl = dm.train_dataloader()
    assert torch.equal(next(iter(dl))["input_ids"], full[0]["input_ids"])
    dm.trainer.global_step = 5
    assert torch.equal(next(iter(dl))["input_ids"], full[5]["input_ids"])
    bad = TaskDataModule(**kw)
    bad.trainer = _fake_trainer(0, world=2)
    bad.trainer._accelerator_connector.use_distributed_sampler = True
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        bad.train_dataloader()


def test_eval_loaders_are_the_test_split_prefix():
    dm = TaskDataModule("phop", batch_size=16, val_size=40, test_size=64, seed=2)
    val = list(dm.val_dataloader())
    assert sum(len(b["input_ids"]) for b in val) == 40
    ids = torch.cat([b["input_ids"] for b in val])
    ex = phop.make_example(2, "test", 39, n=32, p=3, alphabet=4)
    assert dm.decode(ids[39]).split()[:-1] == ["abcd"[c] for c in ex.symbols]
    test = torch.cat([b["input_ids"] for b in dm.test_dataloader()])
    assert test.shape[0] == 64 and torch.equal(test[:40], ids)
    # two ranks: every test example is seen, each shard is sequential
    seen = []
    for r in range(2):
        dm.trainer = _fake_trainer(0, rank=r, world=2)
        seen.append(torch.cat([b["input_ids"] for b in dm.test_dataloader()]))
    assert sorted(map(tuple, torch.cat(seen).tolist())) == sorted(map(tuple, test.tolist()))
