"""Shared pieces of the benchmarks: the machine, threads, the timer, the matmul ceiling, peak memory.

Everything is timed by `time_round_robin`, **round-robin in one process**: round k of every
candidate runs before round k+1 of any (odd rounds in reverse order), so a machine that gets
busier halfway (this one is shared) slows all candidates alike and the ratios stay honest.
Figures are medians; ratios are medians over rounds of the per-round ratio.
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
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

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


# ----------------------------------------------------------------- timing
# the clocks, as module attributes so that a test can substitute a fake one
_wall, _cpu = time.perf_counter, time.process_time


class Stepper:
    """A candidate whose timed call needs state made outside the timing (a cache, a prefilled prompt, a batch).

    `start(episode)` runs untimed before each episode (episode 0, 1, ...); `step(i)` is the timed call, i counting
    from 0 within the episode. Decoding one sequence token by token is one episode: `start` allocates the cache,
    each `step` decodes one token. What `step` returns goes to the timer's `after` hook.
    """

    def start(self, episode: int) -> None:
        pass

    def step(self, i: int) -> Any:
        raise NotImplementedError


class _Calls(Stepper):
    """A plain call as a stepper: nothing to prepare."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn

    def step(self, i: int) -> Any:
        return self.fn()


class Ratio(NamedTuple):
    """A paired ratio: median and range over rounds of the per-round ratio."""

    median: float
    low: float
    high: float


@dataclass
class Timings:
    """Seconds of every timed call, one per round and candidate, in round order: `wall` (perf_counter) and `cpu`
    (this process's CPU time, all its threads); `ceiling`: the matmul probe's GFLOP/s around each call (empty
    lists without a probe). Ratios pair the calls of one round, which ran back to back."""

    reference: str
    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]
    ceiling: dict[str, list[float]]

    def seconds(self, name: str, clock: str = "wall") -> list[float]:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"clock {clock!r}: choose wall or cpu")
        return (self.wall if clock == "wall" else self.cpu)[name]

    def median(self, name: str, clock: str = "wall") -> float:
        return median(self.seconds(name, clock))

    def ratios(self, name: str, reference: str | None = None, clock: str = "wall") -> list[float]:
        """Round by round: name's time / the reference's time (a ratio above 1: name is slower)."""
        ref = self.seconds(reference or self.reference, clock)
        return [a / b for a, b in zip(self.seconds(name, clock), ref)]

    def ratio(self, name: str, reference: str | None = None, clock: str = "wall") -> Ratio:
        """Median and range over rounds of `ratios`: load that changes between rounds cancels out, which a
        ratio of two medians does not guarantee."""
        r = self.ratios(name, reference, clock)
        return Ratio(median(r), min(r), max(r))


def cuda_sync(device) -> Callable[[], None]:
    """A call that waits for `device`'s queued kernels (torch.cuda.synchronize) when it is a GPU, else does
    nothing: CUDA calls return once their kernels are queued, so unsynchronised wall time measures the launch."""
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.synchronize(dev)


def device_of(module: torch.nn.Module) -> torch.device:
    """Where a model's parameters live (the device the timer synchronises)."""
    return next(module.parameters()).device


def time_round_robin(
    candidates: dict[str, Callable[[], Any] | Stepper],
    repeats: int | None = None,
    *,
    warmup: int = 1,
    episodes: Sequence[int] | None = None,
    reference: str | None = None,
    device=None,
    ceiling: Callable[[], float] | None = None,
    after: Callable[[str, Any], None] | None = None,
) -> Timings:
    """Time candidates side by side in one process: plain calls, or `Stepper`s (stateful steps).

    A round runs one call (or step) of every candidate, in dict order on even rounds and reversed on odd ones
    (ABBA: a drift within a round favours no candidate; the alternation runs on through the warm-up). Give
    `repeats` (one episode of `warmup + repeats` rounds) or `episodes` (their lengths in rounds: before each
    one, every stepper's `start` runs untimed). The first `warmup` rounds are not recorded. `reference` (default:
    the first candidate) is what `Timings.ratio` divides by unless told otherwise.

    On a machine shared with other jobs the wall clock includes time spent descheduled and the CPU clock does
    not: with one thread it is the steadier figure, with several it also counts the threads' spin-waits, and on
    a GPU it counts the host's wait for the device. With `device` a GPU, the device is synchronised before and
    after each timed call (and after each `start`), so wall time runs until the call's kernels have finished.

    `ceiling` (a call returning GFLOP/s, see `matmul_probe`) runs right before and right after every timed call
    and `Timings.ceiling` keeps the mean of the two: this VM's matmul throughput drifts by ±25% over seconds
    (measured 185–290 GFLOP/s within 30 s of an idle machine), so a utilisation figure must divide by the
    ceiling of the same moment. `after(name, returned)` runs after every call, warm-up included, untimed: to
    check or keep what the call produced.
    """
    if (repeats is None) == (episodes is None):
        raise TypeError("time_round_robin: give exactly one of repeats (plain calls) and episodes (their lengths)")
    steppers = {k: c if isinstance(c, Stepper) else _Calls(c) for k, c in candidates.items()}
    reference = reference or next(iter(steppers))
    if reference not in steppers:
        raise KeyError(f"reference {reference!r} is not a candidate ({', '.join(steppers)})")
    sync = cuda_sync(device)
    wall: dict[str, list[float]] = {k: [] for k in steppers}
    cpu: dict[str, list[float]] = {k: [] for k in steppers}
    local: dict[str, list[float]] = {k: [] for k in steppers}
    order = list(steppers)
    r = 0
    for episode, length in enumerate([warmup + repeats] if episodes is None else episodes):
        for s in steppers.values():
            s.start(episode)
        sync()
        for i in range(length):
            timed = r >= warmup
            for k in order if r % 2 == 0 else order[::-1]:
                before = ceiling() if ceiling and timed else 0.0
                sync()
                c0, t0 = _cpu(), _wall()
                out = steppers[k].step(i)
                sync()
                t1, c1 = _wall(), _cpu()
                if timed:
                    wall[k].append(t1 - t0)
                    cpu[k].append(c1 - c0)
                    if ceiling:
                        local[k].append((before + ceiling()) / 2)
                if after:
                    after(k, out)
            r += 1
    return Timings(reference, wall, cpu, local)


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


def first_compiled_call(step: Callable[[], None], device=None) -> dict:
    """Run a step whose model was just compiled (the call that compiles its graphs), once and synchronised
    on `device`: {"compile_s": seconds}, or {"error": why} where inductor cannot run (e.g. no C++ toolchain)."""
    sync = cuda_sync(device)
    t0 = _wall()
    try:
        step()
        sync()
    except Exception as e:  # noqa: BLE001 — recorded, so the other figures still come out
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {"compile_s": round(_wall() - t0, 1)}


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
