"""`make gpu-check` (looplab.gpu_check): its refusal on this CPU machine, the checks and commands it builds,
how it reads a run's output (pytest's outcomes among them), its time budget and its report. The GPU work
itself runs only with CUDA: here the real GPU tests are collected and skipped, and where a subprocess would
need a GPU it is a stand-in or a real run on the CPU; no stand-in makes a GPU check pass in a report."""

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

HANG_GUARD_S = 3000  # subprocess limits of these tests: against a hang, never a bound on how long honest work may take
from looplab import gpu_check
from looplab.gpu_check import Check, build_checks, count_log_events, make_report, run_check, summary_table

HAS_GPU_STACK = torch.cuda.is_available() and importlib.util.find_spec("mamba_ssm") is not None


def test_refuses_without_cuda_and_writes_nothing(tmp_path):
    if HAS_GPU_STACK:
        pytest.skip("this machine can run the GPU checks")
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run([sys.executable, "-m", "looplab.gpu_check", "--out", str(out), "--workdir", str(tmp_path / "w")],
                          capture_output=True, text=True, cwd=ROOT, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr
    assert "gpu-check refused" in proc.stderr
    if torch.version.cuda is None:
        assert "built without CUDA" in proc.stderr
    elif not torch.cuda.is_available():
        assert "no CUDA device" in proc.stderr
    if importlib.util.find_spec("mamba_ssm") is None:
        assert "mamba_ssm is not installed" in proc.stderr
    assert not out.exists() and not (tmp_path / "w").exists()


def test_checks_cover_gpu_tests_training_fsdp_and_bench(tmp_path):
    checks = build_checks(tmp_path, python="python")
    names = [c.name for c in checks]
    assert sorted(names) == sorted(
        ["gpu-tests", "bench", "fsdp-hybrid"] + [f"train-{b}-{m}" for b in ("llama", "mamba2", "hybrid") for m in ("eager", "compile")]
    )
    assert names[0] == "gpu-tests"  # the longest start first
    assert names.index("train-llama-compile") < names.index("train-llama-eager")
    for c in checks:
        assert c.output.is_relative_to(tmp_path) and c.timeout_s <= gpu_check.DEFAULT_BUDGET_S
    compiled = [c for c in checks if c.info.get("compile")]
    assert len(compiled) == 3 and all("graph_breaks" in c.env["TORCH_LOGS"] for c in compiled)
    for c in checks:  # every run with Mamba-2 layers must show causal-conv1d's kernel ran
        if c.kind in ("train", "fsdp"):
            assert c.info.get("expect_conv") == (None if c.info["backbone"] == "llama" else "causal_conv1d"), c.name


def test_gpu_tests_command_is_pytest_on_the_gpu_marker(tmp_path):
    import tomllib

    check = next(c for c in build_checks(tmp_path, python="python") if c.name == "gpu-tests")
    cmd = check.cmd
    assert cmd[:3] == ["python", "-m", "pytest"] and cmd[cmd.index("-m", 2) + 1] == "gpu"
    assert "looplab.testing.pytest_report" in cmd[cmd.index("-p", 3):] and "no:cacheprovider" in cmd
    assert cmd[cmd.index("--test-report") + 1] == str(check.output) == str(tmp_path / "gpu-tests.jsonl")
    assert cmd[cmd.index("-n") + 1] == str(gpu_check.GPU_TEST_WORKERS) == "2"  # whole files per process
    assert cmd[cmd.index("--dist") + 1] == "loadfile"
    assert "-n" not in gpu_check.pytest_command(tmp_path / "r.jsonl", "py", workers=1)
    assert cmd[-1] == str(ROOT / "tests") and gpu_check.TESTS_DIR == ROOT / "tests"
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith(f"{gpu_check.GPU_MARK}:") for m in markers)
    assert gpu_check.pytest_command(tmp_path / "r.jsonl", "py", [tmp_path / "t.py"])[-1] == str(tmp_path / "t.py")


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
                              cwd=ROOT, timeout=HANG_GUARD_S).stdout
    for flag in (a for a in check.cmd if a.startswith("--")):
        assert flag in helptext, flag
    assert check.cmd[check.cmd.index("--device") + 1] == "cuda"


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


