"""Rollout-server lifecycle: start servers as subprocesses (or take external URLs), wait for health,
and shut everything down on exit, error or Ctrl-C with no orphans."""

import argparse
import contextlib
import difflib
import functools
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dsrl.config import ConfigError, RolloutConfig, write_private
from dsrl.nodes import routable_address
from dsrl.rundir import PROGRESS_S, die_with_parent, member_fds
from dsrl.serving.embedded_args import build_parser

log = logging.getLogger(__name__)

# torch.distributed variables the deepspeed launcher sets for trainer ranks; a server that
# inherits them would try to join the trainer's world.
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "MASTER_ADDR",
            "MASTER_PORT")  # fmt: skip


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the kernel's ephemeral range: one the kernel hands out (a bind to port 0) it may hand
    again to any outgoing connection before the process meant to listen on it binds it (in CI a rank's TCPStore
    found its master port so taken: EADDRINUSE). Above Ray's worker ports (10002-19999)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = 20000 + secrets.randbelow(low - 20000) if low > 21000 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free port on {host} in 20000-{low}")


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
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
                return


class LogProgress:
    """When a starting server's log last grew by a line of its own: its answers to our /health polls (SGLang logs
    each one once its HTTP server is up) do not count, so a server that hangs after that is still seen as silent."""

    def __init__(self, path: Path):
        self.path, self.at = path, time.monotonic()
        self.read = path.stat().st_size if path.is_file() else 0  # (a restarted server appends to its old log)

    def check(self) -> float:
        """Seconds since the log last said something."""
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            f.seek(self.read)
            new = f.read()
            self.read += len(new)
            lines = new.decode(errors="replace").replace("\r", "\n").splitlines()
            if any(line.strip() and "GET /health" not in line for line in lines):
                self.at = time.monotonic()
        return time.monotonic() - self.at


