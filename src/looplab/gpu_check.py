"""`python -m looplab.gpu_check [--out gpu-check.json] [--only NAMES] [--jobs N] [--budget-s S]` (`make gpu-check`)

The first thing to run on a CUDA machine: every GPU-only path of looplab, in about five
minutes on one GPU, with the figures written to `gpu-check.json` and a table printed.

* `parity-*`: `Mamba2Mixer` on mamba_ssm's fused kernels against the same weights on the torch
  path, fp32 and bf16 autocast: forward, backward (input and parameter gradients), and prefill
  through the fused scan then step decoding; plus the fused mixer under `torch.compile` (graph
  breaks counted). One shape takes causal-conv1d's channel-last view, one needs the copy, one
  has a width causal-conv1d lacks (d_conv 5, kernel=auto: torch conv, fused scan). Which conv
  ran is counted as it runs (mamba2.CONV_CALLS): the torch conv where causal-conv1d was due
  fails the case, as it fails a mamba2/hybrid training check.
* `train-{llama,mamba2,hybrid}-{eager,compile}`: `python -m looplab.train hardware=gpu` for
  20 steps, with and without `compile=true`; graph breaks and recompiles counted from Dynamo's
  counters (a callback the run gets through `+callbacks.gpu_check`) and from TORCH_LOGS lines.
* `fsdp-hybrid`: the same through `hardware=fsdp trainer.devices=1` (FSDP2), and its
  checkpoint read back with `looplab.checkpoint.load_model`.
* `bench`: `python -m looplab.bench --device cuda --quick --only train` (a smoke test).
* `decode`: cached decoding of a d 512 llama 2⊗4 in bf16 at batch 1 and 8: the static-shape step
  (models/static_decode.py) eagerly and captured by CUDA graphs (`static_cache="reduce-overhead"`),
  and self-speculation (k 2, γ 4), each against plain decoding's tokens, with tokens/s (fp32).

Every check runs as its own subprocess (a CUDA fault in one cannot take the others down),
several at a time, each under a timeout inside one overall time budget; its output is kept in
`<workdir>/<check>.log`. A check is `pass`, `fail` (it ran; a figure missed its criterion),
`error` (it did not complete: the exception is recorded) or `skipped` (the budget ran out).
Exit status: 0 all passed, 1 otherwise, 2 refused (no usable CUDA, or a kernel that does not
import: nothing runs, nothing is written). `--preflight` only checks: every kernel the checks
use must import (triton, mamba_ssm's chunked scan and selective state update, causal_conv1d's
conv and conv update), and a refusal names the one that does not with its import error.
`make gpu-check` first builds them once (`make gpu-install`, `looplab.gpu_install`).
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

# max |a - b| / max |ref| per tensor. bf16 figures are also allowed 2x the torch path's own
# bf16-vs-fp32 error (the noise floor bf16 itself adds), whichever is larger.
TOLERANCES = {
    "fp32": {"forward": 5e-3, "grad": 2e-2, "decode": 5e-3},  # Triton's fp32 dots may run in tf32
    "bf16": {"forward": 2e-2, "grad": 5e-2, "decode": 2e-2},
    "compile": {"forward": 1e-2, "grad": 3e-2},  # compiled vs eager, both fused, bf16 autocast
}

# (name, Mamba2Mixer kwargs, kernel): the conv layout each one exercises is recorded in the result
PARITY_SHAPES = (
    ("d256", dict(d_model=256, d_state=64, headdim=64, ngroups=1, d_conv=4, chunk_size=64), "mamba_ssm"),
    ("d96-g2", dict(d_model=96, d_state=32, headdim=32, ngroups=2, d_conv=4, chunk_size=32), "mamba_ssm"),
    ("d256-conv5", dict(d_model=256, d_state=64, headdim=64, ngroups=1, d_conv=5, chunk_size=64), "auto"),
)
PARITY_BATCH, PARITY_LEN, PARITY_PREFILL = 2, 200, 150


# ----------------------------------------------------------------------------- the checks
@dataclass
class Check:
    name: str
    kind: str  # parity | train | fsdp | bench
    cmd: list[str]
    timeout_s: float
    output: Path  # what the command writes: results.json, parity.json, bench.json
    env: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # backbone, compile, ...


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

    checks = [train_check(f"train-{b}-compile", b, "gpu", True, 240, compile_env) for b in BACKBONES]
    checks.append(Check("bench", "bench",
                        [python, "-m", "looplab.bench", "--device", "cuda", "--quick", "--only", "train",
                         "--out", str(workdir / "bench.json")],
                        200, workdir / "bench.json", base_env))
    checks.append(Check("parity", "parity",
                        [python, "-m", "looplab.gpu_check", "--worker", "parity", "--out", str(workdir / "parity.json")],
                        220, workdir / "parity.json", compile_env))
    checks.append(Check("decode", "parity",
                        [python, "-m", "looplab.gpu_check", "--worker", "decode", "--out", str(workdir / "decode.json")],
                        200, workdir / "decode.json", compile_env))
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
INSTALL_HINT = "`make gpu-install` (python -m looplab.gpu_install; README, GPU)"


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


def parse_parity(check: Check, rc: int, log: str) -> dict[str, Any]:
    res = _read_json(check.output)
    if res is None:
        return {"status": "error", "error": f"the parity worker wrote no {check.output.name} (exit code {rc})",
                "log_tail": _tail(log)}
    return res


PARSERS = {"train": parse_train, "fsdp": parse_fsdp, "bench": parse_bench, "parity": parse_parity}


# ----------------------------------------------------------------------------- running
def run_check(check: Check, workdir: Path, deadline: float) -> dict[str, Any]:
    """Run one check's subprocess (output to <workdir>/<name>.log) and read its result; never raises."""
    left = deadline - time.monotonic()
    if left < START_MARGIN_S:
        return {"status": "skipped", "error": f"time budget spent ({left:.0f} s left)", "command": " ".join(check.cmd)}
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
        if rc is None:
            result = {"status": "error", "error": f"timed out after {timeout:.0f} s", "log_tail": _tail(log)}
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
    """The figures of one check that fit on a line (or its error)."""
    if r.get("status") in ("error", "skipped"):
        return str(r.get("error", "")).strip().splitlines()[0][:110] if r.get("error") else ""
    parts = []
    if "cases" in r:  # parity
        worst = r.get("worst") or {}
        parts += [f"worst {k} {_fmt(v['value'])} (tol {_fmt(v['tol'])}, {v['case']})" for k, v in worst.items()]
    for k in ("loss", "tokens_per_s", "graph_breaks", "graph_breaks_logged", "recompiles_logged", "mfu"):
        if r.get(k) is not None:
            parts.append(f"{k} {_fmt(r[k])}")
    if isinstance(r.get("checkpoint"), dict) and "layout" in r["checkpoint"]:
        parts.append(f"ckpt {r['checkpoint']['layout']} loads")
    if r.get("why"):
        parts.append(f"FAIL: {r['why']}")
    return " · ".join(parts)[:160]