def test_parse_bench(tmp_path):
    bench = Check("bench", "bench", ["true"], 10, tmp_path / "bench.json")
    assert gpu_check.parse_bench(bench, -11, "Segmentation fault")["status"] == "error"
    bench.output.write_text(json.dumps({"train": {"status": "ok", "tokens_per_s": 5e5, "mfu": 0.1, "device": "H200"}}))
    assert gpu_check.parse_bench(bench, 0, "") == {"status": "pass", "device": "H200", "tokens_per_s": 5e5, "mfu": 0.1}
    bench.output.write_text(json.dumps({"train": {"status": "error", "error": "ValueError: x"}}))
    assert gpu_check.parse_bench(bench, 0, "")["error"] == "ValueError: x"


# ----------------------------------------------------------------------------- pytest -m gpu
STAND_IN_TESTS = '''
import pytest

pytestmark = pytest.mark.gpu

def test_records_and_passes(record_property):
    record_property("worst", {"forward": 0.001})
    record_property("tokens_per_s", 123.5)

def test_records_then_fails(record_property):
    record_property("worst", {"forward": 0.5})
    assert 0.5 <= 0.02, "forward 0.5 > 0.02"

@pytest.fixture
def broken():
    raise RuntimeError("CUDA error: an illegal memory access")

def test_setup_error(broken):
    pass

@pytest.mark.skip(reason="needs CUDA: none here")
def test_skipped():
    pass

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    pass
'''


STAND_IN_CRASH = '''
import os

import pytest

pytestmark = pytest.mark.gpu

def test_crashes_its_process():  # as a fault in a CUDA extension would
    os._exit(3)

def test_after_the_crash():
    pass
'''


