"""On a shared machine idle OpenMP threads sleep (docs/performance.md#on-a-shared-machine).

What is checked is the setting each entry point runs with, not a speed: that `make` targets and `python -m
looplab.*` get OMP_WAIT_POLICY=PASSIVE before torch is imported, and that a user's own choice is kept. The
speed it buys is a benchmark's figure (measured in the docs), never a timed test."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "MAKEFLAGS", "MAKELEVEL")}
    return {**env, "PYTHONPATH": str(ROOT / "src"), **extra}


PROBE = ("import sys, os, looplab; assert 'torch' not in sys.modules, 'torch came first'; import torch; "
         "print(os.environ['OMP_WAIT_POLICY'], torch.get_num_threads())")


def test_looplab_sets_a_sleeping_wait_policy_before_torch_is_imported_and_keeps_the_users():
    out = subprocess.run([sys.executable, "-c", PROBE], env=_env(), capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", PROBE], env=_env(OMP_WAIT_POLICY="ACTIVE"), capture_output=True,
                         text=True, timeout=1800)
    assert out.stdout.split()[0] == "ACTIVE"  # the user's choice wins
    assert "libgomp" not in out.stderr  # a value GNU OpenMP accepts


def test_every_make_target_exports_it_unless_the_user_set_it():
    show = ["make", "-s", "--no-print-directory", "-f", "Makefile", "--eval", "show-omp: ; @echo $$OMP_WAIT_POLICY",
            "show-omp"]
    assert subprocess.run(show, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=1800).stdout.strip() == "PASSIVE"
    assert subprocess.run(show, cwd=ROOT, env=_env(OMP_WAIT_POLICY="ACTIVE"), capture_output=True, text=True,
                          timeout=1800).stdout.strip() == "ACTIVE"


def test_the_shared_machine_bench_runs_each_condition_with_its_setting_and_reads_the_figure(tmp_path, monkeypatch):
    """The conditions' environments and the figure it reads, with a stand-in for the demo (real demo runs are
    the benchmark's, minutes each)."""
    import json

    from looplab.bench import shared_machine

    seen = []

    def fake_demo(steps, env, run_dir):
        seen.append((steps, dict(env)))
        line = f"steps {steps} · {1000 + len(seen):,} training tokens/s · wall 1 s"
        return subprocess.Popen([sys.executable, "-c", f"print({line!r})"], stdout=subprocess.PIPE, text=True)

    monkeypatch.setattr(shared_machine, "_demo", fake_demo)
    monkeypatch.setattr(shared_machine, "LOAD_SCRIPT", "import time; time.sleep(600)")
    out = tmp_path / "shared.json"
    assert shared_machine.main(["--steps", "7", "--load-steps", "3", "--load", "1", "--repeats", "1",
                                "--out", str(out)]) == 0
    res = json.loads(out.read_text())["tokens_per_s"]
    assert list(res) == ["alone/spinning", "alone/sleeping", "alone/one_thread", "beside_1_busy/spinning",
                         "beside_1_busy/sleeping", "beside_1_busy/one_thread", "two_demos/spinning", "two_demos/sleeping"]
    assert res["alone/spinning"] == [1001.0] and len(res["two_demos/sleeping"]) == 2
    assert [s for s, _ in seen] == [7, 7, 7, 3, 3, 3, 3, 3, 3, 3]
    assert seen[0][1] == {"GOMP_SPINCOUNT": "300000"} and seen[1][1] == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert seen[2][1] == {"OMP_NUM_THREADS": "1"}


def test_a_failed_demo_run_is_an_error_with_its_output():
    import pytest

    from looplab.bench import shared_machine

    proc = subprocess.Popen([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], stdout=subprocess.PIPE,
                            text=True)
    with pytest.raises(RuntimeError, match=r"exit 3.*boom"):
        shared_machine._tokens_per_s(proc)
