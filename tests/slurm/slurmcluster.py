"""A real Slurm cluster on one machine, for tests: `munged`, `slurmctld` and one `slurmd` per
host of `netns.Hosts` (tests/multihost/netns.py), from a generated `slurm.conf`.

    with Hosts(3) as net, SlurmCluster(net) as slurm:   # nodes n0, n1, n2 = 198.18.0.1-3
        job = slurm.sbatch(["tools/slurm/asyncrl.sbatch", "run.toml"], env=...)
        slurm.wait_state(job, {"COMPLETED"}, timeout=300)

Layout. Each host is a network namespace with its own address; each daemon also runs in a
UTS namespace of its own (`unshare --uts`) whose hostname is its node's name (`n0`, `n1`,
...), so `hostname` inside a job says which node it is on, and resolves to nothing, as on
clusters whose hostnames are not on the fast network. `slurmctld` runs on host 0 next to its
`slurmd`. One `munged` serves them all through a socket in the cluster's directory (a Unix
socket does not care about network namespaces). Every daemon runs in the foreground, started
through `Hosts.spawn`, so `Hosts.close` kills them and anything they started (job steps
included: they live inside the namespaces) whatever happens; `SlurmCluster.close` stops them
first in order and removes its directory.

The nodes declare their CPUs in `slurm.conf` (`SlurmdParameters=config_overrides`), not
what the machine has: jobs only need to fit the declared shapes. Process tracking is by
process tree (`proctrack/linuxproc`): no cgroups are touched. Clients (`sbatch`, `srun`,
`scontrol`, ...) run inside host 0 with `SLURM_CONF` pointing at the generated file; jobs
inherit it, so `srun` inside a batch script finds the cluster too.

`missing()` says which programs are absent; `install()` installs them with apt-get (Debian 12
ships slurm-wlm 22.05 and munge), as `.ci/run` does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from netns import Hosts

PROGRAMS = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol",
            "scancel", "squeue", "sinfo", "unshare")
PACKAGES = ("slurm-wlm", "munge")


def missing() -> list[str]:
    """The programs this harness needs that are not on PATH (sbin included)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [p for p in PROGRAMS if shutil.which(p, path=path) is None]


def install(timeout: float = 600) -> str | None:
    """apt-get install what is missing (as root on Debian); None on success, else why not."""
    if not missing():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{', '.join(missing())} missing and no root apt-get to install {PACKAGES}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if r.returncode != 0:
            return f"{' '.join(cmd)} failed: {r.stderr.strip()[-500:]}"
    return None if not missing() else f"still missing after install: {missing()}"


