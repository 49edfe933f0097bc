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
from collections.abc import Callable
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


PORT_TAKEN = ("address already in use", "EADDRINUSE")  # in a server's log: it could not bind a port


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


def wait_healthy(server: "ServerProcess | str", timeout_s: float) -> None:
    """Poll /health until 200; a started server that exits, or any that stays silent, fails with its log's end."""
    external = isinstance(server, str)  # an external URL: no process, no log
    url = server if external else server.url
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not external and server.proc.poll() is not None:
            raise RuntimeError(
                f"rollout server {url} exited with code {server.proc.returncode} while starting; "
                f"end of {server.log_path}:\n{log_tail(server.log_path)}"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    if external:
        raise TimeoutError(
            f"rollout server {url} (--rollout.server_urls) did not answer /health within {timeout_s:.0f}s: "
            "is it running, and reachable from this machine?"
        )
    raise TimeoutError(
        f"rollout server {url} did not answer /health within {timeout_s:.0f}s "
        f"(raise --rollout.startup_timeout_s if it is still loading); end of {server.log_path}:\n"
        f"{log_tail(server.log_path)}"
    )


def as_flags(args: dict) -> list[str]:
    """{mem_fraction_static: 0.5, enable_foo: true} -> ['--mem-fraction-static', '0.5', '--enable-foo']."""
    flags = []
    for key, value in args.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            flags.append(flag)
        elif value not in (False, None):
            flags += [flag, str(value)]
    return flags


def embedded_command(cfg: RolloutConfig, model_path: str, host: str, port: int, seed: int) -> list[str]:
    cmd = [sys.executable, "-m", "dsrl.serving.embedded", "--model-path", model_path, "--host", host]
    return cmd + ["--port", str(port), "--seed", str(seed), *as_flags(cfg.server_args)]


def sglang_command(cfg: RolloutConfig, model_path: str, host: str, port: int, seed: int, colocated: bool) -> list[str]:
    args = {
        "model_path": model_path,
        "host": host,
        "port": port,
        "tp_size": cfg.tp_size,
        "mem_fraction_static": cfg.mem_fraction_static,
        "random_seed": seed,
        "skip_tokenizer_init": True,  # token-in/token-out: dsrl never re-tokenises
        "enable_memory_saver": colocated,  # lets /release_memory_occupation really free the GPU
        # A retracted request is prefilled again after the update; from a prefix cached under the old
        # weights unless the cache is off (set disable_radix_cache: false in server_args to keep it).
        "disable_radix_cache": cfg.interrupt == "pause" and cfg.pause_mode == "retract",
        **cfg.server_args,
    }
    return [sys.executable, "-m", "sglang.launch_server", *as_flags(args)]


@dataclass
class ServerFleet:
    """The rollout servers of one run: started here (and restarted here), or external URLs."""

    urls: list[str]
    processes: list[ServerProcess] = field(default_factory=list)
    launch: Callable[[int], ServerProcess] | None = None  # starts server i; None for external servers
    startup_timeout_s: float = 300.0

    def stop(self) -> None:
        for server in self.processes:
            server.stop()

    def exited(self) -> set[str] | None:
        """The started servers whose process has exited, or None for external servers (ask them over HTTP).

        SGLang's HTTP process goes down with its scheduler, so this needs no round trip: behind a busy
        server's request queue one took ~20 ms per sync."""
        if self.launch is None:
            return None
        return {server.url for server in self.processes if server.proc.poll() is not None}

    def replace(self, dead: set[str]) -> list[str]:
        """Restart the dead servers this fleet started; drop dead external ones. Returns the new URLs."""
        for i, url in enumerate(list(self.urls)):
            if url not in dead:
                continue
            if self.launch is None:
                log.warning("external rollout server %s is down: dropped from the fleet", url)
                self.urls.remove(url)
                continue
            old = self.processes[i]
            old.stop(grace_s=5)
            log.warning("rollout server %s is down (exit code %s): restarting it", url, old.proc.poll())
            self.processes[i] = self.launch(i)
            self.wait_started(i)
            log.info("rollout server %d restarted at %s", i, self.urls[i])
        if not self.urls:
            raise RuntimeError(f"no rollout server left: {sorted(dead)} are down and cannot be restarted")
        return list(self.urls)

    def wait_started(self, i: int) -> None:
        """Wait for server i to answer /health. One that lost a port to another process (several runs
        on one host: a port is free when picked, taken before the server binds it; seen with SGLang's
        own ports on an 8-GPU host) is started once more, on new ports."""
        try:
            wait_healthy(self.processes[i], self.startup_timeout_s)
        except RuntimeError as e:
            if not any(sign in str(e) for sign in PORT_TAKEN):
                raise
            log.warning("rollout server %d lost a port to another process while starting: starting it again", i)
            self.processes[i].stop(grace_s=5)
            self.processes[i] = self.launch(i)
            wait_healthy(self.processes[i], self.startup_timeout_s)
        self.urls[i] = self.processes[i].url

    def __enter__(self) -> "ServerFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_fleet(cfg: RolloutConfig, model_path: str, run_dir: Path, seed: int, engine: str) -> ServerFleet:
    """Start `cfg.num_servers` servers: the embedded engine, or SGLang on consecutive GPUs from `first_gpu`."""
    if cfg.server_urls:
        for url in cfg.server_urls:
            wait_healthy(url.rstrip("/"), cfg.startup_timeout_s)
        return ServerFleet(urls=[url.rstrip("/") for url in cfg.server_urls])
    if engine not in ("embedded", "sglang"):
        raise ValueError(f"--rollout.engine={engine!r}: expected embedded or sglang")
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    # The deepspeed launcher narrows CUDA_VISIBLE_DEVICES to the trainer's GPUs; servers pick
    # theirs with --base-gpu-id among the GPUs `dsrl train` saw.
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if os.environ.get("DSRL_CUDA_VISIBLE_DEVICES"):
        env["CUDA_VISIBLE_DEVICES"] = os.environ["DSRL_CUDA_VISIBLE_DEVICES"]
    env.setdefault("OMP_NUM_THREADS", "1" if engine == "embedded" else "8")
    env["DSRL_PARENT_PID"] = str(os.getpid())  # the embedded engine exits when this process dies

    def launch(i: int) -> ServerProcess:
        host, port = "127.0.0.1", free_port()
        log_path = log_dir / f"server_{i}.log"
        if engine == "embedded":
            cmd = embedded_command(cfg, model_path, host, port, seed + i)
        else:
            cmd = sglang_command(cfg, model_path, host, port, seed + i, cfg.placement == "colocate")
            cmd += ["--base-gpu-id", str(cfg.first_gpu + i * cfg.tp_size)]
        log.info("starting rollout server %d: %s", i, " ".join(cmd))
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group, killed as a whole on stop
            )
        return ServerProcess(url=f"http://{host}:{port}", proc=proc, log_path=log_path)

    fleet = ServerFleet(urls=[], launch=launch, startup_timeout_s=cfg.startup_timeout_s)
    try:
        for i in range(cfg.num_servers):
            server = launch(i)
            fleet.processes.append(server)
            fleet.urls.append(server.url)
        for i in range(len(fleet.processes)):
            fleet.wait_started(i)
            log.info("rollout server ready at %s (log: %s)", fleet.urls[i], fleet.processes[i].log_path)
    except BaseException:
        fleet.stop()
        raise
    return fleet
