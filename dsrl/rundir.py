"""What dsrl does to the directories it writes: a run directory has one owner (a lock), a run is asked
to stop through it, an export never deletes what dsrl did not write, and a failed write names its path.

Imports no torch: the CLI uses it before the launcher starts.
"""

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from dsrl.config import Config, dump_config

log = logging.getLogger(__name__)

LOCK_FILE = ".dsrl.lock"
MEMBERS_FILE = ".dsrl.members"
"""Every process of a run holds a shared flock on it: the ranks take one, and the servers and workers they
start inherit the descriptor. A new run takes the directory only once no process of an old one is left."""
STOP_FILE = "STOP"
"""Written by `dsrl train` when it is signalled: trainer rank 0 sees it at the end of a step."""
EXPORT_MARKER = "dsrl_export.json"
"""In every directory dsrl exports: what marks it as dsrl's to replace (`--overwrite`)."""
OWNER_FLAG = "--dsrl_owner="
"""`dsrl train` passes --dsrl_owner=PID@HOST[@ADDRESS:PORT] to its ranks (on every node: the launcher passes argv on,
not the environment): the process that holds the run directory's lock for them, and, across nodes, a port of its
that refuses once it is gone. Each rank lives only as long as that process (`OwnerWatch`)."""


class RunDirLocked(RuntimeError):
    """Another live run owns the run directory."""


