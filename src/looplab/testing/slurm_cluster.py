"""A real SLURM cluster on this one machine, for tests and for trying `hardware=slurm` before a real cluster.

    python src/looplab/testing/slurm_cluster.py up [--dir DIR] [--nodes 2]   # prints `export SLURM_CONF=...`
    python src/looplab/testing/slurm_cluster.py down [--dir DIR]
    scripts/slurm-cluster up|down|status                                       # the same, any python3

Debian's `slurm-wlm` and `munge` (installed with apt-get when missing; root only): a private `munged`
(its own key and socket), `slurmctld` and one `slurmd` per node, all on 127.0.0.1 with free ports, every
file (config, state, spool, logs, pids) in one folder. Nothing in /etc is used or changed, so it runs next
to a system SLURM or another copy of itself. Stdlib only: no virtual environment needed.

Choices that matter for looplab's tests:
* `ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`: no cgroups (containers and sandboxes).
* `AuthInfo=...,cred_expire=10` and `SchedulerParameters=sched_interval=2`: a requeued job becomes eligible
  `cred_expire` seconds after it ends (slurmctld sets its begin time so) and is started at the next
  scheduling pass; measured 11 s from `scontrol requeue` to the new attempt (defaults: 120 s + up to 60 s).
* `SlurmdParameters=config_overrides`: the node advertises `cpus` CPUs whatever the machine has, so a
  2-core CI machine can hold a 2-rank job and a sweep's jobs at once.
* no accounting (`sacct` does not work); `JobCompType=jobcomp/filetxt` records every finished job.
* nodes are named after this machine (see `node_names`); `--nodes 2` runs a second slurmd as a second node.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("slurm-wlm", "munge")


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be started here; the message says why (tests skip with it)."""


