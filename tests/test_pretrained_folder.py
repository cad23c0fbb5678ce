"""A Hub-style looplab folder works wherever a checkpoint does: init_from=DIR, load_model
(eval, generate, the lm-eval adapter) and dataset.tokenizer=DIR."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose
from tokenizers import Tokenizer, models, pre_tokenizers

from looplab import checkpoint, convert
from looplab.data.tokenizer import load_tokenizer
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.training.compose import model_config_from_cfg

CFG = dict(vocab_size=40, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, n_loops=2, ffn_hidden=64, max_seq_len=64)


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(**CFG)).eval()
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(39)} | {"</s>": 39}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    src = tmp_path / "src"
    src.mkdir()
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    model.save_pretrained(tmp_path / "m", tokenizer=src)
    return tmp_path / "m", model


def test_load_model_reads_a_folder_with_its_tokenizer(folder):
    path, model = folder
    back, meta = checkpoint.load_model(path)
    ids = torch.randint(0, 40, (2, 7))
    assert torch.equal(back(ids).logits, model(ids).logits)
    assert meta["dataset"] == {"tokenizer": str(path / "tokenizer.json"), "eos_token": "</s>"}
    assert checkpoint.read_checkpoint_meta(path)["architecture_hash"] == checkpoint.architecture_hash(model.config)
    tok = load_tokenizer(str(path))  # dataset.tokenizer=DIR
    assert (tok.vocab_size, tok.eos_token, tok.eos_id) == (40, "</s>", 39)
    assert tok.encode("w3 w5") == [3, 5]


def test_init_from_folder_with_the_printed_overrides(folder):
    """The overrides `convert from-hf` prints build the folder's architecture, and the warm start loads it."""
    from looplab.train import load_warm_start

    path, model = folder
    cfg = compose(convert.train_overrides(model.config, path))
    assert cfg.init_from == str(path) and cfg.dataset.tokenizer == str(path)
    built = model_config_from_cfg(cfg)
    checkpoint.check_compatible(checkpoint.read_checkpoint_meta(path), built)
    fresh = LoopedLM(built)
    assert load_warm_start(fresh, str(path)) == []
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)


def test_a_transformers_folder_is_pointed_to_convert(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="looplab.convert from-hf"):
        checkpoint.load_model(tmp_path)


def test_generate_reads_a_folder(folder, capsys):
    from looplab.generate import main

    path, model = folder
    main([f"ckpt={path}", "prompt=w3 w5", "max_new_tokens=3", "device=cpu"])
    printed = capsys.readouterr().out
    ids = model.generate(torch.tensor([[3, 5]]), 3)[0, 2:].tolist()  # greedy: generate's default
    if 39 in ids:  # the command stops at the tokenizer's end of text (the untrained model may say it)
        ids = ids[: ids.index(39) + 1]
    expected = load_tokenizer(str(path)).decode(ids)
    assert ids and expected.strip() and printed.startswith("w3 w5") and printed.strip() == "w3 w5" + expected.strip()