def wait_healthy(server: "ServerProcess | str", timeout_s: float, every_s: float = PROGRESS_S) -> None:
    """Poll /health until 200, saying every `every_s` how long it has waited and what the server's log says last.
    A server this run started may take as long as its log shows progress (a first start's JIT builds and CUDA graph
    captures took 6 minutes for a TP-2 mixture of experts), and fails when it exits or its log stays silent for
    `timeout_s`; an external URL fails when it does not answer within `timeout_s`."""
    external = isinstance(server, str)  # an external URL: no process, no log
    url = server if external else server.url
    progress = None if external else LogProgress(server.log_path)
    start = said = time.monotonic()
    while (time.monotonic() - start if external else progress.check()) < timeout_s:
        if time.monotonic() - said >= every_s:
            said = time.monotonic()
            last = "" if external else f"; its log ends: {log_tail(server.log_path, 1).strip()[:120]}"
            log.info("server %s not ready after %.0f s%s", url, said - start, last)
        if not external and server.proc.poll() is not None:
            raise RuntimeError(
                f"rollout server {url} exited with code {server.proc.returncode} while starting; "
                f"end of {server.log_path}:\n{log_tail(server.log_path)}"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=5) as resp:
            if resp.status == 200:
                return
        time.sleep(0.5)
    if external:
        raise TimeoutError(
            f"rollout server {url} (--rollout.server_urls) did not answer /health within {timeout_s:.0f}s: "
            "is it running, and reachable from this machine?"
        )
    raise TimeoutError(
        f"rollout server {url} did not answer /health, and its log said nothing for {timeout_s:.0f}s "
        f"(--rollout.startup_timeout_s), {time.monotonic() - start:.0f}s after it started; end of "
        f"{server.log_path}:\n{log_tail(server.log_path)}"
    )


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each name a user may give a server argument, mapped to the flag `parser` takes: its field (`dest`: SGLang's
    `fp8_gemm_runner_backend`) and its flag's own spelling (`fp8_gemm_backend`), both to `--fp8-gemm-backend`. A
    field wins where a flag is spelled as another argument's field, and its first flag where deprecated aliases of
    it follow (SGLang's `--cuda-graph-max-bs` for `cuda_graph_max_bs_decode`)."""
    fields_, spellings = {}, {}
    for action in parser._actions:
        flags = [o for o in action.option_strings if o.startswith("--")]
        if flags:
            fields_.setdefault(action.dest, flags[0])
            spellings |= {f[2:].replace("-", "_"): f for f in flags}
    return spellings | fields_


@functools.cache
def server_flags(engine: str) -> dict[str, str] | None:
    """`flag_names` of the engine's own parser: the embedded engine's, or SGLang's (None where SGLang is not
    installed here: the servers run on Ray nodes, and SGLang checks its flags there)."""
    if engine == "embedded":
        return flag_names(build_parser())
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return None
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return flag_names(parser)


def check_server_args(cfg: RolloutConfig, engine: str, flag: str = "--rollout.server_args") -> None:
    """A key of `flag` (--rollout.server_args, or --reward_model.server_args) the engine does not know fails here,
    naming it, before any server starts (SGLang's own arguments, when SGLang is installed here)."""
    names = server_flags(engine)
    if names is None:
        return
    errors = []
    for key in cfg.server_args:
        if key.replace("-", "_") not in names:
            close = difflib.get_close_matches(key.replace("-", "_"), sorted(names), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            errors.append(f"{flag}: {key!r} is not an argument of the {engine} server{hint}")
    if errors:
        raise ConfigError(errors)


def as_flags(args: dict, names: dict[str, str] | None = None) -> list[str]:
    """{mem_fraction_static: 0.5, enable_foo: true, bar: [a, b]} -> ['--mem-fraction-static', '0.5', '--enable-foo',
    '--bar', 'a', 'b'], each key's flag as `names` (`flag_names`) spells it where it names the key."""
    flags = []
    for key, value in args.items():
        flag = (names or {}).get(key.replace("-", "_"), f"--{key.replace('_', '-')}")
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif value not in (False, None):
            flags += [flag, str(value)]
    return flags


def with_server_args(cfg: RolloutConfig, args: dict | None) -> RolloutConfig:
    """`cfg` with `args` over its server_args (a replacement's KV cache cap)."""
    return replace(cfg, server_args={**cfg.server_args, **args}) if args else cfg


def embedded_command(cfg: RolloutConfig, model_path: str, host: str, port: int, seed: int) -> list[str]:
    cmd = [sys.executable, "-m", "dsrl.serving.embedded", "--model-path", model_path, "--host", host]
    return cmd + ["--port", str(port), "--seed", str(seed), *as_flags(cfg.server_args, server_flags("embedded"))]


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
    return [sys.executable, "-m", "sglang.launch_server", *as_flags(args, server_flags("sglang"))]


@dataclass
class Membership:
    """A change of the fleet, as `Fleet.heal` applied it: the new URL list, who joined and who is leaving."""

    urls: list[str]
    joined: list[str]
    """New or restarted servers: they get the weights before any request (`RolloutClient.set_urls(held=...)`)."""
    leaving: list[str]
    """Servers asked to leave: their requests are aborted (and resubmitted elsewhere), then they are stopped."""
    numbers: list[int]
    """Each server's number, in `urls`' order: colocated, server n sits on the GPUs from n x tp_size."""


class ServersLost(RuntimeError):
    """No rollout server is left, and none can come back (their replacements did not start)."""


class Fleet:
    """The rollout servers of one run, held by trainer rank 0.

    Membership changes in one place, `heal`, which the weight update calls before it sends: a server
    that joins (restarted, added) receives the weights before its first request, and the transport
    rebuilds its group only when something changed. Joins and leaves asked for while the run is live
    (`dsrl fleet add/remove`, dsrl/serving/control.py) wait in `requests` until then.

    A server that died is set aside at once and the update goes on with the others; its replacement starts
    in the background (`restart_later`) and joins at the first update after it answers, as any join does.
    A fleet that can restart servers implements the four steps of a restart: `set_aside`, `start_replacement`
    (on the calling thread), `await_started` (on a thread of its own), `adopt`.
    """

    urls: list[str]

    def exited(self) -> set[str] | None:
        """Servers known to be down without asking them over HTTP; None: ask them (external servers)."""
        return None

    def gone(self, url: str) -> bool:
        return url in (self.exited() or ())

    def set_aside(self, url: str) -> Any:
        """Take a dead server out of the fleet; returns its slot (what its replacement takes), None: none starts."""
        raise NotImplementedError(f"{type(self).__name__} cannot restart servers")

    def start_replacement(self, slot: Any) -> Any:
        """Start a server in `slot` without waiting for it; returns its handle. Runs on the thread that holds the
        fleet: the kernel ends a server whose starting thread ended (`spawn`)."""
        raise NotImplementedError

    def await_started(self, handle: Any) -> str:
        """Wait until the server of `handle` answers (on a thread of its own); returns its URL."""
        raise NotImplementedError

    def adopt(self, slot: Any, handle: Any, url: str) -> None:
        """A replacement that answers becomes a member."""
        raise NotImplementedError

    def discard(self, handle: Any) -> None:
        """Stop a replacement that will not join (it failed to start, or the run ends)."""

    def numbers(self) -> list[int]:
        return list(range(len(self.urls)))

    def replace(self, dead: set[str]) -> list[str]:
        """Restart the dead servers and wait for them (the reward model's: a score waits for them anyway)."""
        for url in [u for u in self.urls if u in dead]:
            slot = self.set_aside(url)
            if slot is not None:
                handle = self.start_replacement(slot)
                self.adopt(slot, handle, self.await_started(handle))
        return list(self.urls)

    def add(self, count: int = 0, url: str | None = None) -> list[str]:
        """Start `count` more servers, or take the running server at `url`; returns the new URLs."""
        raise ValueError(f"{type(self).__name__} cannot add servers")

    def detach(self, url: str) -> None:
        """Take a server that is leaving out of the fleet; `stop_server` stops it once its requests are out."""
        self.urls.remove(url)

    def stop_server(self, url: str) -> None:
        """Stop a server that left (a no-op for servers dsrl did not start)."""

    def stop(self) -> None:
        """Stop every server this fleet started, with no orphans (none: servers the user runs)."""

    def __post_init__(self) -> None:
        self.requests: list[dict] = []
        """{"id", "add": count | url} or {"id", "remove": url}, queued by the control endpoint (another thread);
        {"started": (slot, handle, url)} or {"failed": (slot, handle)}, queued by a replacement's thread."""
        self.outcomes: dict[str, str] = {}
        """Request id -> "done", or why it failed (a server that would not start fails its request, not the run)."""
        self.lock = threading.Condition()
        self.starting: list = []
        """Handles of the replacements starting in the background."""
        self.prepare_join: Callable[[str], None] | None = None
        """Called with a replacement's URL once it answers, before it joins (colocated: it releases its memory)."""
        self.deaths = self.restarts = 0
        """Servers found dead, and replacements that joined, since the run started (`fleet/` metrics)."""
        self.replacement_args: dict | None = {}
        """Server arguments a replacement starts with over the others' (colocated: its KV cache's size beside the
        trainers, `GpuLending.size_replacements`); None: as the others', and colocated trainers wait for it."""
        self.unsized: list = []
        """The replacements starting with the others' arguments (None above): colocated, the trainers wait for them."""
        self.max_restarts = 3
        """Tries in a row to start a dead server's replacement (--rollout.max_restarts); then it is given up."""
        self.given_up: list[str] = []
        """Why each replacement given up did not start (one line each)."""

    def restart_later(self, url: str) -> None:
        """Set the dead server at `url` aside and start its replacement, which joins at the first `heal` after it
        answers; one that fails to start is started again at the next `heal`, `max_restarts` times in a row."""
        slot = self.set_aside(url)
        if slot is not None:
            self._start_in_background(slot)

    def _start_in_background(self, slot: Any, tries: int = 1) -> None:
        handle = self.start_replacement(slot)
        self.starting.append(handle)
        if self.replacement_args is None:
            self.unsized.append(handle)
        args = (slot, handle, tries)
        threading.Thread(target=self._await_replacement, args=args, daemon=True, name="replace").start()

    def _await_replacement(self, slot: Any, handle: Any, tries: int) -> None:
        try:
            url = self.await_started(handle)
            if self.prepare_join is not None:
                self.prepare_join(url)
            outcome = {"started": (slot, handle, url)}
        except Exception as e:  # noqa: BLE001 -- reported; the next update starts it again
            lines = str(e).strip().splitlines()  # (the cause, and the last line of the server's log)
            why = f"{lines[0]} {lines[-1]}" if len(lines) > 1 else lines[0]
            log.error("a replacement rollout server did not start (%s)", why)
            outcome = {"failed": (slot, handle), "tries": tries, "why": why}
        with self.lock:
            self.requests.append(outcome)
            self.lock.notify_all()

    def await_replacements(self, timeout_s: float) -> None:
        """Block until every replacement that is starting answered (and took `prepare_join`) or failed."""

        def settled() -> bool:
            return sum("started" in r or "failed" in r for r in self.requests) >= len(self.starting)

        with self.lock:
            self.lock.wait_for(settled, timeout_s)

    def await_server(self) -> bool:
        """No server is left: wait until a replacement answers or fails (`heal` applies it). False: none is starting."""
        if not self.starting:
            return False
        with self.lock:
            outcome = self.lock.wait_for(lambda: any("started" in r or "failed" in r for r in self.requests),
                                         2 * self.startup_timeout_s)  # fmt: skip
        return bool(outcome or self.starting)

    def heal(self, dead: set[str]) -> Membership | None:
        """Apply every change since the last call: dead servers set aside (their replacements started), started
        replacements joined, queued joins and leaves. With no server left, wait for one (`await_server`). Returns the
        new membership, or None when nothing changed; raises `ServersLost` when no server can come back."""
        before = list(self.urls)
        for url in [u for u in self.urls if u in dead]:
            self.deaths += 1
            self.restart_later(url)
        leaving = self._apply()
        if not self.urls:
            log.warning("no rollout server is up: waiting for one to start")
        while not self.urls and self.await_server():
            leaving += self._apply()
        if self.urls == before and not leaving:
            return None
        if not self.urls:
            given_up = "; ".join(self.given_up) or f"{sorted(dead)} are down, {leaving} left"
            raise ServersLost(f"no rollout server left: {given_up}")
        return Membership(list(self.urls), [u for u in self.urls if u not in before], leaving, self.numbers())

    def _apply(self) -> list[str]:
        """Take the queued requests: replacements that started join (one that failed starts again, up to
        `max_restarts` tries in a row), joins and leaves. Returns the servers leaving."""
        with self.lock:
            requests, self.requests = self.requests, []
        leaving = [r["remove"] for r in requests if "remove" in r and r["remove"] in self.urls]
        for url in leaving:
            log.info("rollout server %s leaves the fleet (asked to)", url)
            self.detach(url)
        for r in requests:
            outcome = "done"
            if "started" in r or "failed" in r:
                slot, handle, *url = r.get("started") or r["failed"]
                self.starting.remove(handle)
                self.unsized = [h for h in self.unsized if h is not handle]
                if url:
                    self.adopt(slot, handle, url[0])
                    self.restarts += 1
                    log.info("rollout server %s restarted at %s: it joins with this update's weights", slot, url[0])
                elif r["tries"] < self.max_restarts:
                    self.discard(handle)
                    self._start_in_background(slot, r["tries"] + 1)
                else:
                    self.discard(handle)
                    self.given_up.append(f"rollout server {slot} did not start in {r['tries']} tries: {r['why']}")
                    log.error("%s", self.given_up[-1])
            if "add" in r:
                try:
                    added = self.add(url=r["add"]) if isinstance(r["add"], str) else self.add(count=int(r["add"]))
                    for url in added if self.prepare_join is not None else []:
                        self.prepare_join(url)
                    log.info("rollout servers joined the fleet: %s", ", ".join(added))
                except Exception as e:  # noqa: BLE001 -- a join that fails is reported, the run goes on
                    log.error("rollout servers could not join the fleet (%s): %s", r["add"], e)
                    outcome = f"failed: {e}"
            if r.get("id"):
                self.outcomes[r["id"]] = outcome
        return leaving

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class ServerFleet(Fleet):
    """Servers started here, as subprocesses of trainer rank 0 (and restarted here)."""

    urls: list[str]
    processes: list[ServerProcess] = field(default_factory=list)
    launch: Callable[..., ServerProcess] | None = None  # starts server i: launch(i, server_args over the others')
    startup_timeout_s: float = 300.0
    detached: list[ServerProcess] = field(default_factory=list)
    """Servers that left, until `stop_server`."""

    def stop(self) -> None:
        for server in self.processes + self.detached + self.starting:
            server.stop()

    def exited(self) -> set[str]:
        """The servers whose process has exited. SGLang's HTTP process goes down with its scheduler, so
        this needs no round trip: behind a busy server's request queue one took ~20 ms per sync."""
        return {server.url for server in self.processes if server.proc.poll() is not None}

    def numbers(self) -> list[int]:
        return [self.index(p) for p in self.processes]

    def set_aside(self, url: str) -> int:
        old = self.processes.pop(self.urls.index(url))
        self.urls.remove(url)
        code = old.proc.poll()  # (None: a server that hangs, or failed its weight updates)
        state = "stopped" if code is None else f"exit code {code}"
        log.warning("rollout server %s is down (%s): starting its replacement", url, state)
        old.stop(grace_s=0)  # (one that hangs rather than exited: its GPU is needed)
        return self.index(old)

    def start_replacement(self, slot: int) -> ServerProcess:
        return self.launch(slot, self.replacement_args) if self.replacement_args else self.launch(slot)

    def await_started(self, handle: ServerProcess) -> str:
        wait_healthy(handle, self.startup_timeout_s)
        return handle.url

    def adopt(self, slot: int, handle: ServerProcess, url: str) -> None:
        self.processes.append(handle)
        self.urls.append(url)

    def discard(self, handle: ServerProcess) -> None:
        handle.stop(grace_s=5)

    def add(self, count: int = 0, url: str | None = None) -> list[str]:
        if url is not None:
            raise ValueError(f"this run starts its own servers (--rollout.fleet local): add a count, not {url}")
        first = max((self.index(p) for p in self.processes), default=-1) + 1
        for i in range(first, first + count):
            self.processes.append(self.launch(i))
            self.urls.append(self.processes[-1].url)
            self.wait_started(len(self.processes) - 1)
        return self.urls[len(self.urls) - count :]

    def detach(self, url: str) -> None:
        i = self.urls.index(url)
        self.urls.pop(i)
        self.detached.append(self.processes.pop(i))

    def stop_server(self, url: str) -> None:
        for server in [p for p in self.detached if p.url == url]:
            server.stop()
            self.detached.remove(server)

    @staticmethod
    def index(server: ServerProcess) -> int:
        """The server's number (its log is server_<i>.log): what a restart keeps."""
        return int(server.log_path.stem.rsplit("_", 1)[-1])

    def wait_started(self, i: int) -> None:
        """Wait for the i-th process to answer /health. One that lost a port to another process (several
        runs on one host: a port is free when picked, taken before the server binds it; seen with SGLang's
        own ports on an 8-GPU host) is started once more, on new ports."""
        try:
            wait_healthy(self.processes[i], self.startup_timeout_s)
        except RuntimeError as e:
            if not any(sign in str(e) for sign in PORT_TAKEN):
                raise
            log.warning("rollout server %d lost a port to another process while starting: starting it again", i)
            self.processes[i].stop(grace_s=5)
            self.processes[i] = self.launch(self.index(self.processes[i]))
            wait_healthy(self.processes[i], self.startup_timeout_s)
        if i < len(self.urls):
            self.urls[i] = self.processes[i].url


@dataclass
class ExternalFleet(Fleet):
    """Servers the user runs (--rollout.server_urls). One that goes down is set aside, asked again every few
    seconds (`rejoin_when_answering`), and rejoins (with the weights of the next update) once it answers."""

    urls: list[str]
    startup_timeout_s: float = 300.0

    def set_aside(self, url: str) -> None:
        log.warning("external rollout server %s is down: set aside until it answers again", url)
        self.urls.remove(url)
        rejoin_when_answering(self, url)

    def await_server(self) -> bool:
        """Every server is down: wait up to --rollout.startup_timeout_s for one to answer again (`rejoin_when_answering`
        queues its join), saying so each 30 s."""
        start = time.monotonic()
        while (waited := time.monotonic() - start) < self.startup_timeout_s:
            with self.lock:
                if self.lock.wait_for(lambda: any("add" in r for r in self.requests), 30):
                    return True
            waited = f"{waited + 30:.0f} s of {self.startup_timeout_s:.0f} s (--rollout.startup_timeout_s)"
            log.warning("every rollout server (--rollout.server_urls) is down: waiting for one, %s", waited)
        self.given_up = [f"no external server answered within {self.startup_timeout_s:.0f}s"]
        return False

    def add(self, count: int = 0, url: str | None = None) -> list[str]:
        if url is None:
            raise ValueError("this run uses external servers (--rollout.server_urls): add one by its URL")
        url = url.rstrip("/")
        wait_healthy(url, self.startup_timeout_s)
        self.urls.append(url)
        return [url]


def rejoin_when_answering(fleet: Fleet, url: str, every_s: float = 2.0) -> None:
    """Ask a server set aside whether it answers, from a thread of its own (a partitioned one takes each ask's whole
    timeout), and queue its join once it does: it rejoins at the next update, with its weights."""

    def ask() -> None:
        while not answers(url):
            time.sleep(every_s)
        log.info("rollout servers answer again and rejoin: %s (at the next weight update)", url)
        with fleet.lock:
            fleet.requests.append({"add": url})
            fleet.lock.notify_all()  # (a heal with no server left waits for it: `await_server`)

    threading.Thread(target=ask, daemon=True, name="rejoin").start()


def answers(url: str, timeout_s: float = 5.0) -> bool:
    """Whether a server answers /model_info at all (not /health: SGLang's generates a token)."""
    try:
        with urllib.request.urlopen(url + "/model_info", timeout=timeout_s):
            return True
    except urllib.error.HTTPError:  # it answered (e.g. 401 without the API key)
        return True
    except OSError:
        return False


def server_host(cfg: RolloutConfig, multi_node: bool) -> str:
    """The address started servers bind and are reached at: loopback unless the run spans nodes."""
    if cfg.host:
        return cfg.host
    return routable_address() if multi_node else "127.0.0.1"


def server_env(engine: str) -> dict[str, str]:
    """The environment of a started server: the trainer's, less what would make it join the trainer's world."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    # The deepspeed launcher narrows CUDA_VISIBLE_DEVICES to the trainer's GPUs; servers pick
    # theirs with --base-gpu-id among the GPUs `dsrl train` saw.
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if os.environ.get("DSRL_CUDA_VISIBLE_DEVICES"):
        env["CUDA_VISIBLE_DEVICES"] = os.environ["DSRL_CUDA_VISIBLE_DEVICES"]
    env.setdefault("OMP_NUM_THREADS", "1" if engine == "embedded" else "8")
    env["DSRL_PARENT_PID"] = str(os.getpid())  # the embedded engine exits when this process dies
    return env


def server_command(
    cfg: RolloutConfig, engine: str, model_path: str, host: str, port: int, seed: int, gpu: int | None, key_dir: Path
) -> list[str]:
    """The command line of one server: the embedded engine, or SGLang from `gpu` on (None: as Ray assigned).
    --rollout.api_key goes in a file of `key_dir` only this user reads (`--config`, SGLang's YAML of flags):
    on the command line every user of the machine would see it (ps)."""
    if engine == "embedded":
        cmd = embedded_command(cfg, model_path, host, port, seed)
    else:
        cmd = sglang_command(cfg, model_path, host, port, seed, cfg.placement == "colocate")
        cmd += ["--base-gpu-id", str(gpu)] if gpu is not None else []
    if not cfg.api_key:
        return cmd
    key_file = key_dir / ".server_api_key.yaml"
    write_private(key_file, json.dumps({"api-key": cfg.api_key}))  # JSON is YAML
    return cmd + ["--config", str(key_file)]


def spawn(cmd: list[str], env: dict[str, str], log_path: Path, url: str) -> ServerProcess:
    """Start a server in its own process group (killed as a whole on stop), its output in `log_path`. The
    kernel sends it SIGKILL when the thread that started it ends (a trainer rank or a Ray actor killed with
    its server running; SGLang's own subprocesses follow their parent the same way), and it holds the run
    directory with the process that started it (`member_fds`)."""
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
            pass_fds=member_fds(),
        )
    return ServerProcess(url=url, proc=proc, log_path=log_path)
