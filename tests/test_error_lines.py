"""Hostile input gets one line naming the file, line or value (looplab/cli_errors.py), never a traceback, and never a
misleading message: a bad learning rate, corpus files that are not UTF-8 / not JSON Lines / hold a null text, a
truncated token file, a corrupt safetensors file, weights that do not match their config, a sharded checkpoint
resumed without FSDP, random bytes named .ckpt, an evaluation over 0 batches, a negative max_new_tokens.

Each test goes through `clean_errors`, the wrapper of every looplab CLI (`run_cli`, train's `clean_job_errors`), in
this process; one test runs the real `python -m looplab.train`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from conftest import compose
from looplab import cli_errors
from looplab.checkpoint import SHARDED_META_FILE, UnsafeCheckpointError, load_model, looplab_meta
from looplab.cli_errors import clean_errors
from looplab.data.prepare import SourceConfig, prepare
from looplab.models import LoopedLM, LoopedLMConfig

pytestmark = pytest.mark.usefixtures("one_thread_module")

PROG = "python -m looplab.x"
TOK = "shakespeare-bpe-1024"
DATASET = {"_target_": "looplab.data.tasks.TaskDataModule", "name": "phop", "task": "phop",
           "task_args": {"n": 16, "p": 2, "alphabet": 4}, "batch_size": 8, "val_size": 16, "test_size": 16}
TINY = ["logger=none", "trainer.max_steps=2", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "dataset.batch_size=8", "dataset.val_size=8", "dataset.test_size=8", "backbone.d_model=32", "backbone.n_heads=2",
        "backbone.ffn_hidden=64"]


@pytest.fixture(autouse=True)
def _no_full_error(monkeypatch):
    for k in cli_errors.FULL_ERROR_ENV:
        monkeypatch.delenv(k, raising=False)
    # datasets' log handler keeps the stderr of the test that first used it (closed since: logging then prints its
    # own "--- Logging error ---" traceback); point it at the stderr of now
    for h in logging.getLogger("datasets").handlers:
        if type(h) is logging.StreamHandler:
            h.stream = sys.stderr  # not setStream: it flushes the closed one


def error_line(fn, capsys, tmp_path) -> str:
    """Run fn as a looplab CLI runs its main: the one `PROG: error: ...` line on stderr, exit status 1, no traceback."""
    with pytest.raises(SystemExit) as info, clean_errors(PROG, tmp_path / "traceback.log"):
        fn()
    assert info.value.code == cli_errors.EXIT_CODE
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{PROG}: error: ")]
    assert len(lines) == 1, err
    assert "Traceback (most recent call last)" in (tmp_path / "traceback.log").read_text()
    return lines[0]


def tiny_model(**kw) -> LoopedLM:
    torch.manual_seed(0)
    return LoopedLM(LoopedLMConfig(**{**dict(vocab_size=8, d_model=32, n_heads=2, n_layers=1, n_loops=2), **kw})).eval()


def save_ckpt(model: LoopedLM, path: Path, meta: dict | None = None) -> Path:
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "looplab": meta or looplab_meta(model.config, DATASET)}, path)
    return path


# ------------------------------------------------------------------ 1. optim.lr=-1
def test_negative_learning_rate_is_one_line_before_training(capsys, tmp_path):
    """Refused where the run is built (build_run: before any data or training), not by AdamW inside Lightning's fit."""
    from looplab.train import build_run

    for bad, words in (("optim.lr=-1", "optim.lr=-1 must be a finite number >= 0"),
                       ("optim.betas=[0.9,1.5]", "optim.betas=[0.9, 1.5] must be two numbers in [0, 1)"),
                       ("optim.warmup_steps=-3", "optim.warmup_steps=-3 must be an integer >= 0")):
        line = error_line(lambda: build_run(compose(TINY + [bad])), capsys, tmp_path)
        assert words in line


