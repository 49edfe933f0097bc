"""What a run on several machines needs of each node, measured on that node (DESIGN.md "Several machines"): its address
toward the others, the interface gloo binds, the settings the launcher does not pass on, and `dsrl train`'s check,
over ssh before any rank starts, that every node sees what the run needs at the same path.

Imports no torch: the CLI uses it before the launcher starts.
"""

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from ipaddress import ip_address
from pathlib import Path

import psutil


def local_ranks(default: int = 1) -> int:
    """The trainer ranks on this node: DeepSpeed's launcher says so in LOCAL_SIZE (it sets no LOCAL_WORLD_SIZE),
    torchrun in LOCAL_WORLD_SIZE; `default` outside a launcher."""
    return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or default)


def address_toward(peer: str) -> str | None:
    """This node's address on the route to `peer` (a UDP socket's connect sends no packet); None without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            return None


def routable_address(peer: str | None = None) -> str:
    """The address other nodes reach this one at: on the route to `peer`, else to the trainer's master (MASTER_ADDR,
    set by the launcher), else to the internet; on a node with none of those routes (an air-gapped cluster has no
    default route), the first address of an interface that is up. Never gethostbyname(gethostname()): 127.0.1.1 on
    Debian-style hosts, which no other node reaches."""
    master = os.environ.get("MASTER_ADDR", "")
    for target in (peer, None if is_loopback(master) else master, "8.8.8.8"):
        if target and (found := address_toward(target)):
            return found
    up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if name in up and a.family == socket.AF_INET and not is_loopback(a.address):
                return a.address
    return "127.0.0.1"


def is_loopback(host: str) -> bool:
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def interface_of(address: str) -> str | None:
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


PROBE_S = (5, 2, 3)
"""A quiet connection's first probe after 5 s, then every 2 s; the third unanswered ends it (`probing_socket`)."""


def probing_socket(addr_info: tuple) -> socket.socket:
    """A TCP socket (aiohttp's `socket_factory`) whose peer is probed when the connection goes quiet: one that stops
    answering (a partition, a lost host, where no reset ever comes) fails its requests within ~15 s instead of at
    their own timeout, minutes on. A live server's kernel answers the probes while it computes a long reply."""
    sock = socket.socket(*addr_info[:3])
    idle, interval, count = PROBE_S
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in ((socket.TCP_KEEPIDLE, idle), (socket.TCP_KEEPINTVL, interval), (socket.TCP_KEEPCNT, count),
                          (socket.TCP_USER_TIMEOUT, 1000 * (idle + interval * count))):  # fmt: skip
        sock.setsockopt(socket.IPPROTO_TCP, option, value)  # (USER_TIMEOUT: data sent and never acknowledged)
    return sock


CHOSEN_GLOO = "DSRL_GLOO_SOCKET_IFNAME"
"""Where dsrl notes the GLOO_SOCKET_IFNAME it chose: one that differs from it is the user's, and stays."""


def choose_gloo_interface(peer: str) -> None:
    """Gloo groups built from now on bind the interface on the route to `peer`. Gloo otherwise binds what the
    hostname resolves to: 127.0.1.1 on Debian, and a 2-node run's first group timed out connecting to it. The user's
    own GLOO_SOCKET_IFNAME stays; a peer on loopback leaves gloo's default."""
    given = os.environ.get("GLOO_SOCKET_IFNAME")
    if given and given != os.environ.get(CHOSEN_GLOO):
        return
    address = None if is_loopback(peer) else address_toward(peer)
    interface = interface_of(address) if address and not is_loopback(address) else None
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ[CHOSEN_GLOO] = interface
    elif given:
        del os.environ["GLOO_SOCKET_IFNAME"], os.environ[CHOSEN_GLOO]


def hostfile_hosts(path: str) -> list[str]:
    """The hosts of a DeepSpeed hostfile (`host slots=N` lines), in its order: the first is rank 0's."""
    lines = (line.split("#", 1)[0].split() for line in Path(path).read_text().splitlines())
    return [words[0] for words in lines if words]


FORWARDED = ("OMP_", "MKL_", "ATEN_CPU_CAPABILITY", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "DSRL_", "HF_",
             "TRANSFORMERS_", "RAY_", "GLOO_SOCKET_IFNAME", "NCCL_")  # fmt: skip
