"""p-hop with mixed hop counts (task_args.p a list, table 8's setting): each example draws its own hop count;
answers against an independent follow-the-pointer solver, determinism, the token layout and the bad lists."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from looplab.data import phop
from looplab.data.tasks import IGNORE, TaskDataModule, TaskDataset

HOPS = [1, 2, 3, 4]
KW = dict(n=32, p=HOPS, alphabet=4)


def follow_pointers(symbols: list[int], end: int, hops: int) -> int | None:
    """Independent slow solver: from position `end`, `hops` times find the latest earlier position holding the same
    symbol (a plain backwards loop) and step one to its right; the symbol reached, or None if a hop is missing."""
    pos = end
    for _ in range(hops):
        prev = None
        k = pos - 1
        while k >= 0:
            if symbols[k] == symbols[pos]:
                prev = k
                break
            k -= 1
        if prev is None:
            return None
        pos = prev + 1
    return symbols[pos]


def test_mixed_answers_match_an_independent_solver_for_every_hop_count():
    seen = Counter()
    for split in ("train", "test"):
        for i in range(300):
            ex = phop.make_example(5, split, i, **KW)
            s = ex.symbols
            assert ex.p in HOPS and len(s) == 32 and all(a != b for a, b in zip(s, s[1:]))
            assert follow_pointers(s, len(s) - 1, ex.p) == ex.answer
            for t, h in enumerate(ex.hop_targets):  # the per-position targets follow the example's own hop count
                want = follow_pointers(s, t, ex.p)
                assert h == (-1 if want is None else want)
            seen[ex.p] += 1
    assert set(seen) == set(HOPS)
    assert min(seen.values()) > 600 / len(HOPS) * 0.7  # drawn uniformly from the list (about 150 each)


def test_mixed_is_deterministic_per_seed_split_index():
    a = [phop.make_example(7, "train", i, **KW) for i in range(40)]
    b = [phop.make_example(7, "train", i, **KW) for i in reversed(range(40))][::-1]
    assert a == b
    assert [phop.make_example(8, "train", i, **KW) for i in range(40)] != a
    assert phop.make_example(7, "test", 3, **KW) == phop.make_example(7, "test", 3, n=32, p=(1, 2, 3, 4), alphabet=4)


def test_a_single_int_is_the_fixed_p_task_unchanged():
    dm = TaskDataModule("phop", task_args=dict(n=32, p=3, alphabet=4), seed=1)
    assert dm.seq_len == 33 and dm.hop_counts is None and dm.vocab.names[-1] == "d"
    it = TaskDataset(dm.spec, "train", 1, 100)[0]
    assert set(it) == {"input_ids", "targets", "answer_mask"}


def test_mixed_layout_leads_with_the_hop_count_token():
    dm = TaskDataModule("phop", task_args=dict(n=20, p=[3, 1, 2], alphabet=5), seed=4)
    assert dm.hop_counts == [1, 2, 3] and dm.seq_len == 22 and dm.vocab_size == 2 + 5 + 3
    ds = TaskDataset(dm.spec, "train", 4, 10**6)
    for i in range(30):
        ex = phop.make_example(4, "train", i, n=20, p=[3, 1, 2], alphabet=5)
        it = ds[i]
        assert dm.decode(it["input_ids"]) == " ".join([f"<p{ex.p}>", *("abcde"[c] for c in ex.symbols), "<query>"])
        assert it["answer_mask"].nonzero().flatten().tolist() == [21]
        assert dm.decode([it["targets"][21]]) == "abcde"[ex.answer] and int(it["hops"]) == ex.p
        assert it["targets"][0] == IGNORE
        for t, h in enumerate(ex.hop_targets):
            assert it["targets"][1 + t] == (IGNORE if h < 0 else dm.vocab["a"] + h)
    batch = next(iter(dm.val_dataloader()))
    assert batch["hops"].shape == (dm.per_rank_batch_size(1),) and batch["hops"].dtype == torch.long


def test_mixed_splits_are_disjoint_on_a_small_space():
    kw = dict(n=8, p=[1, 2], alphabet=3)  # 3·2^7 = 384 strings
    train = {tuple(phop.make_example(0, "train", i, **kw).symbols) for i in range(500)}
    test = {tuple(phop.make_example(0, "test", i, **kw).symbols) for i in range(500)}
    assert train and test and not train & test  # no string in both splits, whatever its hop count


@pytest.mark.parametrize(
    "p,named",
    [
        ([], r"p=\[\]"),
        ([1, 0, 2], "hop count 0"),
        ([2, -1], "hop count -1"),
        ([1, 2.5], "hop count 2.5"),
        ([1, "3"], "hop count '3'"),
        ([1, True], "hop count True"),
        ([1, 2, 2], "hop count 2 more than once"),
        ([1, 2, 40], "p=40"),  # n = 32 cannot hold 40 hops
    ],
)
def test_bad_hop_lists_raise_naming_the_value(p, named):
    with pytest.raises(ValueError, match=named):
        TaskDataModule("phop", task_args=dict(n=32, p=p, alphabet=4))
    with pytest.raises(ValueError, match=named):
        phop.make_example(0, "train", 0, n=32, p=p, alphabet=4)


def test_the_table8_experiments_train_on_mixed_hops():
    from omegaconf import OmegaConf

    from looplab.tables.sweeps import CONF

    for bb in ("llama", "mamba", "stateloop"):
        cfg = OmegaConf.load(CONF / "experiment" / f"exit_gate_{bb}_mixed_tiny.yaml")
        assert list(cfg.dataset.task_args.p) == HOPS
        old = OmegaConf.load(CONF / "experiment" / f"exit_gate_{bb}_tiny.yaml")
        assert cfg.trainer == old.trainer and cfg.exit_gate == old.exit_gate and cfg.defaults == old.defaults
