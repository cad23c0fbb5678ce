"""Bad input at the command line: one clean line on stderr, the traceback in a log file.

A config or data error is the user's to fix, and its message already names the bad value, so the entry points
(`python -m looplab.train`, `.eval`, `.generate`, `.tables`) print that message as one line and exit with status 1:

    python -m looplab.train: error: d_model=65 is not divisible by n_heads=4; pick n_heads among the divisors of 65 (traceback: outputs/train/runs/2026-12-05_10-00-00/train.log)

The traceback goes to the run's log (train: the Hydra job's log file in the run folder, `<run>/train.log`, next to
the `results.json` that records the failure); the CLIs without a run folder write it to
`<temp dir>/looplab-logs/<command>-<time>-<pid>.log`. Bad input is (`input_error`):

- a `ValueError` raised by looplab's own code: `ConfigError` and every check that names a value (a ValueError
  raised inside another library, e.g. torch, is not input: it is a bug until shown otherwise);
- a missing file (`FileNotFoundError`: a data file, a checkpoint, a tokenizer);
- a mandatory config value left unset (OmegaConf's `MissingMandatoryValue`, e.g. `dataset=hf` without `dataset.source`);
- any of these raised while Hydra instantiates a config node (`InstantiationException`, e.g. `dataset.batch_size=0`).

Anything else is unexpected (a bug) and keeps its full traceback on the terminal. `LOOPLAB_FULL_ERROR=1` (or
Hydra's own `HYDRA_FULL_ERROR=1`) prints the traceback of input errors too. Hydra reports its own composition errors
(an unknown option `backbone=foo`) itself, compactly and before any run folder exists; the variant names
`python -m looplab.train` is given, and a key a group does not have (`loop_depth.loopz=3`, the keys of a
researcher's state mode), are checked before Hydra composes (training/variants.py), so a typo there is one line
naming the closest names and the valid ones, not Hydra's "use +". In a sweep Hydra reports key typos per job.

In a `-m` sweep nothing changes: a failed job is recorded in its results.json and the sweep goes on
(training.run_utils.task_wrapper); `clean_errors` only acts on a single run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

EXIT_CODE = 1
FULL_ERROR_ENV = ("LOOPLAB_FULL_ERROR", "HYDRA_FULL_ERROR")


def input_error(exc: BaseException) -> BaseException | None:
    """The exception to report in one line when `exc` is bad input (see the module docstring), else None."""
    from hydra.errors import InstantiationException
    from omegaconf.errors import MissingMandatoryValue

    if isinstance(exc, InstantiationException):
        return input_error(exc.__cause__) if exc.__cause__ is not None else None
    if isinstance(exc, (FileNotFoundError, MissingMandatoryValue)):
        return exc
    if isinstance(exc, ValueError) and (type(exc).__module__.startswith("looplab") or _raised_in_looplab(exc)):
        return exc
    return None


def _raised_in_looplab(exc: BaseException) -> bool:
    """Whether the innermost Python frame of exc's traceback is looplab code (a builtin such as int() called
    from looplab counts as looplab's: it has no frame of its own)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    g = tb.tb_frame.f_globals
    name = str(g.get("__name__", ""))
    if name == "__main__" and g.get("__spec__") is not None:  # `python -m looplab.generate`: its module is __main__
        name = g["__spec__"].name
    return name == "looplab" or name.startswith("looplab.")


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (multi-line messages joined with '; '; OmegaConf's without the
    full_key / object_type lines it appends)."""
    from omegaconf.errors import OmegaConfBaseException

    text = str(exc)
    if isinstance(exc, OmegaConfBaseException) and getattr(exc, "msg", None):
        first, key = exc.msg.strip().splitlines()[0], getattr(exc, "full_key", None)
        text = first + (f" (full_key: {key})" if key and key not in first else "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return "; ".join(lines) or type(exc).__name__


def full_error_requested() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes") for k in FULL_ERROR_ENV)


def default_log_file(prog: str) -> Path:
    """Where a CLI without a run folder writes a traceback: <temp dir>/looplab-logs/<command>-<time>-<pid>.log."""
    name = prog.split()[-1].replace(".", "-")
    return Path(tempfile.gettempdir()) / "looplab-logs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def write_traceback(exc: BaseException, log_file: Path | None, prog: str) -> Path:
    """Append exc's full traceback to `log_file` (default: default_log_file(prog)), through the logging handler
    that already writes that file when there is one (a Hydra job's <run>/<job>.log: same format as its other
    lines); the file."""
    message = f"{prog}: bad input, stopping: {one_line(input_error(exc) or exc)}"
    path = Path(log_file) if log_file is not None else default_log_file(prog)
    handlers = [h for h in logging.getLogger().handlers
                if isinstance(h, logging.FileHandler) and Path(h.baseFilename).resolve() == path.resolve()]
    if handlers:
        record = logging.getLogger("looplab").makeRecord("looplab", logging.ERROR, __file__, 0, "%s", (message,),
                                                         (type(exc), exc, exc.__traceback__))
        handlers[0].handle(record)
        handlers[0].flush()
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}\n{''.join(traceback.format_exception(exc))}")
    return path


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@contextlib.contextmanager
def clean_errors(prog: str, log_file: Path | None = None, *, multirun: bool = False) -> Iterator[None]:
    """Turn bad input raised inside into one line on stderr and exit status EXIT_CODE, the traceback written to
    the log (write_traceback). Other exceptions, every exception of a sweep job (multirun=True) and, with
    LOOPLAB_FULL_ERROR=1 / HYDRA_FULL_ERROR=1, input errors too propagate unchanged."""
    try:
        yield
    except Exception as exc:
        err = input_error(exc)
        if err is None or multirun or full_error_requested():
            raise
        where = write_traceback(exc, log_file, prog)
        for h in logging.getLogger().handlers:  # what was logged before the error reaches the terminal first
            h.flush()
        sys.stdout.flush()
        print(f"{prog}: error: {one_line(err)} (traceback: {_shown(where)})", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CODE) from None


def hydra_job() -> tuple[Path | None, bool]:
    """(the current Hydra job's log file <output_dir>/<job name>.log, whether it is a multirun job); (None, False)
    outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        return Path(hc.runtime.output_dir) / f"{hc.job.name}.log", hc.mode == RunMode.MULTIRUN
    except Exception:  # not inside a Hydra job
        return None, False


@contextlib.contextmanager
def clean_job_errors(prog: str) -> Iterator[None]:
    """clean_errors for the body of a @hydra.main task function: the traceback into the job's log file, sweeps untouched."""
    log_file, multirun = hydra_job()
    with clean_errors(prog, log_file, multirun=multirun):
        yield


def run_cli(main: Callable[[], T], prog: str) -> T:
    """main() under clean_errors: what a CLI's `if __name__ == "__main__":` calls."""
    with clean_errors(prog):
        return main()