@pytest.mark.slow
def test_negative_learning_rate_through_the_real_train_cli(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in cli_errors.FULL_ERROR_ENV}
    env.update({"WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    proc = subprocess.run([sys.executable, "-m", "looplab.train", *TINY, "optim.lr=-1", f"hydra.run.dir={tmp_path / 'r'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == cli_errors.EXIT_CODE, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("python -m looplab.train: error: ")]
    assert len(lines) == 1 and "optim.lr=-1 must be a finite number >= 0" in lines[0], proc.stderr[-3000:]
    assert not (tmp_path / "r" / "checkpoints").exists()


# ------------------------------------------------------------------ 2, 3, 9. corpus files
def _prepare(path: Path, cache: Path, source: str = "json"):
    return prepare(SourceConfig(source=source, data_files=str(path), val_fraction=0.25), TOK, cache, verbose=False)


def test_corpus_that_is_not_utf8_names_the_file_and_line(capsys, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"first line\nsecond line\nthird \xff\xfe line\nfourth line\n")
    line = error_line(lambda: _prepare(text, tmp_path / "c1", source="text"), capsys, tmp_path)
    assert f"data file '{text}' line 3 is not UTF-8 text (byte 0xff at column 7)" in line
    jsonl = tmp_path / "corpus.jsonl"  # the JSON reader accepts these bytes; the tokenizer would fail on them later
    jsonl.write_bytes(b'{"text": "one"}\n{"text": "two"}\n{"text": "caf\xe9"}\n{"text": "four"}\n')
    line = error_line(lambda: _prepare(jsonl, tmp_path / "c2"), capsys, tmp_path)
    assert f"data file '{jsonl}' line 3 is not UTF-8 text" in line


def test_null_text_in_a_jsonl_corpus_names_the_file_and_line(capsys, tmp_path):
    import datasets

    from looplab.data.prepare import DataFileError, _token_batches
    from looplab.data.tokenizer import load_tokenizer

    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n\n{"text": null}\n{"text": "five"}\n')
    line = error_line(lambda: _prepare(path, tmp_path / "c"), capsys, tmp_path)
    assert f"data file '{path}' line 4: its 'text' field is null, not text" in line
    # a streamed source (not checked when loaded) is refused by the tokenisation step, as bad input
    stream = datasets.Dataset.from_dict({"text": ["one", None]}).to_iterable_dataset()
    with pytest.raises(DataFileError, match="'text' field is None"):
        list(_token_batches(stream, load_tokenizer(TOK), "text", 1, 8))


def test_malformed_jsonl_line_is_named(capsys, tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three",}\n{"text": "four"}\n')
    line = error_line(lambda: _prepare(path, tmp_path / "c"), capsys, tmp_path)
    assert f"data file '{path}' line 3 is not valid JSON (" in line and "column 18" in line


# ------------------------------------------------------------------ 4. truncated token file
def test_truncated_token_file_is_one_line(capsys, tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} of a tiny corpus"}) + "\n" for i in range(8)))
    tf = _prepare(path, tmp_path / "c")["train"]
    tf.path.write_bytes(tf.path.read_bytes()[:-2])
    line = error_line(lambda: _prepare(path, tmp_path / "c"), capsys, tmp_path)
    assert f"token file '{tf.path}' has" in line and "truncated or overwritten" in line


# ------------------------------------------------------------------ 5, 6. folders and checkpoints
def test_corrupt_safetensors_file_is_one_line_naming_it(capsys, tmp_path):
    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    for bad in (b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" + bytes(64), good[: len(good) // 2], os.urandom(256)):
        weights.write_bytes(bad)
        line = error_line(lambda: load_model(folder), capsys, tmp_path)
        assert f"'{weights}' is not a readable safetensors file (corrupt, truncated or not safetensors" in line


def test_config_and_weights_of_different_widths_are_one_line(capsys, tmp_path):
    folder = tmp_path / "model"
    model = tiny_model()
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "d_model": 64}))
    line = error_line(lambda: load_model(folder), capsys, tmp_path)
    assert (f"the weights in '{folder / 'model.safetensors'}' do not match '{folder / 'config.json'}': embed.weight has "
            "shape [8, 32] there but [8, 64] under the config") in line
    meta = looplab_meta(model.config, DATASET)
    meta["model_config"]["d_model"] = 64
    ckpt = save_ckpt(model, tmp_path / "wide.ckpt", meta)
    line = error_line(lambda: load_model(ckpt), capsys, tmp_path)
    assert f"the weights in checkpoint '{ckpt}' do not match its recorded model config: embed.weight" in line


# ------------------------------------------------------------------ 7. resume= of a sharded folder without FSDP
def test_resuming_a_sharded_checkpoint_without_fsdp_is_one_line(capsys, tmp_path):
    import torch.distributed.checkpoint as dcp

    from looplab.train import build_run, train

    cfg = compose(TINY)
    model_cfg = build_run(cfg).model_cfg
    folder = tmp_path / "last.ckpt"
    state = {f"model.{k}": v for k, v in LoopedLM(model_cfg).state_dict().items()}
    with warnings.catch_warnings():  # "no process group: saving in a single process" is the intent
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": state}, checkpoint_id=str(folder))
    torch.save({"epoch": 0, "global_step": 1, "looplab": looplab_meta(model_cfg, DATASET)}, folder / SHARDED_META_FILE)

    run = tmp_path / "run"
    cfg = compose(TINY + [f"resume={folder}", f"hydra.run.dir={run}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run)
    HydraConfig.instance().set_config(cfg)
    line = error_line(lambda: train(cfg), capsys, tmp_path)
    assert f"resume='{folder}' is a sharded (FSDP2) checkpoint folder, which only the FSDP strategy reads" in line
    assert "hardware=fsdp" in line and f"init_from={folder}" in line


# ------------------------------------------------------------------ 8. random bytes named .ckpt
def test_random_bytes_are_not_a_checkpoint_and_a_crafted_pickle_is_still_unsafe(capsys, tmp_path):
    path = tmp_path / "random.ckpt"
    path.write_bytes(bytes((i * 97 + 13) % 256 for i in range(4096)))  # no zip, no pickle: garbage
    line = error_line(lambda: load_model(path), capsys, tmp_path)
    assert f"checkpoint '{path}' cannot be read: it is not a torch checkpoint (corrupt, truncated, or not a checkpoint" in line
    assert "unsafe" not in line and "refused" not in line and "allowlist" not in line
    (tmp_path / "text.ckpt").write_text("not a checkpoint\n" * 50)
    assert "it is not a torch checkpoint" in error_line(lambda: load_model(tmp_path / "text.ckpt"), capsys, tmp_path)

    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"looplab": {"note": Payload()}}, tmp_path / "evil.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="refused.*outside looplab's weights-only allowlist"):
        load_model(tmp_path / "evil.ckpt")


# ------------------------------------------------------------------ 10. eval --max-batches 0
def test_eval_refuses_zero_batches_and_never_reports_a_metric_over_zero_tokens(capsys, tmp_path):
    from looplab.eval.__main__ import main
    from looplab.eval.exit_sweep import exit_sweep

    ckpt = save_ckpt(tiny_model(vocab_size=6), tmp_path / "m.ckpt")
    with pytest.raises(SystemExit) as info:
        main([str(ckpt), "--max-batches", "0", "--out", str(tmp_path / "eval")])
    assert info.value.code == 2 and "--max-batches must be ≥ 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "eval" / "eval.json").exists()
    batches = [{"input_ids": torch.zeros(1, 4, dtype=torch.long), "targets": torch.zeros(1, 4, dtype=torch.long)}]
    line = error_line(lambda: exit_sweep(tiny_model(vocab_size=6), batches, max_batches=0), capsys, tmp_path)
    assert "no target tokens were scored (max_batches=0" in line


# ------------------------------------------------------------------ 11. generate max_new_tokens=-5
def test_generate_refuses_a_negative_max_new_tokens(capsys, tmp_path):
    from looplab.generate import main
    from looplab.models.generation import generate

    ckpt = save_ckpt(tiny_model(vocab_size=6), tmp_path / "m.ckpt")
    line = error_line(lambda: main([f"ckpt={ckpt}", "prompt=a b", "max_new_tokens=-5"]), capsys, tmp_path)
    assert "max_new_tokens=-5 must be an integer >= 0" in line
    with pytest.raises(ValueError, match="max_new_tokens=-5 must be an integer >= 0"):
        generate(tiny_model(), torch.tensor([[1, 2]]), -5)
    assert generate(tiny_model(), torch.tensor([[1, 2]]), 0).shape == (1, 2)  # zero new tokens stays allowed