"""The settings the ranks on other nodes get from `dsrl train`'s environment (DeepSpeed's pdsh launch passes only
PYTHON*, MLFLOW*, MV2*, UCX* and, on CUDA, NCCL* variables): the threads and kernels it pins, the accelerator, the
JIT builds' directory, the GPUs its servers see, the Hugging Face and Ray settings."""


def env_file(run_dir: Path, env: dict[str, str]) -> Path:
    """<run_dir>/.deepspeed_env: the `FORWARDED` settings of `env`, then the lines of the user's own .deepspeed_env
    (home, then here: DeepSpeed's order, so the user's win), which DeepSpeed reads no more once DS_ENV_FILE names
    this file. The launcher exports each line on every node."""
    lines = [f"{k}={v}" for k, v in sorted(env.items()) if k.startswith(FORWARDED) and "\n" not in v]
    own = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    for folder in (Path.home(), Path.cwd()):
        with contextlib.suppress(OSError):
            lines += [line for line in (folder / own).read_text().splitlines() if "=" in line]
    path = Path(run_dir) / ".deepspeed_env"
    path.write_text("".join(line + "\n" for line in lines))
    return path.resolve()


CHECK = """
import contextlib, json, os, random, socket, sys
a = json.loads(sys.argv[1])
out = {"host": socket.gethostname(), "missing": [p for p in a["paths"] if not os.path.exists(p)], "lock": None}
try:
    out["lock"] = open(a["lock"]).read()
except OSError:
    pass
try:
    socket.create_connection((a["address"], a["port"]), timeout=10).close()
    out["reached"] = ""
except OSError as e:
    out["reached"] = str(e)
ports = iter(random.SystemRandom().sample(range(20000, 32768), 200))  # below the ephemeral range: see free_port
while "free_port" not in out:
    with socket.socket() as s, contextlib.suppress(OSError):
        port = next(ports)
        s.bind(("", port))
        out["free_port"] = port
print(json.dumps(out))
"""
"""Run on every node of the hostfile by `check_nodes`, with the Python the launcher will run there."""


def check_nodes(hosts: list[str], paths: dict[str, str], lock: Path, owner: tuple[str, int]) -> tuple[list[str], int]:
    """Over ssh (as DeepSpeed's launcher will reach them), on each of `hosts`: that it sees each of `paths` (its flag
    -> the path) and the run directory's lock as this node wrote it (the run directory shared at the same path), and
    that it reaches `owner` (an address and port of this node's). Returns a line per node that lacks any, and a port
    free on the first host (rank 0's master port)."""
    args = json.dumps({"paths": list(paths.values()), "lock": str(lock), "address": owner[0], "port": owner[1]})
    held = lock.read_text()

    def check(host: str) -> tuple[str | None, int]:
        cmd = ["ssh", "-o", "BatchMode=yes", host, shlex.join([sys.executable, "-c", CHECK, args])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            out = json.loads(proc.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            why = "did not answer within 60 s" if "proc" not in locals() else (proc.stderr.strip() or "no output")
            return f"node {host}: ssh {host} failed, as DeepSpeed's launcher would: {why[:300]}", 0
        name, lacks = f"node {host} ({out['host']})", []
        lacks += [f"{flag} {path}" for flag, path in paths.items() if path in out["missing"]]
        if out["lock"] != held:
            lacks.append(f"the run directory {lock.parent} this node holds (not shared with it at that path)")
        if out["reached"]:
            lacks.append(f"a connection to this node's {owner[0]}:{owner[1]} ({out['reached']}: open ports)")
        if not lacks:
            return None, out["free_port"]
        return f"{name} lacks {'; '.join(lacks)}", out["free_port"]

    with ThreadPoolExecutor(len(hosts)) as pool:
        results = list(pool.map(check, hosts))
    return [line for line, _ in results if line], results[0][1]


def unanswering(hosts: list[str], timeout_s: int = 5) -> dict[str, str]:
    """Those of `hosts` that ssh does not reach within `timeout_s`, and what ssh said."""

    def ask(host: str) -> str | None:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout_s}", host, "true"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 5)
        except subprocess.TimeoutExpired:
            return f"no answer within {timeout_s} s"
        return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["no answer"])[-1][:200]

    with ThreadPoolExecutor(len(hosts)) as pool:
        return {host: why for host, why in zip(hosts, pool.map(ask, hosts)) if why}