class RunLock:
    """The run directory's lock: an flock on <run_dir>/.dsrl.lock, held for the life of the owner, with the
    owner's host and pid written in it. The kernel drops an flock when its process dies, so a lock file
    that names an owner and can be locked again was left by a run that died (SIGKILL): it is taken over,
    with a warning naming that owner."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self, command: str = "") -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            raise RunDirLocked(
                f"--logging.run_dir={str(self.path.parent)!r} belongs to a run that is still going: {owner}. "
                "Wait for it, stop it, or choose another --logging.run_dir"
            ) from None
        try:
            _no_members_left(self.path.parent)
        except RunDirLocked:
            os.close(fd)
            raise
        previous = _read_owner(fd)
        if previous:
            log.warning("%s: taking over the lock of a run that is gone (%s)", self.path.parent, previous)
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({**info, "command": command}).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # empty: nobody's (the file stays: unlinking it races a new owner)
            os.close(self.fd)
            self.fd = None


MEMBERS_WAIT_S = 20.0
"""How long a new run waits for the processes of a run whose owner died to end before it refuses the directory:
their watch (`OwnerWatch`) ends them within about a second, a loaded machine's in a few (a resume right after a
kill -9, two test runs at a time on 2 cores, was refused when it did not wait)."""


def _no_members_left(run_dir: Path, wait_s: float = MEMBERS_WAIT_S) -> None:
    """Wait up to `wait_s` for the processes of a previous run that still hold the run directory to end; raise
    naming them if they have not."""
    path = run_dir / MEMBERS_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline, tries = time.monotonic() + wait_s, 0
    try:
        while True:
            try:
                return fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                if not tries:
                    log.warning("%s: waiting up to %.0f s for a lost run's processes to end", run_dir, wait_s)
                tries += 1
                time.sleep(0.5)
        held = ", ".join(f"pid {pid} ({name})" for pid, name in _holders(path) if pid != os.getpid())
        raise RunDirLocked(
            f"--logging.run_dir={str(run_dir)!r}: processes of a run that lost its owner are still alive "
            f"{wait_s:.0f} s on: {held or 'on another host'}. Stop them, or choose another --logging.run_dir"
        ) from None
    finally:
        os.close(fd)


def _holders(path: Path) -> list[tuple[int, str]]:
    """The processes of this host (of this user) with `path` open, found in /proc."""
    target, found = str(path.resolve()), []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:60].decode(errors="replace")
                found.append((int(proc.name), command.strip()))
    return found


_member_fd: int | None = None


def hold_run_dir(run_dir: Path | None) -> None:
    """This process belongs to the run in `run_dir` (a shared flock on its members file) until it exits or
    calls this with None; `member_fds()` hands the descriptor to the processes it starts."""
    global _member_fd
    if _member_fd is not None:
        os.close(_member_fd)
        _member_fd = None
    if run_dir is not None:
        _member_fd = os.open(Path(run_dir) / MEMBERS_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(_member_fd, fcntl.LOCK_SH)


def member_fds() -> tuple[int, ...]:
    """For `subprocess.Popen(pass_fds=...)`: a started server or worker holds the run directory too."""
    return () if _member_fd is None else (_member_fd,)


def _read_owner(fd: int) -> str:
    raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not raw:
        return ""
    try:
        o = json.loads(raw)
        return f"pid {o['pid']} on {o['host']} since {o['since']}" + (f" ({o['command']})" if o.get("command") else "")
    except (ValueError, KeyError, TypeError):
        return raw[:200]


def _lock_owner(path: Path) -> tuple[int, str] | None:
    try:
        held = json.loads(path.read_text())
        return int(held["pid"]), held["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """The kernel sends this process `signum` when the thread that started it ends (Linux's PR_SET_PDEATHSIG):
    for `preexec_fn`, or called first thing in a child."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)


class OwnerWatch:
    """A rank's watch on what it lives for: `dsrl train` (its pid on the host it launched from; on other hosts, the
    port it listens on there) and trainer rank 0 (its TCP store's address, on ranks above 0). When either is gone --
    killed by any signal, SIGKILL included, or its node lost -- the rank kills the processes it started and itself,
    so nothing of the run outlives its owner. `closing()` before the ranks close: rank 0 may exit first then, but
    `dsrl train` outlives every rank, so a close that hangs still ends with it."""

    def __init__(self, holder: tuple[int, str], ports: list[tuple[str, tuple[str, int]]], interval_s: float = 1.0):
        self.holder, self.ports, self.interval_s = holder, ports, interval_s
        """`holder`: `dsrl train`'s (pid, host), which holds the run directory's lock for the ranks."""
        self.owner = None
        if holder[1] == socket.gethostname():
            try:
                self.owner = psutil.Process(holder[0])
            except psutil.NoSuchProcess:
                self._end(f"dsrl train (pid {holder[0]})")
        threading.Thread(target=self._watch, name="dsrl-owner-watch", daemon=True).start()

    @classmethod
    def of(cls, argv: list[str]) -> tuple["OwnerWatch | None", list[str]]:
        """Launched by `dsrl train` (--dsrl_owner=PID@HOST[@ADDRESS:PORT] among the rank's `argv`): its watch (else
        None), and `argv` without the flag."""
        owner = next((a.split("=", 1)[1] for a in argv if a.startswith(OWNER_FLAG)), None)
        argv = [a for a in argv if not a.startswith(OWNER_FLAG)]
        if owner is None:
            return None, argv
        pid, host, *port = owner.split("@")
        ports = []
        if port and host != socket.gethostname():  # its pid is not seen from here: its port is
            address, number = port[0].rsplit(":", 1)
            ports.append((f"dsrl train (pid {pid} on {host}, its port {address}:{number})", (address, int(number))))
        if os.environ.get("RANK", "0") != "0":
            store = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            ports.append((f"trainer rank 0 (its store at {store[0]}:{store[1]})", store))
        return cls((int(pid), host), ports), argv

    def _watch(self) -> None:
        misses: dict[str, int | None] = {who: None for who, _ in self.ports}  # watched once it has answered (rank 0's
        while True:  # store starts with rank 0's world)
            time.sleep(self.interval_s)
            if self.owner is not None and not self.owner.is_running():
                self._end(f"dsrl train (pid {self.owner.pid})")
            for who, address in list(self.ports):
                try:
                    socket.create_connection(address, timeout=2).close()
                    misses[who] = 0
                except OSError:  # refused at once when the process is gone; a slow network, or a lost node, 3 tries
                    misses[who] = None if misses[who] is None else misses[who] + 1
                    if misses[who] is not None and misses[who] >= 3:
                        self._end(who)

    def _end(self, who: str) -> None:
        end_process(f"the run's owner, {who}, is gone")

    def closing(self) -> None:
        """The ranks close on their own now: rank 0's store is no longer watched (it may exit first)."""
        self.ports = [(who, address) for who, address in self.ports if not who.startswith("trainer rank 0")]


def end_process(why: str) -> None:
    """Log `why` and where the main thread was (a rank waiting on a peer that hung: where it waited), kill every
    process this one started, then this one (SIGKILL: no cleanup can hang)."""
    main = sys._current_frames().get(threading.main_thread().ident)
    where = "".join(traceback.format_stack(main)[-6:]) if main is not None else ""
    log.error("%s: this rank and the processes it started exit now; its main thread was at:\n%s", why, where)
    for handler in logging.getLogger().handlers:
        handler.flush()
    for child in psutil.Process().children(recursive=True):
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


_deadlines: list[tuple[str, float]] = []
"""The armed `deadline` blocks of this process, innermost last: (what, when it is due)."""
_deadlines_lock = threading.Lock()
_deadline_watch: list[threading.Thread] = []


@contextmanager
def deadline(what: str, seconds: float, flag: str) -> Iterator[None]:
    """End this process (`end_process`) when the block runs past `seconds`, with one line naming `what` and
    the `flag` that sets the limit. For waits across processes that Python cannot interrupt: an NCCL call stuck
    in C++, a collective a peer never enters. A thread watches, so it fires whatever the block waits in (torch's
    collectives and HTTP waits release the GIL). The rest of the run follows: its launcher stops every rank
    when one fails, and the other ranks' own deadlines and owner watches fire too."""
    entry = (f"{what} did not finish within {seconds:.0f}s ({flag})", time.monotonic() + seconds)
    with _deadlines_lock:
        if not _deadline_watch:
            _deadline_watch.append(threading.Thread(target=_watch_deadlines, name="dsrl-deadline", daemon=True))
            _deadline_watch[0].start()
        _deadlines.append(entry)
    try:
        yield
    finally:
        with _deadlines_lock:
            _deadlines.remove(entry)


def _watch_deadlines() -> None:
    while True:
        time.sleep(0.25)
        with _deadlines_lock:
            late = [why for why, due in _deadlines if time.monotonic() > due]
        if late:
            end_process(late[-1])  # the innermost names the phase


# -- stopping a run --------------------------------------------------------------------------------


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What stops a run cleanly: a job scheduler's or container runtime's stop, and Ctrl-C."""


def request_stop(run_dir: Path, signum: int) -> None:
    """Ask the run's ranks to stop at the end of the step (what `dsrl train` does when it is signalled)."""
    (Path(run_dir) / STOP_FILE).write_text(f"{signum}\n")


def clear_stop(run_dir: Path) -> None:
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


class RunStopped(RuntimeError):
    """The run stopped at the end of a step because it was asked to (SIGTERM, SIGINT)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, message: str | None = None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (--logging.save_on_signal false)"
        super().__init__(message or f"stopped by {signal.Signals(signum).name} after step {step}; {saved}")


class StopRequests:
    """A rank's view of stop requests: SIGTERM or SIGINT to this process, or the run directory's STOP file
    (`dsrl train` writes it when it is signalled itself). The first asks for a stop at the end of the
    step; a second signal stops at once (KeyboardInterrupt)."""

    def __init__(self, run_dir: Path, watch_file: bool):
        self.run_dir, self.watch_file = Path(run_dir), watch_file
        self.signum: int | None = None
        self.previous: dict[int, object] = {}

    def install(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"a second {signal.Signals(signum).name}: stopping now")
        self.signum = signum
        log.warning("%s: stopping at the end of this step (send it again to stop at once)",
                    signal.Signals(signum).name)  # fmt: skip

    def requested(self) -> int | None:
        """The signal a stop was asked for with, if one was (this rank's view)."""
        if self.signum is None and self.watch_file:
            try:
                self.signum = int((self.run_dir / STOP_FILE).read_text().strip() or signal.SIGTERM)
            except FileNotFoundError:
                pass
            except ValueError:
                self.signum = signal.SIGTERM
        return self.signum

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


# -- exports ---------------------------------------------------------------------------------------


class ExportTargetError(ValueError):
    """An export would replace or mix with files dsrl did not write."""


def check_export_target(out: Path, overwrite: bool, flag: str = "--out") -> None:
    """Refuse a target that holds anything but a previous dsrl export (and that one unless `overwrite`);
    `.`, `/` and the home directory never are targets."""
    out = Path(out)
    resolved = out.expanduser().resolve()
    if resolved in {Path.cwd().resolve(), Path.home().resolve(), Path("/")} or resolved == resolved.parent:
        raise ExportTargetError(f"{flag}={str(out)!r} is {resolved}: export into a directory of its own")
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportTargetError(f"{flag}={str(out)!r} is a file, not a directory")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if EXPORT_MARKER not in entries:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise ExportTargetError(
            f"{flag}={str(out)!r} holds files dsrl did not write ({shown}): nothing there is deleted; "
            "export into a new or empty directory"
        )
    if not overwrite:
        raise ExportTargetError(f"{flag}={str(out)!r} holds a previous dsrl export: --overwrite replaces it")


def staging_dir(out: Path) -> Path:
    """Where an export to `out` is built before it is published: beside it, a name only this process uses."""
    return out.with_name(f".{out.name}.dsrl-tmp-{os.getpid()}")


def publish_export(tmp: Path, out: Path, source: str, overwrite: bool) -> None:
    """Move a finished export into place. A previous dsrl export there is swapped out and then deleted
    (checked again here: nothing else is ever deleted); an empty directory is replaced."""
    check_export_target(out, overwrite)
    (tmp / EXPORT_MARKER).write_text(json.dumps({"source": source, "time": time.strftime("%Y-%m-%d %H:%M:%S")}))
    old = None
    if out.exists():
        if any(out.iterdir()):
            old = out.with_name(f".{out.name}.dsrl-old-{os.getpid()}")
            out.rename(old)
        else:
            out.rmdir()
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


def check_writable(run_dir: Path) -> None:
    probe = run_dir / "checkpoints" / ".write_test"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"--logging.run_dir={str(run_dir)!r}: cannot write checkpoints there ({e})") from e


def claim_run_dir(run_dir: Path, cfg: Config, owner: tuple[int, str] | None) -> "RunLock | None":
    """Rank 0, before anything is written: the run directory's lock (unless `dsrl train`, `owner` (pid, host), holds
    it for the ranks), a writable checkpoint directory, an export target that holds nothing but dsrl's own; then the
    config."""
    lock = None
    if owner is None or _lock_owner(run_dir / LOCK_FILE) != owner:  # not launched by `dsrl train`, which holds it
        lock = RunLock(run_dir).acquire("python -m dsrl.train")
        clear_stop(run_dir)  # a stale stop request is ours to clear
    check_writable(run_dir)
    if cfg.logging.export_hf:
        check_export_target(run_dir / "hf", overwrite=True, flag="the final export <run_dir>/hf")
    dump_config(cfg, run_dir / "config.yaml")
    return lock


def record_trace(path: Path, step: int, rows: list[int], filtered: list[int]) -> None:
    """Every prompt trained on, once: a line per step, with the rows dynamic sampling dropped."""
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "rows": rows} | ({"filtered": filtered} if filtered else {})) + "\n")


