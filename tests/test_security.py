"""Someone else's model runs no code: every payload kind against every entry point that reads a model.

Payload kinds (each writes a marker file if it ever runs):
  nested_target     the recorded dataset config holds a `_target_` inside a harmless-looking field (task_args) that
                    would call torch.load(weights_only=False) on a pickle shipped beside the model
  npy_target        the dataset's own `_target_` is numpy.load(allow_pickle=True) of a shipped .npy pickle
  pt_target         the dataset's own `_target_` is torch.load(weights_only=False) of a shipped .pt pickle
  shipped_variant   the model config names state_mode=evilvariant.gru, and evilvariant.py lies in the model's folder,
                    which is the working directory (as `python -m looplab.eval .` run from there would have it)
  remote_code       an exported folder (convert to-hf) whose modeling_looplab.py was edited
  ckpt_pickle       the checkpoint file itself unpickles a __reduce__ payload

Entry points: load_model, eval, generate, to-hf, from-hf, resume=, init_from=, and the bench's trained-run loader.
A payload comes as a checkpoint file (`ckpt`) and as a Hub-style folder (`folder`) where the entry point takes one.
Each cell asserts that no marker appears and, where the entry point refuses, that the refusal names what it
refused; a payload the entry point never reads (an exported folder's .py files, read by nothing but from-hf with
--trust-remote-code) must leave it working. `test_every_payload_is_live` shows each payload does run when the guard is
bypassed, so a cell that passes is not a payload that never worked. A new entry point is a new row of ENTRY_POINTS.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import compose
from looplab import checkpoint, convert
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models import registry

pytestmark = pytest.mark.usefixtures("one_thread_module")

PHOP = {"_target_": "looplab.data.tasks.TaskDataModule", "name": "phop", "task": "phop",
        "task_args": {"n": 12, "p": 2, "alphabet": 4}, "batch_size": 4, "val_size": 8, "test_size": 8, "seed": 0}
TINY = dict(vocab_size=None, d_model=32, n_heads=2, n_layers=1, n_loops=2, ffn_hidden=64, max_seq_len=64)


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):  # what a real attack would do: run a command
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(autouse=True)
def _no_leaked_trust(monkeypatch):
    """--trust-variants is process state: no cell may see another's."""
    monkeypatch.delenv(registry.TRUST_ENV, raising=False)
    saved = set(registry._TRUSTED)
    registry._TRUSTED.clear()
    yield
    registry._TRUSTED.clear()
    registry._TRUSTED.update(saved)


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A genuine tiny phop checkpoint (as training writes it) and its exported remote-code folder."""
    from looplab.checkpoint import looplab_meta
    from looplab.data.tasks import TaskDataModule

    root = tmp_path_factory.mktemp("genuine")
    dm = TaskDataModule(**{k: v for k, v in PHOP.items() if not k.startswith("_") and k != "name"})
    cfg = LoopedLMConfig(**{**TINY, "vocab_size": dm.vocab_size})
    torch.manual_seed(0)
    model = LoopedLM(cfg)
    dataset = {**PHOP, "_vocab_size": dm.vocab_size, "_tokenizer_identity": dm.tokenizer_identity}
    ckpt = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": 1, "epoch": 0,
            "looplab": looplab_meta(cfg, dataset)}
    torch.save(ckpt, root / "genuine.ckpt")
    convert.to_hf(str(root / "genuine.ckpt"), root / "exported", log=lambda *_: None)
    return root / "genuine.ckpt", root / "exported"


# ------------------------------------------------------------------ payloads
def _pickles(where: Path, marker: Path) -> tuple[Path, Path]:
    npy, pt = where / "evil.npy", where / "evil.pt"
    np.save(npy, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    torch.save(_Payload(marker), pt)
    return npy, pt


def _with(genuine, out: Path, form: str, *, dataset=None, model_config=None) -> Path:
    """The genuine model with its dataset record or model config replaced, as a checkpoint file or as its exported
    folder (convert to-hf: what one downloads from a hub, and what from-hf reads back)."""
    if form == "ckpt":
        ckpt = torch.load(genuine[0], weights_only=True)
        if dataset is not None:
            ckpt["looplab"]["dataset"] = dataset
        if model_config is not None:
            ckpt["looplab"]["model_config"] = model_config
        torch.save(ckpt, out / "model.ckpt")
        return out / "model.ckpt"
    folder = out / "model"
    shutil.copytree(genuine[1], folder)
    cfg = json.loads((folder / "config.json").read_text())
    if model_config is not None:
        cfg.update(model_config)
    if dataset is not None:
        cfg["extra"] = {**(cfg.get("extra") or {}), "dataset": dataset}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def nested_target(genuine, out, marker, form):
    _, pt = _pickles(out, marker)
    ds = {**PHOP, "task_args": {**PHOP["task_args"], "cache": {"_target_": "torch.load", "f": str(pt), "weights_only": False}}}
    return _with(genuine, out, form, dataset=ds), "dataset.task_args.cache._target_"


def npy_target(genuine, out, marker, form):
    npy, _ = _pickles(out, marker)
    return _with(genuine, out, form, dataset={"_target_": "numpy.load", "file": str(npy), "allow_pickle": True}), \
        "dataset._target_='numpy.load'"


def pt_target(genuine, out, marker, form):
    _, pt = _pickles(out, marker)
    return _with(genuine, out, form, dataset={"_target_": "torch.load", "f": str(pt), "weights_only": False}), \
        "dataset._target_='torch.load'"


def shipped_variant(genuine, out, marker, form):
    cfg = torch.load(genuine[0], weights_only=True)["looplab"]["model_config"]
    path = _with(genuine, out, form, model_config={**cfg, "state_mode": "evilvariant.gru"})
    code = f"open({str(marker)!r}, 'w').close()\n"
    for where in {out, path if path.is_dir() else out}:
        (where / "evilvariant.py").write_text(code)
    return path, "'evilvariant'"


def remote_code(genuine, out, marker, form):
    # a name of its own: transformers keys the remote code it imports by the folder's name, once per process
    folder = out / f"exported_{abs(hash(str(out))):x}"
    shutil.copytree(genuine[1], folder)
    code = folder / "modeling_looplab.py"
    text = code.read_text()
    head = "from __future__ import annotations\n"
    code.write_text(text.replace(head, head + f"open({str(marker)!r}, 'w').close()\n", 1))
    return folder, None  # nothing reads it: the entry point must work and run none of it


def ckpt_pickle(genuine, out, marker, form):
    ckpt = torch.load(genuine[0], weights_only=True)
    ckpt["looplab"]["note"] = _Payload(marker)
    torch.save(ckpt, out / "model.ckpt")
    return out / "model.ckpt", "refused"


PAYLOADS = {"nested_target": (nested_target, ("ckpt", "folder")), "npy_target": (npy_target, ("ckpt", "folder")),
            "pt_target": (pt_target, ("ckpt", "folder")), "shipped_variant": (shipped_variant, ("ckpt", "folder")),
            "remote_code": (remote_code, ("folder",)), "ckpt_pickle": (ckpt_pickle, ("ckpt",))}


# ------------------------------------------------------------------ entry points
def _train(path: Path, tmp: Path, key: str):
    """looplab.train in-process (as @hydra.main runs it) with resume= / init_from= naming the model."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from looplab.train import train

    run = tmp / "run"
    cfg = compose(["logger=none", f"hydra.run.dir={run}", "trainer.max_steps=1", "trainer.limit_val_batches=0",
                   "trainer.limit_test_batches=1", "test_after_fit=false", "trainer.enable_progress_bar=false",
                   "trainer.enable_model_summary=false", "dataset=phop", "dataset.task_args.n=12", "dataset.task_args.p=2",
                   "dataset.batch_size=4", "dataset.val_size=8", "dataset.test_size=8", "backbone.d_model=32",
                   "backbone.n_heads=2", "backbone.ffn_hidden=64", "loop_depth=1x2", "hardware=cpu",
                   f"{key}={path}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run)
    HydraConfig.instance().set_config(cfg)
    return train(cfg)


def _cli(main, argv):
    """A CLI's main in-process: a refusal raises, or prints to stderr and exits / returns non-zero."""
    rc = main(argv)
    if isinstance(rc, int) and rc != 0:
        raise SystemExit(rc)


def _eval(path, tmp):
    from looplab.eval.__main__ import main

    _cli(main, [str(path), "--max-batches", "1", "--out", str(tmp / "eval"), "--thresholds", "0.5"])


def _generate(path, tmp):
    from looplab.generate import main

    main([f"ckpt={path}", "max_new_tokens=2", "prompt=a b"])


def _bench_loader(path, tmp):
    from looplab.bench.trained_runs import held_out_examples

    _, meta = checkpoint.load_model(path)
    held_out_examples(meta, 2)


ENTRY_POINTS = {
    "load_model": (lambda p, tmp: checkpoint.load_model(p), ("ckpt", "folder")),
    "eval": (_eval, ("ckpt", "folder")),
    "generate": (_generate, ("ckpt", "folder")),
    "to-hf": (lambda p, tmp: _cli(convert.main, ["to-hf", str(p), "--out", str(tmp / "hf")]), ("ckpt", "folder")),
    "from-hf": (lambda p, tmp: _cli(convert.main, ["from-hf", str(p), "--out", str(tmp / "conv")]), ("folder",)),
    "resume=": (lambda p, tmp: _train(p, tmp, "resume"), ("ckpt",)),
    "init_from=": (lambda p, tmp: _train(p, tmp, "init_from"), ("ckpt", "folder")),
    "bench trained-run loader": (_bench_loader, ("ckpt", "folder")),
}

CELLS = [(payload, entry, form) for payload, (_, pforms) in PAYLOADS.items()
         for entry, (_, eforms) in ENTRY_POINTS.items() for form in pforms if form in eforms]


@pytest.mark.parametrize("payload,entry,form", CELLS, ids=[f"{p}-{e}-{f}" for p, e, f in CELLS])
def test_no_payload_runs_and_each_refusal_names_what_it_refused(payload, entry, form, genuine, tmp_path, monkeypatch,
                                                                  capsys):
    marker = tmp_path / "PWNED"
    work = tmp_path / "work"
    work.mkdir()
    path, names = PAYLOADS[payload][0](genuine, work, marker, form)
    # `python -m ...` from the model's folder: the working directory is first on sys.path
    here = path if path.is_dir() else path.parent
    monkeypatch.chdir(here)
    monkeypatch.syspath_prepend(str(here))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    sys.modules.pop("evilvariant", None)
    run = ENTRY_POINTS[entry][0]
    try:
        run(path, tmp_path)
        refusal = None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - what matters is what it says
        refusal = f"{e}\n{capsys.readouterr().err}"
    assert not marker.exists(), f"{payload} ran through {entry}"
    if names is None:
        assert refusal is None, f"{entry} should read the folder and run none of its code, but failed: {refusal}"
    else:
        assert refusal is not None, f"{entry} accepted the {payload} payload"
        assert names in refusal, refusal[-1500:]
        assert "Traceback" not in refusal


def test_every_payload_is_live(genuine, tmp_path, monkeypatch):
    """Each payload runs when its guard is bypassed: hydra's instantiate, a plain import, transformers' remote code,
    a plain torch.load."""
    import hydra

    from looplab.data.registry import check_plain_data  # noqa: F401 (the guard these bypass)

    for kind, fire in (
        ("nested_target", lambda p: hydra.utils.instantiate(torch.load(p, weights_only=True)["looplab"]["dataset"])),
        ("npy_target", lambda p: hydra.utils.instantiate(torch.load(p, weights_only=True)["looplab"]["dataset"])),
        ("pt_target", lambda p: hydra.utils.instantiate(torch.load(p, weights_only=True)["looplab"]["dataset"])),
        ("ckpt_pickle", lambda p: torch.load(p, weights_only=False)),
    ):
        marker, out = tmp_path / f"{kind}.marker", tmp_path / kind
        out.mkdir()
        path, _ = PAYLOADS[kind][0](genuine, out, marker, "ckpt")
        try:
            fire(path)
        except Exception:  # noqa: BLE001 - the payload ran before whatever failed after it
            pass
        assert marker.exists(), kind
    marker, out = tmp_path / "variant.marker", tmp_path / "variant"
    out.mkdir()
    shipped_variant(genuine, out, marker, "ckpt")
    monkeypatch.syspath_prepend(str(out))
    sys.modules.pop("evilvariant", None)
    __import__("evilvariant")
    assert marker.exists()
    marker, out = tmp_path / "remote.marker", tmp_path / "remote"
    out.mkdir()
    folder, _ = remote_code(genuine, out, marker, "folder")
    convert.load_remote_code(folder, trust_remote_code=True)
    assert marker.exists()


def test_trusting_a_variant_package_imports_it_from_pythonpath_never_from_the_working_directory(genuine, tmp_path,
                                                                                                 monkeypatch):
    marker = tmp_path / "PWNED"
    work = tmp_path / "work"
    work.mkdir()
    path, _ = shipped_variant(genuine, work, marker, "ckpt")
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    sys.modules.pop("evilvariant", None)
    monkeypatch.setenv(registry.TRUST_ENV, "evilvariant")
    with pytest.raises(Exception) as info:  # trusted, but the working directory is not searched
        checkpoint.load_model(path)
    assert not marker.exists() and "evilvariant" in str(info.value)
    monkeypatch.setenv("PYTHONPATH", str(work))  # where the user put it on purpose
    sys.modules.pop("evilvariant", None)
    with pytest.raises(Exception):  # it registers nothing, but it was imported: the user trusted it
        checkpoint.load_model(path)
    assert marker.exists()


def test_from_hf_runs_the_folders_code_only_with_trust_remote_code(genuine, tmp_path):
    marker = tmp_path / "PWNED"
    folder, _ = remote_code(genuine, tmp_path, marker, "folder")
    assert convert.main(["from-hf", str(folder), "--out", str(tmp_path / "a")]) == 0
    assert not marker.exists() and (tmp_path / "a" / "model.safetensors").is_file()
    assert convert.main(["from-hf", str(folder), "--out", str(tmp_path / "b"), "--trust-remote-code"]) == 0
    assert marker.exists()


def test_every_dataset_config_names_a_registered_data_module():
    """conf/dataset/*.yaml are the user's own configs; a run records them, so each must rebuild through the registry."""
    import yaml

    from looplab.data.registry import allowed_targets

    conf = Path(__file__).resolve().parents[1] / "conf" / "dataset"
    targets = {yaml.safe_load(f.read_text())["_target_"] for f in conf.glob("*.yaml")}
    assert targets and targets <= set(allowed_targets()), targets - set(allowed_targets())


# ------------------------------------------------------------------ the tokenizer a model was trained with
def _lm_run_parts(tmp_path, tokenizer: str):
    from looplab.train import build_run

    cfg = compose(["dataset=lm_tiny", f"dataset.tokenizer={tokenizer}", "dataset.seq_len=16", "dataset.batch_size=2",
                   f"dataset.cache_dir={tmp_path / 'cache'}", "backbone.d_model=32", "backbone.n_heads=2",
                   "backbone.ffn_hidden=64", "loop_depth=1x2", "logger=none", "hardware=cpu"])
    return build_run(cfg)


@pytest.fixture
def permuted_tokenizer(tmp_path):
    """The embedded tokenizer with two tokens' ids swapped: same size, same merges, other ids."""
    from looplab.data.tokenizer import ASSETS

    tok = json.loads((ASSETS / "shakespeare-bpe-4096.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path = tmp_path / "permuted.json"
    path.write_text(json.dumps(tok))
    return str(path)


def test_a_permuted_tokenizer_is_refused_on_resume_init_from_and_eval(tmp_path, permuted_tokenizer):
    from looplab.checkpoint import looplab_meta
    from looplab.data.registry import datamodule_from_meta
    from looplab.data.tokenizer import TokenizerMismatchError, load_tokenizer

    run = _lm_run_parts(tmp_path, "shakespeare-bpe-4096")
    dataset = run.module.dataset_cfg
    assert dataset["_tokenizer_identity"] == load_tokenizer("shakespeare-bpe-4096").identity
    assert load_tokenizer(permuted_tokenizer).vocab_size == load_tokenizer("shakespeare-bpe-4096").vocab_size
    ckpt = {"state_dict": {f"model.{k}": v for k, v in run.module.model.state_dict().items()},
            "looplab": looplab_meta(run.model_cfg, dataset)}
    torch.save(ckpt, tmp_path / "lm.ckpt")
    for key in ("resume", "init_from"):
        with pytest.raises(TokenizerMismatchError, match=r"tokenizer identity .*other token ids"):
            _train_lm(tmp_path, key, permuted_tokenizer)
    # eval, generate and the lm-eval adapter rebuild the tokenizer from the record: the file it names was swapped
    with pytest.raises(TokenizerMismatchError, match="permuted.json"):
        datamodule_from_meta({**dataset, "tokenizer": permuted_tokenizer}).tokenizer_identity
    with pytest.raises(TokenizerMismatchError):
        load_tokenizer({**dataset, "tokenizer": permuted_tokenizer})
    # the tokenizer it was trained with passes
    assert datamodule_from_meta(dataset).tokenizer_identity == dataset["_tokenizer_identity"]


def _train_lm(tmp_path, key, tokenizer):
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from looplab.train import train

    run = tmp_path / f"run-{key}"
    cfg = compose(["dataset=lm_tiny", f"dataset.tokenizer={tokenizer}", "dataset.seq_len=16", "dataset.batch_size=2",
                   f"dataset.cache_dir={tmp_path / 'cache'}", "backbone.d_model=32", "backbone.n_heads=2",
                   "backbone.ffn_hidden=64", "loop_depth=1x2", "logger=none", "hardware=cpu", "trainer.max_steps=1",
                   f"hydra.run.dir={run}", f"{key}={tmp_path / 'lm.ckpt'}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run)
    HydraConfig.instance().set_config(cfg)
    return train(cfg)


# ------------------------------------------------------------------ sizes, before anything is allocated
def test_an_impossible_depth_is_refused_before_the_model_is_allocated(monkeypatch):
    from looplab.models import ConfigError, looped
    from looplab.train import build_run

    def allocated(*a, **k):
        raise AssertionError("the model was allocated before the size check")

    monkeypatch.setattr(looped.LoopedLM, "__init__", allocated)
    cfg = compose(["loop_depth.loops=1000000000000", "logger=none", "hardware=cpu"])
    with pytest.raises(ConfigError, match=r"n_loops=1000000000000 need at least [\d,.]+ GB .* but this machine's RAM"):
        build_run(cfg)


def test_an_impossible_depth_is_one_line_on_the_command_line(tmp_path):
    import subprocess

    p = subprocess.run([sys.executable, "-m", "looplab.train", "loop_depth.loops=1000000000000", "logger=none",
                        f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if "cannot fit" in line]
    assert len(errors) == 1 and "GB" in errors[0] and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_a_folder_asking_for_a_huge_vocabulary_is_refused_before_allocation(genuine, tmp_path, monkeypatch):
    from looplab.models import ConfigError, looped

    folder = _with(genuine, tmp_path, "folder")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vocab_size"] = 10**9
    (folder / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(looped.LoopedLM, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError("allocated")))
    for load in (checkpoint.load_model, LoopedLM.from_pretrained):
        with pytest.raises(ConfigError, match=r"vocab_size=1000000000, .* need at least [\d,.]+ GB"):
            load(str(folder))
