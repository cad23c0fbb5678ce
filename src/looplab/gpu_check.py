"""`python -m looplab.gpu_check [--out gpu-check.json] [--only NAMES] [--jobs N] [--budget-s S]` (`make gpu-check`)

The first thing to run on a CUDA machine: every GPU-only path of looplab, in about five minutes on one
GPU, with the figures written to `gpu-check.json` and a table printed (docs/gpu.md#gpu-check).

* `gpu-tests`: `python -m pytest -m gpu` over tests/, the GPU tests of the suite: Mamba2Mixer on
  mamba_ssm's fused kernels against the torch path (tests/test_mamba2_kernels.py: fp32 and bf16 forward,
  backward, prefill + step decoding through selective_state_update and causal_conv1d_update, the kernel step
  against the torch step, three conv layouts, torch.compile; which conv and SSM step ran counted from
  mamba2.CONV_CALLS and mamba2.STEP_CALLS) and decoding (tests/test_gpu_decode.py: the static-shape step compiled and captured by
  CUDA graphs — a graph must be captured —, self-speculation, against plain decoding's tokens; parallel-loop
  decoding, each kv mode at batch 1 and left-padded batch 8, against the CLP forward, with tokens/s beside the
  sequential and the unlooped model; the dtype matrix of every decoder and both serving schedules in fp32, bf16 and
  bf16 autocast; the exported model under sdpa, eager and flash-attention). Each test's outcome and the figures it
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
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# what the checks produced, read back, and the report (re-exported: `looplab.gpu_check.parse_train` etc.)
from looplab.gpu_results import (GPU_MARK, STEPS, conv_verdict, count_log_events, dynamo_counters_callback,  # noqa: F401
                                 machine_info, make_report, parse_bench, parse_fsdp, parse_tests, parse_train,
                                 summary_table, write_dynamo_counters, write_report, _one_line, _tail)

BACKBONES = ("llama", "mamba2", "hybrid")
TRAIN_LOOP_DEPTH = "2x2"  # two layers: the hybrid block holds one Mamba-2 and one attention layer
DEFAULT_BUDGET_S = 290  # `make gpu-check` promises about five minutes
START_MARGIN_S = 20  # a check is not started with less than this left of the budget
TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"  # the clone's tests/: gpu-check runs from a clone
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
    report = make_report(results, machine, workdir, started, time.monotonic() - t0, steps=args.steps)
    write_report(Path(args.out), report)
    print(summary_table(report))
    print(f"wrote {args.out}")
    return 0 if report["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
