"""End-to-end training: fast_dev_run per dataset, results.json, resume equivalence, multirun, failures, DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from conftest import ROOT, compose
from looplab.checkpoint import load_model, model_state_dict, read_checkpoint
from looplab.models import ConfigError


def run_train(overrides: list[str], run_dir: Path):
    """Run looplab.train.train in-process on a composed config, as @hydra.main would."""
    from looplab.train import train

    cfg = compose(overrides + [f"hydra.run.dir={run_dir}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    return train(cfg)


def cli(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "looplab.train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


class CrashAtStep(L.Callback):
    """Simulates a killed job: raises once training reaches `step` (after the checkpoint of step-1 was written)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


@pytest.mark.parametrize(
    "dataset, backbone, depth",
    [("phop", "llama_tiny", "1x2"), ("mano", "llama_tiny", "1x2"), ("phop", "mamba2_tiny", "1x2"), ("mano", "hybrid_tiny", "2x2")],
)
def test_fast_dev_run(dataset, backbone, depth, tiny_overrides, tmp_path):
    res = run_train(tiny_overrides + [f"dataset={dataset}", f"backbone={backbone}", f"loop_depth={depth}",
                                      "++backbone.headdim=16", "trainer.fast_dev_run=true"], tmp_path / dataset)
    assert res["status"] == "ok" and res["model"]["backbone"] == backbone.split("_")[0]
    assert (tmp_path / dataset / "results.json").exists()


