"""python -m looplab.eval: the accuracy–exit-depth sweep of a gated checkpoint, checked against the model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from looplab.checkpoint import looplab_meta
from looplab.data.tasks import TaskDataModule
from looplab.eval.__main__ import main
from looplab.eval.exit_sweep import exit_sweep
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exits import ExitPolicy
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
            logits = model(batch["input_ids"], exits=ExitPolicy(threshold=0.5)).logits
            m = batch["answer_mask"]
            correct += int((logits.argmax(-1) == batch["targets"])[m].sum())
            steps_sum += int(steps[m].sum())
            n += int(m.sum())
    assert q_half["accuracy"] == pytest.approx(correct / n)
    assert q_half["mean_exit_step"] == pytest.approx(steps_sum / n)


def test_eval_cli_at_a_test_time_depth(gated_checkpoint, tmp_path):
    """--loops R′ (test-time depth): the per-loop rows run over 1..R′ with the same weights, and loop R′'s accuracy is that of
    model(ids, n_loops=R′), recomputed here; R′ < 1 is refused."""
    path, model, dm = gated_checkpoint
    report = main([str(path), "--loops", "5", "--thresholds", "0.5", "--out", str(tmp_path / "eval5")])
    sweep = report["sweep"]
    assert report["n_loops"] == sweep["n_loops"] == 5 and report["trained_n_loops"] == 3 and "agreement" not in report
    assert [r["mean_exit_step"] for r in sweep["fixed"]] == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])
    dm.setup("test")
    correct = n = 0
    with torch.no_grad():
        for batch in dm.test_dataloader():
            logits, m = model(batch["input_ids"], n_loops=5).logits, batch["answer_mask"]
            correct += int((logits.argmax(-1) == batch["targets"])[m].sum())
            n += int(m.sum())
    assert sweep["fixed"][4]["accuracy"] == pytest.approx(correct / n)
    with pytest.raises(SystemExit):
        main([str(path), "--loops", "0", "--out", str(tmp_path / "eval0")])


def test_sweep_without_gate_reports_fixed_depths_only():
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1, n_loops=2))
    batch = {"input_ids": torch.randint(0, 11, (2, 5)), "targets": torch.randint(0, 11, (2, 5))}
    res = exit_sweep(model, [batch])
    assert len(res["fixed"]) == 2 and res["thresholds"] == [] and res["expected"] is None
    nll = torch.nn.functional.cross_entropy(model(batch["input_ids"]).logits.reshape(-1, 11), batch["targets"].reshape(-1))
    assert res["fixed"][-1]["nll"] == pytest.approx(nll.item(), rel=1e-5)


# ----------------------------------------------------------------- eval reproduces a run's results.json
def _train(overrides: list[str], run_dir):
    """looplab.train.train on a composed config, in-process, as @hydra.main would run it."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from conftest import compose
    from looplab.train import train

    cfg = compose(overrides + [f"hydra.run.dir={run_dir}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    return train(cfg)


COMMON = ["logger=none", "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
          "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "checkpoint_every_n_steps=2",
          "backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64"]


def _lm_files(tmp_path):
    import random

    rng = random.Random(0)
    words = "the king and queen of a fair land shall speak to thee my lord good night sweet prince what is honour".split()

    def write(name, n_docs):
        path = tmp_path / f"{name}.jsonl"
        with path.open("w") as f:
            for _ in range(n_docs):
                lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(40)]
                f.write(json.dumps({"text": "\n".join(lines)}) + "\n")
        return path

    return write("train", 20), write("validation", 8)


@pytest.mark.parametrize("case", ["phop_gated", "phop_stateloop_limited", "lm_limited"])
def test_eval_reproduces_results_json(case, tmp_path):
    """`python -m looplab.eval` on a run's checkpoint recomputes every test/ metric of its results.json."""
    if case.startswith("phop"):
        over = COMMON + ["dataset=phop", "dataset.task_args.n=16", "dataset.task_args.p=2", "dataset.batch_size=16",
                         "dataset.val_size=16", "dataset.test_size=88", "loop_depth=1x3"]
        if case == "phop_gated":  # a gate: exit statistics at every threshold; the whole test split (6 batches, last short)
            over += ["exit_gate=ouro", "exit_gate.eval_thresholds=[0.3,0.5,0.9,1.01]"]
        else:  # StateLoop diagnostics; only the first 4 test batches, as the run's limit_test_batches says
            over += ["state_mode=stateloop", "trainer.limit_test_batches=4"]
    else:
        train_file, val_file = _lm_files(tmp_path)
        over = COMMON + ["dataset=hf", "dataset.source=json", f"dataset.data_files={{train:'{train_file}',validation:'{val_file}'}}",
                         "dataset.val_split=validation", "dataset.seq_len=32", "dataset.batch_size=8", "dataset.val_tokens=1024",
                         f"dataset.cache_dir={tmp_path / 'cache'}", "dataset.num_proc=1", "loop_depth=2x2",
                         "trainer.limit_test_batches=3", "backbone.max_seq_len=64"]
    run_dir = tmp_path / "run"
    res = _train(over, run_dir)
    assert res["status"] == "ok" and res["final_split"] == "test"
    logged = {k: v for k, v in res["metrics"].items() if k.startswith("test/")}
    assert len(logged) >= (4 if case == "lm_limited" else 7)

    report = main([str(run_dir / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "eval")])
    agree = report["agreement"]
    assert agree["missing"] == [] and agree["compared"] == len(logged)
    # a perplexity is exp(mean loss): a relative error ε of the loss (float32 sums in another order) becomes
    # ε·loss of the perplexity (measured: 1.07e-6 at ppl 2,528, loss 7.8), so it is compared through its log
    def off(k, v):
        a, b = (math.log(v["eval"]), math.log(v["results_json"])) if "ppl" in k else (v["eval"], v["results_json"])
        return abs(a - b) > 1e-6 * max(abs(b), 1e-6)

    assert agree["max_rel_diff"] < 1e-5 and not [k for k, v in agree["values"].items() if off(k, v)], agree["values"]
    mine = report["metrics"]
    R = res["model"]["loops"]
    assert [mine[f"test/loss_loop{d}"] for d in range(1, R + 1)] == pytest.approx(res["per_depth"]["loss"], rel=1e-6)
    assert mine["test/loss"] == pytest.approx(res["loss"], rel=1e-6)
    on_disk = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert on_disk["agreement"]["compared"] == agree["compared"]
    if case == "phop_gated":
        assert report["max_batches"] is None and report["scored_answers"] == 88
        assert [mine[f"test/acc_loop{d}"] for d in range(1, R + 1)] == pytest.approx(res["per_depth"]["acc"], rel=1e-6)
        for q, e in res["exit"].items():
            assert mine[f"test/exit_q{float(q)}_acc"] == pytest.approx(e["acc"], rel=1e-6)
            assert mine[f"test/exit_q{float(q)}_mean_step"] == pytest.approx(e["mean_step"], rel=1e-6)
        assert mine["test/exit_expected_step"] == pytest.approx(res["exit_expected_step"], rel=1e-6)
    elif case == "phop_stateloop_limited":
        assert report["max_batches"] == 4 and report["scored_answers"] == 64
        assert any(k.startswith("test/state_retention_loop") for k in logged)
    else:
        assert report["max_batches"] == 3 and report["scored_tokens"] == 3 * 8 * 32
        assert mine["test/ppl"] == pytest.approx(res["perplexity"], rel=1e-5)


def test_eval_cli_zero_shot_exit_rule_rows(gated_checkpoint, tmp_path):
    """`python -m looplab.eval CKPT --exit-rule kl --rule-thresholds ...`: one row per threshold, each the
    accuracy of reading every answer at the depth the rule picks, recomputed here from the model."""
    path, model, dm = gated_checkpoint
    report = main([str(path), "--exit-rule", "kl", "--rule-thresholds", "0", "0.01", "1e9", "--out", str(tmp_path / "e")])
    never, mid, always = report["sweep"]["rule"]
    assert [r["mode"] for r in (never, mid, always)] == ["kl<0.0", "kl<0.01", "kl<1000000000.0"]
    fixed = report["sweep"]["fixed"]
    assert never["mean_exit_step"] == pytest.approx(3.0) and never["accuracy"] == pytest.approx(fixed[2]["accuracy"])
    assert always["mean_exit_step"] == pytest.approx(2.0)  # KL needs a previous loop: the earliest stop is loop 2
    dm.setup("test")
    correct = n = 0
    with torch.no_grad():
        for batch in dm.test_dataloader():
            logits = model(batch["input_ids"], exits=ExitPolicy(threshold=0.01, rule="kl")).logits
            m = batch["answer_mask"]
            correct += int((logits.argmax(-1) == batch["targets"])[m].sum())
            n += int(m.sum())
    assert mid["accuracy"] == pytest.approx(correct / n)
    with pytest.raises(SystemExit):  # a rule without thresholds is refused before anything loads
        main([str(path), "--exit-rule", "entropy"])
