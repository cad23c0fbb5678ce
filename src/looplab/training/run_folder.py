"""A run owns its folder: one live run per folder, a resume only with the overrides that trained the checkpoint,
and no temporary files left behind by killed or failed saves.

`claim_run_folder` wraps every attempt of `python -m looplab.train` (train.py `train`):

* **The lock.** Global rank 0 (the process that launches the others, or rank 0 of an srun / torchrun job) takes
  `fcntl.flock` on `<run>/.lock` before anything is written and holds it for the whole attempt; the file records its
  PID, host and SLURM job. A second run into a folder whose lock is held is refused in one line naming that PID
  (`RunFolderBusy`). The kernel drops the lock when the process dies however it dies (kill -9 included), so a re-run
  or a SLURM requeue after a crash takes it at once; the lock is not handed to forked children (DataLoader workers),
  and the lock of an earlier attempt of this same SLURM job is taken over with a warning (SLURM ends an attempt
  before it starts the requeued one; on a shared file system a dead node's lock can outlive it). The other ranks take no lock (rank 0's would refuse them). Where the file
  system has no flock the run goes on unlocked, with a warning.
* **The overrides.** Each attempt records its command-line overrides in `attempts.json`. `resume=auto` into a folder
  that holds a checkpoint is refused when the new overrides differ from the ones recorded by the folder's latest
  attempt (before attempts recorded them: results.json's), naming each differing key with both values
  (`ResumeOverridesDiffer`); `resume=force` resumes anyway (the forced overrides are then the folder's record).
  Keys in `EXEMPT` may differ on a resume: they decide how long training goes on and what is logged or shown, not
  what the checkpoint was trained with.
* **Temp files.** Under the lock every temporary file of a save in the folder is an orphan (its writer died with
  the lock): `sweep_orphans` removes `.NAME.ckpt.tmp-PID` (AtomicCheckpointIO), `.NAME.ckpt.tmp/` (a sharded save)
  and `.NAME.json.tmp-PID` (write_json_atomic) at the start of the attempt. Without the lock only those whose PID
  is gone from this host are removed.

A refused run writes nothing into the folder: task_wrapper writes no failed results.json for a `RunFolderRefused`,
and the Hydra files that Hydra itself writes into `<run>/.hydra/` before any task code runs are put back from the
copy the accepted run keeps in `<run>/.hydra/.accepted/`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("looplab")

LOCK_NAME = ".lock"

# Override keys that may differ between the attempts of one run, and why. A key is exempt when it is listed or
# lies under a listed prefix (`callbacks` covers `+callbacks.NAME=...`).
EXEMPT: dict[str, str] = {
    "resume": "how this attempt starts, not what the checkpoint is",
    "trainer.max_steps": "continuing a run for longer is a resume (a lower value than the checkpoint's step trains no more)",
    "trainer.max_epochs": "as trainer.max_steps",
    "trainer.max_time": "as trainer.max_steps",
    "checkpoint_every_n_steps": "when checkpoints are written, not what is trained",
    "callbacks": "extra callbacks of one attempt (a profiler, a debugging hook)",
    "logger": "where metrics are logged",
    "tags": "W&B labels",
    "group": "W&B labels",
    "trainer.enable_progress_bar": "display",
    "trainer.enable_model_summary": "display",
    "trainer.log_every_n_steps": "display and logging frequency",
    "hardware.num_threads": "CPU threads: speed, not the result",
    "hardware.activation_checkpointing": "recomputation for memory: the same gradients (docs/training.md)",
    "hydra": "Hydra's own settings (not task overrides; listed for safety)",
}


class RunFolderRefused(ValueError):
    """This run may not use its folder; it writes nothing there (no failed results.json: the folder is another
    run's). A ValueError raised by looplab, so the CLI prints it as one line (cli_errors)."""


class RunFolderBusy(RunFolderRefused):
    """Another live run holds the folder's lock."""


class ResumeOverridesDiffer(RunFolderRefused):
    """resume=auto into a folder whose checkpoint was trained with other overrides."""


# ------------------------------------------------------------------------------------------------ the lock
_held_fds: set[int] = set()


def _close_held_in_child() -> None:
    """After fork: the child drops its copies of the held lock descriptors, so that a DataLoader worker (or any
    forked helper) outliving a killed run does not keep its folder locked. The parent's lock is unaffected."""
    for fd in list(_held_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _held_fds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return True
    return True


def _holder_info() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0),
            "argv": sys.argv[1:]}