def _stand_in_suite(tmp_path) -> Path:
    """A folder of CPU tests marked gpu (its own pytest.ini registers the marker), one deselected."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: stand-in\n")
    (suite / "test_stand_in.py").write_text(STAND_IN_TESTS)
    (suite / "test_stand_in_crash.py").write_text(STAND_IN_CRASH)
    (suite / "test_cpu_only.py").write_text("def test_not_marked():\n    pass\n")
    return suite


def _tests_check(tmp_path, paths) -> Check:
    report = tmp_path / "gpu-tests.jsonl"
    return Check("gpu-tests", "tests", gpu_check.pytest_command(report, sys.executable, paths), HANG_GUARD_S, report,
                 info={"tests_dir": str(paths[0])})


def test_pytest_outcomes_and_recorded_figures_reach_the_report(tmp_path):
    """The real `pytest -m gpu` command, report plugin and xdist workers, over stand-in CPU tests: every outcome
    in the order collected, with the figures each test recorded; a crashed worker's test is an error, the rest
    of its file not reached, the other file's tests all run; the run's status is the worst of them."""
    suite = _stand_in_suite(tmp_path)
    r = run_check(_tests_check(tmp_path, [suite]), tmp_path, gpu_check.time.monotonic() + HANG_GUARD_S)
    names = {n.split("::")[1]: t for n, t in r["tests"].items()}
    assert list(names) == ["test_records_and_passes", "test_records_then_fails", "test_setup_error", "test_skipped",
                           "test_expected_failure", "test_param[1]", "test_param[2]", "test_crashes_its_process",
                           "test_after_the_crash"]  # test_not_marked deselected
    passed = names["test_records_and_passes"]
    assert passed["status"] == "pass" and passed["worst"] == {"forward": 0.001} and passed["tokens_per_s"] == 123.5
    failed = names["test_records_then_fails"]
    assert failed["status"] == "fail" and failed["why"].startswith("AssertionError: forward 0.5 > 0.02")
    assert failed["worst"] == {"forward": 0.5}  # recorded before the assertion: kept
    assert names["test_setup_error"]["status"] == "error" and "illegal memory access" in names["test_setup_error"]["error"]
    assert names["test_skipped"]["status"] == "skipped" and names["test_skipped"]["reason"] == "needs CUDA: none here"
    assert names["test_expected_failure"] == {"status": "skipped", "wall_s": names["test_expected_failure"]["wall_s"],
                                              "reason": "expected to fail: known"}  # it confirms nothing
    crashed = names["test_crashes_its_process"]
    assert crashed["status"] == "error" and "crashed while running" in crashed["error"]
    assert names["test_after_the_crash"] == {"status": "skipped", "reason": "not run: pytest or its worker stopped before it"}
    assert r["collected"] == 9 and r["counts"] == {"pass": 3, "fail": 1, "error": 2, "skipped": 3}
    assert r["status"] == "error" and r["returncode"] == 1 and "test_setup_error" in r["why"]
    log = Path(r["log"]).read_text()
    assert "PASSED" in log and "test_stand_in.py::test_records_and_passes" in log  # -v: a line per test
    table = summary_table(make_report({"gpu-tests": r}, {}, tmp_path, "now", 1))
    assert "3 pass, 1 fail, 2 error, 3 skipped" in table
    row = next(line for line in table.splitlines() if "test_records_and_passes" in line)
    assert row.startswith("  ") and "worst forward 1.00e-03" in row and "tokens_per_s 124" in row


def test_a_module_that_does_not_import_is_an_error(tmp_path):
    suite = _stand_in_suite(tmp_path)
    (suite / "test_broken.py").write_text("import no_such_module_here\n")
    r = run_check(_tests_check(tmp_path, [suite]), tmp_path, gpu_check.time.monotonic() + HANG_GUARD_S)
    assert r["status"] == "error" and r["error"].startswith("a test module did not import: ")
    assert "test_broken.py" in r["error"] and "no_such_module_here" in r["error"]


def _report_lines(*records) -> str:
    return "".join(json.dumps(rec) + "\n" for rec in records)


A, B, C = (f"tests/test_stand_in.py::test_{x}" for x in "abc")


def test_parse_tests_when_pytest_died_or_found_nothing(tmp_path):
    check = Check("gpu-tests", "tests", ["true"], 10, tmp_path / "r.jsonl", info={"tests_dir": "tests"})
    r = gpu_check.parse_tests(check, -11, "Fatal Python error: Segmentation fault")
    assert r["status"] == "error" and "pytest wrote no test report" in r["error"] and "Segmentation" in r["log_tail"]

    check.output.write_text(_report_lines({"collected": [A, B, C]}, {"started": A},
                                          {"nodeid": A, "outcome": "failed", "duration_s": 1.5,
                                           "message": "AssertionError: grad 0.09 > 0.05", "properties": {"grad": 0.09}},
                                          {"started": B}))
    r = gpu_check.parse_tests(check, -11, "")  # a CUDA fault killed pytest in test B
    assert r["tests"][A] == {"status": "fail", "wall_s": 1.5, "grad": 0.09, "why": "AssertionError: grad 0.09 > 0.05"}
    assert r["tests"][B] == {"status": "error", "error": "pytest stopped while this test ran (exit code -11)"}
    assert r["tests"][C] == {"status": "skipped", "reason": "not run: pytest or its worker stopped before it"}
    assert r["status"] == "error" and r["counts"] == {"fail": 1, "error": 1, "skipped": 1}

    check.output.write_text(_report_lines({"collected": []}))
    r = gpu_check.parse_tests(check, 5, "")
    assert r["status"] == "error" and r["error"] == "pytest exited with 5 (no test collected)"
    r = gpu_check.parse_tests(check, 0, "")
    assert r["status"] == "error" and r["error"] == "no test is marked 'gpu' under tests"


@pytest.mark.slow
def test_gpu_tests_collect_and_skip_on_the_cpu_with_their_reasons(tmp_path):
    """The real gpu-tests check over tests/: every test marked gpu is collected and, without CUDA, skipped
    with the reason named; the check is not a pass."""
    if not gpu_check.cuda_problems():
        pytest.skip("this machine has CUDA: the GPU tests run")
    check = next(c for c in build_checks(tmp_path) if c.name == "gpu-tests")
    check.timeout_s = HANG_GUARD_S
    # a hang guard only, far beyond what the work takes on a loaded machine: the test bounds its work (collection
    # of the gpu-marked tests), never the time it takes (a 280 s budget once failed `make test` on a busy 2-core box)
    r = run_check(check, tmp_path, gpu_check.time.monotonic() + HANG_GUARD_S)
    files = {n.split("::")[0] for n in r["tests"]}
    assert {"tests/test_mamba2_kernels.py", "tests/test_gpu_decode.py"} <= files, files
    assert r["status"] == "skipped" and r["counts"] == {"skipped": r["collected"]} and r["returncode"] == 0
    for nodeid, t in r["tests"].items():
        assert t["reason"].startswith("needs CUDA"), (nodeid, t)


def test_run_check_keeps_the_tests_that_finished_when_pytest_times_out(tmp_path):
    """A stand-in for pytest writes the plugin's lines for one finished test, starts the next and hangs."""
    check = _tests_check(tmp_path, [tmp_path])
    lines = _report_lines({"collected": [A, B, C]}, {"started": A},
                          {"nodeid": A, "outcome": "failed", "duration_s": 0.1, "message": "AssertionError: x",
                           "properties": {"tokens_per_s": 10.0}}, {"started": B})
    prewritten = tmp_path / "lines.jsonl"
    prewritten.write_text(lines)  # sh + cat write them within the timeout even on a starved machine (a python would import first)
    check.cmd = ["sh", "-c", f"cat '{prewritten}' > '{check.output}'; exec sleep 120"]
    check.timeout_s = 2
    r = run_check(check, tmp_path, gpu_check.time.monotonic() + 600)
    assert r["status"] == "error" and r["error"] == "timed out after 2 s" and r["returncode"] is None
    assert r["tests"][A]["status"] == "fail" and r["tests"][A]["tokens_per_s"] == 10.0
    assert r["tests"][B]["error"] == "pytest stopped while this test ran (timed out)"
    assert r["tests"][C]["status"] == "skipped"


