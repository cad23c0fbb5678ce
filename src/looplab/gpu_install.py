"""`python -m looplab.gpu_install [--constraint constraints.txt]` (`make gpu-install`; `make gpu-check` runs it once)

Builds looplab's gpu extra (pyproject.toml: triton, causal-conv1d, mamba-ssm) into this environment the
way their READMEs say: torch first (already installed, kept at its pin by the constraint file), then
`pip install --no-build-isolation`, causal-conv1d before mamba-ssm. Both setup.py files import torch
and compile CUDA extensions against it (causal_conv1d_cuda; mamba-ssm's selective_scan_cuda, which
every released mamba-ssm up to 2.3.2 imports on `import mamba_ssm`). Under pip's default build
isolation they would be built against a second torch fetched from PyPI, not the one that loads
them. Neither publishes a wheel for torch 2.13, so both compile with nvcc: minutes each, once.

In order; each refusal names what is missing and how to get it:
1. CUDA: a CUDA build of torch and a visible device (gpu_check's words). Exit 2 on a CPU machine,
   before anything is installed or built.
2. Every kernel already imports: nothing to do.
3. Build prerequisites: pip installs mamba-ssm's [build-system] requirements (setuptools, wheel,
   packaging, ninja; absent without isolation), then checks nvcc under CUDA_HOME (found as torch's
   cpp_extension finds it), nvcc's CUDA major version against torch's, the CUDA headers, a C++
   compiler and Python.h. Exit 2 when one is missing: nothing built.
4. `pip install --no-build-isolation REQ` for each requirement of the extra.
5. `python -m looplab.gpu_check --preflight` in a fresh process: every kernel imports.
Exit status: 0 installed (or already), 1 a build or the final preflight failed, 2 refused.

Upstream's own switches pass through the environment: CAUSAL_CONV1D_FORCE_BUILD=TRUE and
MAMBA_FORCE_BUILD=TRUE skip their guess at a prebuilt wheel on GitHub; MAX_JOBS caps ninja's jobs.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Mapping

# mamba-ssm's [build-system] requires, less torch (here already); without build isolation pip does not
# fetch them, and ninja also has to be on PATH for torch's BuildExtension (else a slow serial build).
BUILD_REQUIREMENTS = ("setuptools>=61", "wheel", "packaging", "ninja")
BUILD_MODULES = ("setuptools", "wheel", "packaging", "ninja")
BUILD_ORDER = ("triton", "causal-conv1d", "mamba-ssm")  # mamba-ssm's README: causal-conv1d, then mamba-ssm


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def gpu_requirements(pyproject: Path | None = None) -> list[str]:
    """The gpu extra's requirements in build order: from the checkout's pyproject.toml when there is one
    (what `make` was run on), else from the installed looplab's metadata."""
    pyproject = pyproject or Path(__file__).resolve().parents[2] / "pyproject.toml"
    reqs: list[str] = []
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "looplab":
            reqs = list(project.get("optional-dependencies", {}).get("gpu", []))
    if not reqs:
        import importlib.metadata as md

        reqs = [r.split(";")[0].strip() for r in md.requires("looplab") or []
                if re.search(r"""extra\s*==\s*["']gpu["']""", r)]
    if not reqs:
        raise SystemExit("gpu-install: looplab declares no gpu extra (pyproject.toml [project.optional-dependencies])")
    rank = {name: i for i, name in enumerate(BUILD_ORDER)}
    return sorted(reqs, key=lambda r: rank.get(_name(r), len(rank)))


def build_env(environ: Mapping[str, str], constraint: Path | None, python: str = sys.executable) -> dict[str, str]:
    """The builds' environment: this interpreter's bin folder first on PATH (pip's `ninja` and the
    interpreter itself, found by torch's BuildExtension by name), and the constraint that keeps torch."""
    env = dict(environ)
    env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
    if constraint is not None:
        env["PIP_CONSTRAINT"] = str(constraint)
    return env


