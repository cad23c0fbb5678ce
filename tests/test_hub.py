"""LoopedLM.save_pretrained / from_pretrained and `python -m looplab.convert to-hf`."""

from __future__ import annotations

import json
import re

import pytest
import torch

from looplab import convert
from looplab.checkpoint import looplab_meta
from looplab.models import LoopedLM, LoopedLMConfig

TINY = dict(vocab_size=64, d_model=32, n_heads=4, n_layers=2, n_loops=2, ffn_hidden=64, d_state=8, headdim=16,
            hybrid_pattern="MA", state_dim=32, max_seq_len=64)


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


def _model(backbone, state_mode, exit_gate, seed=0):
    torch.manual_seed(seed)
    model = LoopedLM(LoopedLMConfig(**TINY, backbone=backbone, state_mode=state_mode, exit_gate=exit_gate))
    with torch.no_grad():  # StateLoop's W_o starts at zero; make every branch matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _check_same(a: LoopedLM, b: LoopedLM) -> None:
    ids = torch.randint(0, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        oa, ob = a(ids, return_all_loops=True), b(ids, return_all_loops=True)
    assert torch.equal(oa.loop_logits, ob.loop_logits)
    if oa.exit_probs is not None:
        assert torch.equal(oa.exit_probs, ob.exit_probs)


# Every registered variant's checkpoint → folder → model round trip, and the remote-code export or its refusal by
# name, is the conformance kit's (tests/test_conformance.py: checkpoint, export). Here: the converter's CLI and card.
@pytest.mark.parametrize("backbone, state_mode, exit_gate", [("llama", "stateloop_attn", "ouro"),
                                                             ("hybrid", "stateloop", "none")])
def test_checkpoint_to_folder_to_model_gives_identical_logits(backbone, state_mode, exit_gate, tmp_path):
    model = _model(backbone, state_mode, exit_gate)
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "looplab": looplab_meta(model.config, {"tokenizer": None})}, ckpt)
    reason = model.config.unsupported("export")  # what the variants declare (models/registry.py)
    if reason:  # refused by name; --looplab writes the folder only looplab reads
        with pytest.raises(convert.ConversionError, match=re.escape(reason.split(":")[0])):
            convert.to_hf(str(ckpt), tmp_path / "refused", log=lambda *a: None)
        assert not (tmp_path / "refused" / "config.json").exists()
    args = ["--looplab"] if reason else []
    assert convert.main(["to-hf", str(ckpt), "--out", str(tmp_path / "hf"), *args]) == 0
    assert (tmp_path / "hf" / "modeling_looplab.py").is_file() == (reason is None)
    back = LoopedLM.from_pretrained(str(tmp_path / "hf"))
    assert back.config.architecture_dict() == model.config.architecture_dict()
    assert back.config.extra["dataset"] == {"tokenizer": None}  # kept for eval of the folder
    _check_same(model, back)
    card = (tmp_path / "hf" / "README.md").read_text()
    for line in ("| N⊗R | 2⊗2 |", f"| state mode | {state_mode} |", f"| exit gate | {exit_gate} |"):
        assert line in card
    assert card.count(f"| backbone | {backbone}") == 1


def test_folder_layout_tied_embeddings_and_tokenizer(tmp_path):
    model = LoopedLM(LoopedLMConfig(**{**TINY, "tie_embeddings": True}))
    tok = tmp_path / "tok.json"
    tok.write_text('{"not": "checked here"}')
    model.save_pretrained(tmp_path / "f", tokenizer=tok)
    names = sorted(p.name for p in (tmp_path / "f").iterdir())
    assert names == ["README.md", "config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((tmp_path / "f" / "config.json").read_text())["tie_embeddings"] is True
    back = LoopedLM.from_pretrained(str(tmp_path / "f"))
    assert back.head.weight.data_ptr() == back.embed.weight.data_ptr()  # still tied after loading
    _check_same(model.eval(), back)


def test_loading_is_strict_and_safetensors_only(tmp_path):
    from safetensors.torch import load_file, save_file

    model = LoopedLM(LoopedLMConfig(**TINY))
    model.save_pretrained(tmp_path / "f")
    sd = load_file(tmp_path / "f" / "model.safetensors")
    sd.pop("final_norm.weight")
    save_file(sd, tmp_path / "f" / "model.safetensors")
    with pytest.raises(RuntimeError, match="final_norm.weight"):
        LoopedLM.from_pretrained(str(tmp_path / "f"))
    (tmp_path / "f" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "f" / "pytorch_model.bin")  # a pickle is never read
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        LoopedLM.from_pretrained(str(tmp_path / "f"))
