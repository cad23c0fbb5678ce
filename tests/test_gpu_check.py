"""`make gpu-check` (looplab.gpu_check): its refusal on this CPU machine, the checks and commands it
builds, how it reads a run's output, and its report; the GPU work itself runs only with CUDA."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import ROOT, compose
from looplab import gpu_check
from looplab.gpu_check import Check, build_checks, count_log_events, make_report, run_check, summary_table

HAS_GPU_STACK = torch.cuda.is_available() and importlib.util.find_spec("mamba_ssm") is not None


def test_refuses_without_cuda_and_writes_nothing(tmp_path):
    if HAS_GPU_STACK:
        pytest.skip("this machine can run the GPU checks")
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run([sys.executable, "-m", "looplab.gpu_check", "--out", str(out), "--workdir", str(tmp_path / "w")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "gpu-check refused" in proc.stderr
    if torch.version.cuda is None:
        assert "built without CUDA" in proc.stderr
    elif not torch.cuda.is_available():
        assert "no CUDA device" in proc.stderr
    if importlib.util.find_spec("mamba_ssm") is None:
        assert "mamba_ssm is not installed" in proc.stderr
    assert not out.exists() and not (tmp_path / "w").exists()


def test_checks_cover_parity_training_fsdp_and_bench(tmp_path):
    checks = build_checks(tmp_path, python="python")
    names = [c.name for c in checks]
    assert sorted(names) == sorted(
        ["parity", "bench", "fsdp-hybrid"] + [f"train-{b}-{m}" for b in ("llama", "mamba2", "hybrid") for m in ("eager", "compile")]
    )
    assert names.index("train-llama-compile") < names.index("train-llama-eager")  # the longest start first
    for c in checks:
        assert c.output.is_relative_to(tmp_path) and c.timeout_s <= gpu_check.DEFAULT_BUDGET_S
    compiled = [c for c in checks if c.info.get("compile")]
    assert len(compiled) == 3 and all("graph_breaks" in c.env["TORCH_LOGS"] for c in compiled)


@pytest.mark.parametrize("name", ["train-hybrid-compile", "train-llama-eager", "fsdp-hybrid"])
def test_training_commands_compose_with_the_real_configs(tmp_path, name):
    """The overrides are the ones `python -m looplab.train` accepts: compose them as it would."""
    from looplab.training.compose import model_config_from_cfg

    check = next(c for c in build_checks(tmp_path, python="python") if c.name == name)
    assert check.cmd[1:3] == ["-m", "looplab.train"]
    cfg = compose(check.cmd[3:])
    assert cfg.trainer.max_steps == gpu_check.STEPS and cfg.logger.name == "none" and cfg.resume is None
    assert cfg.hardware.name == ("fsdp" if name.startswith("fsdp") else "gpu")
    assert cfg.compile is check.info["compile"]
    assert cfg.hydra.run.dir == str(Path(check.info["run_dir"]))
    assert cfg.callbacks.gpu_check._target_ == "looplab.gpu_check.dynamo_counters_callback"
    if name.startswith("fsdp"):
        assert cfg.trainer.devices == 1
    mc = model_config_from_cfg(cfg, vocab_size=16)
    assert mc.layer_types == {"llama": "AA", "mamba2": "MM", "hybrid": "MA"}[check.info["backbone"]]


def test_bench_command_uses_flags_bench_has():
    check = next(c for c in build_checks(Path("/tmp/x"), python="python") if c.name == "bench")
    helptext = subprocess.run([sys.executable, "-m", "looplab.bench", "--help"], capture_output=True, text=True,
                              cwd=ROOT, timeout=300).stdout
    for flag in (a for a in check.cmd if a.startswith("--")):
        assert flag in helptext, flag
    assert check.cmd[check.cmd.index("--device") + 1] == "cuda"


def test_parity_shapes_exercise_each_conv_layout():
    """One shape takes causal-conv1d's channel-last view, one needs the copy, one a width it lacks."""
    from looplab.models.mamba2 import Mamba2Mixer

    layouts = {}
    for name, kw, kernel in gpu_check.PARITY_SHAPES:
        m = Mamba2Mixer(kernel="torch", **kw)
        layouts[name] = gpu_check._conv_layout(m, torch.randn(1, 8, kw["d_model"]))
    assert layouts == {"d256": "channel-last view (no copy)", "d96-g2": "channel-last copy",
                       "d256-conv5": "torch conv (d_conv=5)"}