def find_cuda_home(env: Mapping[str, str]) -> str | None:
    """The CUDA toolkit the builds will use, found as torch.utils.cpp_extension finds it: CUDA_HOME,
    CUDA_PATH, the folder above the `nvcc` on PATH, /usr/local/cuda."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        return str(Path(nvcc).parent.parent)
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda") else None


def nvcc_version(nvcc: str, env: Mapping[str, str]) -> tuple[int, int] | str:
    """(major, minor) from `nvcc -V`, as both setup.py files read it; or why it could not be read."""
    try:
        out = subprocess.run([nvcc, "-V"], capture_output=True, text=True, timeout=60, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    m = re.search(r"release (\d+)\.(\d+)", out.stdout)
    if out.returncode != 0 or not m:
        return f"exit code {out.returncode}, output {(out.stdout + out.stderr).strip()[:200]!r}"
    return int(m.group(1)), int(m.group(2))


def prerequisite_problems(env: Mapping[str, str], torch_cuda: str | None) -> list[str]:
    """What the CUDA builds need and this machine lacks, each with its fix; empty when they can start."""
    import importlib.util

    problems = []
    home = find_cuda_home(env)
    if home is None:
        problems.append(f"nvcc not found (no CUDA_HOME or CUDA_PATH, no nvcc on PATH, no /usr/local/cuda): "
                        f"install the CUDA toolkit {torch_cuda or ''} that matches torch (a *-devel image has it) "
                        "and set CUDA_HOME to it")
    else:
        nvcc = Path(home) / "bin" / "nvcc"
        if not os.access(nvcc, os.X_OK):
            problems.append(f"nvcc not found at {nvcc} (CUDA_HOME={home}): set CUDA_HOME to the CUDA toolkit's folder")
        else:
            version = nvcc_version(str(nvcc), env)
            if isinstance(version, str):
                problems.append(f"{nvcc} -V does not run ({version})")
            elif torch_cuda and version[0] != int(torch_cuda.split(".")[0]):
                problems.append(f"nvcc at {nvcc} is CUDA {version[0]}.{version[1]} but torch was built with CUDA "
                                f"{torch_cuda}: torch's extension builder refuses different major versions; install "
                                f"CUDA {torch_cuda.split('.')[0]}.x and set CUDA_HOME to it")
        if not (Path(home) / "include" / "cuda_runtime.h").is_file():
            problems.append(f"no CUDA headers at {home}/include (cuda_runtime.h): CUDA_HOME must be the toolkit's "
                            "folder (an nvcc wrapper on PATH is not enough; set CUDA_HOME)")
    cxx = env.get("CXX") or "c++"
    if shutil.which(cxx, path=env.get("PATH")) is None:
        problems.append(f"no C++ compiler ({cxx}) on PATH: install g++ (e.g. apt-get install build-essential)")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        problems.append(f"no Python.h in {include}: install this Python's headers (e.g. apt-get install "
                        f"python{sys.version_info.major}.{sys.version_info.minor}-dev)")
    for module in BUILD_MODULES:
        if importlib.util.find_spec(module) is None:
            problems.append(f"the Python package {module} is not installed (pip install {module})")
    if shutil.which("ninja", path=env.get("PATH")) is None:
        problems.append("no ninja on PATH (pip install ninja puts it next to this Python)")
    return problems


Runner = Callable[..., subprocess.CompletedProcess]


def main(argv: list[str] | None = None, run: Runner = subprocess.run) -> int:
    ap = argparse.ArgumentParser(prog="python -m looplab.gpu_install", description=__doc__.split("\n\n")[1])
    ap.add_argument("--constraint", default="constraints.txt",
                    help="pip constraint file that pins torch (default constraints.txt; 'none' for none)")
    args = ap.parse_args(argv)

    from looplab import gpu_check

    if gpu_check.cuda_problems():  # a CPU machine: refuse before installing or building anything
        print(gpu_check.refusal(gpu_check.preflight(), "nothing was built, run or written"), file=sys.stderr)
        return 2
    if not gpu_check.kernel_import_problems():
        print("[gpu-install] CUDA works and every kernel imports; nothing to build")
        return 0

    import torch

    constraint = None
    if args.constraint != "none":
        constraint = Path(args.constraint).resolve()
        if not constraint.is_file():
            print(f"gpu-install refused: constraint file {constraint} does not exist (pass --constraint PATH, "
                  "or --constraint none)", file=sys.stderr)
            return 2
    env = build_env(os.environ, constraint)
    pip = [sys.executable, "-m", "pip", "install"]
    print(f"[gpu-install] build prerequisites: {' '.join(BUILD_REQUIREMENTS)}", flush=True)
    rc = run([*pip, *BUILD_REQUIREMENTS], env=env).returncode
    problems = prerequisite_problems(env, torch.version.cuda)
    if rc != 0:
        problems.insert(0, f"`pip install {' '.join(BUILD_REQUIREMENTS)}` failed (exit code {rc}, output above)")
    if problems:
        print("gpu-install refused before building anything: " + "; ".join(problems) + ".", file=sys.stderr)
        return 2

    for req in gpu_requirements():
        cmd = [*pip, "--no-build-isolation", req]
        print(f"[gpu-install] {shlex.join(cmd)}  (against torch {torch.__version__}; a CUDA build takes minutes)",
              flush=True)
        rc = run(cmd, env=env).returncode
        if rc != 0:
            print(f"gpu-install failed: `{shlex.join(cmd)}` exited with {rc} (its output is above)", file=sys.stderr)
            return 1
    rc = run([sys.executable, "-m", "looplab.gpu_check", "--preflight"], env=env).returncode
    if rc != 0:
        print("gpu-install failed: the gpu extra is installed but a kernel does not import (above)", file=sys.stderr)
        return 1
    print("[gpu-install] done: every kernel imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
