"""A two-node Slurm cluster on this machine, for the cluster tests: Debian's ``slurm-wlm`` and ``munge``.

One ``slurmctld`` and two ``slurmd`` (``-N n1``, ``-N n2``, each on a port of its own,
``%n`` in their spool, pid and log paths), and a ``munged`` with its own socket and key,
all under one temporary folder and on free ports, so the cluster touches nothing of the
machine's own Slurm or munge. The node names do not resolve; both nodes have
``NodeAddr=127.0.0.1``, which is what a job looks up for its rendezvous host.

``start(root)`` returns the :class:`Cluster` (its ``env`` carries ``SLURM_CONF``), or raises
:class:`Unavailable` with one line when the packages are missing or the daemons do not come up
(the tests then skip with that line). ``stop()`` cancels every job left, then ends each daemon
by the pid in its pid file, and waits until they are gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared_prefect import free_port

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")

CONF = """\
ClusterName=fp8rltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={n1_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=5
MinJobAge=300
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


class Unavailable(RuntimeError):
    """The packages are missing or the daemons did not start: the one line the tests skip with."""


@dataclass
class Cluster:
    root: Path
    env: dict = field(default_factory=dict)

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def jobs(self) -> list[str]:
        """Ids of the jobs Slurm still holds as pending or running (completing included)."""
        r = self.run("squeue", "-h", "-o", "%i")
        return r.stdout.split()

    def pids(self) -> list[int]:
        out = []
        for f in [self.root / "munge" / "munged.pid", self.root / "slurmctld.pid", *self.root.glob("slurmd.*.pid")]:
            try:
                out.append(int(f.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
        return out

    def stop(self) -> None:
        """Cancel what is left, then end slurmd, slurmctld and munged (in that order) by their pid files."""
        if self.jobs():
            self.run("scancel", "--full", *self.jobs())
            deadline = time.monotonic() + 20
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        order = [*sorted(self.root.glob("slurmd.*.pid")), self.root / "slurmctld.pid", self.root / "munge/munged.pid"]
        for f in order:
            try:
                pid = int(f.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            _end(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _end(pid: int, wait_s: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def start(root: Path) -> Cluster:
    """A running two-node cluster under ``root``; :class:`Unavailable` (one line) where it cannot be."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if missing:
        raise Unavailable(
            f"Slurm and munge are not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
        )
    if os.geteuid() != 0:
        raise Unavailable("the local Slurm cluster runs its daemons as root (SlurmUser=root); not root here")
    for d in ("spool/n1", "spool/n2", "state", "log", "munge"):
        (root / d).mkdir(parents=True, exist_ok=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "munge").chmod(0o700)
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(root=root, ctld_port=free_port(), n1_port=free_port(), n2_port=free_port()))
    cluster = Cluster(root, dict(os.environ, SLURM_CONF=str(conf)))
    sbin = lambda name: shutil.which(name) or f"/usr/sbin/{name}"  # noqa: E731
    m = root / "munge"
    steps = [
        [
            sbin("munged"),
            f"--key-file={key}",
            f"--socket={m}/munge.socket",
            f"--pid-file={m}/munged.pid",
            f"--log-file={m}/munged.log",
            f"--seed-file={m}/seed",
            "--force",
        ],
        [sbin("slurmctld")],
        [sbin("slurmd"), "-N", "n1"],
        [sbin("slurmd"), "-N", "n2"],
    ]
    try:
        for cmd in steps:
            r = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise Unavailable(f"{Path(cmd[0]).name} did not start: {(r.stderr or r.stdout).strip()[:200]}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = cluster.run("sinfo", "-h", "-o", "%T %D")
            if r.returncode == 0 and r.stdout.split()[:2] == ["idle", "2"]:
                return cluster
            time.sleep(0.5)
        raise Unavailable(f"the two slurmd did not become idle in 60 s (sinfo: {r.stdout.strip() or r.stderr.strip()})")
    except BaseException:
        cluster.stop()
        raise