def test_results_json_contents(tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    res = run_train(tiny_overrides + ["loop_depth=1x3", "state_mode=stateloop", "logger=csv"], run_dir)
    on_disk = json.loads((run_dir / "results.json").read_text())
    assert on_disk["status"] == "ok" and on_disk["global_step"] == 6
    assert len(on_disk["per_depth"]["acc"]) == 3 and all(0 <= a <= 1 for a in on_disk["per_depth"]["acc"])
    assert on_disk["accuracy"] == on_disk["per_depth"]["acc"][-1]
    assert on_disk["params"]["state_branch"] > 0 and 0 < on_disk["state_branch_overhead"] < 1
    assert on_disk["flops_per_token"]["training"] == 3 * on_disk["flops_per_token"]["forward"]
    assert on_disk["throughput"]["tokens_per_s"] > 0
    assert set(on_disk["state_diagnostics"]) == {"retention", "state_norm", "state_to_stream"}
    assert len(on_disk["state_diagnostics"]["retention"]) == 3
    assert on_disk["git_commit"] and on_disk["config"]["loop_depth"]["loops"] == 3
    assert (run_dir / "csv" / "metrics.csv").exists()
    model, meta = load_model(run_dir / "checkpoints" / "last.ckpt")
    assert model.config.n_loops == 3 and model.config.state_mode == "stateloop"
    assert res["model"]["loops"] == 3


def test_last_checkpoint_is_the_final_model_when_max_steps_is_off_the_interval(tiny_overrides, tmp_path):
    """max_steps 5 with a checkpoint every 3 steps: last.ckpt must hold step 5, the model results.json
    describes (it held step 3, so eval and zero-shot scored an older model)."""
    run_dir = tmp_path / "run"
    res = run_train(tiny_overrides + ["trainer.max_steps=5", "checkpoint_every_n_steps=3"], run_dir)
    assert res["global_step"] == 5
    assert read_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 5


def test_resume_after_crash_equals_uninterrupted(tiny_overrides, tmp_path):
    common = tiny_overrides + ["test_after_fit=false", "trainer.val_check_interval=100", "checkpoint_every_n_steps=3"]
    run_train(common, tmp_path / "straight")
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_train(common + ["+callbacks.crash={_target_: test_train.CrashAtStep, step: 4}"], crashed)
    assert read_checkpoint(crashed / "checkpoints" / "last.ckpt")["global_step"] == 3
    res = run_train(common, crashed)  # resume=auto picks up last.ckpt
    assert res["global_step"] == 6
    a = model_state_dict(read_checkpoint(tmp_path / "straight" / "checkpoints" / "last.ckpt"))
    b = model_state_dict(read_checkpoint(crashed / "checkpoints" / "last.ckpt"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_checkpoint_from_another_config_is_refused(tiny_overrides, tmp_path):
    run_train(tiny_overrides + ["test_after_fit=false"], tmp_path / "a")
    with pytest.raises(ConfigError, match="d_model"):
        run_train(tiny_overrides + ["backbone.d_model=48", f"resume={tmp_path}/a/checkpoints/last.ckpt"], tmp_path / "b")


def test_stage2_trains_only_the_gate(tiny_overrides, tmp_path):
    run_train(tiny_overrides + ["test_after_fit=false", "loop_depth=1x3"], tmp_path / "plain")
    ckpt = tmp_path / "plain" / "checkpoints" / "last.ckpt"
    res = run_train(tiny_overrides + ["loop_depth=1x3", "exit_gate=ouro", "exit_gate.stage=stage2",
                                      f"exit_gate.init_from={ckpt}"], tmp_path / "stage2")
    before = model_state_dict(read_checkpoint(ckpt))
    after = model_state_dict(read_checkpoint(tmp_path / "stage2" / "checkpoints" / "last.ckpt"))
    for k, v in before.items():
        assert torch.equal(v, after[k]), f"{k} changed in stage 2"
    assert any(k.startswith("exit_gate.") for k in after)
    assert res["exit"] and all(0 <= v["acc"] <= 1 for v in res["exit"].values())


@pytest.mark.slow
@pytest.mark.parametrize("state_mode", ["vanilla", "stateloop"])
def test_vanilla_and_stateloop_both_learn(state_mode, tiny_overrides, tmp_path):
    """p-hop, 60 steps: the held-out loss falls well below chance for both modes (docs/formulations.md#tasks, the tiny setting)."""
    import math

    res = run_train(tiny_overrides + [f"state_mode={state_mode}", "loop_depth=1x3", "trainer.max_steps=60",
                                      "trainer.val_check_interval=60", "dataset.batch_size=32", "optim.lr=3e-3",
                                      "test_after_fit=false"], tmp_path / state_mode)
    chance = math.log(4)  # uniform over the alphabet
    assert res["loss"] < 0.9 * chance, res["per_depth"]
    if state_mode == "stateloop":
        assert res["state_diagnostics"]["state_to_stream"][-1] > 0  # W_o left zero: the state is being used


@pytest.mark.slow
def test_cli_multirun_with_a_failing_job(tmp_path):
    """-m writes one results.json per job; an impossible job is recorded as failed and the sweep goes on."""
    proc = cli(["-m", "logger=none", "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                "trainer.limit_test_batches=1", "trainer.enable_progress_bar=false", "dataset.batch_size=8",
                "dataset.val_size=8", "dataset.test_size=8", "backbone.d_model=32", "backbone.ffn_hidden=64",
                "loop_depth=1x1,1x2", "backbone.n_heads=2,3", f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "sweep").glob("*/results.json"))]
    assert len(results) == 4
    ok = [r for r in results if r["status"] == "ok"]
    failed = [r for r in results if r["status"] == "failed"]
    assert len(ok) == 2 and len(failed) == 2
    assert all("n_heads=3" in r["error"] or "n_heads" in r["error"] for r in failed)
    assert sorted(r["model"]["loops"] for r in ok) == [1, 2]


@pytest.mark.slow
def test_cli_bad_config_fails_before_training(tmp_path):
    proc = cli(["logger=none", "loop_depth.loops=0", f"hydra.run.dir={tmp_path}/bad"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "loop_depth.loops=0" in proc.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()
    assert json.loads((tmp_path / "bad" / "results.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_cli_ddp_two_cpu_processes(tmp_path):
    proc = cli(["hardware=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true", "logger=none",
                "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
                "trainer.enable_progress_bar=false", "dataset.batch_size=8", "dataset.val_size=8", "dataset.test_size=8",
                "backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64", f"hydra.run.dir={tmp_path}/ddp"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "ddp" / "results.json").read_text())
    assert res["status"] == "ok" and res["global_step"] == 4
    assert res["throughput"]["tokens"] == 4 * 8 * 33  # each rank saw its half of every global batch


def test_plain_progress_lines_when_stdout_is_not_a_terminal(tmp_path):
    """Under SLURM, CI or `> file` a live bar prints nothing for minutes: training logs a plain line
    every log_every_n_steps instead (also into the run's train.log), and the model summary once."""
    args = ["logger=none", f"hydra.run.dir={tmp_path}/run", "trainer.max_steps=6", "trainer.log_every_n_steps=2",
            "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
            "dataset.batch_size=8", "dataset.val_size=8", "dataset.test_size=8", "backbone.d_model=32",
            "backbone.n_heads=2", "backbone.ffn_hidden=64", "loop_depth=1x2"]
    proc = cli(args, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    import re

    lines = re.findall(r"step (\d+)/6 · loss (\d+\.\d+) · ([\d,]+) tokens/s · elapsed \d+:\d\d:\d\d · eta \d+:\d\d:\d\d", out)
    assert [int(s) for s, _, _ in lines] == [2, 4, 6], out[-3000:]
    assert all(0 < float(loss) < 10 and int(tps.replace(",", "")) > 0 for _, loss, tps in lines)
    assert re.search(r"validation at step 3: acc [\d.]+ · loss [\d.]+ · ppl [\d.]+", out)
    assert out.count("Trainable params") == 1  # the model summary, once
    assert "\x1b[" not in proc.stdout  # no terminal control sequences in a log file
    assert len(re.findall(r"step \d+/6 · loss", (tmp_path / "run" / "train.log").read_text())) == 3


def test_rerun_of_a_finished_run_keeps_its_training_record(tiny_overrides, tmp_path):
    """Re-running a finished job (a table run again) re-tests its checkpoint: results.json keeps the throughput of the
    invocation that trained it and adds up the wall time of both, instead of reporting the re-test as the run."""
    first = run_train(tiny_overrides, tmp_path / "r")
    again = run_train(tiny_overrides, tmp_path / "r")
    assert again["global_step"] == first["global_step"] == 6
    assert first["throughput"]["tokens"] > 0 and again["throughput"] == first["throughput"]
    assert first["wall_time_total_s"] == first["wall_time_s"]
    assert again["wall_time_total_s"] == pytest.approx(first["wall_time_s"] + again["wall_time_s"])
