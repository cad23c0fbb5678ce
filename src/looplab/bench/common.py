"""Shared pieces of the benchmarks: the machine, threads, side-by-side timing, the matmul ceiling, peak memory.

Everything is timed **round-robin in one process**: repeat k of every candidate runs
before repeat k+1 of any (odd rounds in reverse order), so a machine that gets busier
halfway (this one is shared) slows all candidates alike and the ratios stay honest.
Figures are medians.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)  # CPU training uses no inter-op parallelism; fails once work has started
    except RuntimeError:
        pass


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int) -> dict:
    info = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "dtype": "float32",
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def time_side_by_side(
    fns: dict[str, Callable[[], None]],
    warmup: int = 1,
    repeats: int = 3,
    cpu_times: dict | None = None,
    ceiling: Callable[[], float] | None = None,
    local_ceilings: dict | None = None,
) -> dict[str, list[float]]:
    """Wall seconds per call of each fn, interleaved round-robin after `warmup` untimed calls of each.

    If `cpu_times` is a dict, it receives this process's CPU seconds per call as well: on a
    machine shared with other jobs the wall clock includes time spent descheduled, the CPU
    clock does not (with one thread it is the steadier figure; with several it also counts
    the threads' spin-waits).

    If `ceiling` is given (a call returning GFLOP/s, see `matmul_probe`), it runs right
    before and right after every timed call, and `local_ceilings` receives the mean of the
    two per call: this VM's matmul throughput drifts by ±25% over seconds (measured
    185–290 GFLOP/s within 30 s of an idle machine), so a utilisation figure must divide
    by the ceiling of the same moment, not by one measured a minute earlier.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    local: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for r in range(repeats):
        # ABBA: odd rounds run in reverse, so a drift within a round favours no candidate
        for k in order if r % 2 == 0 else order[::-1]:
            fn = fns[k]
            before = ceiling() if ceiling else 0.0
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
            if ceiling:
                local[k].append((before + ceiling()) / 2)
    if cpu_times is not None:
        cpu_times.update(cpu)
    if local_ceilings is not None and ceiling:
        local_ceilings.update(local)
    return times


def matmul_probe(n: int = 2048, calls: int = 1, device: str = "cpu", dtype=torch.float32) -> Callable[[], float]:
    """A call that runs `calls` `torch.mm` at n³ and returns their GFLOP/s (the ceiling probe).

    fp32 on the CPU; on CUDA the training dtype (bf16: the tensor-core ceiling), synchronised.
    """
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    cuda = torch.device(device).type == "cuda"
    torch.mm(a, b, out=out)  # page in the buffers, pick the kernel

    def probe() -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b, out=out)
        if cuda:
            torch.cuda.synchronize()
        return calls * 2 * n**3 / (time.perf_counter() - t0) / 1e9

    return probe


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def first_compiled_call(step: Callable[[], None]) -> dict:
    """Run a step whose model was just compiled (the call that compiles its graphs):
    {"compile_s": seconds}, or {"error": why} where inductor cannot run (e.g. no C++ toolchain)."""
    t0 = time.perf_counter()
    try:
        step()
    except Exception as e:  # noqa: BLE001 — recorded, so the other figures still come out
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {"compile_s": round(time.perf_counter() - t0, 1)}


# ----------------------------------------------------------------- memory
# tracemalloc does not see torch's CPU allocations, and the CPU allocator keeps no
# peak statistics, so peak memory is the process's resident set: each configuration
# runs in a fresh subprocess, the peak-RSS mark (VmHWM) is reset after setup through
# /proc/self/clear_refs (Linux ≥ 4.0) and read again after one training step.


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def run_probes(module: str, specs: dict[str, dict], threads: int, parallel: int = 1, timeout: float = 900) -> dict:
    """Run `python -m <module> --probe '<json spec>'` per spec in fresh processes, `parallel` at a time;
    return {key: the JSON each printed last} (or {"error": ...})."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out: dict = {}
    pending = list(specs.items())
    while pending:
        batch, pending = pending[:parallel], pending[parallel:]
        procs = {
            k: subprocess.Popen([sys.executable, "-m", module, "--probe", json.dumps(s), "--threads", str(threads)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for k, s in batch
        }
        for k, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                tail = (stderr or stdout).strip().splitlines()[-3:]
                out[k] = {"error": f"probe exited {proc.returncode}: {' | '.join(tail)}"}
            else:
                out[k] = json.loads(lines[-1])
    return out
