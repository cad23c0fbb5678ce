"""`python -m looplab.gpu_check [--out gpu-check.json] [--only NAMES] [--jobs N] [--budget-s S]` (`make gpu-check`)

The first thing to run on a CUDA machine: every GPU-only path of looplab, in about five minutes on one
GPU, with the figures written to `gpu-check.json` and a table printed (docs/gpu.md#gpu-check).

* `gpu-tests`: `python -m pytest -m gpu` over tests/, the GPU tests of the suite: Mamba2Mixer on
  mamba_ssm's fused kernels against the torch path (tests/test_mamba2_kernels.py: fp32 and bf16 forward,
  backward, prefill + step decoding, three conv layouts, torch.compile; which conv ran counted from
  mamba2.CONV_CALLS) and decoding (tests/test_gpu_decode.py: the static-shape step compiled and captured by
  CUDA graphs, self-speculation, against plain decoding's tokens; parallel-loop decoding, each kv mode at
  batch 1 and left-padded batch 8, against the CLP forward, with tokens/s beside the sequential and the
  unlooped model). Each test's outcome and the figures it
  recorded (`record_property`) come back through looplab.testing.pytest_report, written as each test ends.
* `train-{llama,mamba2,hybrid}-{eager,compile}`: `python -m looplab.train hardware=gpu` for 20 steps,
  with and without `compile=true`; graph breaks and recompiles counted from Dynamo's counters (a callback
  the run gets through `+callbacks.gpu_check`) and from TORCH_LOGS lines; a run with Mamba-2 layers fails
  unless causal-conv1d's kernel ran (its conv calls are counted in the run).
* `fsdp-hybrid`: the same through `hardware=fsdp trainer.devices=1` (FSDP2), and its checkpoint read back
  with `looplab.checkpoint.load_model`.
* `bench`: `python -m looplab.bench --device cuda --quick --only train` (a smoke test).

Every check runs as its own subprocess (a CUDA fault in one cannot take the others down), several at a
time, each under a timeout inside one overall time budget; its output is kept in `<workdir>/<check>.log`.
A check is `pass`, `fail` (it ran; a figure missed its criterion), `error` (it did not complete: the
exception is recorded) or `skipped` (the budget ran out; for a test, pytest skipped it or never reached
it). Exit status: 0 all passed, 1 otherwise, 2 refused (no usable CUDA, or a kernel that does not import:
nothing runs, nothing is written). `--preflight` only checks: every kernel the checks use must import
(triton, mamba_ssm's chunked scan and selective state update, causal_conv1d's conv and conv update), and
a refusal names the one that does not with its import error. `make gpu-check` first builds them once
(`make gpu-install`, `looplab.gpu_install`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEPS = 20
BACKBONES = ("llama", "mamba2", "hybrid")
TRAIN_LOOP_DEPTH = "2x2"  # two layers: the hybrid block holds one Mamba-2 and one attention layer
DEFAULT_BUDGET_S = 290  # `make gpu-check` promises about five minutes
START_MARGIN_S = 20  # a check is not started with less than this left of the budget
TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"  # the clone's tests/: gpu-check runs from a clone
GPU_MARK = "gpu"  # pyproject.toml's marker of the tests that need CUDA
# The GPU test files run in this many pytest-xdist processes, whole files each (--dist loadfile): the kernel
# parity file and the decoding file side by side, as their two workers ran before they were tests, and a
# process that crashes (a fault in a CUDA extension) leaves the other's tests running. Its worker is not
# restarted: xdist would hand the new one the crashing test again, up to 8 times.
GPU_TEST_WORKERS = 2


# ----------------------------------------------------------------------------- the checks
@dataclass
class Check:
    name: str
    kind: str  # tests | train | fsdp | bench
    cmd: list[str]
    timeout_s: float
    output: Path  # what the command writes: the test report, results.json, bench.json
    env: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # backbone, compile, ...


def pytest_command(report: Path, python: str = sys.executable, paths=(TESTS_DIR,),
                   workers: int = GPU_TEST_WORKERS) -> list[str]:
    """`pytest -m gpu` over `paths`, each test's outcome written to `report` as it ends (JSON lines)."""
    parallel = ["-n", str(workers), "--dist", "loadfile", "--max-worker-restart", "0"] if workers > 1 else []
    return [python, "-m", "pytest", "-m", GPU_MARK, "-v", "-p", "no:cacheprovider", *parallel,
            "-p", "looplab.testing.pytest_report", "--test-report", str(report), *map(str, paths)]