# ----------------------------------------------------------------------------- running, the budget, the report
def test_run_check_runs_reads_times_out_and_skips(tmp_path):
    check = _train_check(tmp_path)  # a stand-in run that stopped short: read as a fail, its output kept
    script = (f"import json; open({str(check.output)!r}, 'w').write(json.dumps({_results(global_step=7)!r})); "
              "print('trained')")
    check.cmd = [sys.executable, "-c", script]
    far = gpu_check.time.monotonic() + 600
    r = run_check(check, tmp_path, far)
    assert r["status"] == "fail" and r["why"] == "global_step 7 != 20" and r["returncode"] == 0
    assert "trained" in Path(r["log"]).read_text() and r["command"] == " ".join(check.cmd)

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


def test_the_budget_cuts_a_running_check_and_skips_the_ones_not_started(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "START_MARGIN_S", 1)
    never = tmp_path / "never-ran"
    slow = Check("slow", "bench", [sys.executable, "-c", "import time; time.sleep(120)"], 100, tmp_path / "slow.json")
    late = Check("late", "bench", [sys.executable, "-c", f"open({str(never)!r}, 'w')"], 100, tmp_path / "late.json")
    results = gpu_check.run_checks([slow, late], tmp_path, jobs=1, budget_s=3, echo=lambda s: None)
    assert results["slow"]["status"] == "error" and results["slow"]["error"] == "timed out after 3 s"
    assert results["late"]["status"] == "skipped" and results["late"]["error"].startswith("time budget spent")
    assert not never.exists()


def fake_results():
    return {
        "gpu-tests": {"status": "fail", "collected": 2, "counts": {"fail": 1, "skipped": 1}, "wall_s": 40.0,
                      "why": "tests/test_mamba2_kernels.py::test_x[d96-g2-bf16]: grad 0.09 > 0.05",
                      "tests": {"tests/test_mamba2_kernels.py::test_x[d96-g2-bf16]":
                                {"status": "fail", "wall_s": 3.0, "worst": {"grad": 0.09},
                                 "tolerance": {"grad": 0.05}, "why": "AssertionError: grad 0.09 > 0.05"},
                                "tests/test_gpu_decode.py::test_y[1]": {"status": "skipped", "reason": "not reached"}}},
        "train-llama-compile": {"status": "fail", "loss": 1.1, "tokens_per_s": 2e5, "graph_breaks": 0, "wall_s": 50.0,
                                "why": "global_step 7 != 20"},
        "fsdp-hybrid": {"status": "error", "error": "RuntimeError: NCCL error\nmore lines", "wall_s": 12.0},
        "bench": {"status": "skipped", "error": "time budget spent (3 s left)"},
    }