def test_count_log_events_reads_torch_logs_records():
    prefix = "V1130 15:40:01.123000 4242 torch/_dynamo/symbolic_convert.py:5124] [0/0]"
    log = textwrap.dedent(f"""\
        {prefix} [__graph_breaks] Graph break in user code at /x/mamba2.py:310
        {prefix} [__graph_breaks] Graph Break Reason: torch.compiler.disable
        {prefix} [__graph_breaks] Graph break (user stack suppressed due to duplicate graph break) in user code at /x:1
        {prefix} [__recompiles] Recompiling function forward in /x/mamba2.py:270
        {prefix} [__recompiles]     triggered by the following guard failure(s):
        an ordinary line mentioning Graph break
        """)
    assert count_log_events(log) == {"graph_breaks_logged": 2, "recompiles_logged": 1}


def _train_check(tmp_path, steps=20, compile=False) -> Check:
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    return Check("train-x", "train", ["true"], 10, run_dir / "results.json",
                 info={"backbone": "mamba2", "compile": compile, "steps": steps, "run_dir": str(run_dir)})


def _results(**kw):
    res = {"status": "ok", "global_step": 20, "loss": 1.25, "accuracy": 0.5,
           "throughput": {"tokens_per_s": 1234.0, "compiled": False}, "wall_time_s": 9.0}
    res.update(kw)
    return res


def test_parse_train_pass_fail_error(tmp_path):
    check = _train_check(tmp_path)
    check.output.write_text(json.dumps(_results()))
    (check.output.parent / "dynamo_counters.json").write_text(json.dumps(
        {"graph_breaks": 3, "graph_break_reasons": {"disable": 3}, "unique_graphs": 4, "mamba2_kernels": "mamba_ssm scan"}))
    r = gpu_check.parse_train(check, 0, "")
    assert r["status"] == "pass" and r["graph_breaks"] == 3 and r["mamba2_kernels"] == "mamba_ssm scan"
    assert r["tokens_per_s"] == 1234.0

    check.output.write_text(json.dumps(_results(global_step=7, loss=float("nan"))))
    r = gpu_check.parse_train(check, 0, "")
    assert r["status"] == "fail" and "global_step 7 != 20" in r["why"] and "not finite" in r["why"]

    compiled = _train_check(tmp_path, compile=True)
    compiled.output.write_text(json.dumps(_results()))
    assert "compile=True was asked" in gpu_check.parse_train(compiled, 0, "")["why"]

    check.output.write_text(json.dumps({"status": "failed", "error": "RuntimeError: CUDA out of memory", "traceback": "tb"}))
    r = gpu_check.parse_train(check, 1, "")
    assert r["status"] == "error" and "out of memory" in r["error"]

    check.output.unlink()
    r = gpu_check.parse_train(check, 1, "line\nTraceback: boom")
    assert r["status"] == "error" and "no results.json" in r["error"] and "boom" in r["log_tail"]


def test_parse_bench_and_parity(tmp_path):
    bench = Check("bench", "bench", ["true"], 10, tmp_path / "bench.json")
    bench.output.write_text(json.dumps({"train": {"status": "ok", "tokens_per_s": 5e5, "mfu": 0.1, "device": "H200"}}))
    assert gpu_check.parse_bench(bench, 0, "") == {"status": "pass", "device": "H200", "tokens_per_s": 5e5, "mfu": 0.1}
    bench.output.write_text(json.dumps({"train": {"status": "error", "error": "ValueError: x"}}))
    assert gpu_check.parse_bench(bench, 0, "")["error"] == "ValueError: x"

    parity = Check("parity", "parity", ["true"], 10, tmp_path / "parity.json")
    assert gpu_check.parse_parity(parity, -11, "Segmentation fault")["status"] == "error"
    parity.output.write_text(json.dumps({"status": "pass", "cases": {}, "worst": {}}))
    assert gpu_check.parse_parity(parity, 0, "")["status"] == "pass"


