"""Loading weights never runs code hidden in a pickle (issue 17, item 5).

A crafted checkpoint whose unpickling would create a file is refused on every path that
reads weights: read_checkpoint(_meta), load_model, init_from= (load_warm_start), resume's
metadata check, generate and convert to-hf; the file is never created. eval and the
lm-eval adapter read through the same load_model (importing lm-eval alone takes ~7 s, too
slow here), which the last test pins down: no other torch.load exists in looplab. A genuine
checkpoint still loads.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from looplab import checkpoint, convert
from looplab.checkpoint import UnsafeCheckpointError, looplab_meta
from looplab.models import LoopedLM, LoopedLMConfig

CFG = dict(vocab_size=32, d_model=32, n_heads=4, n_layers=1, n_loops=2, ffn_hidden=64)


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


class _Payload:
    """Unpickling this runs `touch MARKER` (os.system is what a real attack would call)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_dict(marker):
    model = LoopedLM(LoopedLMConfig(**CFG))
    meta = looplab_meta(model.config)
    meta["note"] = _Payload(marker)
    return {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "looplab": meta}


@pytest.fixture
def evil(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.ckpt"
    torch.save(_evil_dict(marker), path)
    return path, marker


def _train_warm_start(path):
    from looplab.train import load_warm_start

    load_warm_start(LoopedLM(LoopedLMConfig(**CFG)), str(path))


def _generate(path):
    from looplab.generate import main

    main([f"ckpt={path}", "device=cpu", "max_new_tokens=1"])


def _to_hf(path):
    """The CLI prints the refusal and exits non-zero; raised here so the test sees one shape."""
    if convert.main(["to-hf", str(path), "--out", str(path) + ".hf"]) != 0:
        raise SystemExit(1)


PATHS = {
    "read_checkpoint": lambda p: checkpoint.read_checkpoint(p),
    "read_checkpoint_meta (resume=)": lambda p: checkpoint.read_checkpoint_meta(p),
    "load_model": lambda p: checkpoint.load_model(p),
    "init_from (load_warm_start)": _train_warm_start,
    "generate": _generate,
    "convert to-hf": _to_hf,
}


@pytest.mark.parametrize("name", list(PATHS))
def test_crafted_pickle_is_refused_and_never_runs(name, evil, capsys):
    path, marker = evil
    with pytest.raises((UnsafeCheckpointError, SystemExit)) as info:
        PATHS[name](path)
    text = str(info.value) + capsys.readouterr().err
    assert "refused" in text
    assert not marker.exists()
    if name == "load_model":
        assert "posix.system" in text or "os.system" in text or "system" in text  # the offending global is named


def test_sharded_meta_file_is_refused_too(tmp_path):
    marker = tmp_path / "PWNED"
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    torch.save({"looplab": {"note": _Payload(marker)}}, folder / checkpoint.SHARDED_META_FILE)
    with pytest.raises(UnsafeCheckpointError):
        checkpoint.read_checkpoint_meta(folder)
    assert not marker.exists()


def test_a_lightning_style_checkpoint_still_loads(tmp_path):
    """The shapes of a real Lightning checkpoint: OrderedDict state dict, optimizer and scheduler
    states, loops and callback states, hyper-parameters as plain dicts."""
    from collections import OrderedDict

    model = LoopedLM(LoopedLMConfig(**CFG))
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95))
    model(torch.randint(0, 32, (1, 4))).logits.sum().backward()
    opt.step()
    ckpt = {
        "epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6",
        "state_dict": OrderedDict((f"model.{k}", v) for k, v in model.state_dict().items()),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.batch_progress": {"total": {"ready": 1}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None, "dirpath": "/x"}},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [{"base_lrs": [0.003], "last_epoch": 1, "lr_lambdas": [None]}],
        "hparams_name": "kwargs", "hyper_parameters": {"model_config": model.config.to_dict(), "optim": {"lr": 3e-3}},
        "looplab": looplab_meta(model.config, {"task": "phop"}),
    }
    torch.save(ckpt, tmp_path / "ok.ckpt")
    back, meta = checkpoint.load_model(tmp_path / "ok.ckpt")
    assert meta["dataset"] == {"task": "phop"}
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


def test_every_weight_reader_goes_through_the_safe_loader():
    """The one torch.load in looplab is checkpoint._torch_load (weights_only=True); eval, the
    lm-eval adapter, perplexity, generate and convert all read through load_model."""
    from pathlib import Path

    import looplab

    root = Path(looplab.__file__).parent
    call = re.compile(r"^\s*(return\s+|[\w\[\]\"', ]+=\s*)?torch\.load\(")
    loads = [(p.relative_to(root), line.strip()) for p in root.rglob("*.py") for line in p.read_text().splitlines()
             if call.match(line)]
    assert [str(p) for p, _ in loads] == ["checkpoint.py"] and "weights_only=True" in loads[0][1]
    for reader in ("eval/__main__.py", "eval/lm_eval_adapter.py", "eval/perplexity.py", "generate.py", "convert.py"):
        assert "from looplab.checkpoint import load_model" in (root / reader).read_text(), reader


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
