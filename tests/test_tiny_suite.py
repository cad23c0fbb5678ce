"""The looplab_tiny zero-shot suite: deterministic, held-out text only, well-formed, shipped."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from looplab.data import corpus
from looplab.eval import tiny_suite as ts

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fresh_suite():
    return ts.generate()


@pytest.fixture(scope="module")
def shipped():
    return ts.load()


def test_held_out_plays_are_lm_tinys():
    conf = yaml.safe_load((ROOT / "conf" / "dataset" / "lm_tiny.yaml").read_text())
    assert conf["val_fraction"] == ts.LM_TINY_VAL_FRACTION and conf["tokenizer"] == ts.TOKENIZER
    names = [n for n, _ in corpus.documents()]
    assert ts.held_out_names() == sorted(corpus.held_out(names, conf["val_fraction"]))
    assert ts.held_out_names() == ["antony_and_cleopatra", "as_you_like_it", "loves_labours_lost"]


def test_shipped_files_are_the_generators_output(fresh_suite):
    """The generator is deterministic: a fresh run (another process than the one that wrote the
    shipped files) gives them byte for byte."""
    assert list(fresh_suite) == ts.TASKS
    for task, items in fresh_suite.items():
        assert (ts.TASK_DIR / f"{task}.jsonl").read_text(encoding="utf-8") == ts.dumps(items), task


def test_generation_is_a_function_of_the_seed():
    small = {"cloze": 20, "next_line": 20, "speaker": 20}
    a, b, c = ts.generate(seed=3, sizes=small), ts.generate(seed=3, sizes=small), ts.generate(seed=4, sizes=small)
    assert a == b and a != c


def test_sizes_and_well_formed_items(shipped):
    assert sum(len(v) for v in shipped.values()) >= 500
    for task, items in shipped.items():
        assert len(items) == ts.SIZES[task[len(ts.GROUP) + 1:]]
        assert len({it["id"] for it in items}) == len(items)
        for it in items:
            ch = it["choices"]
            assert len(ch) == ts.N_CHOICES and len({c.lower() for c in ch}) == len(ch), it["id"]
            assert 0 <= it["answer"] < len(ch) and isinstance(it["answer"], int)
            assert it["play"] in ts.held_out_names()
            assert it["context"] == it["context"].strip() and all(c == c.strip() and c for c in ch)
        # answers spread over the positions (a position prior gives nothing)
        counts = [sum(it["answer"] == k for it in items) for k in range(ts.N_CHOICES)]
        assert min(counts) > len(items) / ts.N_CHOICES / 2
        assert ts.chance(task) == pytest.approx(0.25)
    assert ts.chance("no_such_task") is None


def test_items_come_from_held_out_text_only(shipped):
    """Every scored line is in its held-out play and nowhere in the training split."""
    train = ts.training_text()
    docs = dict(corpus.documents())
    plays = {n: "\n".join(ts.norm(l) for l in docs[n].split("\n")) for n in ts.held_out_names()}
    for it in shipped["looplab_tiny_cloze"]:
        gold_line = it["context"].split("\n")[-1] + " " + it["choices"][it["answer"]]
        assert gold_line in plays[it["play"]] and gold_line not in train, it["id"]
    for it in shipped["looplab_tiny_next_line"]:
        for line in it["choices"]:
            assert line in plays[it["play"]] and line not in train, it["id"]
        speech = "\n".join(it["context"].split("\n")[1:] + [it["choices"][it["answer"]]])
        assert speech in plays[it["play"]] or it["choices"][it["answer"]] in plays[it["play"]]
    for it in shipped["looplab_tiny_speaker"]:
        assert it["context"] not in train, it["id"]
        for block in it["context"].split("\n\n"):
            for line in block.split("\n"):
                assert line in plays[it["play"]], it["id"]
        speakers = {c[:-1] for c in it["choices"]}
        assert all(c.endswith(".") for c in it["choices"]) and all(f"\n{s}." in plays[it["play"]] for s in speakers)


def test_context_free_scoring_is_near_chance(shipped):
    """Distractors match the gold answers in length and frequency: a unigram model of the training
    split (no context) stays within a few points of chance on every task."""
    base = ts.unigram_baseline(shipped)
    for task, r in base.items():
        assert r["n"] == len(shipped[task]) and r["chance"] == pytest.approx(0.25)
        assert abs(r["acc"] - 0.25) < 0.07 and abs(r["acc_norm"] - 0.25) < 0.07, (task, r)


def test_task_yamls_and_packaging():
    for task in ts.TASKS:
        cfg = (ts.TASK_DIR / f"{task}.yaml").read_text()
        data = yaml.load(cfg.replace("!function", ""), Loader=yaml.SafeLoader)
        assert data["task"] == task and data["tag"] == ts.GROUP
        assert data["dataset_kwargs"]["data_files"]["test"] == f"{task}.jsonl"
        assert data["target_delimiter"] == ts.DELIMITERS[task[len(ts.GROUP) + 1:]]
        assert data["doc_to_text"] == "context" and data["doc_to_choice"] == "choices" and data["doc_to_target"] == "answer"
    assert (ts.TASK_DIR / "utils.py").exists()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"eval/tasks/**/*"' in pyproject  # package-data: the jsonl, yaml and utils.py files ship in the wheel


def test_parse_play_speeches():
    text = ("Persons.\n\nKING, a king.\n\nACT I.\n\nSCENE I. A park.\n\n[Enter KING.]\n\nKING. \nLet fame, that all\n"
            "hunt after in their lives,\n\nBEROWNE. [Aside.]\nShot, by heaven!\n[Steps aside.]\nProceed.\n\n"
            "[Exit KING.]\n\nWhat, Longaville!\n\nSCENE II. Another.\n\nLE BEAU.\nGood sir.\n")
    sp = ts.parse_play("p", text)
    assert [(s.scene, s.speaker, s.lines) for s in sp] == [
        (2, "KING", ["Let fame, that all", "hunt after in their lives,"]),
        (2, "BEROWNE", ["Shot, by heaven!", "Proceed.", "What, Longaville!"]),
        (3, "LE BEAU", ["Good sir."]),
    ]