def test_run_check_runs_reads_times_out_and_skips(tmp_path):
    check = _train_check(tmp_path)
    script = f"import json; open({str(check.output)!r}, 'w').write(json.dumps({_results()!r})); print('trained')"
    check.cmd = [sys.executable, "-c", script]
    far = gpu_check.time.monotonic() + 600
    r = run_check(check, tmp_path, far)
    assert r["status"] == "pass" and r["returncode"] == 0 and "trained" in Path(r["log"]).read_text()

    check.cmd = [sys.executable, "-c", "import time; time.sleep(120)"]  # and the old results.json is not read
    check.timeout_s = 1
    r = run_check(check, tmp_path, far)
    assert r["status"] == "error" and r["error"].startswith("timed out") and r["returncode"] is None

    r = run_check(check, tmp_path, gpu_check.time.monotonic() + 1)  # the budget is spent
    assert r["status"] == "skipped" and "budget" in r["error"]

    check.kind = "nonsense"  # a broken parser is an error of that check, not of the run
    check.cmd = ["true"]
    r = run_check(check, tmp_path, far)
    assert r["status"] == "error" and "KeyError" in r["error"]


def fake_results():
    return {
        "parity": {"status": "fail", "why": "d96-g2-bf16: grad 0.09 > 0.05",
                   "worst": {"grad": {"value": 0.09, "tol": 0.05, "ratio": 1.8, "case": "d96-g2-bf16"}},
                   "cases": {"d96-g2-bf16": {"status": "fail"}}, "wall_s": 40.0},
        "train-llama-compile": {"status": "pass", "loss": 1.1, "tokens_per_s": 2e5, "graph_breaks": 0, "wall_s": 50.0},
        "fsdp-hybrid": {"status": "error", "error": "RuntimeError: NCCL error\nmore lines", "wall_s": 12.0},
        "bench": {"status": "skipped", "error": "time budget spent (3 s left)"},
    }


def test_report_json_and_summary_table(tmp_path):
    report = make_report(fake_results(), {"gpu": "NVIDIA H200", "torch": "2.13.0", "cuda": "12.8"}, tmp_path, "now", 123.4)
    assert report["status"] == "fail" and report["counts"] == {"fail": 1, "pass": 1, "error": 1, "skipped": 1}
    gpu_check.write_report(tmp_path / "gpu-check.json", report)
    back = json.loads((tmp_path / "gpu-check.json").read_text())
    assert back["checks"]["fsdp-hybrid"]["error"].startswith("RuntimeError: NCCL error")
    assert back["tolerances"]["bf16"]["grad"] == gpu_check.TOLERANCES["bf16"]["grad"]
    table = summary_table(report)
    assert "NVIDIA H200" in table
    for name, status in [("parity", "fail"), ("train-llama-compile", "pass"), ("fsdp-hybrid", "error"), ("bench", "skipped")]:
        assert any(line.startswith(name) and status in line for line in table.splitlines()), name
    assert "RuntimeError: NCCL error" in table and "more lines" not in table  # the first line of an error
    assert "worst grad 0.09 (tol 0.05, d96-g2-bf16)" in table
    assert make_report({"a": {"status": "pass"}}, {}, tmp_path, "now", 1)["status"] == "pass"


def test_main_runs_every_check_even_when_one_fails(tmp_path, monkeypatch, capsys):
    """The orchestration end to end with stand-in commands: one check crashes, the others still run."""
    def fake_checks(workdir, python=sys.executable, steps=20):
        ok, bad = _train_check(workdir), Check("bench", "bench", [python, "-c", "raise SystemExit('bench broke')"], 30,
                                               Path(workdir) / "bench.json")
        ok.cmd = [python, "-c", f"open({str(ok.output)!r}, 'w').write({json.dumps(_results())!r})"]
        return [bad, ok]

    monkeypatch.setattr(gpu_check, "preflight", lambda: [])
    monkeypatch.setattr(gpu_check, "build_checks", fake_checks)
    monkeypatch.setattr(gpu_check, "machine_info", lambda: {"gpu": "fake"})
    out = tmp_path / "report.json"
    rc = gpu_check.main(["--out", str(out), "--workdir", str(tmp_path / "w"), "--jobs", "2"])
    assert rc == 1
    report = json.loads(out.read_text())
    assert report["checks"]["train-x"]["status"] == "pass"
    assert report["checks"]["bench"]["status"] == "error" and "bench broke" in report["checks"]["bench"]["log_tail"]
    printed = capsys.readouterr().out
    assert "overall: fail" in printed and f"wrote {out}" in printed


