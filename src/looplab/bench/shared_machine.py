"""`python -m looplab.bench.shared_machine [--steps 200] [--load-steps 100] [--load 3] [--repeats 2] [--out FILE.json]`

The demo's training alone and on a shared machine, under OpenMP's wait policies (docs/performance.md#on-a-shared-machine).

Each condition is one `python -m looplab.train` of the demo's model (p-hop 1⊗4, no validation, no test) whose
printed training tokens/s is read back:

* alone, spinning (GNU OpenMP's default, `GOMP_SPINCOUNT=300000`), sleeping (`OMP_WAIT_POLICY=PASSIVE`, looplab's
  default) and one thread;
* the same beside `--load` busy torch processes (small training loops with OpenMP's default, spinning);
* two demos at once, both spinning or both sleeping.

Conditions alternate within each repeat, so a drift of the machine favours none. Run it on an otherwise idle
machine: the load is the one it makes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SPINNING = {"GOMP_SPINCOUNT": "300000"}  # libgomp's default spin count: overrides the policy looplab sets
SLEEPING = {"OMP_WAIT_POLICY": "PASSIVE"}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
LOAD_SCRIPT = """
import torch
m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
o = torch.optim.AdamW(m.parameters())
x = torch.randn(64, 256)
while True:
    m(x).square().mean().backward(); o.step(); o.zero_grad()
"""
TOKENS_PER_S = re.compile(r"steps (\d+) · ([\d,]+) training tokens/s")


def _demo(steps: int, env: dict[str, str], run_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "looplab.train", "logger=csv", f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
           "test_after_fit=false", "eval_per_depth=false", "loop_diagnostics=false", f"hydra.run.dir={run_dir}"]
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    return subprocess.Popen(cmd, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _tokens_per_s(proc: subprocess.Popen) -> float:
    out = proc.communicate()[0]
    m = TOKENS_PER_S.search(out)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"the demo run failed (exit {proc.returncode}): {out[-2000:]}")
    return float(m.group(2).replace(",", ""))


def measure(steps: int, load_steps: int, load: int, repeats: int, workdir: Path) -> dict[str, list[float]]:
    settings = {"spinning": SPINNING, "sleeping": SLEEPING, "one_thread": ONE_THREAD}
    res: dict[str, list[float]] = {}
    n = iter(range(10**6))

    def run(name: str, steps: int, env: dict[str, str]) -> None:
        res.setdefault(name, []).append(_tokens_per_s(_demo(steps, env, workdir / f"run{next(n)}")))

    for _ in range(repeats):
        for s, env in settings.items():
            run(f"alone/{s}", steps, env)
    loaders = [subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT], env={**os.environ, **SPINNING})
               for _ in range(load)]
    try:
        for _ in range(repeats):
            for s, env in settings.items():
                run(f"beside_{load}_busy/{s}", load_steps, env)
    finally:
        for p in loaders:
            p.kill()
            p.wait()
    for _ in range(repeats):
        for s in ("spinning", "sleeping"):
            pair = [_demo(load_steps, settings[s], workdir / f"run{next(n)}") for _ in range(2)]
            res.setdefault(f"two_demos/{s}", []).extend(_tokens_per_s(p) for p in pair)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m looplab.bench.shared_machine", description=__doc__.split("\n\n")[1])
    ap.add_argument("--steps", type=int, default=200, help="training steps of a run alone")
    ap.add_argument("--load-steps", type=int, default=100, help="training steps of a run beside a load")
    ap.add_argument("--load", type=int, default=3, help="busy torch processes beside the demo")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/shared_machine.json")
    a = ap.parse_args(argv)
    for name in ("steps", "load_steps", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at least 1")
    if a.load < 0:
        ap.error(f"--load {a.load}: must be 0 or more")
    with tempfile.TemporaryDirectory(prefix="looplab-shared-") as tmp:
        res = measure(a.steps, a.load_steps, a.load, a.repeats, Path(tmp))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokens_per_s": res, "steps": a.steps, "load_steps": a.load_steps, "load": a.load,
                               "cpus": os.cpu_count()}, indent=1) + "\n")
    for name, v in res.items():
        print(f"{name:28s} " + " ".join(f"{x:8,.0f}" for x in v))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
