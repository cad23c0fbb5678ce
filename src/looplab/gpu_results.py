"""What gpu-check's checks produced, read back (`looplab.gpu_check`, docs/gpu.md#gpu-check): each kind's parser turns a
check's exit code, log and output file into a result (pass / fail / error / skipped, with its figures), and the
report gathers them into gpu-check.json and a table. The counters the training runs write come from here too."""

from __future__ import annotations

import json
import math
import os
import platform
import re
from pathlib import Path
from typing import Any

GPU_MARK = "gpu"  # pyproject.toml's marker of the tests that need CUDA
STEPS = 20  # training steps per run

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


def parse_train(check, rc: int, log: str) -> dict[str, Any]:
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


def parse_fsdp(check, rc: int, log: str) -> dict[str, Any]:
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


def parse_bench(check, rc: int, log: str) -> dict[str, Any]:
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


def parse_tests(check, rc: int | None, log: str) -> dict[str, Any]:
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


def make_report(results: dict[str, dict], machine: dict, workdir: Path, started_at: str, wall_s: float,
                steps: int = STEPS) -> dict:
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r.get("status", "error")] = counts.get(r.get("status", "error"), 0) + 1
    status = "pass" if results and all(r.get("status") == "pass" for r in results.values()) else "fail"
    return {"status": status, "counts": counts, "started_at": started_at, "wall_s": round(wall_s, 1),
            "workdir": str(workdir), "machine": machine, "steps": steps,
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


