"""Loading weights never runs code hidden in a pickle.

A crafted checkpoint whose unpickling would create a file is refused on every path that
reads weights: read_checkpoint(_meta), load_model, init_from= (load_warm_start), resume's
metadata check, generate and convert to-hf; the file is never created. eval and the
lm-eval adapter read through the same load_model (importing lm-eval alone takes ~7 s, too
slow here), which the last test pins down: no other torch.load exists in looplab. A genuine
checkpoint still loads.

Sharded folders: torch.distributed.checkpoint unpickles `.metadata` and every non-tensor
entry unrestricted, so a folder with a benign meta.pt and a crafted `.metadata` is refused on every
path that reads one, eval, the lm-eval adapter and FSDP resume included (those three import lm-eval
or start a training run, a few seconds each); a genuine one still loads to identical weights.
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


# ---- sharded (FSDP2 / torch.distributed.checkpoint) folders: a benign meta.pt, a crafted .metadata


def _dcp_save(folder, state, meta):
    """A sharded folder as Lightning's ModelParallelStrategy writes it (dcp.save + meta.pt), from one process."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "no process group: saving in a single process" is the intent
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    torch.save(meta, folder / checkpoint.SHARDED_META_FILE)


@pytest.fixture
def sharded(tmp_path):
    """A genuine sharded checkpoint (model and AdamW states, as ModelParallelStrategy saves them) and its model."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = LoopedLM(LoopedLMConfig(**CFG))
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95))
    model(torch.randint(0, 32, (1, 4))).logits.sum().backward()
    opt.step()
    folder = tmp_path / "last.ckpt"
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
             "optimizer_0": get_optimizer_state_dict(model, opt)}  # its param_groups are non-tensor (BYTE_IO) entries
    _dcp_save(folder, state, {"epoch": 0, "global_step": 1, "looplab": looplab_meta(model.config)})
    return folder, model


def _craft_metadata(folder, marker):
    """The genuine index with a payload planted in it: still a valid Metadata, so torch's own reader
    would run `touch MARKER` and then load the checkpoint as if nothing happened."""
    import pickle

    metadata = checkpoint._safe_reader_class()(str(folder)).read_metadata()
    metadata.planner_data["note"] = _Payload(marker)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.fixture
def evil_sharded(sharded, tmp_path):
    folder, _ = sharded
    marker = tmp_path / "PWNED"
    _craft_metadata(folder, marker)
    return folder, marker


def test_the_crafted_metadata_runs_code_through_torchs_own_reader(evil_sharded):
    """The control: the payload is live, torch.distributed.checkpoint's FileSystemReader runs it."""
    from torch.distributed.checkpoint import FileSystemReader

    folder, marker = evil_sharded
    FileSystemReader(str(folder)).read_metadata()
    assert marker.exists()


def _eval_cli(path):
    from looplab.eval.__main__ import main  # imports lm-eval (~7 s): the eval package registers the adapter

    main([str(path), "--device", "cpu", "--max-batches", "1"])


def _lm_eval_adapter(path):
    from looplab.eval import LooplabLM

    LooplabLM(checkpoint=str(path), device="cpu")


SHARDED_PATHS = {k: v for k, v in PATHS.items() if k != "read_checkpoint_meta (resume=)"}  # that one reads meta.pt only
SHARDED_PATHS |= {"python -m looplab.eval": _eval_cli, "lm-eval adapter (LooplabLM)": _lm_eval_adapter}


@pytest.mark.parametrize("name", list(SHARDED_PATHS))
def test_crafted_sharded_metadata_is_refused_and_never_runs(name, evil_sharded, capsys):
    folder, marker = evil_sharded
    with pytest.raises((UnsafeCheckpointError, SystemExit)) as info:
        SHARDED_PATHS[name](folder)
    text = str(info.value) + capsys.readouterr().err
    assert "refused" in text and ".metadata" in text, text
    assert "posix.system" in text or "os.system" in text, text  # the offending global is named
    assert not marker.exists()


def test_crafted_rank_local_metadata_is_refused_too(sharded, tmp_path):
    """DCP falls back to __RANK.metadata when .metadata does not load: the same unpickler reads it."""
    folder, _ = sharded
    marker = tmp_path / "PWNED"
    _craft_metadata(folder, marker)
    (folder / ".metadata").rename(folder / "__0.metadata")
    with pytest.raises(UnsafeCheckpointError, match="__0.metadata"):
        checkpoint._safe_reader_class()(str(folder)).read_metadata(rank=0)
    assert not marker.exists()