def test_report_json_and_summary_table(tmp_path):
    report = make_report(fake_results(), {"gpu": "NVIDIA H200", "torch": "2.13.0", "cuda": "12.8"}, tmp_path, "now", 123.4)
    assert report["status"] == "fail" and report["counts"] == {"fail": 2, "error": 1, "skipped": 1}
    gpu_check.write_report(tmp_path / "gpu-check.json", report)
    back = json.loads((tmp_path / "gpu-check.json").read_text())
    assert back["checks"]["fsdp-hybrid"]["error"].startswith("RuntimeError: NCCL error")
    assert back["checks"]["gpu-tests"]["tests"]["tests/test_mamba2_kernels.py::test_x[d96-g2-bf16]"]["worst"] == {"grad": 0.09}
    table = summary_table(report)
    assert "NVIDIA H200" in table
    for name, status in [("gpu-tests", "fail"), ("train-llama-compile", "fail"), ("fsdp-hybrid", "error"),
                         ("bench", "skipped"), ("  test_mamba2_kernels.py::test_x[d96-g2-bf16]", "fail"),
                         ("  test_gpu_decode.py::test_y[1]", "skipped")]:
        assert any(line.startswith(name) and status in line for line in table.splitlines()), name
    assert "RuntimeError: NCCL error" in table and "more lines" not in table  # the first line of an error
    assert "worst grad 0.09 (tol 0.05)" in table and "1 fail, 1 skipped" in table
    assert make_report({"a": {"status": "pass"}}, {}, tmp_path, "now", 1)["status"] == "pass"


def test_main_runs_every_check_even_when_one_fails(tmp_path, monkeypatch, capsys):
    """The orchestration end to end: the real gpu-tests check over the GPU test files (skipped here: no CUDA)
    beside a stand-in bench that crashes; both are reported, the run is not a pass."""
    if not gpu_check.cuda_problems():
        pytest.skip("this machine has CUDA: the GPU tests would run")

    def checks(workdir, python=sys.executable, steps=20):
        report = Path(workdir) / "gpu-tests.jsonl"
        paths = [ROOT / "tests" / "test_gpu_decode.py"]
        tests = Check("gpu-tests", "tests", gpu_check.pytest_command(report, python, paths), 120, report)
        bench = Check("bench", "bench", [python, "-c", "raise SystemExit('bench broke')"], 30, Path(workdir) / "bench.json")
        return [tests, bench]

    monkeypatch.setattr(gpu_check, "preflight", lambda: [])
    monkeypatch.setattr(gpu_check, "build_checks", checks)
    out = tmp_path / "report.json"
    rc = gpu_check.main(["--out", str(out), "--workdir", str(tmp_path / "w"), "--jobs", "2"])
    assert rc == 1
    report = json.loads(out.read_text())
    # 3 decoders × 2 batches, 3 kv × 2 batches, 3 engine arms, 8 decoders × 3 dtypes, 4 engines × 2 schedules × 2
    # dtypes, the CUDA-graph capture, 3 attention implementations of the exported model
    assert report["checks"]["gpu-tests"]["status"] == "skipped" and report["checks"]["gpu-tests"]["collected"] == 59
    assert report["checks"]["bench"]["status"] == "error" and "bench broke" in report["checks"]["bench"]["log_tail"]
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["cpu_count"] >= 1
    assert "gpu" not in report["machine"]  # no GPU here, and none is claimed
    printed = capsys.readouterr().out
    assert "overall: fail" in printed and f"wrote {out}" in printed
    assert "test_gpu_decode.py::test_decoder_on_the_gpu_decodes_plain_tokens[compiled-1]" in printed


def test_dynamo_counters_callback_writes_counters(tmp_path):
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import Callback

    cb = gpu_check.dynamo_counters_callback()
    assert isinstance(cb, Callback)
    cb.on_train_end(SimpleNamespace(is_global_zero=True, default_root_dir=str(tmp_path)), None)
    data = json.loads((tmp_path / "dynamo_counters.json").read_text())
    assert set(data) == {"graph_breaks", "graph_break_reasons", "unique_graphs", "mamba2_kernels", "conv_calls"}
    assert isinstance(data["graph_breaks"], int) and isinstance(data["conv_calls"], dict)


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
    check.info["expect_conv"] = "torch"  # on the CPU the torch conv must have run, and causal_conv1d never
    check.timeout_s = HANG_GUARD_S  # a hang guard, not a speed bound: the work is bounded (3 steps)
    check.env["OMP_NUM_THREADS"] = "1"
    r = run_check(check, tmp_path, gpu_check.time.monotonic() + HANG_GUARD_S)
    assert r["status"] == "pass", r
    assert r["global_step"] == 3 and r["graph_breaks"] == 0 and r["mamba2_kernels"].startswith("torch")
    assert r["conv_calls"]["torch"] > 0 and "causal_conv1d" not in r["conv_calls"]


