"""A cluster on one box: nodes made of Linux namespaces, for tests of runs on several machines.

Each node is a network, UTS (hostname), mount and PID namespace: its own address, hostname, /tmp, /run, /dev/shm
and process table; /etc/hosts as on a Debian install (its own name is 127.0.1.1, the others' their addresses).
Everything else of the box (the repository, the venv, the model, /root) is seen at the same path on every node, as
a cluster's shared install would be. The nodes are joined by veth pairs on a bridge that lives in a namespace of its
own (nothing is added to the box's network), with addresses from 198.18.0.0/15 (RFC 2544's benchmarking range, which
no real network routes) and no route out. Each node runs sshd (root, key auth, port 22), so DeepSpeed's pdsh launch
reaches it as on a cluster. `/mnt/shared` is one directory on every node (a bind mount), or one per node
(`shared=False`). Needs root, util-linux's unshare and nsenter, iproute2, openssh-server and pdsh (.ci/run installs
them).

    from tests.cluster import up
    with up(3) as cluster:                 # node1..node3 at 198.18.0.1..3
        node = cluster.nodes[0]
        node.run("hostname -I")            # a shell command on the node, in a login-like environment
        node.popen("ray start --head ...") # one that keeps running (ended with the cluster)
        cluster.shape("10gbit")            # every link at 10 Gbit/s each way (tc tbf), None: unshaped
        cluster.nodes[2].kill()            # every process of node3 killed (its sshd too): the node is lost
        cluster.nodes[2].revive()          # its sshd again: it is back
        cluster.nodes[1].partition()       # its link down; .heal() brings it up
        env = cluster.start_slurm()        # Debian's Slurm on the nodes (where it is installed): sbatch, srun

Everything ends with the cluster (`down`, or the exit of the thread that made it, SIGKILL included): each node's
first process is its PID namespace's init, which takes every process of the node with it, and the namespaces and
links go with their last process.

From a shell (as root): `python -m tests.cluster up -n 3` holds a cluster until Ctrl-C (or `python -m tests.cluster
down`); `python -m tests.cluster run node2 -- hostname -I` runs a command on one of its nodes.
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from dsrl.rundir import die_with_parent

SUBNET = "198.18.0.0/15"
SHARED = "/mnt/shared"
"""The path every node sees the shared directory at."""
STATE = Path(tempfile.gettempdir()) / "dsrl-cluster.json"
"""Where `python -m tests.cluster up` says which cluster it holds."""
NEEDS = ("unshare", "nsenter", "ip", "tc", "sshd", "ssh", "ssh-keygen", "pdsh")
INIT = "import os, time\nwhile True:\n try:\n  os.wait()\n except ChildProcessError:\n  time.sleep(1)\n"
"""The first process of a node: PID 1 of its namespace, which reaps the orphans handed to it."""
PATH = f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def missing() -> str | None:
    """Why this box cannot make a cluster (not root, a tool missing, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "the cluster needs root"
    lacking = [tool for tool in NEEDS if not shutil.which(tool, path=PATH)]
    if lacking:
        return f"the cluster needs {', '.join(lacking)} (apt-get install openssh-server pdsh iproute2)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"this box cannot make namespaces: {probe.stderr.decode().strip()}"
    return None


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def hold(flags: list[str]) -> tuple[subprocess.Popen, int]:
    """An `unshare` of `flags` whose child (`INIT`) holds the namespaces; returns it and the child's pid. SIGKILL to
    it, or the end of the thread that called this, ends the child (unshare's --kill-child) and with it the node."""
    holder = subprocess.Popen(["unshare", *flags, "--fork", "--kill-child", sys.executable, "-c", INIT],
                              preexec_fn=die_with_parent)  # fmt: skip
    for _ in range(200):
        children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children")
        with contextlib.suppress(OSError):
            if pids := children.read_text().split():
                return holder, int(pids[0])
        if holder.poll() is not None:
            raise RuntimeError(f"unshare {' '.join(flags)} exited with {holder.returncode}")
        time.sleep(0.02)
    raise RuntimeError("unshare's child did not start")


def bits(rate: str) -> float:
    """Bits a second of a rate in tc's words (10gbit, 500mbit)."""
    number, unit = re.fullmatch(r"([\d.]+)([kmg]?)bit", rate).groups()
    return float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit]


def pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


@dataclass
class Node:
    name: str
    address: str
    index: int
    """1-based: node<index>, at 198.18.0.<index>; its link is `n<index>` on the bridge."""
    cluster: "Cluster"
    pid: int = 0
    """Its init (PID 1 inside), as this box sees it."""
    holder: subprocess.Popen | None = None
    started: list[subprocess.Popen] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        """The node's own files on the box: tmp/ (its /tmp), run/ (its /run), shared/ (unshared: its /mnt/shared)."""
        return self.cluster.dir / self.name

    def enter(self, namespaces: str = "-n -u -m -p") -> list[str]:
        return ["nsenter", "-t", str(self.pid), *namespaces.split()]

    def environment(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """A login's environment on the node (not the caller's): HOME, PATH with this Python's install first."""
        base = {"HOME": "/root", "USER": "root", "LOGNAME": "root", "SHELL": "/bin/bash", "LANG": "C.UTF-8"}
        return {**base, "PATH": PATH, **(env or {})}

    def run(self, command: str, env: dict[str, str] | None = None, timeout: float = 120, check: bool = True,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:  # fmt: skip
        """`command` (bash) on the node, waited for; its output returned. `check`: a failure raises with it."""
        proc = subprocess.run(
            [*self.enter(), "bash", "-c", f"cd {shlex.quote(str(cwd or self.cluster.cwd))} && {command}"],
            env=self.environment(env), capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise RuntimeError(f"on {self.name}: {command!r} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        return proc

    def popen(self, command: str, env: dict[str, str] | None = None, log: Path | None = None,
              cwd: str | Path | None = None, **kwargs) -> subprocess.Popen:  # fmt: skip
        """`command` (bash) started on the node; its output to `log` (default: <node dir>/<n>.log), or as
        `kwargs` say (stdout=PIPE). It ends with the node, if not before."""
        log = log or self.dir / f"{len(self.started)}.log"
        out = kwargs.pop("stdout", None) or open(log, "ab")  # noqa: SIM115 -- the process's own, closed below
        proc = subprocess.Popen(
            [*self.enter(), "bash", "-c", f"cd {shlex.quote(str(cwd or self.cluster.cwd))} && {command}"],
            env=self.environment(env), stdout=out, stderr=kwargs.pop("stderr", subprocess.STDOUT), **kwargs,
        )  # fmt: skip
        if out is not subprocess.PIPE:
            out.close()
        self.started.append(proc)
        return proc

    def end(self, proc: subprocess.Popen) -> None:
        """SIGKILL a process `popen` started (the command on the node, not only the nsenter before it)."""
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        proc.kill()
        proc.wait()

    def processes(self) -> list[int]:
        """The pids (as the box sees them) of every process of the node but its init."""
        ns = pid_namespace(self.pid)
        pids = [int(p.name) for p in Path("/proc").glob("[0-9]*") if pid_namespace(p.name) == ns]
        return [pid for pid in pids if pid != self.pid]

    def kill(self) -> list[int]:
        """SIGKILL every process of the node (its sshd, raylet, ranks and servers): the node is lost, as a host that
        dies. Its links stay up (a host that is gone is silent, not a link down). Returns the pids killed."""
        killed = []
        for _ in range(100):  # until none is left: a process may fork as it is killed
            pids = self.processes()
            if not pids:
                return killed
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed += pids
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: processes still running after SIGKILL: {self.processes()}")

    def revive(self) -> None:
        """The node back after `kill`: its sshd again (what else it ran, start again)."""
        self.started = [p for p in self.started if p.poll() is None]
        self.popen("exec /usr/sbin/sshd -D -e -f /etc/ssh/sshd_config", log=self.dir / "sshd.log")
        self.wait_port(22)

    def wait_port(self, port: int, address: str | None = None, timeout: float = 30) -> None:
        """Until something listens on `port` of the node."""
        test = f"exec 3<>/dev/tcp/{address or self.address}/{port}"
        due = time.monotonic() + timeout
        while self.run(test, check=False).returncode != 0:
            if time.monotonic() > due:
                raise TimeoutError(f"{self.name}: nothing listens on port {port} after {timeout:.0f}s")
            time.sleep(0.1)

    def link(self, command: str) -> None:
        """`ip link set <its bridge port> <command>`, on the bridge's side."""
        sh(*self.cluster.switch_enter(), "ip", "link", "set", f"n{self.index}", *command.split())

    def partition(self) -> None:
        """Its link down, at the bridge: the node and the others no longer reach each other."""
        self.link("down")

    def heal(self) -> None:
        self.link("up")


class Cluster:
    """`up(n)` makes one; `down()` (or leaving its `with`) ends it and everything that ran on it."""

    def __init__(self, n: int, shared: bool = True, base: Path | None = None, cwd: Path | None = None):
        if n < 1 or n > 250:
            raise ValueError(f"a cluster of {n} nodes: 1 to 250")
        self.id = uuid.uuid4().hex[:6]
        self.dir = Path(base or tempfile.mkdtemp(prefix=f"dsrl-cluster-{self.id}-"))
        self.cwd = Path(cwd or Path(__file__).resolve().parents[1])
        self.shared = shared
        self.nodes = [Node(f"node{i}", f"198.18.0.{i}", i, self) for i in range(1, n + 1)]
        self.switch: subprocess.Popen | None = None
        self.switch_pid = 0
        self.rate: str | None = None

    def switch_enter(self) -> list[str]:
        return ["nsenter", "-t", str(self.switch_pid), "-n"]

    def start(self) -> "Cluster":
        try:
            self._start()
        except BaseException:
            self.down()
            raise
        return self

    def _start(self) -> None:
        etc = self.dir / "etc-ssh"  # every node's /etc/ssh: its sshd's config and keys, and its ssh client's
        etc.mkdir(parents=True)
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(etc / "ssh_host_ed25519_key"))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(etc / "cluster_key"))
        shutil.copy(etc / "cluster_key.pub", etc / "authorized_keys")
        (etc / "sshd_config").write_text(SSHD_CONFIG)
        (etc / "ssh_config").write_text(SSH_CONFIG)
        (self.dir / "shared").mkdir()
        self.switch, self.switch_pid = hold(["--net"])
        sh(*self.switch_enter(), "ip", "link", "add", "br0", "type", "bridge")
        sh(*self.switch_enter(), "ip", "link", "set", "br0", "up")
        for node in self.nodes:
            self._make(node)
        for node in self.nodes:
            node.revive()

    def _make(self, node: Node) -> None:
        for sub in ("tmp", "run/sshd", "shared"):
            (node.dir / sub).mkdir(parents=True)
        (node.dir / "tmp").chmod(0o1777)
        hosts = ["127.0.0.1 localhost", f"127.0.1.1 {node.name}"]  # Debian's line for its own name
        hosts += [f"{other.address} {other.name}" for other in self.nodes if other is not node]
        (node.dir / "hosts").write_text("\n".join(hosts) + "\n")
        node.holder, node.pid = hold(["--net", "--uts", "--mount", "--pid", "--mount-proc", "--propagation", "private"])
        shared = self.dir / "shared" if self.shared else node.dir / "shared"
        setup = [
            f"hostname {node.name}",
            f"mount --bind {node.dir / 'run'} /run",
            "mount -t tmpfs tmpfs /dev/shm",
            "mount -t tmpfs tmpfs /mnt",
            f"mkdir {SHARED} && mount --bind {shared} {SHARED}",
            f"mount --bind {self.dir / 'etc-ssh'} /etc/ssh",
            f"mount --bind {node.dir / 'hosts'} /etc/hosts",
            *self._keep_under_tmp(node),
            f"mount --rbind {node.dir / 'tmp'} /tmp",  # last: the paths above are under the box's /tmp
            "ip link set lo up",
        ]
        sh(*node.enter("-n -u -m"), "sh", "-ec", "; ".join(setup))
        port = f"n{node.index}"
        sh(*self.switch_enter(), "ip", "link", "add", port, "type", "veth", "peer", "eth0", "netns", str(node.pid))
        sh(*self.switch_enter(), "ip", "link", "set", port, "master", "br0", "up")
        sh(*node.enter("-n"), "sh", "-ec", f"ip addr add {node.address}/15 dev eth0; ip link set eth0 up")

    @staticmethod
    def _keep_under_tmp(node: Node) -> list[str]:
        """A checkout or venv under the box's /tmp (a clone in /tmp/x) stays at its path on the node, bound into the
        node's own /tmp before that replaces the box's."""
        tmp = Path("/tmp").resolve()
        keep = {p for p in (Path(__file__).resolve().parents[1], Path(sys.prefix).resolve()) if p.is_relative_to(tmp)}
        return [f"mkdir -p {node.dir / 'tmp' / p.relative_to(tmp)} && mount --bind {p} "
                f"{node.dir / 'tmp' / p.relative_to(tmp)}" for p in sorted(keep)]  # fmt: skip

    def start_slurm(self) -> dict[str, str]:
        """Debian's Slurm on the nodes (slurmctld, slurmd, munge): munged on each (the box's key), slurmctld on
        node1, slurmd on each, one partition of them all. Returns what a node's Slurm commands need in their
        environment (SLURM_CONF: each node's /tmp/slurm.conf)."""
        lines = [SLURM_CONFIG] + [f"NodeName={n.name} NodeAddr={n.address} CPUs={os.cpu_count()}" for n in self.nodes]
        for node in self.nodes:
            (node.dir / "tmp" / "slurm.conf").write_text(
                "\n".join(lines) + "\nPartitionName=main Nodes=ALL Default=YES\n"
            )
            munged = "mkdir -p /run/munge && exec munged -F --force --log-file=/tmp/munged.log --seed-file=/tmp/seed"
            node.popen(munged, log=node.dir / "munged.log")
        self.nodes[0].popen(
            "mkdir -p /tmp/slurmctld && exec slurmctld -D -f /tmp/slurm.conf", log=self.dir / "ctld.log"
        )
        self.nodes[0].wait_port(6817)
        for node in self.nodes:
            node.popen("mkdir -p /tmp/slurmd && exec slurmd -D -f /tmp/slurm.conf", log=node.dir / "slurmd.log")
        env = {"SLURM_CONF": "/tmp/slurm.conf"}
        due = time.monotonic() + 60
        while len(self.nodes[0].run("sinfo -h -N -t idle -o %N", env=env, check=False).stdout.split()) < len(
            self.nodes
        ):
            if time.monotonic() > due:
                raise TimeoutError(f"Slurm's nodes did not come up: {self.nodes[0].run('sinfo', env=env).stdout}")
            time.sleep(0.5)
        return env

    def hostfile(self, nodes: list[Node], slots: int = 1) -> str:
        """DeepSpeed's hostfile of `nodes`, by address."""
        return "".join(f"{node.address} slots={slots}\n" for node in nodes)

    def shape(self, rate: str | None) -> None:
        """Every link at `rate` each way (tc's words: 10gbit; tbf, with a burst of a millisecond's bytes), or
        unshaped (None). (These machines' kernels have tbf and htb, not netem: no delay.)"""
        self.rate = rate
        for node in self.nodes:
            for enter, dev in ((self.switch_enter(), f"n{node.index}"), (node.enter("-n"), "eth0")):
                sh(*enter, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                if rate:
                    burst = f"{max(64 * 1024, int(bits(rate) / 8 / 1000))}b"
                    sh(*enter, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                       "latency", "20ms")  # fmt: skip

    def down(self) -> None:
        """End every process of every node, then the nodes and the bridge (idempotent)."""
        holders = [node.holder for node in self.nodes] + [self.switch]
        for holder in holders:
            if holder is not None and holder.poll() is None:
                holder.kill()
        for holder in holders:
            if holder is not None:
                holder.wait(30)
        for node in self.nodes:
            for proc in node.started:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        due = time.monotonic() + 10  # (an init gets its SIGKILL from unshare's end a moment later)
        while (left := [n.name for n in self.nodes if n.pid and pid_namespace(n.pid)]) and time.monotonic() < due:
            time.sleep(0.05)
        if left:
            raise RuntimeError(f"the cluster's nodes {left} outlived it")

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def up(n: int = 3, shared: bool = True, base: Path | None = None) -> Cluster:
    """A cluster of `n` nodes, each with sshd running: see the module's docstring."""
    return Cluster(n, shared, base).start()


SSHD_CONFIG = """\
Port 22
HostKey /etc/ssh/ssh_host_ed25519_key
AuthorizedKeysFile /etc/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile /run/sshd.pid
MaxStartups 100
MaxSessions 100
"""
SLURM_CONFIG = """\
ClusterName=dsrl
SlurmctldHost=node1(198.18.0.1)
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmUser=root
SlurmdUser=root
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/tmp/slurmd
StateSaveLocation=/tmp/slurmctld
SlurmctldLogFile=/tmp/slurmctld.log
SlurmdLogFile=/tmp/slurmd.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none"""
SSH_CONFIG = """\
Host *
    IdentityFile /etc/ssh/cluster_key
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    BatchMode yes
    ConnectTimeout 10
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser("up", help="make a cluster and hold it until Ctrl-C or `down`")
    make.add_argument("-n", type=int, default=3, help="nodes")
    make.add_argument("--unshared", action="store_true", help=f"each node its own {SHARED}")
    make.add_argument("--rate", help="every link's rate, in tc's words (10gbit)")
    on = sub.add_parser("run", help="run a command on a node of the held cluster")
    on.add_argument("node", help="node1, node2, ...")
    on.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="end the held cluster")
    args = parser.parse_args(argv)
    if args.action == "up":
        if why := missing():
            sys.exit(f"python -m tests.cluster: {why}")
        cluster = up(args.n, shared=not args.unshared)
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        try:
            cluster.shape(args.rate)
            nodes = {node.name: node.pid for node in cluster.nodes}
            STATE.write_text(json.dumps({"pid": os.getpid(), "dir": str(cluster.dir), "nodes": nodes}))
            for node in cluster.nodes:
                print(f"{node.name} {node.address} (ssh {node.address} from any node; nsenter -t {node.pid} -a)")
            print(f"files: {cluster.dir}; Ctrl-C or `python -m tests.cluster down` ends it", flush=True)
            while not stop:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            cluster.down()
            STATE.unlink(missing_ok=True)
            shutil.rmtree(cluster.dir, ignore_errors=True)
        return 0
    if not STATE.is_file():
        sys.exit("python -m tests.cluster: no cluster is up (`python -m tests.cluster up`)")
    state = json.loads(STATE.read_text())
    if args.action == "down":
        os.kill(state["pid"], signal.SIGTERM)
        return 0
    pid = state["nodes"].get(args.node)
    if pid is None:
        sys.exit(f"python -m tests.cluster: no node {args.node!r}: {', '.join(state['nodes'])}")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return subprocess.call(["nsenter", "-t", str(pid), "-n", "-u", "-m", "-p", "--wd=" + os.getcwd(),
                            *(command or ["bash"])])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
