"""Rollout-server lifecycle: start servers as subprocesses (or take external URLs), wait for health,
and shut everything down on exit, error or Ctrl-C with no orphans.

Each server runs in its own process session with its log in <run_dir>/logs, so a failure to
start shows the end of that log, and stopping kills the server's whole process group.
"""

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dsrl.config import RolloutConfig

log = logging.getLogger(__name__)

# torch.distributed variables the deepspeed launcher sets for trainer ranks; a server that
# inherits them would try to join the trainer's world.
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def wait_healthy(server: ServerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"rollout server {server.url} exited with code {server.proc.returncode} while starting; "
                f"end of {server.log_path}:\n{log_tail(server.log_path)}"
            )
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(
        f"rollout server {server.url} did not answer /health within {timeout_s:.0f}s "
        f"(raise --rollout.startup_timeout_s if it is still loading); end of {server.log_path}:\n"
        f"{log_tail(server.log_path)}"
    )


def embedded_command(model_path: str, host: str, port: int, seed: int, extra: dict) -> list[str]:
    cmd = [sys.executable, "-m", "dsrl.serving.embedded", "--model-path", model_path, "--host", host]
    cmd += ["--port", str(port), "--seed", str(seed)]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


@dataclass
class ServerFleet:
    """The rollout servers of one run: started here, or external URLs."""

    urls: list[str]
    processes: list[ServerProcess] = field(default_factory=list)

    def stop(self) -> None:
        for server in self.processes:
            server.stop()

    def __enter__(self) -> "ServerFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_fleet(cfg: RolloutConfig, model_path: str, run_dir: Path, seed: int, engine: str) -> ServerFleet:
    """Start `cfg.num_servers` servers of the given engine ('embedded' here; SGLang comes with GPUs)."""
    if cfg.server_urls:
        return ServerFleet(urls=list(cfg.server_urls))
    if engine != "embedded":
        raise ValueError(f"--rollout.engine={engine!r}: only the embedded engine can be started on this machine")
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env["OMP_NUM_THREADS"] = "1"
    fleet = ServerFleet(urls=[])
    try:
        for i in range(cfg.num_servers):
            host, port = "127.0.0.1", free_port()
            log_path = log_dir / f"server_{i}.log"
            with open(log_path, "ab") as log_file:
                proc = subprocess.Popen(
                    embedded_command(model_path, host, port, seed + i, cfg.server_args),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # its own process group, killed as a whole on stop
                )
            server = ServerProcess(url=f"http://{host}:{port}", proc=proc, log_path=log_path)
            fleet.processes.append(server)
            fleet.urls.append(server.url)
        for server in fleet.processes:
            wait_healthy(server, cfg.startup_timeout_s)
            log.info("rollout server ready at %s (log: %s)", server.url, server.log_path)
    except BaseException:
        fleet.stop()
        raise
    return fleet