# ----------------------------------------------------------------------------- which kernels import, which ran
def _fake_module(name: str, **attrs):
    import types

    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def fake_gpu_stack(monkeypatch):
    """CUDA "works" and every kernel module imports (stand-ins in sys.modules); a test then breaks one."""
    import looplab.models.mamba2  # noqa: F401  imported (and torch._dynamo with it) before the stand-in triton goes in
    monkeypatch.setattr(gpu_check, "cuda_problems", lambda: [])
    fakes = {"triton": {}, "mamba_ssm": {}, "mamba_ssm.ops": {}, "mamba_ssm.ops.triton": {},
             "mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": object()},
             "mamba_ssm.ops.triton.selective_state_update": {"selective_state_update": object()},
             "causal_conv1d": {"causal_conv1d_fn": object(), "causal_conv1d_update": object()}}
    for name, attrs in fakes.items():
        monkeypatch.setitem(sys.modules, name, _fake_module(name, **attrs))
    return monkeypatch


def test_preflight_passes_only_when_every_kernel_imports(fake_gpu_stack, capsys):
    assert gpu_check.preflight() == []
    assert gpu_check.main(["--preflight"]) == 0
    assert "every kernel import" in capsys.readouterr().out
    fake_gpu_stack.setitem(sys.modules, "mamba_ssm.ops.triton.selective_state_update", _fake_module("x"))
    [problem] = gpu_check.preflight()
    assert problem.startswith("mamba_ssm selective state update (mamba_ssm.ops.triton.selective_state_update."
                              "selective_state_update) does not import: AttributeError")


def test_preflight_refuses_a_causal_conv1d_that_does_not_import(fake_gpu_stack, tmp_path, capsys):
    fake_gpu_stack.setitem(sys.modules, "causal_conv1d", None)  # `import causal_conv1d` raises ImportError
    problems = gpu_check.preflight()
    assert [p.split(" (")[0] for p in problems] == ["causal_conv1d conv", "causal_conv1d conv update"]
    assert all("does not import: ModuleNotFoundError: import of causal_conv1d halted" in p for p in problems)
    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--out", str(out), "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu-check refused: causal_conv1d conv (causal_conv1d.causal_conv1d_fn) does not import")
    assert "make gpu-install" in err and not out.exists() and not (tmp_path / "w").exists()