def test_dynamo_counters_callback_writes_counters(tmp_path):
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import Callback

    cb = gpu_check.dynamo_counters_callback()
    assert isinstance(cb, Callback)
    cb.on_train_end(SimpleNamespace(is_global_zero=True, default_root_dir=str(tmp_path)), None)
    data = json.loads((tmp_path / "dynamo_counters.json").read_text())
    assert set(data) == {"graph_breaks", "graph_break_reasons", "unique_graphs", "mamba2_kernels"}
    assert isinstance(data["graph_breaks"], int)


@pytest.mark.slow
def test_a_real_training_check_on_the_cpu(tmp_path):
    """One training check as built, on the CPU instead of the GPU (hardware=cpu, 3 steps): the command
    runs, the callback writes its counters, and parse_train reads the real results.json."""
    check = next(c for c in build_checks(tmp_path) if c.name == "train-hybrid-eager")
    swap = {"hardware=gpu": "hardware=cpu", "trainer.max_steps=20": "trainer.max_steps=3",
            "trainer.val_check_interval=10": "trainer.val_check_interval=3", "checkpoint_every_n_steps=20": "checkpoint_every_n_steps=3",
            "dataset.batch_size=32": "dataset.batch_size=8", "dataset.val_size=64": "dataset.val_size=16",
            "dataset.test_size=64": "dataset.test_size=16"}
    check.cmd = [swap.get(a, a) for a in check.cmd]
    check.info["steps"] = 3
    check.timeout_s = 280
    check.env["OMP_NUM_THREADS"] = "1"
    r = run_check(check, tmp_path, gpu_check.time.monotonic() + 300)
    assert r["status"] == "pass", r
    assert r["global_step"] == 3 and r["graph_breaks"] == 0 and r["mamba2_kernels"].startswith("torch")


def test_parity_worker_plumbing_on_the_cpu(tmp_path):
    """The parity code on the CPU, torch path against itself (so every difference is 0): forward,
    gradients, prefill + step decoding, the compiled case (Dynamo with the eager backend), one case
    that raises, and the aggregation into worst figures. The kernels themselves need the GPU."""
    kw = dict(d_model=32, d_state=16, headdim=8, ngroups=2, d_conv=4, chunk_size=8)

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access")

    jobs = [("small-fp32", lambda: gpu_check.parity_case(kw, "torch", "fp32", device="cpu", length=20, prefill=12)),
            ("small-bf16", lambda: gpu_check.parity_case(kw, "torch", "bf16", device="cpu", length=20, prefill=12)),
            ("small-compiled", lambda: gpu_check.compile_case(kw, "torch", device="cpu", length=20, backend="eager")),
            ("broken", broken)]
    out = tmp_path / "parity.json"
    assert gpu_check.parity_worker(out, jobs) == 0
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert cases["small-fp32"]["status"] == "pass" and cases["small-fp32"]["forward"]["max_abs"] == 0
    assert set(cases["small-fp32"]["grad"]) >= {"x", "A_log", "dt_bias", "D", "conv1d.weight"}
    assert cases["small-fp32"]["decode"]["vs_own_forward"]["max_rel"] <= 1e-4
    assert cases["small-bf16"]["status"] == "pass" and "bf16_noise_floor" in cases["small-bf16"]
    assert cases["small-compiled"]["status"] == "pass" and cases["small-compiled"]["graph_breaks"] == 0
    assert cases["broken"]["status"] == "error" and "illegal memory access" in cases["broken"]["error"]
    assert report["status"] == "error" and "broken" in report["error"]
    assert set(report["worst"]) == {"forward", "grad", "decode"}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU_STACK, reason="needs CUDA and mamba_ssm")
def test_parity_worker_on_the_gpu(tmp_path):
    out = tmp_path / "parity.json"
    assert gpu_check.parity_worker(out) == 0
    report = json.loads(out.read_text())
    assert report["status"] == "pass", report.get("why") or report.get("error")