def ensure_packages(install: bool = True) -> None:
    """`slurm-wlm` and `munge` from apt when their daemons are missing; ClusterUnavailable naming what is missing."""
    missing = [d for d in DAEMONS if not _which(d)]
    if not missing:
        return
    if not install:
        raise ClusterUnavailable(f"{', '.join(missing)} not installed: apt-get install -y {' '.join(PACKAGES)}")
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"{', '.join(missing)} not installed and not root to apt-get install {' '.join(PACKAGES)}")
    if not shutil.which("apt-get"):
        raise ClusterUnavailable(f"{', '.join(missing)} not installed and no apt-get here (install {' '.join(PACKAGES)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise ClusterUnavailable(f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
    missing = [d for d in DAEMONS if not _which(d)]
    if missing:
        raise ClusterUnavailable(f"{', '.join(missing)} still missing after installing {' '.join(PACKAGES)}")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def _first_job_id(jobs: int = 50) -> int:
    """A first job id whose jobs' rendezvous ports are free. Lightning's SLURMEnvironment puts a job's ranks on port
    15000 + the job id's last four digits; two clusters on one machine (two `make test` at once) that both number
    their jobs from 1 gave their FSDP ranks the same port, and one suite's ranks hung on the other's store."""
    import random

    rng = random.SystemRandom()
    for _ in range(200):
        first = rng.randrange(1000, 10000 - jobs)
        try:
            for port in range(15000 + first, 15000 + first + jobs):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    return rng.randrange(1000, 10000 - jobs)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def node_names(n: int) -> list[str]:
    """This machine's host name, then `HOST-2`, `HOST-3`, ... Jobs use node names as addresses (Lightning's
    MASTER_ADDR is the first node of SLURM_NODELIST): the first resolves (slurmctld checks it is this host);
    the others do not, so a multi-node job here sets MASTER_ADDR=127.0.0.1 (a real cluster's names resolve).
    (`localhost` is no way out: slurm renames a node called so to the host name.)"""
    host = socket.gethostname().split(".")[0]
    return [host] + [f"{host}-{i}" for i in range(2, n + 1)]


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 4096


class SlurmCluster:
    """One `slurmctld` and `nodes` `slurmd`s on 127.0.0.1, everything under `root`.

    `start()` returns once `sinfo` shows every node idle; `stop()` ends the daemons it started, by PID.
    `env` is what a client (sbatch, srun, squeue, scontrol, and the jobs themselves) needs: SLURM_CONF.
    """

    def __init__(self, root: str | os.PathLike | None = None, nodes: int = 1, cpus: int | None = None,
                 cred_expire: int = 10, partition: str = "debug"):
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="looplab-slurm-"))
        self.nodes = node_names(nodes)
        self.cpus = cpus or max(4, os.cpu_count() or 1)
        self.cred_expire = cred_expire
        self.partition = partition
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.startup_s: float | None = None

    # ---- configuration
    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        for d in ("munge", "state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged refuses group/other-writable folders on its paths
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o600)
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        host = socket.gethostname().split(".")[0]
        r = self.root
        lines = [
            "# written by looplab/testing/slurm_cluster.py: a one-machine cluster on 127.0.0.1",
            "ClusterName=looplab",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"FirstJobId={_first_job_id()}",  # jobs' rendezvous ports (Lightning: 15000 + id) apart from another cluster's
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge/munge.socket,cred_expire={self.cred_expire}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",  # a requeued job starts when eligible, not at the next minute
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={r}/log/jobcomp.txt",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "KillWait=5",
            "MinJobAge=600",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            "MessageTimeout=20",
        ]
        for name, port in zip(self.nodes, node_ports):  # NodeHostname: distinct, or slurmctld refuses the config
            lines.append(f"NodeName={name} NodeHostname=looplab-{name} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                         f"RealMemory={_memory_mb()} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")
        for name in self.nodes:
            (r / "spool" / name).mkdir(exist_ok=True)

    # ---- daemons
    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env, start_new_session=True)
        log.close()
        self._write_pids()

    def _write_pids(self) -> None:
        (self.root / "pids.json").write_text(json.dumps({k: p.pid for k, p in self.procs.items()}))

    def start(self, timeout: float = 90.0) -> "SlurmCluster":
        t0 = time.monotonic()
        ensure_packages()
        if os.geteuid() != 0:
            raise ClusterUnavailable("the daemons run as root here (SlurmUser=root); run as root")
        self.write_config()
        m = self.root / "munge"
        try:
            self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--socket={m}/munge.socket",
                                   f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid",
                                   f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"])
            self._wait(lambda: (m / "munge.socket").exists(), 20, "munged socket")
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), 30, "slurmctld (scontrol ping)")
            for name in self.nodes:
                self._spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)])
            self._wait(self.idle, timeout - (time.monotonic() - t0), f"{len(self.nodes)} idle node(s) in sinfo")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _ok(self, cmd: list[str], needle: str) -> bool:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True)
        return proc.returncode == 0 and needle in proc.stdout

    def idle(self) -> bool:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return proc.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + max(timeout, 1.0)
        while time.monotonic() < deadline:
            dead = [k for k, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise ClusterUnavailable(f"{', '.join(dead)} exited while waiting for {what}: {self.log_tail()}")
            if ready():
                return
            time.sleep(0.3)
        raise ClusterUnavailable(f"timed out after {timeout:.0f} s waiting for {what}: {self.log_tail()}")

    def log_tail(self, n: int = 6) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if f.is_file() and f.stat().st_size:
                out.append(f"[{f.name}] " + " | ".join(f.read_text(errors="replace").strip().splitlines()[-n:]))
        return " ".join(out)[-3000:]

    def stop(self, grace: float = 10.0) -> None:
        """Cancels the jobs still queued or running (their tasks would outlive slurmd), then ends the daemons
        (slurmd first, munged last): SIGTERM, then SIGKILL after `grace` seconds, by PID."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True).stdout.split()
            if jobs:
                subprocess.run(["scancel", *jobs], env=self.env, capture_output=True)
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline and subprocess.run(
                        ["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True).stdout.strip():
                    time.sleep(0.5)
        order = [k for k in self.procs if k.startswith("slurmd")] + [k for k in ("slurmctld", "munged") if k in self.procs]
        for name in order:
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        self._write_pids()

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- client helpers (for tests)
    def run(self, *cmd: str, check: bool = True, timeout: float = 60, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """A client command (sbatch, srun, scontrol, ...) against this cluster; `env` adds to the environment
        (sbatch hands the whole environment to the job)."""
        proc = subprocess.run(list(cmd), env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode:
            raise RuntimeError(f"`{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def job(self, job_id: str | int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); {} once the record is gone."""
        proc = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        if proc.returncode:
            return {}
        return dict(tok.split("=", 1) for tok in proc.stdout.split() if "=" in tok)

    def wait_job(self, job_id: str | int, timeout: float = 300, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                        "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1)
        raise TimeoutError(f"job {job_id} not finished after {timeout} s: {self.job(job_id)}")


def stop_from_pids(root: Path, grace: float = 10.0) -> list[str]:
    """`down`: the daemons that `up` started, from ROOT/pids.json (ended by PID, slurmd first)."""
    f = root / "pids.json"
    pids = json.loads(f.read_text()) if f.exists() else {}
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    if pids.get("slurmctld") and _alive(pids["slurmctld"]):  # jobs' tasks would outlive slurmd
        jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
        if jobs:
            subprocess.run(["scancel", *jobs], env=env, capture_output=True)
            time.sleep(grace / 2)
    order = sorted(pids, key=lambda k: (not k.startswith("slurmd"), k == "munged"))
    stopped = []
    for name in order:
        pid = pids[name]
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        stopped.append(f"{name} ({pid})")
    f.write_text("{}")
    return stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of a parent that is gone counts as ended
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument("--dir", default="/tmp/looplab-slurm", help="the cluster's folder (config, state, logs, pids)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--cpus", type=int, default=None, help="CPUs each node advertises (default: max(4, this machine's))")
    ap.add_argument("--cred-expire", type=int, default=10)
    args = ap.parse_args(argv)
    root = Path(args.dir)
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    if args.action == "down":
        print("stopped: " + (", ".join(stop_from_pids(root)) or "nothing was running"))
        return 0
    if args.action == "status":
        return subprocess.run(["sinfo", "-N", "-l"], env=env).returncode
    if (root / "pids.json").exists() and any(_alive(p) for p in json.loads((root / "pids.json").read_text()).values()):
        print(f"already up in {root}; `down --dir {root}` first", file=sys.stderr)
        return 1
    root.mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(root, nodes=args.nodes, cpus=args.cpus, cred_expire=args.cred_expire)
    try:
        cluster.start()
    except ClusterUnavailable as e:
        print(f"cluster not started: {e}", file=sys.stderr)
        return 2
    print(f"up in {cluster.startup_s:.1f} s: nodes {','.join(cluster.nodes)} ({cluster.cpus} CPUs each), folder {root}")
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
