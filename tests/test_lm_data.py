"""Language-model data: packing, manifests, cache invalidation, errors, and the LMDataModule stream."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pytest
import torch

from looplab.data import corpus
from looplab.data.lm import LMDataModule
from looplab.data.prepare import SourceConfig, TokenCacheError, load_split, prepare
from looplab.data.tokenizer import clear_cache, load_tokenizer, train_bpe

REPO = Path(__file__).resolve().parents[1]
TOK = "shakespeare-bpe-4096"


def _docs(n=24, chars=1500):
    """Short real documents: slices of the embedded works (different works, so all distinct)."""
    works = corpus.documents()
    return [works[i % len(works)][1][2000 + 3000 * (i // len(works)) :][:chars] for i in range(n)]


def _write_jsonl(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _split_docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    ends = np.flatnonzero(tokens == eos)
    assert ends.size and ends[-1] == len(tokens) - 1, "every document must end with EOS"
    starts = np.r_[0, ends[:-1] + 1]
    return [tokens[s:e].tolist() for s, e in zip(starts, ends)]


@pytest.fixture
def jsonl(tmp_path):
    texts = _docs()
    return _write_jsonl(tmp_path / "docs.jsonl", texts), texts


def _src(path, **kw):
    return SourceConfig(source="json", data_files=str(path), val_fraction=0.25, **kw)


# ------------------------------------------------------------------ packing
def test_prepare_round_trip_reproduces_token_stream(tmp_path, jsonl):
    path, texts = jsonl
    tok = load_tokenizer(TOK)
    files = prepare(_src(path), TOK, tmp_path / "cache", verbose=False)
    seen = {}
    for split, tf in files.items():
        m = tf.manifest
        assert m["split"] == split and m["dtype"] == "uint16" and m["tokenizer_hash"] == tok.hash
        assert m["vocab_size"] == 4096 and m["eos_id"] == tok.eos_id == 0
        assert tf.path.stat().st_size == m["num_tokens"] * 2
        arr = np.asarray(tf.open())
        docs = _split_docs(arr, tok.eos_id)
        assert len(docs) == m["num_docs"]
        for ids in docs:
            text = tok.decode(ids)
            assert tok.encode(text) == ids  # each document is exactly its own encoding, in file order
            seen.setdefault(split, []).append(text)
    assert sorted(seen["train"] + seen["validation"]) == sorted(texts)
    assert not set(seen["train"]) & set(seen["validation"])
    assert len(seen["validation"]) == 6  # ceil(0.25 · 24)
    # train order is source order
    assert seen["train"] == [t for t in texts if t in set(seen["train"])]

    # a second call reuses the files without rewriting them
    mtime = files["train"].path.stat().st_mtime_ns
    again = prepare(_src(path), TOK, tmp_path / "cache", verbose=False)
    assert again["train"].path == files["train"].path and again["train"].path.stat().st_mtime_ns == mtime


def test_max_tokens_caps_the_packed_stream(tmp_path, jsonl):
    path, _ = jsonl
    full = prepare(_src(path), TOK, tmp_path / "c", verbose=False)["train"]
    capped = prepare(_src(path, max_train_tokens=1000), TOK, tmp_path / "c", verbose=False)["train"]
    assert capped.num_tokens == 1000 and capped.path.parent != full.path.parent
    assert np.array_equal(np.asarray(capped.open()), np.asarray(full.open())[:1000])


def test_changed_tokenizer_never_reuses_cache(tmp_path, jsonl):
    path, texts = jsonl
    cache = tmp_path / "cache"
    a = prepare(_src(path), TOK, cache, verbose=False)["train"]
    tok_file = tmp_path / "tok.json"
    train_bpe(texts, 300).save(str(tok_file))
    clear_cache()
    b = prepare(_src(path), str(tok_file), cache, verbose=False)["train"]
    assert b.path.parent != a.path.parent
    assert b.manifest["tokenizer_hash"] != a.manifest["tokenizer_hash"]
    assert b.num_tokens > a.num_tokens  # a 300-token vocabulary needs more tokens for the same text
    # rewrite the tokenizer file in place (same path, other vocabulary): a new cache again
    train_bpe(texts, 400).save(str(tok_file))
    clear_cache()
    c = prepare(_src(path), str(tok_file), cache, verbose=False)["train"]
    assert c.path.parent not in (a.path.parent, b.path.parent)
    tok_c = load_tokenizer(str(tok_file))
    assert all(tok_c.encode(tok_c.decode(d)) == d for d in _split_docs(np.asarray(c.open()), tok_c.eos_id))
    # and a cache folder is refused when asked for with another tokenizer's hash
    with pytest.raises(TokenCacheError, match="tokenizer"):
        load_split(a.path.parent, "train", tokenizer_hash=c.manifest["tokenizer_hash"])


def test_changed_source_never_reuses_cache(tmp_path, jsonl):
    path, texts = jsonl
    cache = tmp_path / "cache"
    a = prepare(_src(path), TOK, cache, verbose=False)
    _write_jsonl(path, [t.replace("the", "thy") for t in texts])  # same size class, other content
    b = prepare(_src(path), TOK, cache, verbose=False)
    assert b["train"].path.parent != a["train"].path.parent
    assert b["train"].manifest["source_fingerprint"] != a["train"].manifest["source_fingerprint"]
    tok = load_tokenizer(TOK)
    assert "thy" in tok.decode(np.asarray(b["train"].open())[:3000])
    with pytest.raises(TokenCacheError, match="source"):
        load_split(a["train"].path.parent, "train", source_fingerprint=b["train"].manifest["source_fingerprint"])


# ------------------------------------------------------------------- errors
def test_missing_and_empty_inputs_name_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        prepare(_src(missing), TOK, tmp_path / "c", verbose=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl.*empty"):
        prepare(_src(empty), TOK, tmp_path / "c", verbose=False)
    blank = _write_jsonl(tmp_path / "blank.jsonl", [""] * 8)
    with pytest.raises(ValueError, match="contains no text"):
        prepare(_src(blank), TOK, tmp_path / "c", verbose=False)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"body": t}) + "\n" for t in _docs(8)))
    with pytest.raises(ValueError, match="no column 'text'.*body"):
        prepare(_src(other), TOK, tmp_path / "c", verbose=False)
    with pytest.raises(ValueError, match="data_files"):
        prepare(SourceConfig(source="json"), TOK, tmp_path / "c", verbose=False)
    with pytest.raises(FileNotFoundError, match="never prepared"):
        load_split(tmp_path / "c", "train")


def test_broken_cache_symlink_is_named(tmp_path, jsonl):
    """A cache_dir that is a dangling symlink (e.g. a worktree linked to a cache that was removed) names itself."""
    path, _ = jsonl
    cache = tmp_path / "cache"
    cache.symlink_to(tmp_path / "gone")
    with pytest.raises(FileExistsError, match=r"cache.*exists and is not a folder \(a broken symlink\?\)"):
        prepare(_src(path), TOK, cache, verbose=False)


def test_truncated_or_corrupt_token_file_is_detected(tmp_path, jsonl):
    path, _ = jsonl
    cache = tmp_path / "cache"
    tf = prepare(_src(path), TOK, cache, verbose=False)["train"]
    data = tf.path.read_bytes()

    tf.path.write_bytes(data[:-2])  # one token short
    with pytest.raises(TokenCacheError, match=r"truncated.*delete"):
        prepare(_src(path), TOK, cache, verbose=False)  # never silently reused

    flipped = bytearray(data)
    flipped[100] ^= 0xFF
    tf.path.write_bytes(bytes(flipped))  # right size, wrong content
    with pytest.raises(TokenCacheError, match="checksum"):
        load_split(tf.path.parent, "train")

    tf.path.unlink()
    with pytest.raises(TokenCacheError, match="missing"):
        load_split(tf.path.parent, "train")

    (tf.path.parent / "train.json").write_text("{not json")
    with pytest.raises(TokenCacheError, match="corrupt"):
        load_split(tf.path.parent, "train")


# --------------------------------------------------------------- DataModule
@pytest.fixture
def dm(tmp_path, jsonl):
    path, _ = jsonl
    d = LMDataModule(source="json", data_files=str(path), val_fraction=0.25, seq_len=16, batch_size=8,
                     cache_dir=str(tmp_path / "cache"), val_tokens=None, seed=3)
    d.setup()
    return d


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_windows_are_contiguous_and_cover_each_epoch(dm):
    tokens = np.asarray(dm.files["train"].open()).astype(np.int64)
    T = dm.seq_len
    W = (len(tokens) - 1) // T
    n_batches = -(-W // dm.batch_size) + 2  # a bit more than one epoch
    starts = []
    for b in _take(dm.train_batches(0), n_batches):
        x, y = b["input_ids"], b["targets"]
        assert x.shape == y.shape == (8, T) and x.dtype == y.dtype == torch.long
        assert set(b) == {"input_ids", "targets"}
        for row_x, row_y in zip(x.numpy(), y.numpy()):
            s = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(tokens, T)[::T] == row_x, axis=1))[0]) * T
            assert np.array_equal(row_y, tokens[s + 1 : s + T + 1])  # targets are the next tokens
            starts.append(s // T)
    assert sorted(starts[:W]) == list(range(W))  # every window exactly once in epoch 0
    assert starts[:W] != list(range(W))  # shuffled
    assert len(set(starts[W:])) == len(starts[W:])  # epoch 1 starts a fresh permutation


def test_stream_is_deterministic_and_resumable(dm, tmp_path, jsonl):
    a = _take(dm.train_batches(0), 12)
    b = _take(dm.train_batches(0), 12)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    resumed = _take(dm.train_batches(7), 5)  # restart mid-epoch at batch 7
    assert all(torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["targets"], y["targets"]) for x, y in zip(a[7:], resumed))
    # Lightning path: one global batch per optimizer step, cut into accumulate_grad_batches micro-batches
    dm.trainer = SimpleNamespace(global_step=3, accumulate_grad_batches=2, global_rank=0, world_size=1)
    try:
        first = next(iter(dm.train_dataloader()))
    finally:
        dm.trainer = None
    assert torch.equal(first["input_ids"], a[3]["input_ids"][:4])
    other = LMDataModule(source="json", data_files=str(jsonl[0]), val_fraction=0.25, seq_len=16, batch_size=8,
                         cache_dir=str(tmp_path / "cache"), seed=4)
    assert not torch.equal(next(iter(other.train_batches(0)))["input_ids"], a[0]["input_ids"])


def test_ranks_take_disjoint_slices_of_the_global_batch(dm):
    whole = _take(dm.train_batches(0, rank=0, world_size=1), 4)
    parts = [_take(dm.train_batches(0, rank=r, world_size=4), 4) for r in range(4)]
    for j in range(4):
        assert all(p[j]["input_ids"].shape == (2, 16) for p in parts)
        assert torch.equal(torch.cat([p[j]["input_ids"] for p in parts]), whole[j]["input_ids"])
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        dm.train_batches(0, rank=0, world_size=3)


def test_dataloader_workers_do_not_change_the_stream(dm):
    dm.num_workers = 2
    try:
        with_workers = _take(dm.train_batches(5), 6)
    finally:
        dm.num_workers = 0
    plain = _take(dm.train_batches(5), 6)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(with_workers, plain))


def test_validation_windows_are_ordered_and_sharded(dm):
    tokens = np.asarray(dm.files["validation"].open()).astype(np.int64)
    T = dm.seq_len
    full = dm.val_windows(rank=0, world_size=1)
    assert len(full) == (len(tokens) - 1) // T
    for i in range(len(full)):
        w = full[i]
        assert np.array_equal(w["input_ids"].numpy(), tokens[i * T : i * T + T])
        assert np.array_equal(w["targets"].numpy(), tokens[i * T + 1 : i * T + T + 1])
    shards = [dm.val_windows(rank=r, world_size=3) for r in range(3)]
    assert len({len(s) for s in shards}) == 1
    idx = np.concatenate([s.index for s in shards])
    assert len(set(idx.tolist())) == len(idx) == 3 * (len(full) // 3)
    dm.val_tokens = 5 * T
    assert len(dm.val_windows(rank=0, world_size=1)) == 5
    batches = list(dm.val_dataloader())
    assert sum(b["input_ids"].shape[0] for b in batches) == 5


def test_tokenizer_properties_and_decode(dm, jsonl):
    tok = load_tokenizer(dm.tokenizer_spec)
    assert dm.vocab_size == tok.vocab_size == 4096 and dm.eos_id == tok.eos_id
    assert load_tokenizer({"tokenizer": dm.tokenizer_spec, "name": "lm_tiny"}).hash == tok.hash
    b = next(iter(dm.train_batches(0)))
    text = dm.decode(b["input_ids"][0])
    assert len(text) > 16 and text in "<|endoftext|>".join(jsonl[1]) + "<|endoftext|>"


def test_short_split_gives_clear_error(tmp_path, jsonl):
    path, _ = jsonl
    d = LMDataModule(source="json", data_files=str(path), val_fraction=0.25, seq_len=100_000, batch_size=2,
                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="fewer than seq_len"):
        d.train_batches(0)
    with pytest.raises(ValueError, match="too few"):
        d.val_windows(0, 1)


# ------------------------------------------------------------------ configs
@pytest.mark.parametrize("name", ["lm_tiny", "pile", "hf"])
def test_dataset_yaml_fields_are_constructor_arguments(name):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "conf" / "dataset" / f"{name}.yaml")
    params = inspect.signature(LMDataModule.__init__).parameters
    assert cfg["_target_"] == "looplab.data.lm.LMDataModule"
    assert set(cfg) - {"_target_"} <= set(params), set(cfg) - set(params)


def test_hydra_composes_and_instantiates_lm_tiny(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    monkeypatch.setenv("LOOPLAB_CACHE", str(tmp_path / "cache"))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="prepare", overrides=["dataset=lm_tiny", "dataset.seq_len=64"])
    d = instantiate(cfg.dataset)
    assert isinstance(d, LMDataModule) and d.seq_len == 64 and d.cache_dir == str(tmp_path / "cache")
    assert d.tokenizer_spec == TOK and d.vocab_size == 4096


# ------------------------------------------------------- the embedded corpus
@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory):
    src = SourceConfig()  # the embedded corpus
    return prepare(src, TOK, tmp_path_factory.mktemp("lm_tiny_cache"), verbose=False)


@pytest.mark.slow
def test_embedded_corpus_holds_out_whole_works(tiny_files):
    tok = load_tokenizer(TOK)
    works = dict(corpus.documents())
    assert len(works) == 42 and sum(map(len, works.values())) > 5_000_000
    val_names = corpus.held_out(sorted(works), 0.05)
    assert len(val_names) == 3
    val_docs = _split_docs(np.asarray(tiny_files["validation"].open()), tok.eos_id)
    train_docs = _split_docs(np.asarray(tiny_files["train"].open()), tok.eos_id)
    assert len(val_docs) == 3 and len(train_docs) == 39
    assert sorted(tok.decode(d) for d in val_docs) == sorted(works[n] for n in val_names)
    assert tok.decode(train_docs[0]) == works[sorted(set(works) - val_names)[0]]
    assert 1_400_000 < tiny_files["train"].num_tokens < 1_700_000


@pytest.mark.slow
def test_lm_tiny_trains_and_validation_perplexity_falls(tiny_files):
    """A few AdamW steps of a tiny looped model on the embedded corpus lower held-out perplexity."""
    from looplab.eval.perplexity import evaluate_perplexity
    from looplab.models import LoopedLM, LoopedLMConfig

    torch.manual_seed(0)
    torch.set_num_threads(1)
    d = LMDataModule(seq_len=32, batch_size=16, val_tokens=32 * 32, cache_dir=str(tiny_files["train"].path.parent.parent))
    d.setup()
    assert d.files["train"].path == tiny_files["train"].path  # reused, not re-prepared
    model = LoopedLM(LoopedLMConfig(vocab_size=d.vocab_size, d_model=32, n_heads=2, n_layers=1, n_loops=2, max_seq_len=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = evaluate_perplexity(model, d.val_dataloader())
    it = iter(d.train_batches(0))
    for _ in range(40):
        b = next(it)
        loss = torch.nn.functional.cross_entropy(model(b["input_ids"]).logits.flatten(0, 1), b["targets"].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = evaluate_perplexity(model, d.val_dataloader())
    assert before["perplexity"] > 2000  # ≈ uniform over 4096 tokens at init
    assert after["perplexity"] < 0.25 * before["perplexity"]
    assert len(after["loop_perplexity"]) == 2


def test_parallel_tokenisation_gives_the_same_tokens(tmp_path, jsonl):
    path, _ = jsonl
    one = prepare(_src(path), TOK, tmp_path / "a", num_proc=1, verbose=False)
    two = prepare(_src(path), TOK, tmp_path / "b", num_proc=2, verbose=False)
    for split in ("train", "validation"):
        assert np.array_equal(np.asarray(one[split].open()), np.asarray(two[split].open()))
        assert one[split].manifest["sha256"] == two[split].manifest["sha256"]


def test_streaming_hub_source_offline(tmp_path, monkeypatch, jsonl):
    """The hub/streaming branch (the Pile's path), fed by a stand-in load_dataset: no network."""
    import datasets

    _, texts = jsonl
    calls = {}

    def fake_load_dataset(path, **kw):
        calls.update(path=path, **kw)
        return {"train": datasets.Dataset.from_dict({"text": texts[:18], "meta": ["x"] * 18}).to_iterable_dataset(),
                "validation": datasets.Dataset.from_dict({"text": texts[18:], "meta": ["y"] * 6}).to_iterable_dataset()}

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    src = SourceConfig(source="someone/pile-like", streaming=True, val_split="validation", revision="abc", max_train_tokens=2000)
    files = prepare(src, TOK, tmp_path / "cache", verbose=False)
    assert calls["path"] == "someone/pile-like" and calls["streaming"] is True and calls["revision"] == "abc"
    tok = load_tokenizer(TOK)
    want = np.concatenate([tok.encode(t) + [tok.eos_id] for t in texts[:18]])[:2000]
    assert files["train"].num_tokens == 2000 and np.array_equal(np.asarray(files["train"].open()), want)
    val = _split_docs(np.asarray(files["validation"].open()), tok.eos_id)
    assert [tok.decode(d) for d in val] == texts[18:]
    # a prepared streaming source opens without contacting the hub (offline evaluation of a Pile run)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("hub contacted for a prepared cache"))
    again = prepare(src, TOK, tmp_path / "cache", verbose=False)
    assert again["train"].path == files["train"].path
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(ValueError, match="streaming sources need a val_split"):
        prepare(SourceConfig(source="someone/pile-like", streaming=True), TOK, tmp_path / "cache", verbose=False)


def test_lightning_resume_sees_the_uninterrupted_batches(tmp_path, dm):
    """Fit 6 steps, vs. fit 3 steps + resume from the checkpoint to 6: the same batches in the same order."""
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen = []

        def training_step(self, batch, i):
            self.seen.append(batch["input_ids"].sum().item() * 1000003 + batch["input_ids"][0, 0].item())
            return (self.w * batch["input_ids"].float().mean()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def trainer(steps, root):
        return L.Trainer(max_steps=steps, accelerator="cpu", devices=1, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=str(root))

    full = Recorder()
    trainer(6, tmp_path / "a").fit(full, datamodule=dm)
    first = Recorder()
    t = trainer(3, tmp_path / "b")
    t.fit(first, datamodule=dm)
    t.save_checkpoint(tmp_path / "b.ckpt")
    second = Recorder()
    trainer(6, tmp_path / "c").fit(second, datamodule=dm, ckpt_path=str(tmp_path / "b.ckpt"))
    assert len(full.seen) == 6 and len(first.seen) == 3 and len(second.seen) == 3
    assert first.seen + second.seen == full.seen


@pytest.mark.slow
def test_prepare_cli_writes_manifests(tmp_path, jsonl):
    import subprocess
    import sys

    path, _ = jsonl
    env = {**os.environ, "LOOPLAB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "looplab.data.prepare", "dataset=hf", "dataset.source=json", f"dataset.data_files={path}",
           "dataset.num_proc=1", f"hydra.run.dir={tmp_path / 'run'}"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-2000:]
    manifests = sorted((tmp_path / "cache").glob("*/*.json"))
    assert [m.name for m in manifests] == ["train.json", "validation.json"]
    m = json.loads(manifests[0].read_text())
    assert m["source"]["data_files"] == str(path) and "train:" in res.stdout and f"{m['num_tokens']:,} tokens" in res.stdout
