"""python -m looplab.eval: the accuracy–exit-depth sweep of a gated checkpoint, checked against the model."""

from __future__ import annotations

import json

import pytest
import torch

from looplab.checkpoint import looplab_meta
from looplab.data.tasks import TaskDataModule
from looplab.eval.__main__ import main
from looplab.eval.exit_sweep import exit_sweep
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exit_gate import threshold_exit_steps

DATASET = {"_target_": "looplab.data.tasks.TaskDataModule", "name": "phop", "task": "phop",
           "task_args": {"n": 16, "p": 2, "alphabet": 4}, "batch_size": 8, "val_size": 16, "test_size": 32}


@pytest.fixture
def gated_checkpoint(tmp_path):
    torch.manual_seed(0)
    dm = TaskDataModule(**{k: v for k, v in DATASET.items() if not k.startswith("_") and k != "name"})
    model = LoopedLM(LoopedLMConfig(vocab_size=dm.vocab_size, d_model=32, n_heads=2, n_layers=1, n_loops=3, exit_gate="ouro"))
    torch.nn.init.normal_(model.exit_gate.proj.weight, std=2.0)  # spread the exits over depths
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "looplab": looplab_meta(model.config, DATASET)}, path)
    return path, model, dm


def test_eval_cli_sweep(gated_checkpoint, tmp_path):
    path, model, dm = gated_checkpoint
    report = main([str(path), "--thresholds", "0", "0.5", "1.01", "--out", str(tmp_path / "eval")])
    assert (tmp_path / "eval" / "exit_curve.png").stat().st_size > 0
    on_disk = json.loads((tmp_path / "eval" / "eval.json").read_text())
    sweep = on_disk["sweep"]
    assert report["metric"] == "accuracy" and sweep["n_loops"] == 3
    for row in sweep["fixed"] + sweep["thresholds"] + [sweep["expected"]]:
        assert sum(row["exit_histogram"]) == pytest.approx(1.0)
        assert 1.0 <= row["mean_exit_step"] <= 3.0 and 0 <= row["accuracy"] <= 1
        assert row["scored"] == 32  # one answer per test example
    assert [r["mean_exit_step"] for r in sweep["fixed"]] == pytest.approx([1.0, 2.0, 3.0])
    q0, q_half, q_all = sweep["thresholds"]
    assert q0["mean_exit_step"] == pytest.approx(1.0) and q0["accuracy"] == pytest.approx(sweep["fixed"][0]["accuracy"])
    assert q_all["mean_exit_step"] == pytest.approx(3.0) and q_all["accuracy"] == pytest.approx(sweep["fixed"][2]["accuracy"])

    # independent recomputation of the q=0.5 row straight from the model
    dm.setup("test")
    correct, steps_sum, n = 0, 0, 0
    with torch.no_grad():
        for batch in dm.test_dataloader():
            out = model(batch["input_ids"], return_all_loops=True)
            steps = threshold_exit_steps(out.exit_probs, 0.5)
            logits = model(batch["input_ids"], exit_threshold=0.5).logits
            m = batch["answer_mask"]
            correct += int((logits.argmax(-1) == batch["targets"])[m].sum())
            steps_sum += int(steps[m].sum())
            n += int(m.sum())
    assert q_half["accuracy"] == pytest.approx(correct / n)
    assert q_half["mean_exit_step"] == pytest.approx(steps_sum / n)


def test_sweep_without_gate_reports_fixed_depths_only():
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1, n_loops=2))
    batch = {"input_ids": torch.randint(0, 11, (2, 5)), "targets": torch.randint(0, 11, (2, 5))}
    res = exit_sweep(model, [batch])
    assert len(res["fixed"]) == 2 and res["thresholds"] == [] and res["expected"] is None
    nll = torch.nn.functional.cross_entropy(model(batch["input_ids"]).logits.reshape(-1, 11), batch["targets"].reshape(-1))
    assert res["fixed"][-1]["nll"] == pytest.approx(nll.item(), rel=1e-5)