def trim_trace(path: Path, step: int) -> None:
    """Keep the trained-prompt trace consistent with a resumed run: drop steps after the checkpoint."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < step]
        path.write_text("".join(line + "\n" for line in lines))


# -- long writes -----------------------------------------------------------------------------------

PROGRESS_S = 10.0
"""How long a wait (a server's start, a checkpoint, an export) goes before it says how far it got, and then again."""


@contextlib.contextmanager
def reporting(report, every_s: float = PROGRESS_S):
    """While the block runs: `report(" so far")` every `every_s`, from a thread of its own, then `report("")` at its
    end (on success)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every_s):
            report(" so far")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    report("")


@contextlib.contextmanager
def report_writes(path: Path | None, what: str, published: Path | None = None, every_s: float = PROGRESS_S):
    """While the block writes under `path` (None: nothing to report here): every `every_s` a line with the bytes
    written so far and the rate, and one at the end with those `published` there (on success), so that a checkpoint
    or an export of GBs is never silent. A torch JIT build in `path` (its build.ninja) says its steps instead."""
    if path is None:
        yield
        return
    start = time.monotonic()

    def report(so_far: str) -> None:
        where = path if so_far else published or path
        if (where / "build.ninja").is_file():  # a build writes its bytes at the end: its steps move before
            log.info("%s: %.0f s, %s", what, time.monotonic() - start, ninja_steps(where))
            return
        try:
            size, seconds = sum(f.stat().st_size for f in where.rglob("*") if f.is_file()), time.monotonic() - start
        except OSError:  # a file renamed as it was counted: said the next time
            return
        if size == 0:
            log.info("%s: nothing written yet, %.0f s on", what, seconds)
            return
        amount = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
        log.info("%s: %s written%s in %.1f s (%.0f MB/s)", what, amount, so_far, seconds, size / 1e6 / (seconds + 1e-9))

    with reporting(report, every_s):
        yield


def ninja_steps(build: Path) -> str:
    """How far the ninja build in `build` got: its steps done (those in .ninja_log, which ninja appends to as each
    ends: its own `[k/n]` lines are piped away by torch) and those under way (their inputs built)."""
    steps = {}  # output: (rule, inputs), from build.ninja's `build OUT: RULE IN...` lines
    for line in (build / "build.ninja").read_text().splitlines():
        if line.startswith("build "):
            out, _, rule_inputs = line.removeprefix("build ").partition(": ")
            steps[out] = rule_inputs.split()
    logged = (build / ".ninja_log").read_text().splitlines() if (build / ".ninja_log").is_file() else []
    done = {f[3] for f in (line.split("\t") for line in logged) if len(f) > 3} & steps.keys()
    doing = [
        f"linking {out}" if rule == "link" else f"compiling {Path(inputs[0]).name}"
        for out, (rule, *inputs) in steps.items()
        if out not in done and all(i in done for i in inputs if i in steps)
    ]
    return f"{len(done)} of {len(steps)} steps done" + (f", under way: {', '.join(doing)}" if doing else "")


# -- writes that fail ----------------------------------------------------------------------------


class WriteError(OSError):
    """A write dsrl could not complete, naming the path and the cause."""

    def __init__(self, message: str, code: int = errno.EIO):
        super().__init__(message)
        self.errno = code


def write_error(path: Path, e: BaseException) -> WriteError:
    """`e` (an OSError, or the RuntimeError torch.save raises for one) as a message naming `path` and the
    cause: a full disk says how much is free."""
    path = Path(path)
    code = getattr(e, "errno", None)
    free = free_bytes(path)
    if code == errno.ENOSPC or (code is None and free is not None and free < 64 << 20):
        cause = f"no space left on the device ({free / 1e6:.1f} MB free)" if free is not None else "no space left"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        cause = f"permission denied ({os.strerror(code)})"
    elif code is not None:
        cause = os.strerror(code)
    else:
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return WriteError(f"cannot write {path}: {cause}", code or errno.EIO)


def free_bytes(path: Path) -> int | None:
    """The free bytes of the disk that holds `path` (or would: its nearest existing folder); None if unreadable."""
    for p in [path, *path.parents]:
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None