def test_an_index_naming_files_outside_the_folder_is_refused(sharded):
    import pickle

    folder, _ = sharded
    metadata = checkpoint._safe_reader_class()(str(folder)).read_metadata()
    first = next(iter(metadata.storage_data.values()))
    first.relative_path = "../../../etc/passwd"
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeCheckpointError, match="outside the folder"):
        checkpoint.load_model(folder)


def test_crafted_non_tensor_entry_is_refused_by_name(tmp_path):
    """DCP stores every non-tensor value as pickled bytes and torch's planner loads them with
    weights_only=False; here they are unpickled weights-only, and a payload is refused by its key."""
    model = LoopedLM(LoopedLMConfig(**CFG))
    marker = tmp_path / "PWNED"
    folder = tmp_path / "last.ckpt"
    state = {"state_dict": {**{f"model.{k}": v for k, v in model.state_dict().items()}, "model.note": _Payload(marker)}}
    _dcp_save(folder, state, {"looplab": looplab_meta(model.config)})
    with pytest.raises(UnsafeCheckpointError, match=r"'state_dict\.model\.note'") as info:
        checkpoint.load_model(folder)
    assert "refused" in str(info.value) and not marker.exists()


def test_a_genuine_sharded_checkpoint_loads_with_identical_weights(sharded):
    from looplab.train import load_warm_start

    folder, model = sharded
    want = model.state_dict()
    back, meta = checkpoint.load_model(folder)
    assert meta == looplab_meta(model.config)
    warm = LoopedLM(LoopedLMConfig(**CFG))
    load_warm_start(warm, str(folder))
    for got in (back.state_dict(), warm.state_dict()):
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_genuine_optimizer_state_loads_through_the_safe_reader(sharded):
    """What FSDP resume reads besides the weights: AdamW's tensors and its non-tensor hyper-parameters."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    folder, model = sharded
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95))
    saved = checkpoint._safe_reader_class()(str(folder)).read_metadata().state_dict_metadata
    assert any(k.startswith("optimizer_0.param_groups.") for k, v in saved.items() if not hasattr(v, "chunks"))
    model(torch.randint(0, 32, (1, 4))).logits.sum().backward()
    opt.step()
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)  # other hyper-parameters, no state: all must be read back
    state = {"optimizer_0": get_optimizer_state_dict(model, fresh)}
    state["optimizer_0"]["state"] = get_optimizer_state_dict(model, opt)["state"]  # the shapes to read into
    checkpoint.load_sharded(state, folder)
    groups = state["optimizer_0"]["param_groups"]
    assert groups[0]["betas"] == (0.9, 0.95) and groups[0]["lr"] == pytest.approx(1e-3)
    assert int(state["optimizer_0"]["state"]["embed.weight"]["step"]) == 1


@pytest.mark.slow
def test_fsdp_resume_loads_a_genuine_sharded_checkpoint_and_refuses_a_crafted_one(tmp_path):
    """resume under hardware=fsdp: Lightning's ModelParallelStrategy.load_checkpoint, overridden by
    LoopedFSDPStrategy. One rank runs the same load path as two, at half the CPU."""
    import json
    import subprocess

    from conftest import ROOT

    run_dir = tmp_path / "run"
    args = ["+experiment=phop_tiny", "loop_depth=1x2", "hardware=fsdp", "trainer.accelerator=cpu", "trainer.devices=1",
            "logger=none", "trainer.limit_val_batches=0", "test_after_fit=false", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", "checkpoint_every_n_steps=1", "dataset.batch_size=4",
            "backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}

    def train(steps: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "looplab.train", *args, f"trainer.max_steps={steps}"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=1800)

    first = train(1)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert (ckpt / ".metadata").is_file()
    resumed = train(2)  # the genuine folder: weights, AdamW state (non-tensor entries too) and loops come back
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "resuming from" in log, log[-3000:]
    assert json.loads((run_dir / "results.json").read_text())["global_step"] == 2

    marker = tmp_path / "PWNED"
    _craft_metadata(ckpt, marker)
    refused = train(3)
    log = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "UnsafeCheckpointError" in log and "refused" in log, log[-3000:]
    assert not marker.exists()


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
    # torch.distributed.checkpoint is read only through the safe reader: no dcp.load / FileSystemReader
    # elsewhere, and FSDP resume overrides Lightning's load_checkpoint (which uses torch's reader)
    dcp_reads = re.compile(r"FileSystemReader\(|_load_state_dict_from_keys\(|dcp\.load\(|distributed\.checkpoint import (.*, )?load\b")
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if dcp_reads.search(p.read_text()))
    assert readers == ["checkpoint.py"], readers
    import inspect

    from looplab.training.distributed import LoopedFSDPStrategy

    assert "load_sharded(" in inspect.getsource(LoopedFSDPStrategy.load_checkpoint)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