def test_preflight_names_the_import_error_of_a_broken_causal_conv1d_build(fake_gpu_stack):
    """The usual failure on a GPU machine: causal-conv1d is installed, but its extension was built against
    another torch and does not load. A meta path finder raises that error for `import causal_conv1d`."""
    import importlib.abc

    symbol_error = "causal_conv1d_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"

    class BrokenBuild(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "causal_conv1d":
                raise ImportError(symbol_error)
            return None

    fake_gpu_stack.delitem(sys.modules, "causal_conv1d")
    fake_gpu_stack.setattr(sys, "meta_path", [BrokenBuild(), *sys.meta_path])
    problems = gpu_check.preflight()
    assert len(problems) == 2 and all(p.startswith("causal_conv1d conv") for p in problems)
    assert all(p.endswith(f"does not import: ImportError: {symbol_error}") for p in problems)


def test_mamba2_keeps_why_causal_conv1d_did_not_import(fake_gpu_stack, tmp_path):
    from looplab.models import mamba2

    fake_gpu_stack.setitem(sys.modules, "causal_conv1d", None)
    fake_gpu_stack.setattr(mamba2, "_FUSED", None)
    with pytest.warns(RuntimeWarning, match="causal_conv1d does not import .*use the torch conv"):
        ops = mamba2.resolve_fused_ops()
    assert isinstance(ops, mamba2.FusedOps) and ops.causal_conv1d is None
    assert ops.causal_conv1d_error.startswith("ModuleNotFoundError: import of causal_conv1d halted")
    data = gpu_check.write_dynamo_counters(tmp_path / "counters.json")
    assert data["mamba2_kernels"] == f"mamba_ssm scan + torch conv (causal_conv1d: {ops.causal_conv1d_error})"


def test_training_check_fails_when_its_mamba2_layers_ran_the_torch_conv(tmp_path):
    check = _train_check(tmp_path)
    check.info["expect_conv"] = "causal_conv1d"
    check.output.write_text(json.dumps(_results()))
    counters = check.output.parent / "dynamo_counters.json"
    kernels = "mamba_ssm scan + torch conv (causal_conv1d: ModuleNotFoundError: No module named 'causal_conv1d')"
    counters.write_text(json.dumps({"graph_breaks": 0, "mamba2_kernels": kernels, "conv_calls": {"torch": 40}}))
    r = gpu_check.parse_train(check, 0, "")
    assert r["status"] == "fail" and r["why"].startswith("conv: the torch conv ran 40x, causal_conv1d ran 0x")
    assert "No module named 'causal_conv1d'" in r["why"]
    counters.write_text(json.dumps({"mamba2_kernels": "mamba_ssm scan + causal_conv1d conv",
                                    "conv_calls": {"causal_conv1d": 40, "torch_cached": 3}}))
    assert gpu_check.parse_train(check, 0, "")["status"] == "pass"
    counters.unlink()  # no counts: the conv that ran is unknown, which is not a pass
    assert "the conv that ran is unknown" in gpu_check.parse_train(check, 0, "")["why"]


# ----------------------------------------------------------------------------- make gpu-install / gpu-check
from looplab import gpu_install  # noqa: E402


class Recorder:
    """Stands in for subprocess.run in gpu_install.main: records each command, fails the ones asked."""

    def __init__(self, fail_on: str | None = None):
        self.calls: list[tuple[list[str], dict]] = []
        self.fail_on = fail_on

    def __call__(self, cmd, env=None, **kw):
        self.calls.append((list(cmd), dict(env or {})))
        rc = 1 if self.fail_on and any(self.fail_on in a for a in cmd) else 0
        return subprocess.CompletedProcess(cmd, rc)

    def commands(self) -> list[str]:
        return [" ".join(c[c.index("-m") + 1 :]) for c, _ in self.calls]


def test_gpu_install_refuses_on_a_cpu_machine_before_installing_anything(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = Recorder()
    assert gpu_install.main(["--constraint", str(ROOT / "constraints.txt")], run=run) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu-check refused: ") and "nothing was built, run or written" in err
    assert ("built without CUDA" if torch.version.cuda is None else "no CUDA device") in err
    assert run.calls == []  # not even pip


def test_gpu_install_does_nothing_when_every_kernel_imports(fake_gpu_stack, capsys):
    run = Recorder()
    assert gpu_install.main(["--constraint", str(ROOT / "constraints.txt")], run=run) == 0
    assert run.calls == [] and "nothing to build" in capsys.readouterr().out


@pytest.fixture
def cuda_but_no_kernels(monkeypatch):
    monkeypatch.setattr(gpu_check, "cuda_problems", lambda: [])
    monkeypatch.setattr(gpu_check, "kernel_import_problems", lambda: ["causal_conv1d conv does not import"])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    return monkeypatch


def _toolkit(root: Path, release: str, headers: bool = True) -> Path:
    """A stand-in CUDA toolkit: bin/nvcc printing `nvcc -V`'s release line, include/cuda_runtime.h."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    if headers:
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime.h").write_text("")
    return root


def test_gpu_install_names_a_missing_nvcc_and_builds_nothing(cuda_but_no_kernels, tmp_path, capsys):
    cuda_but_no_kernels.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    run = Recorder()
    assert gpu_install.main(["--constraint", str(ROOT / "constraints.txt")], run=run) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu-install refused before building anything: ")
    assert f"nvcc not found at {tmp_path / 'no-cuda' / 'bin' / 'nvcc'} (CUDA_HOME={tmp_path / 'no-cuda'})" in err
    assert run.commands() == ["pip install setuptools>=61 wheel packaging ninja"]  # prerequisites only


def test_gpu_install_prerequisites_name_each_problem(tmp_path, monkeypatch):
    env = {"PATH": str(tmp_path / "empty-bin"), "CUDA_HOME": str(_toolkit(tmp_path / "cuda12", "12.4"))}
    problems = gpu_install.prerequisite_problems(env, "13.0")
    assert any(p.startswith(f"nvcc at {tmp_path}/cuda12/bin/nvcc is CUDA 12.4 but torch was built with CUDA 13.0")
               for p in problems), problems
    assert any(p.startswith("no C++ compiler (c++) on PATH") for p in problems)
    assert any(p.startswith("no ninja on PATH") for p in problems)
    env["CUDA_HOME"] = str(_toolkit(tmp_path / "wrapper", "13.0", headers=False))
    problems = gpu_install.prerequisite_problems(env, "13.0")
    assert any(p.startswith(f"no CUDA headers at {tmp_path}/wrapper/include") for p in problems), problems
    env = {"PATH": str(_toolkit(tmp_path / "cuda13", "13.0") / "bin")}  # found through nvcc on PATH, as torch does
    assert gpu_install.find_cuda_home(env) == str(tmp_path / "cuda13")
    assert not any("nvcc" in p or "CUDA" in p for p in gpu_install.prerequisite_problems(env, "13.0"))


def test_gpu_install_builds_each_requirement_without_build_isolation_in_order(cuda_but_no_kernels, capsys):
    cuda_but_no_kernels.setattr(gpu_install, "prerequisite_problems", lambda env, torch_cuda: [])
    cuda_but_no_kernels.chdir(ROOT)  # where make runs it
    run = Recorder()
    assert gpu_install.main(["--constraint", "constraints.txt"], run=run) == 0
    assert run.commands() == ["pip install setuptools>=61 wheel packaging ninja",
                              "pip install --no-build-isolation triton>=3.0",
                              "pip install --no-build-isolation causal-conv1d>=1.5.1",
                              "pip install --no-build-isolation mamba-ssm>=2.2",
                              "looplab.gpu_check --preflight"]
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert sorted(gpu_install.gpu_requirements()) == sorted(extra)
    for cmd, env in run.calls:
        assert cmd[0] == sys.executable
        assert env["PIP_CONSTRAINT"] == str(Path("constraints.txt").resolve())  # torch stays at its pin
        assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)  # pip's ninja, found by name

    failing = Recorder(fail_on="causal-conv1d")
    assert gpu_install.main(["--constraint", "none"], run=failing) == 1
    assert "pip install --no-build-isolation 'causal-conv1d>=1.5.1'` exited with 1" in capsys.readouterr().err
    assert not any("mamba-ssm" in c for c in failing.commands()) and "PIP_CONSTRAINT" not in failing.calls[0][1]


def test_make_gpu_check_refuses_on_a_cpu_machine_without_building(tmp_path):
    """`make gpu-check` with an installed venv (a stand-in python that logs its arguments): the install
    step refuses at once, nothing is built, no stamp is written, and the checks never start. No GPU is
    visible to it (CUDA_VISIBLE_DEVICES=""), so this holds on a CUDA machine too."""
    import shutil
    import time

    if shutil.which("make") is None:
        pytest.skip("needs make")
    venv, log = tmp_path / "venv", tmp_path / "python-calls.log"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".looplab-installed").touch()  # `make install` done (newer than pyproject.toml / constraints.txt)
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    env = {k: v for k, v in env.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}

    dry = subprocess.run(["make", "-s", "-n", "gpu-check", f"VENV={venv}"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1800).stdout.splitlines()
    assert [line.split(" -m ")[-1] for line in dry if " -m " in line] == [
        "looplab.gpu_install --constraint constraints.txt", "looplab.gpu_check"]

    # refused at once is shown by what ran (the python-calls log below: the install step's check, no pip, no
    # checks), not by how long it took: a loaded machine is allowed to be slow
    proc = subprocess.run(["make", "gpu-check", f"VENV={venv}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode != 0
    assert "gpu-check refused: " in proc.stderr and "nothing was built, run or written" in proc.stderr
    assert ("built without CUDA" if torch.version.cuda is None else "no CUDA device is visible") in proc.stderr
    assert log.read_text().splitlines() == ["-m looplab.gpu_install --constraint constraints.txt"]  # no pip, no checks
    assert not (venv / ".looplab-gpu-installed").exists()