def summary_table(report: dict) -> str:
    m = report.get("machine", {})
    lines = [f"looplab gpu-check · {m.get('gpu')} · torch {m.get('torch')} (CUDA {m.get('cuda')}) · "
             f"mamba_ssm {m.get('mamba_ssm')} · causal_conv1d {m.get('causal_conv1d')} · {report.get('started_at')}",
             f"{'check':<22} {'status':<7} {'wall s':>7}  figures"]
    for name, r in report.get("checks", {}).items():
        lines.append(f"{name:<22} {r.get('status', '?'):<7} {r.get('wall_s', 0):7.1f}  {_one_line(r)}")
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
            "workdir": str(workdir), "machine": machine, "tolerances": TOLERANCES, "steps": STEPS,
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
    import importlib.metadata as md

    import torch

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "mamba_ssm": version("mamba-ssm") or version("mamba_ssm"),
            "causal_conv1d": version("causal-conv1d") or version("causal_conv1d"), "triton": version("triton"),
            "lightning": version("lightning"), "cpu_count": os.cpu_count()}
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


# ----------------------------------------------------------------------------- the parity worker
def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _diff(a, b) -> dict[str, float]:
    return {"max_abs": (a.float() - b.float()).abs().max().item(), "max_rel": _rel(a, b)}