def read_holder(folder: str | os.PathLike) -> dict[str, Any]:
    """What the last holder of the folder's lock recorded ({} when nothing readable)."""
    try:
        return json.loads((Path(folder) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _stale(holder: dict[str, Any]) -> str | None:
    """Why a holder of the lock cannot be a live run, or None when it may be one."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and holder.get("slurm_job_id") == job and int(holder.get("slurm_restart_count") or 0) < int(
            os.environ.get("SLURM_RESTART_COUNT", 0) or 0):
        return (f"it is attempt {holder.get('slurm_restart_count') or 0} of this SLURM job {job}, which SLURM ended "
                f"before starting this attempt")
    return None


def _orphaned(holder: dict[str, Any]) -> bool:
    """A holder recorded on this host whose PID is gone: a process it started (not by a Python fork) has the lock."""
    pid = holder.get("pid")
    return isinstance(pid, int) and holder.get("host") == socket.gethostname() and not _pid_alive(pid)


class RunFolderLock:
    """An exclusive flock on `<folder>/.lock`, held until `release()` or the process's death."""

    def __init__(self, folder: Path, fd: int | None, note: str = "") -> None:
        self.folder, self.fd, self.note = folder, fd, note

    @property
    def held(self) -> bool:
        return self.fd is not None

    @classmethod
    def acquire(cls, folder: str | os.PathLike) -> "RunFolderLock":
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK_NAME
        for _ in range(5):  # a takeover replaces the file: lock the file that the path names after locking
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    log.warning("cannot lock %s (%s): this file system has no flock; the run goes on without the "
                                "folder lock (make sure no other run uses %s)", path, e, folder)
                    return cls(folder, None, note=str(e))
                holder = read_holder(folder)
                why = _stale(holder)
                if why is not None:  # read again just before the takeover: a new holder may have written meanwhile
                    holder = read_holder(folder)
                    why = _stale(holder)
                if why is None:
                    raise RunFolderBusy(
                        f"run folder {folder} is in use by another live run: PID {holder.get('pid', '?')} on "
                        f"{holder.get('host', '?')}, started {holder.get('started', '?')}"
                        + (f" (SLURM job {holder['slurm_job_id']})" if holder.get("slurm_job_id") else "")
                        + ("; that PID is gone, but a process it started holds the lock still (fuser -v "
                           f"{path})" if _orphaned(holder) else "")
                        + "; wait for it to end, or choose another hydra.run.dir") from None
                log.warning("taking over the lock of %s from PID %s: %s", folder, holder.get("pid"), why)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # another process replaced the file meanwhile: lock the new one
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(_holder_info()).encode())
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # taken over between the lock and the write: try again (and be refused, most likely)
                os.close(fd)
                continue
            _held_fds.add(fd)
            return cls(folder, fd)
        raise RunFolderBusy(f"could not lock {path}: other processes kept replacing it")

    def release(self) -> None:
        if self.fd is not None:
            _held_fds.discard(self.fd)
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


# ------------------------------------------------------------------------------------------- the overrides
def parse_overrides(overrides: list[str] | None) -> dict[str, str]:
    """Command-line overrides → {key: value as written}; `+key`/`++key` as `key`, a deletion `~key` as `<deleted>`."""
    out: dict[str, str] = {}
    for o in overrides or []:
        key, sep, value = str(o).partition("=")
        deleted = key.startswith("~")
        key = key.lstrip("~+").strip()
        out[key] = "<deleted>" if deleted else value.strip()
    return out


def exempt(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in EXEMPT)


def recorded_overrides(folder: str | os.PathLike) -> tuple[list[str] | None, str]:
    """The overrides the folder's latest attempt ran with, and where they were read: attempts.json (each attempt
    records its own), else results.json (a folder from before that); (None, "") when neither has any."""
    folder = Path(folder)
    try:
        attempts = json.loads((folder / "attempts.json").read_text())["attempts"]
        for a in reversed(attempts):
            if isinstance(a, dict) and a.get("overrides") is not None:
                return list(a["overrides"]), "attempts.json"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        prev = json.loads((folder / "results.json").read_text())
        if prev.get("overrides") is not None:
            return list(prev["overrides"]), "results.json"
    except (OSError, ValueError, AttributeError):
        pass
    return None, ""


def differing_overrides(old: list[str], new: list[str]) -> dict[str, tuple[str | None, str | None]]:
    """{key: (old value, new value)} of every non-exempt key set differently (None: not overridden)."""
    a, b = parse_overrides(old), parse_overrides(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not exempt(k)}


def has_checkpoint(folder: Path) -> bool:
    ckpt = folder / "checkpoints"
    return (ckpt / "last.ckpt").exists() or (ckpt / ".last.ckpt.old").exists()  # .old: recover_checkpoint puts it back


def check_resume_overrides(folder: str | os.PathLike, overrides: list[str], resume: Any) -> None:
    """resume=auto continues the folder's checkpoint only with the overrides it was trained with (EXEMPT aside)."""
    folder = Path(folder)
    if resume != "auto" or not has_checkpoint(folder):
        return
    old, source = recorded_overrides(folder)
    if old is None:
        return
    diff = differing_overrides(old, list(overrides))
    if diff:
        shown = "; ".join(f"{k}: {'(not set)' if a is None else a} -> {'(not set)' if b is None else b}"
                          for k, (a, b) in diff.items())
        raise ResumeOverridesDiffer(
            f"resume=auto: {folder} holds a checkpoint trained with other overrides ({source}), and these differ: "
            f"{shown}; rerun with the same overrides, choose another hydra.run.dir, or pass resume=force to "
            f"continue that checkpoint with the new ones")


# ---------------------------------------------------------------------------------------------- temp files
CKPT_TEMP = re.compile(r"^\..+\.ckpt\.tmp(?:-(?P<pid>\d+))?$")  # AtomicCheckpointIO; a sharded save: no PID
JSON_TEMP = re.compile(r"^\..+\.json\.tmp-(?P<pid>\d+)$")  # write_json_atomic


def _size(p: Path) -> int:
    try:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
    except OSError:
        return 0


def remove_orphans(candidates: list[tuple[Path, int | None]], locked: bool) -> list[Path]:
    """Remove each (path, writer PID): all of them when `locked` (no writer can be alive), else only those whose
    PID is gone from this host."""
    removed = []
    for p, pid in candidates:
        if not locked and (pid is None or _pid_alive(pid)):
            continue
        try:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("could not remove the orphaned temporary %s: %s", p, e)
            continue
        removed.append(p)
    return removed


def sweep_orphans(folder: str | os.PathLike, locked: bool = True) -> list[Path]:
    """Remove the temporary files of saves that died in this run folder (see the module docstring); the removed."""
    folder = Path(folder)
    candidates: list[tuple[Path, int | None]] = []
    for where, pattern in ((folder / "checkpoints", CKPT_TEMP), (folder, JSON_TEMP)):
        try:
            entries = list(where.iterdir())
        except OSError:
            continue
        for p in entries:
            m = pattern.match(p.name)
            if m:
                candidates.append((p, int(m["pid"]) if m["pid"] else None))
    sizes = {p: _size(p) for p, _ in candidates}
    removed = remove_orphans(candidates, locked)
    if removed:
        log.info("removed %d orphaned temporary file(s) of killed saves (%.1f MB): %s", len(removed),
                 sum(sizes[p] for p in removed) / 2**20, ", ".join(p.name for p in removed))
    return removed


# ------------------------------------------------------------------------------------ Hydra's files, put back
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def _hydra_subdir(folder: Path) -> Path | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        sub = HydraConfig.get().output_subdir
    except Exception:
        return None
    return None if sub is None else folder / str(sub)


def keep_hydra_files(folder: Path) -> None:
    """The accepted run's copy of the Hydra files in <run>/.hydra/.accepted/ (a refused run puts them back)."""
    sub = _hydra_subdir(folder)
    if sub is None or not all((sub / f).is_file() for f in HYDRA_FILES):
        return
    try:
        (sub / ".accepted").mkdir(exist_ok=True)
        for f in HYDRA_FILES:
            shutil.copyfile(sub / f, sub / ".accepted" / f)
    except OSError as e:
        log.warning("could not keep a copy of %s: %s", sub, e)


def restore_hydra_files(folder: Path) -> None:
    """Undo what Hydra wrote into the folder's .hydra/ for a refused run (it writes before any task code runs)."""
    sub = _hydra_subdir(folder)
    if sub is None or not all((sub / ".accepted" / f).is_file() for f in HYDRA_FILES):
        return
    with contextlib.suppress(OSError):
        for f in HYDRA_FILES:
            tmp = sub / f".{f}.tmp-{os.getpid()}"
            shutil.copyfile(sub / ".accepted" / f, tmp)
            os.replace(tmp, sub / f)


# -------------------------------------------------------------------------------------------------- the claim
@contextlib.contextmanager
def claim_run_folder(folder: str | os.PathLike, overrides: list[str], resume: Any, *,
                     rank_zero: bool = True) -> Iterator[RunFolderLock | None]:
    """One attempt's ownership of its run folder (the module docstring): lock, override check, orphan sweep; the
    lock is released on the way out. Ranks other than global rank 0 only check the overrides (as rank 0 does, so
    that every rank of a refused job stops)."""
    folder = Path(folder)
    lock = None
    try:
        if rank_zero:
            lock = RunFolderLock.acquire(folder)
        check_resume_overrides(folder, overrides, resume)
    except BaseException as e:
        if rank_zero and isinstance(e, RunFolderRefused):
            restore_hydra_files(folder)
        if lock is not None:
            lock.release()
        raise
    try:
        if rank_zero:
            sweep_orphans(folder, locked=lock is not None and lock.held)
            keep_hydra_files(folder)
        yield lock
    finally:
        if lock is not None:
            lock.release()