def train_overrides(run_dir: Path, backbone: str, hardware: str, compile: bool, steps: int = STEPS) -> list[str]:
    """A 20-step run of the tiny preset on the GPU, no logger, a short validation and test."""
    over = [
        f"backbone={backbone}",
        f"loop_depth={TRAIN_LOOP_DEPTH}",
        f"hardware={hardware}",
        f"compile={str(compile).lower()}",
        "logger=none",
        "resume=null",  # a reused --workdir must not resume a finished run
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={max(1, steps // 2)}",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "trainer.enable_progress_bar=false",
        f"checkpoint_every_n_steps={steps}",
        "dataset.batch_size=32",
        "dataset.val_size=64",
        "dataset.test_size=64",
        f"hydra.run.dir={run_dir}",
        "+callbacks.gpu_check._target_=looplab.gpu_check.dynamo_counters_callback",
    ]
    if hardware == "fsdp":
        over.append("trainer.devices=1")
    return over


def build_checks(workdir: Path, python: str = sys.executable, steps: int = STEPS) -> list[Check]:
    """Every check, longest first (they are started in this order)."""
    workdir = Path(workdir)
    base_env = {"PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", "WANDB_MODE": "offline"}
    compile_env = {**base_env, "TORCH_LOGS": "graph_breaks,recompiles"}

    def train_check(name: str, backbone: str, hardware: str, compile_: bool, timeout_s: int, env: dict) -> Check:
        run_dir = workdir / name
        info = {"backbone": backbone, "compile": compile_, "steps": steps, "run_dir": str(run_dir)}
        if backbone != "llama":  # d_conv 4 on CUDA: the Mamba-2 layers must run causal-conv1d's kernel
            info["expect_conv"] = "causal_conv1d"
        return Check(name, "fsdp" if hardware == "fsdp" else "train",
                     [python, "-m", "looplab.train", *train_overrides(run_dir, backbone, hardware, compile_, steps)],
                     timeout_s, run_dir / "results.json", env, info)

    report = workdir / "gpu-tests.jsonl"
    checks = [Check("gpu-tests", "tests", pytest_command(report, python), 270, report, base_env,
                    {"tests_dir": str(TESTS_DIR)})]
    checks += [train_check(f"train-{b}-compile", b, "gpu", True, 240, compile_env) for b in BACKBONES]
    checks.append(Check("bench", "bench",
                        [python, "-m", "looplab.bench", "--device", "cuda", "--quick", "--only", "train",
                         "--out", str(workdir / "bench.json")],
                        200, workdir / "bench.json", base_env))
    checks.append(train_check("fsdp-hybrid", "hybrid", "fsdp", False, 180, base_env))
    checks += [train_check(f"train-{b}-eager", b, "gpu", False, 150, base_env) for b in BACKBONES]
    return checks


# ----------------------------------------------------------------------------- refusal
# (what, module, attribute): every kernel the checks run, or that mamba_ssm's Mamba2 would, must import
KERNEL_IMPORTS = (
    ("triton", "triton", None),
    ("mamba_ssm chunked scan", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    ("mamba_ssm selective state update", "mamba_ssm.ops.triton.selective_state_update", "selective_state_update"),
    ("causal_conv1d conv", "causal_conv1d", "causal_conv1d_fn"),
    ("causal_conv1d conv update", "causal_conv1d", "causal_conv1d_update"),
)
GPU_PACKAGES = ("triton", "mamba_ssm", "causal_conv1d")  # import names of the gpu extra
INSTALL_HINT = "`make gpu-install` (python -m looplab.gpu_install; docs/gpu.md#gpu-install)"


def cuda_problems() -> list[str]:
    """Why torch cannot run CUDA kernels here; empty when it can."""
    import torch

    if torch.version.cuda is None:
        return [f"torch {torch.__version__} is built without CUDA (install a CUDA wheel of torch)"]
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return ["no CUDA device is visible (driver, or CUDA_VISIBLE_DEVICES="
                f"{visible!r})" if visible is not None else "no CUDA device is visible (driver?)"]
    return []


def kernel_import_problems() -> list[str]:
    """Each kernel of KERNEL_IMPORTS that does not import, with the import error's text."""
    import importlib

    problems = []
    for what, module, attr in KERNEL_IMPORTS:
        try:
            obj = importlib.import_module(module)
            if attr is not None:
                getattr(obj, attr)
        except Exception as e:  # ImportError, an undefined symbol (ABI), a CUDA error at import time
            where = f"{module}.{attr}" if attr else module
            problems.append(f"{what} ({where}) does not import: {type(e).__name__}: {e}")
    return problems


def preflight() -> list[str]:
    """What is missing for the GPU checks; empty when they can run."""
    import importlib.util

    missing = cuda_problems()
    if missing:  # every released mamba_ssm needs CUDA just to import: only say what is not installed
        missing += [f"{name} is not installed" for name in GPU_PACKAGES if importlib.util.find_spec(name) is None]
        return missing
    return kernel_import_problems()


def refusal(missing: list[str], what: str = "nothing was run and nothing written") -> str:
    return (f"gpu-check refused: {'; '.join(missing)}. It runs on a CUDA machine with looplab's gpu extra, "
            f"built by {INSTALL_HINT}; {what}.")


# ----------------------------------------------------------------------------- reading results
_GRAPH_BREAK = re.compile(r"\[__graph_breaks\] Graph break")
_RECOMPILE = re.compile(r"\[__recompiles\] Recompiling function")


def count_log_events(text: str) -> dict[str, int]:
    """Dynamo's TORCH_LOGS=graph_breaks,recompiles records in a run's output (one per record: the
    formatter prefixes every line of a record, only its first line starts with these words)."""
    return {"graph_breaks_logged": len(_GRAPH_BREAK.findall(text)), "recompiles_logged": len(_RECOMPILE.findall(text))}


def _tail(text: str, n: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def parse_train(check: Check, rc: int, log: str) -> dict[str, Any]:
    res = _read_json(check.output)
    out: dict[str, Any] = {"backbone": check.info.get("backbone"), "compile": check.info.get("compile")}
    counters = _read_json(Path(check.info.get("run_dir", check.output.parent)) / "dynamo_counters.json") or {}
    out.update(count_log_events(log))
    if counters:
        out["graph_breaks"] = counters.get("graph_breaks")
        out["graph_break_reasons"] = counters.get("graph_break_reasons")
        out["unique_graphs"] = counters.get("unique_graphs")
        out["mamba2_kernels"] = counters.get("mamba2_kernels")
        out["conv_calls"] = counters.get("conv_calls")
    if res is None:
        return {**out, "status": "error", "error": f"no results.json (exit code {rc})", "log_tail": _tail(log)}
    if res.get("status") != "ok":
        return {**out, "status": "error", "error": res.get("error") or f"run status {res.get('status')!r}",
                "log_tail": _tail(res.get("traceback") or log)}
    tp = res.get("throughput") or {}
    out.update(global_step=res.get("global_step"), loss=res.get("loss"), accuracy=res.get("accuracy"),
               tokens_per_s=tp.get("tokens_per_s"), compiled=tp.get("compiled"), run_wall_s=res.get("wall_time_s"))
    why = []
    if res.get("global_step") != check.info.get("steps"):
        why.append(f"global_step {res.get('global_step')} != {check.info.get('steps')}")
    if not _finite(res.get("loss")):
        why.append(f"loss {res.get('loss')!r} is not finite")
    if check.info.get("compile") is not None and bool(tp.get("compiled")) != bool(check.info["compile"]):
        why.append(f"compiled={tp.get('compiled')} but compile={check.info['compile']} was asked")
    if rc != 0:
        why.append(f"exit code {rc}")
    if check.info.get("expect_conv"):
        conv = conv_verdict(check.info["expect_conv"], counters.get("conv_calls"), counters.get("mamba2_kernels"))
        if conv:
            why.append(conv)
    out["status"] = "fail" if why else "pass"
    if why:
        out["why"] = "; ".join(why)
    return out


def conv_verdict(expected: str, calls: dict | None, detail: str | None = None) -> str | None:
    """Why the conv that ran (mamba2.CONV_CALLS, counted as it ran) is not the expected one; None if it is.
    The CUDA kernel is always counted, the torch conv only outside compiled graphs: so causal_conv1d passes
    on a positive count with no torch call, and torch passes on no causal_conv1d call."""
    if calls is None:
        return f"the conv that ran is unknown (no conv counts), expected {expected}"
    fused, fallback = calls.get("causal_conv1d", 0), calls.get("torch", 0)
    if expected == "causal_conv1d" and (fused == 0 or fallback > 0):
        ran = f"the torch conv ran {fallback}x" if fallback else "no causal_conv1d call was counted"
        return f"conv: {ran}, causal_conv1d ran {fused}x, expected causal_conv1d" + (f" ({detail})" if detail else "")
    if expected == "torch" and fused > 0:
        return f"conv: causal_conv1d ran {fused}x, expected the torch conv"
    return None


def parse_fsdp(check: Check, rc: int, log: str) -> dict[str, Any]:
    out = parse_train(check, rc, log)
    if out["status"] == "error":
        return out
    ckpt = Path(check.info.get("run_dir", check.output.parent)) / "checkpoints" / "last.ckpt"
    try:
        from looplab.checkpoint import load_model, read_checkpoint_meta

        read_checkpoint_meta(ckpt)
        model, _ = load_model(ckpt)
        out["checkpoint"] = {"layout": "sharded folder" if ckpt.is_dir() else "file",
                             "params": sum(p.numel() for p in model.parameters())}
    except Exception as e:
        out["checkpoint"] = {"error": f"{type(e).__name__}: {e}"}
        out["status"] = "fail"
        out["why"] = "; ".join(filter(None, [out.get("why"), f"checkpoint {ckpt} does not load: {type(e).__name__}: {e}"]))
    return out


def parse_bench(check: Check, rc: int, log: str) -> dict[str, Any]:
    res = _read_json(check.output)
    part = (res or {}).get("train")
    if not part:
        return {"status": "error", "error": f"no train part in {check.output} (exit code {rc})", "log_tail": _tail(log)}
    if part.get("status") != "ok":
        return {"status": "error", "error": part.get("error") or part.get("reason") or part.get("status"),
                "log_tail": _tail(log)}
    keys = ("device", "dtype", "tokens_per_s", "ratio_vs_transformers", "mfu", "peak_memory_mb", "wall_s")
    return {"status": "pass" if rc == 0 else "fail", **{k: part.get(k) for k in keys if k in part},
            **({} if rc == 0 else {"why": f"exit code {rc}"})}


# a test's pytest outcome → its status here: an expected failure or a skip confirms nothing
TEST_STATUS = {"passed": "pass", "xpassed": "pass", "failed": "fail", "error": "error", "skipped": "skipped",
               "xfailed": "skipped"}
PYTEST_EXIT = {2: "interrupted", 3: "an internal error", 4: "a usage error", 5: "no test collected"}
_WORST_FIRST = ("error", "fail", "skipped", "pass")


def _test_result(rec: dict) -> dict[str, Any]:
    """One finished test's line of the report: its status, seconds, recorded figures and message."""
    status = TEST_STATUS.get(rec.get("outcome"), "error")
    out: dict[str, Any] = {"status": status, "wall_s": rec.get("duration_s"), **(rec.get("properties") or {})}
    if rec.get("message"):
        out[{"fail": "why", "error": "error", "skipped": "reason"}.get(status, "message")] = rec["message"]
    return out


def parse_tests(check: Check, rc: int | None, log: str) -> dict[str, Any]:
    """The pytest run's report (looplab.testing.pytest_report's JSON lines) → one result per test, in the
    order collected, and the run's status: the worst of its tests', or error when pytest did not finish.
    A test that was running when pytest died is an error; one it never reached is skipped."""
    records, unreadable = [], None
    try:
        lines = Path(check.output).read_text().splitlines()
    except OSError as e:
        lines, unreadable = [], f"{type(e).__name__}: {e}"
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short by the kill that ended pytest
            continue
    collected: list[str] = []
    running: set[str] = set()  # started, not finished (one at a time, or one per xdist worker)
    done: dict[str, dict] = {}
    broken: list[str] = []
    for rec in records:
        if "collected" in rec:
            collected = rec["collected"]
        elif "collection_error" in rec:
            broken.append(f"{rec['collection_error']}: {rec.get('message')}")
        elif "started" in rec:
            running.add(rec["started"])
        elif "nodeid" in rec:
            done[rec["nodeid"]] = rec
            running.discard(rec["nodeid"])

    tests: dict[str, dict] = {}
    for nodeid in [*collected, *(n for n in done if n not in collected)]:
        rec = done.get(nodeid)
        if rec is None and nodeid in running:
            stopped = "timed out" if rc is None else f"exit code {rc}"
            tests[nodeid] = {"status": "error", "error": f"pytest stopped while this test ran ({stopped})"}
        elif rec is None:
            tests[nodeid] = {"status": "skipped", "reason": "not run: pytest or its worker stopped before it"}
        else:
            tests[nodeid] = _test_result(rec)

    counts: dict[str, int] = {}
    for t in tests.values():
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    out: dict[str, Any] = {"collected": len(collected), "counts": counts, "tests": tests}
    problem = None
    if unreadable or not records:
        problem = f"pytest wrote no test report ({unreadable or 'empty'}; exit code {rc})"
    elif broken:
        problem = "a test module did not import: " + " | ".join(dict.fromkeys(broken))  # once, not per worker
    elif rc in PYTEST_EXIT:
        problem = f"pytest exited with {rc} ({PYTEST_EXIT[rc]})"
    elif not tests:
        problem = f"no test is marked {GPU_MARK!r} under {check.info.get('tests_dir', 'the test paths')}"
    if problem:
        return {**out, "status": "error", "error": problem, "log_tail": _tail(log)}
    out["status"] = next(s for s in _WORST_FIRST if s in counts)
    worst = [(n, t) for n, t in tests.items() if t["status"] == out["status"]]
    if out["status"] == "skipped":  # skips share their reasons (no CUDA, no mamba_ssm): each said once
        out["why"] = " | ".join(dict.fromkeys(str(t.get("reason")) for _, t in worst))
    elif out["status"] != "pass":
        out["why"] = " | ".join(f"{n}: {t.get('why') or t.get('error')}" for n, t in worst)
    return out


PARSERS = {"tests": parse_tests, "train": parse_train, "fsdp": parse_fsdp, "bench": parse_bench}


# ----------------------------------------------------------------------------- running
def run_check(check: Check, workdir: Path, deadline: float) -> dict[str, Any]:
    """Run one check's subprocess (output to <workdir>/<name>.log) and read its result; never raises."""
    left = deadline - time.monotonic()
    if left < START_MARGIN_S:
        return {"status": "skipped", "error": f"time budget spent ({max(left, 0):.0f} s left)",
                "command": " ".join(check.cmd)}
    timeout = min(check.timeout_s, left)
    log_path = Path(workdir) / f"{check.name}.log"
    env = {**os.environ, **check.env}
    check.output.unlink(missing_ok=True)  # a result left by an earlier run in a reused --workdir is not this run's
    t0 = time.monotonic()
    rc: int | None = None
    try:
        with open(log_path, "w") as log_file:
            # its own session, so that a timeout ends its children too (compile workers, ranks)
            proc = subprocess.Popen(check.cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            _RUNNING.add(proc)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
            finally:
                _RUNNING.discard(proc)
        log = log_path.read_text(errors="replace")
        if rc is None:  # the tests that finished before the kill are still reported
            result = parse_tests(check, rc, log) if check.kind == "tests" else {}
            result.update(status="error", error=f"timed out after {timeout:.0f} s", log_tail=_tail(log))
        else:
            result = PARSERS[check.kind](check, rc, log)
    except Exception as e:  # a broken parser or an unreadable log must not stop the other checks
        result = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["returncode"] = rc
    result["log"] = str(log_path)
    result["command"] = " ".join(check.cmd)
    return result


_RUNNING: set[subprocess.Popen] = set()  # the checks' processes, ended on Ctrl-C (they have their own sessions)


def _kill_group(proc: subprocess.Popen) -> None:
    """End the check's own process group (its children too: compile workers, DDP ranks)."""
    import signal

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_checks(checks: list[Check], workdir: Path, jobs: int, budget_s: float, echo=print) -> dict[str, dict]:
    deadline = [time.monotonic() + budget_s]
    results: dict[str, dict] = {}

    def one(check: Check) -> None:
        results[check.name] = r = run_check(check, workdir, deadline[0])
        echo(f"[gpu-check] {check.name:<22} {r['status']:<7} {r.get('wall_s', 0):6.1f} s  {_one_line(r)}")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        try:
            list(pool.map(one, checks))
        except KeyboardInterrupt:
            deadline[0] = 0.0  # checks not yet started are skipped
            for proc in list(_RUNNING):
                _kill_group(proc)
            raise
    return {c.name: results[c.name] for c in checks}


# ----------------------------------------------------------------------------- report
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2e}" if (v != 0 and abs(v) < 1e-2) else f"{v:,.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def _one_line(r: dict) -> str:
    """The figures of one check or test that fit on a line (or why it did not run)."""
    parts = []
    if "tests" in r:  # the pytest run
        parts.append(", ".join(f"{n} {status}" for status, n in r.get("counts", {}).items()))
    if r.get("status") in ("error", "skipped"):
        text = str(r.get("error") or r.get("reason") or r.get("why") or "").strip()
        return " · ".join(parts + [text.splitlines()[0][:110]] if text else parts)[:160]
    worst, tol = r.get("worst"), r.get("tolerance")
    if isinstance(worst, dict):  # a parity test: its worst relative error per comparison
        parts += [f"worst {k} {_fmt(v)}" + (f" (tol {_fmt(tol[k])})" if isinstance(tol, dict) and k in tol else "")
                  for k, v in worst.items()]
    for k in ("loss", "tokens_per_s", "plain_tokens_per_s", "first_call_s", "graph_breaks", "graph_breaks_logged",
              "recompiles_logged", "mfu"):
        if r.get(k) is not None:
            parts.append(f"{k} {_fmt(r[k])}")
    if isinstance(r.get("checkpoint"), dict) and "layout" in r["checkpoint"]:
        parts.append(f"ckpt {r['checkpoint']['layout']} loads")
    if r.get("why"):
        parts.append(f"FAIL: {r['why']}")
    return " · ".join(parts)[:160]


def _rows(checks: dict[str, dict]):
    """(name, result) of each check, the pytest run's tests indented under it."""
    for name, r in checks.items():
        yield name, r
        for nodeid, t in (r.get("tests") or {}).items():
            yield "  " + nodeid.removeprefix("tests/"), t


def summary_table(report: dict) -> str:
    m = report.get("machine", {})
    rows = list(_rows(report.get("checks", {})))
    width = max([22, *(len(name) for name, _ in rows)])
    lines = [f"looplab gpu-check · {m.get('gpu')} · torch {m.get('torch')} (CUDA {m.get('cuda')}) · "
             f"mamba_ssm {m.get('mamba_ssm')} · causal_conv1d {m.get('causal_conv1d')} · {report.get('started_at')}",
             f"{'check':<{width}} {'status':<7} {'wall s':>7}  figures"]
    for name, r in rows:
        lines.append(f"{name:<{width}} {r.get('status', '?'):<7} {r.get('wall_s') or 0:7.1f}  {_one_line(r)}")
    counts = report.get("counts", {})
    lines.append(f"overall: {report.get('status')} ({', '.join(f'{v} {k}' for k, v in counts.items())}); "
                 f"logs in {report.get('workdir')}")
    return "\n".join(lines)


def make_report(results: dict[str, dict], machine: dict, workdir: Path, started_at: str, wall_s: float) -> dict:
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r.get("status", "error")] = counts.get(r.get("status", "error"), 0) + 1
    status = "pass" if results and all(r.get("status") == "pass" for r in results.values()) else "fail"
    return {"status": status, "counts": counts, "started_at": started_at, "wall_s": round(wall_s, 1),
            "workdir": str(workdir), "machine": machine, "steps": STEPS,
            "checks": results}


def write_report(path: Path, report: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(_json_safe(report), indent=1))
    os.replace(tmp, path)


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def machine_info() -> dict:
    """The machine as the benchmarks describe it (looplab.bench.common.machine_info: CPU, torch, Python,
    platform, date, load), plus what the GPU checks depend on: the GPU, CUDA, the kernel packages, Lightning,
    the host and the commit."""
    import importlib.metadata as md

    import torch

    from looplab.bench.common import machine_info as bench_machine_info

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    info = bench_machine_info(torch.get_num_threads())
    info.pop("dtype", None)  # the benchmarks' CPU figures are fp32; each check here states its own precision
    info.update(host=platform.node(), cuda=torch.version.cuda, mamba_ssm=version("mamba-ssm"),
                causal_conv1d=version("causal-conv1d"), triton=version("triton"), lightning=version("lightning"))
    try:
        from looplab.training.run_utils import git_commit

        info["git_commit"] = git_commit()
    except Exception:
        info["git_commit"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_count=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}",
                    gpu_memory_gb=round(p.total_memory / 2**30, 1))
    return info


# ----------------------------------------------------------------------------- inside the training runs
def dynamo_counters_callback():
    """A Lightning callback (for `+callbacks.gpu_check._target_=...`) that writes Dynamo's counters and
    the Mamba-2 kernel path to <run dir>/dynamo_counters.json when training ends."""
    from lightning.pytorch.callbacks import Callback

    class DynamoCounters(Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            if trainer.is_global_zero:
                write_dynamo_counters(Path(trainer.default_root_dir) / "dynamo_counters.json")

    return DynamoCounters()


def write_dynamo_counters(path: Path) -> dict:
    import torch._dynamo.utils as dynamo_utils

    from looplab.models import mamba2

    counters = dynamo_utils.counters
    breaks = dict(counters.get("graph_break", {}))
    fused = mamba2._FUSED
    if isinstance(fused, mamba2.FusedOps):
        kernels = "mamba_ssm scan + " + ("causal_conv1d conv" if fused.causal_conv1d is not None
                                         else f"torch conv (causal_conv1d: {fused.causal_conv1d_error})")
    else:
        kernels = "torch (fused kernels never resolved)" if fused is None else f"torch (mamba_ssm: {fused})"
    data = {"graph_breaks": sum(breaks.values()),
            "graph_break_reasons": {str(k)[:300]: v for k, v in sorted(breaks.items(), key=lambda kv: -kv[1])[:10]},
            "unique_graphs": dict(counters.get("stats", {})).get("unique_graphs", 0),
            "mamba2_kernels": kernels,
            "conv_calls": dict(mamba2.CONV_CALLS)}  # which conv ran in this process, counted as it ran
    write_report(path, data)
    return data


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m looplab.gpu_check", description=__doc__.split("\n\n")[1])
    ap.add_argument("--out", default="gpu-check.json", help="the JSON report (default gpu-check.json)")
    ap.add_argument("--workdir", default=None, help="run folders and logs (default outputs/gpu-check/<time>)")
    ap.add_argument("--only", default=None, help="comma-separated check names or prefixes (e.g. gpu-tests,train-llama)")
    ap.add_argument("--jobs", type=int, default=4, help="checks run at the same time (default 4)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="overall time budget in seconds")
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps per run (default 20)")
    ap.add_argument("--list", action="store_true", help="print the checks and their commands, run nothing")
    ap.add_argument("--preflight", action="store_true", help="only check that CUDA works and every kernel imports")
    args = ap.parse_args(argv)

    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    workdir = Path(args.workdir or Path("outputs") / "gpu-check" / stamp).resolve()
    checks = build_checks(workdir, steps=args.steps)
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        checks = [c for c in checks if any(c.name == w or c.name.startswith(w) for w in wanted)]
        if not checks:
            ap.error(f"--only {args.only!r} matches no check; see --list")
    if args.list:
        for c in checks:
            print(f"{c.name:<22} timeout {c.timeout_s:>4.0f} s  {' '.join(c.cmd)}")
        return 0

    missing = preflight()
    if missing:
        print(refusal(missing), file=sys.stderr)
        return 2
    if args.preflight:
        print("gpu-check preflight: CUDA and every kernel import (" + ", ".join(w for w, _, _ in KERNEL_IMPORTS) + ")")
        return 0

    workdir.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    machine = machine_info()
    print(f"[gpu-check] {len(checks)} checks, {args.jobs} at a time, budget {args.budget_s:.0f} s; logs in {workdir}",
          flush=True)
    results = run_checks(checks, workdir, args.jobs, args.budget_s, echo=lambda s: print(s, flush=True))
    report = make_report(results, machine, workdir, started, time.monotonic() - t0)
    write_report(Path(args.out), report)
    print(summary_table(report))
    print(f"wrote {args.out}")
    return 0 if report["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