def _conv_layout(mixer, x) -> str:
    """Which input causal-conv1d gets for this mixer (mirrors Mamba2Mixer._conv)."""
    import torch

    from looplab.models.config import CAUSAL_CONV1D_WIDTHS
    from looplab.models.mamba2 import _conv_channel_last_ok

    if mixer.d_conv not in CAUSAL_CONV1D_WIDTHS:
        return f"torch conv (d_conv={mixer.d_conv})"
    with torch.no_grad():
        proj = mixer.in_proj(x[:, :4])
    xBC = proj[..., mixer.d_inner : mixer.d_inner + mixer.conv_dim]
    if _conv_channel_last_ok(xBC.transpose(1, 2)):
        return "channel-last view (no copy)"
    if _conv_channel_last_ok(xBC.contiguous().transpose(1, 2)):
        return "channel-last copy"
    return "channel-first copy"


def _conv_ran(mixer, x, calls: dict) -> dict[str, Any]:
    """The conv the mixer's forward actually ran (calls: mamba2.CONV_CALLS over that forward) against
    the one it should run; a fallback to the torch conv where causal_conv1d was due fails the case."""
    from looplab.models.config import CAUSAL_CONV1D_WIDTHS
    from looplab.models.mamba2 import FusedOps

    expected = "causal_conv1d" if mixer.kernel != "torch" and mixer.d_conv in CAUSAL_CONV1D_WIDTHS else "torch"
    ops = mixer._fused_ops(x)
    error = ops.causal_conv1d_error if isinstance(ops, FusedOps) else None
    fused, fallback = calls.get("causal_conv1d", 0), calls.get("torch", 0)
    ran = " + ".join(k for k, n in (("causal_conv1d", fused), ("torch", fallback)) if n) or "none counted"
    out: dict[str, Any] = {"ran": ran, "expected": expected, "calls": calls}
    if fused:
        out["layout"] = _conv_layout(mixer, x)
    if error:
        out["causal_conv1d_error"] = error
    why = conv_verdict(expected, calls, f"causal_conv1d: {error}" if error else None)
    if why:
        out["why"] = why
    return out


def _mixer_pair(kw: dict, kernel: str, device: str = "cuda"):
    import torch

    from looplab.models.mamba2 import Mamba2Mixer

    torch.manual_seed(0)
    ref = Mamba2Mixer(kernel="torch", **kw).to(device)
    with torch.no_grad():  # non-trivial conv bias and norm weight, as in tests/test_mamba2.py
        ref.conv1d.bias.normal_()
        ref.norm.weight.uniform_(0.5, 1.5)
    fused = Mamba2Mixer(kernel=kernel, **kw).to(device)
    fused.load_state_dict(ref.state_dict())
    return ref, fused


_GRAD_PARAMS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "dt_bias", "D", "norm.weight", "out_proj.weight")