def _sbin(name: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        raise FileNotFoundError(name)
    return found


class SlurmCluster:
    """Slurm on `net`'s hosts: node `n<i>` is host i (see the module doc). Context manager."""

    def __init__(self, net: Hosts, *, cpus: int = 4, kill_wait_s: int = 30,
                 slurmd_timeout_s: int = 10, root: Path | None = None) -> None:
        self.net = net
        self.cpus = cpus
        self.kill_wait_s = kill_wait_s
        self.slurmd_timeout_s = slurmd_timeout_s
        # short: the munge socket's path must fit a sockaddr_un (108 bytes)
        self.dir = Path(tempfile.mkdtemp(prefix="arlslurm", dir=root or "/tmp"))
        self.conf = self.dir / "slurm.conf"
        self.socket = self.dir / "munge.sock"
        self._slurmd: dict[int, Any] = {}
        self._ctld: Any = None
        self._munged: Any = None

    # ------------------------------------------------------------------------------ naming
    @staticmethod
    def node(i: int) -> str:
        return f"n{i}"

    @property
    def env(self) -> dict[str, str]:
        """The environment a client (and the jobs it submits) needs."""
        path = os.environ.get("PATH", "/usr/bin:/bin")
        if "/usr/sbin" not in path.split(":"):
            path += ":/usr/sbin:/sbin"
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": path}

    # ------------------------------------------------------------------------------ start
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_conf(self) -> None:
        d = self.dir
        nodes = "\n".join(
            f"NodeName={self.node(i)} NodeAddr={self.net.addr(i)} CPUs={self.cpus} "
            "RealMemory=1000 State=UNKNOWN" for i in range(self.net.n))
        names = ",".join(self.node(i) for i in range(self.net.n))
        self.conf.write_text(f"""\
# generated by tests/slurm/slurmcluster.py
ClusterName=asyncrltest
SlurmctldHost={self.node(0)}({self.net.addr(0)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout_s}
SlurmctldTimeout=30
MessageTimeout=10
KillWait={self.kill_wait_s}
InactiveLimit=0
MinJobAge=3600
JobRequeue=1
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")

    def start(self, timeout: float = 60) -> None:
        (self.dir / "state").mkdir()
        for i in range(self.net.n):
            (self.dir / f"spool-{self.node(i)}").mkdir()
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.write_conf()
        log = (self.dir / "daemons.log").open("ab")
        self._munged = self.net.spawn(0, [
            _sbin("munged"), "-F", "-f", f"--socket={self.socket}", f"--key-file={key}",
            f"--pid-file={self.dir}/munged.pid", f"--log-file={self.dir}/munged.log",
            f"--seed-file={self.dir}/munged.seed", "--num-threads=4"],
            stdout=log, stderr=subprocess.STDOUT)
        self._wait(lambda: self.socket.exists(), timeout, "munged's socket")
        self._ctld = self._in_uts(0, [_sbin("slurmctld"), "-D", "-c", "-f", str(self.conf)], log)
        for i in range(self.net.n):
            self.start_slurmd(i)
        self._wait(lambda: self.idle_nodes() == self.net.n, timeout,
                   f"{self.net.n} idle nodes", lambda: self.sinfo())

    def _in_uts(self, i: int, argv: Sequence[str], log: Any) -> Any:
        """`argv` on host i in a UTS namespace whose hostname is node i's name."""
        script = f'hostname {self.node(i)} && exec "$@"'
        return self.net.spawn(i, ["unshare", "--uts", "sh", "-c", script, "sh", *argv],
                              stdout=log, stderr=subprocess.STDOUT, env=self.env, keep_sys=True)

    def start_slurmd(self, i: int) -> None:
        """(Re)start node i's slurmd."""
        log = (self.dir / "daemons.log").open("ab")
        self._slurmd[i] = self._in_uts(
            i, [_sbin("slurmd"), "-D", "-N", self.node(i), "-f", str(self.conf)], log)

    def kill_slurmd(self, i: int) -> None:
        """SIGKILL node i's slurmd (its job steps' processes are left alone)."""
        proc = self._slurmd.pop(i)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=10)

    def kill_node(self, i: int) -> list[int]:
        """Node i lost: SIGKILL its slurmd, then every process on host i (its job steps'
        slurmstepd and tasks). Returns the pids killed besides slurmd."""
        self.kill_slurmd(i)
        out = subprocess.run(["ip", "netns", "pids", self.net.ns(i)], capture_output=True,
                             text=True, timeout=30).stdout
        pids = [int(p) for p in out.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        return pids

    # ---------------------------------------------------------------------------- clients
    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float = 30,
            env: dict[str, str] | None = None, cwd: Path | str | None = None,
            host: int = 0) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (`sbatch`, `scontrol`, ...) on host `host`."""
        r = self.net.run(host, list(argv), timeout=timeout, env={**self.env, **(env or {})},
                         cwd=cwd)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()}"
                                 f" {r.stdout.strip()}")
        return r

    def sbatch(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
               cwd: Path | str | None = None) -> str:
        """Submit; returns the job id."""
        out = self.run(["sbatch", "--parsable", *argv], env=env, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict ({} once the job is forgotten)."""
        r = self.run(["scontrol", "-o", "show", "job", job_id], check=False)
        fields: dict[str, str] = {}
        for item in r.stdout.split():
            k, _, v = item.partition("=")
            fields.setdefault(k, v)
        return fields

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_state(self, job_id: str, states: set[str], timeout: float,
                   logs: Sequence[Path] = ()) -> str:
        """Block until the job is in one of `states`; AssertionError (with the job, the
        daemons' log and the `logs` tails) after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state(job_id)
            if st in states:
                return st
            time.sleep(1)
        tails = {str(p): p.read_text()[-3000:] for p in logs if p.exists()}
        raise AssertionError(f"job {job_id} not {states} after {timeout}s: {self.job(job_id)}"
                             f"\nslurmctld: {self.ctld_log()[-3000:]}\n{tails}")

    def steps(self, job_id: str) -> dict[str, str]:
        """Step name -> step id (`JOB.N`) of the job's running steps."""
        r = self.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], check=False)
        out = {}
        for line in r.stdout.splitlines():
            sid, _, name = line.strip().partition(" ")
            out[name.strip()] = sid
        return out

    def sinfo(self) -> str:
        return self.run(["sinfo", "-N", "-h", "-o", "%N %t"], check=False).stdout

    def idle_nodes(self) -> int:
        return sum(1 for line in self.sinfo().splitlines() if line.split()[-1:] == ["idle"])

    def node_state(self, i: int) -> str:
        for line in self.sinfo().splitlines():
            name, _, st = line.partition(" ")
            if name == self.node(i):
                return st.strip()
        return ""

    def ctld_log(self) -> str:
        p = self.dir / "slurmctld.log"
        return p.read_text(errors="replace") if p.exists() else ""

    @staticmethod
    def _wait(ok: Any, timeout: float, what: str, detail: Any = lambda: "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.5)
        raise AssertionError(f"no {what} after {timeout}s: {detail()}")

    # ---------------------------------------------------------------------------- stop
    def close(self) -> None:
        """Stop slurmds, slurmctld, munged (SIGTERM, then SIGKILL); remove the directory.
        Anything they leave inside the namespaces is killed by `Hosts.close`."""
        procs = [*self._slurmd.values(), self._ctld, self._munged]
        for p in procs:
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 15)
        for p in procs:
            if p is None:
                continue
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
                p.wait(timeout=10)
        self._slurmd.clear()
        self._ctld = self._munged = None
        if os.environ.get("ASYNCRL_SLURM_KEEP"):
            print(f"slurm cluster directory kept: {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