def _fwd_bwd(mixer, x, g, bf16: bool, call=None):
    """Forward (through `call`, e.g. a compiled wrapper, if given) and backward; output and gradients."""
    import contextlib

    import torch

    xi = x.clone().requires_grad_()
    ctx = torch.autocast(x.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with ctx:
        y = (mixer if call is None else call)(xi)
    y.float().backward(g)
    grads = {"x": xi.grad.detach().clone()}
    grads.update({n: mixer.get_parameter(n).grad.detach().float().clone() for n in _GRAD_PARAMS})
    mixer.zero_grad(set_to_none=True)
    return y.detach().float(), grads


def _decode(mixer, x, bf16: bool, prefill: int):
    import contextlib

    import torch

    ctx = torch.autocast(x.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        cache = mixer.allocate_cache(x.shape[0], x.shape[1], x.device, x.dtype)
        parts = [mixer(x[:, :prefill], None, None, cache)]
        parts += [mixer(x[:, t : t + 1], None, None, cache) for t in range(prefill, x.shape[1])]
    return torch.cat(parts, 1).float()


def parity_case(kw: dict, kernel: str, precision: str, device: str = "cuda", length: int = PARITY_LEN,
                prefill: int = PARITY_PREFILL) -> dict[str, Any]:
    """Fused vs torch mixer, same weights: forward, gradients, prefill + step decoding, and which conv ran."""
    import torch

    from looplab.models.mamba2 import CONV_CALLS

    ref, fused = _mixer_pair(kw, kernel, device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(PARITY_BATCH, length, kw["d_model"], device=device, generator=gen)
    g = torch.randn(x.shape, device=device, generator=gen)
    bf16 = precision == "bf16"
    tol = dict(TOLERANCES[precision])
    yr, gr = _fwd_bwd(ref, x, g, bf16)
    CONV_CALLS.clear()
    yf, gf = _fwd_bwd(fused, x, g, bf16)
    conv = _conv_ran(fused, x, dict(CONV_CALLS))
    out: dict[str, Any] = {"kernel": kernel, "precision": "bf16 autocast" if bf16 else "fp32", "conv": conv}
    out["forward"] = _diff(yf, yr)
    out["grad"] = {n: _diff(gf[n], gr[n]) for n in gr}
    dec = _decode(fused, x, bf16, prefill)
    out["decode"] = {"vs_own_forward": _diff(dec, yf), "vs_torch_forward": _diff(dec, yr)}
    if bf16:  # the noise floor: what bf16 alone does to the torch path
        y32, g32 = _fwd_bwd(ref, x, g, False)
        noise = {"forward": _rel(yr, y32), "grad": max(_rel(gr[n], g32[n]) for n in gr)}
        noise["decode"] = noise["forward"]
        out["bf16_noise_floor"] = noise
        tol = {k: max(v, 2 * noise[k]) for k, v in tol.items()}
    out["tolerance"] = tol
    worst = {"forward": out["forward"]["max_rel"], "grad": max(d["max_rel"] for d in out["grad"].values()),
             "decode": max(d["max_rel"] for d in out["decode"].values())}
    out["worst"] = worst
    bad = [f"{k} {v:.3g} > {tol[k]:.3g}" for k, v in worst.items() if not v <= tol[k]]
    bad += [conv["why"]] if "why" in conv else []
    out["status"] = "fail" if bad else "pass"
    if bad:
        out["why"] = "; ".join(bad)
    return out


def compile_case(kw: dict, kernel: str = "mamba_ssm", device: str = "cuda", length: int = PARITY_LEN,
                 backend: str = "inductor") -> dict[str, Any]:
    """The fused mixer under torch.compile (bf16 autocast): equal to eager, its graph breaks counted
    (expected: the scan's and the conv's, each kept out of the graph by torch.compiler.disable)."""
    import torch
    import torch._dynamo.utils as dynamo_utils

    from looplab.models.mamba2 import CONV_CALLS

    _, fused = _mixer_pair(kw, kernel, device)
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(PARITY_BATCH, length, kw["d_model"], device=device, generator=gen)
    g = torch.randn(x.shape, device=device, generator=gen)
    ye, ge = _fwd_bwd(fused, x, g, True)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = torch.compile(fused, backend=backend)
    CONV_CALLS.clear()
    _fwd_bwd(fused, x, g, True, call=compiled)
    yc, gc = _fwd_bwd(fused, x, g, True, call=compiled)  # the second call reuses the graphs
    conv = _conv_ran(fused, x, dict(CONV_CALLS))
    breaks = dict(dynamo_utils.counters.get("graph_break", {}))
    tol = TOLERANCES["compile"]
    worst = {"forward": _rel(yc, ye), "grad": max(_rel(gc[n], ge[n]) for n in ge)}
    bad = [f"{k} {v:.3g} > {tol[k]:.3g}" for k, v in worst.items() if not v <= tol[k]]
    bad += [conv["why"]] if "why" in conv else []
    out = {"status": "fail" if bad else "pass", "precision": "bf16 autocast", "worst": worst, "tolerance": tol,
           "conv": conv,
           "graph_breaks": sum(breaks.values()), "graph_break_reasons": {str(k)[:300]: v for k, v in breaks.items()},
           "unique_graphs": dict(dynamo_utils.counters.get("stats", {})).get("unique_graphs", 0)}
    if bad:
        out["why"] = "; ".join(bad)
    return out


def parity_jobs() -> list[tuple[str, Any]]:
    """(name, thunk) of every GPU parity case."""
    jobs = [(f"{name}-{prec}", lambda kw=kw, kernel=kernel, prec=prec: parity_case(kw, kernel, prec))
            for name, kw, kernel in PARITY_SHAPES for prec in ("fp32", "bf16")]
    jobs.append(("d256-compiled", lambda: compile_case(PARITY_SHAPES[0][1])))
    return jobs


def decode_worker(out_path: Path, new_tokens: int = 128) -> int:
    """Issue 27: the static-shape decode step captured by CUDA graphs (torch.compile mode="reduce-overhead")
    decodes plain cached decoding's tokens; tokens/s of plain, static eager and the captured step, and of
    self-speculation (k = 2, γ = 4), on a random d 512 llama 2⊗4 at batch 1 and 8 (fp32: bf16 near-ties would
    flip greedy tokens between kernels and say nothing about the decoders)."""
    import torch

    from looplab.models import LoopedLM, LoopedLMConfig
    from looplab.models.generation import generate

    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=8192, d_model=512, n_heads=8, n_layers=2, n_loops=4, max_seq_len=512))
    model = model.to("cuda").eval()
    res: dict[str, Any] = {"status": "pass", "model": "llama 2x4 d512 fp32, random weights", "new_tokens": new_tokens}
    try:
        for batch in (1, 8):
            ids = torch.randint(0, 8192, (batch, 32), device="cuda")
            ref = generate(model, ids, new_tokens)
            row: dict[str, Any] = {}
            for name, kw in {"plain": {}, "static_eager": {"static_cache": "eager"},
                             "reduce_overhead": {"static_cache": "reduce-overhead"},
                             "speculative_k2_g4": {"speculative_loops": 2, "draft_tokens": 4}}.items():
                t0 = time.perf_counter()
                out = generate(model, ids, new_tokens, **kw)  # the first call compiles / captures
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = generate(model, ids, new_tokens, **kw)
                torch.cuda.synchronize()
                row[name] = {"tokens_per_s": round(batch * new_tokens / (time.perf_counter() - t0), 1),
                             "first_call_s": round(first, 2), "same_tokens": bool(torch.equal(out, ref))}
                if not row[name]["same_tokens"]:
                    res["status"] = "fail"
                    res["why"] = f"{name} at batch {batch} decoded other tokens than plain decoding"
            res[f"batch_{batch}"] = row
    except Exception as e:  # noqa: BLE001 — reported, not raised: the other checks still run
        res.update(status="error", error=f"{type(e).__name__}: {e}")
    out_path.write_text(json.dumps(res, indent=1))
    return 0 if res["status"] == "pass" else 1


def parity_worker(out_path: Path, jobs: list[tuple[str, Any]] | None = None) -> int:
    """Every parity case, each in its own try: writes {status, cases, worst} to out_path."""
    cases: dict[str, dict] = {}
    jobs = parity_jobs() if jobs is None else jobs
    for name, fn in jobs:
        t0 = time.monotonic()
        try:
            cases[name] = fn()
        except Exception as e:  # one failing case must not hide the others
            cases[name] = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        cases[name]["wall_s"] = round(time.monotonic() - t0, 1)
        print(f"[parity] {name}: {cases[name]['status']} {cases[name].get('why') or cases[name].get('error') or ''}",
              flush=True)
        if len(cases) < len(jobs):  # kept if the process dies in a later case (a CUDA fault)
            write_report(out_path, {"status": "error", "error": f"the parity worker stopped after case {name}",
                                    "cases": cases})
    worst: dict[str, dict] = {}
    for name, c in cases.items():
        for k, v in (c.get("worst") or {}).items():
            ratio = v / c["tolerance"][k]
            if k not in worst or ratio > worst[k]["ratio"]:
                worst[k] = {"value": v, "tol": c["tolerance"][k], "ratio": ratio, "case": name}
    statuses = [c["status"] for c in cases.values()]
    status = "error" if "error" in statuses else "fail" if "fail" in statuses else "pass"
    failed = [f"{n}: {c.get('why') or c.get('error')}" for n, c in cases.items() if c["status"] != "pass"]
    report = {"status": status, "worst": worst, "cases": cases}
    if failed:
        report["why" if status == "fail" else "error"] = " | ".join(failed)
    write_report(out_path, report)
    return 0


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m looplab.gpu_check", description=__doc__.split("\n\n")[1])
    ap.add_argument("--out", default="gpu-check.json", help="the JSON report (default gpu-check.json)")
    ap.add_argument("--workdir", default=None, help="run folders and logs (default outputs/gpu-check/<time>)")
    ap.add_argument("--only", default=None, help="comma-separated check names or prefixes (e.g. parity,train-llama)")
    ap.add_argument("--jobs", type=int, default=4, help="checks run at the same time (default 4)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="overall time budget in seconds")
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps per run (default 20)")
    ap.add_argument("--list", action="store_true", help="print the checks and their commands, run nothing")
    ap.add_argument("--preflight", action="store_true", help="only check that CUDA works and every kernel imports")
    ap.add_argument("--worker", choices=("parity", "decode"), help=argparse.SUPPRESS)
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
    if args.worker == "parity":
        return parity_worker(Path(args.out))
    if args.worker == "decode":
        return decode_worker(Path(args.out))

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
