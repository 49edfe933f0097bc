"""Reward functions (and an agent's environments and tools) in worker processes, each call with a timeout
(--algorithm.reward_workers, --agent.env_workers, --agent.tool_workers).

A reward function is user code: it may hang, kill its process, or return garbage. Here it runs in
`reward_workers` spawned processes per trainer rank; a call that outlasts --algorithm.reward_timeout_s
has its process killed and replaced, a process that dies is replaced, and either way only that row
fails, with a message naming it. The trainer's event loop is not blocked while rewards are computed
(`run_async`), so a slow reward does not stall the requests in flight. An agent's tools run in a `WorkerPool`
of their own, its environments in a `StickyPool` (`dsrl.rollout.episode.EpisodeRunner`).

Workers are fresh interpreters (`python -m dsrl.rewards.pool`, not multiprocessing's spawn, which
imports the trainer's main module again: seconds of torch and DeepSpeed per worker). They import
this module, which imports nothing heavy, and the reward function by its `module:function` path.
"""

import asyncio
import contextlib
import inspect
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe, wait

from dsrl.rewards.rules import load_function, load_reward_fn
from dsrl.rundir import die_with_parent, member_fds

log = logging.getLogger(__name__)

NOT_SCORED = "not scored: another row of its group failed first"
READY = "ready"
"""A worker's first message: it has imported its function and takes calls."""

Item = tuple[str, str, object, dict]
"""(prompt, response, answer, the dataset row): what one call of the reward function gets."""


class TimedOut(str):
    """The failure of a call that ran out of its time, as the message that names the flag: callers count timeouts
    by this type, never by the message's words."""


def replaced(flag: str, seconds: float) -> TimedOut:
    return TimedOut(f"took longer than {flag}={seconds:g}s (its process was replaced)")


def call_reward(fn, prompt: str, response: str, answer, row: dict):
    """fn(prompt, response, answer), with `row=` when it takes one; a function with verl's interface,
    compute_score(data_source, solution_str, ground_truth, extra_info), as verl calls it, its dict's "score"
    taken as verl takes it. An async function is run to its end."""
    try:
        params = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or C function: no keyword to offer it
        params = set()
    if "solution_str" in params:  # a verl user's reward function, as it is
        extra = row.get("extra_info") or {}
        value = fn(data_source=row.get("data_source"), solution_str=response, ground_truth=answer, extra_info=extra)
    else:
        value = fn(prompt, response, answer, **({"row": row} if "row" in params else {}))
    value = asyncio.run(value) if inspect.isawaitable(value) else value
    return value["score"] if isinstance(value, dict) and "score" in value else value


def _worker(spec: str, conn: Connection, plain: bool) -> None:
    """A worker's loop: (call id, items) in, (call id, values or an error) out, until told to stop. A reward
    function gets (prompt, response, answer[, row]); a `plain` function its item's arguments as they are."""
    fn = load_function(spec, "worker")
    if plain:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # user code's prints: a tool's 10 MB stays out of the log
    try:
        conn.send(READY)  # its imports done: a call's timeout starts when the call does
        while (message := conn.recv()) is not None:
            call_id, items = message
            try:
                if plain:
                    values = [fn(*item) for item in items]
                elif getattr(fn, "dsrl_batched", False):
                    values = list(call_reward(fn, *map(list, zip(*items))))
                else:
                    values = [call_reward(fn, *item) for item in items]
                outcome = (call_id, values, None)
            except Exception as e:  # noqa: BLE001 -- sent back, the trainer names the row
                outcome = (call_id, None, repr(e))
            conn.send(outcome)
    except (EOFError, OSError):  # the trainer went away (its failure is reported there, once)
        return


def spawn_worker(spec: str, plain: bool) -> tuple[subprocess.Popen, socket.socket]:
    """A worker: a fresh interpreter (never a fork of a trainer: CUDA, threads), on a socket pair."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # as spawn: the same imports
    cmd = [sys.executable, "-m", "dsrl.rewards.pool", spec, str(theirs.fileno()), str(int(plain))]
    fds = (theirs.fileno(), *member_fds())  # it holds the run directory while it lives
    process = subprocess.Popen(cmd, pass_fds=fds, env=env, start_new_session=True, preexec_fn=die_with_parent)
    theirs.close()
    return process, ours


@dataclass
class _Request:
    """One caller's items; its future resolves once every call of it has an outcome."""

    items: list[Item]
    future: Future
    fail_fast: bool
    """Settle at the first failed row (the caller skips the whole group then): the rest is not scored."""
    results: list = field(default_factory=list)
    left: int = 0

    def settle(self, indices: list[int], outcomes: list[tuple[object, str | None]]) -> None:
        for i, outcome in zip(indices, outcomes):
            self.results[i] = outcome
        self.left -= 1
        failed = self.fail_fast and any(error for _, error in outcomes)
        if (self.left == 0 or failed) and not self.future.done():
            self.future.set_result(self.results)


class WorkerPool:
    """`workers` processes fed by one dispatcher thread: calls from many groups run side by side, and a
    call that hangs holds up only its own row. `plain`: the function is called with each item's arguments
    (a tool), not as a reward function; `timeout_flag` names the timeout's flag."""

    def __init__(
        self,
        spec: str,
        workers: int,
        timeout_s: float,
        plain: bool = False,
        timeout_flag: str = "--algorithm.reward_timeout_s",
    ):
        self.spec, self.timeout_s, self.plain, self.timeout_flag = spec, timeout_s, plain, timeout_flag
        self.batched = not plain and getattr(load_reward_fn(spec), "dsrl_batched", False)
        self.workers = [self._spawn() for _ in range(workers)]
        self.starting = set(range(workers))  # not ready yet: no call goes to them
        self.queue: deque[tuple[_Request, list[int]]] = deque()  # calls not yet handed to a worker
        self.lock = threading.Lock()
        self.wake_recv, self.wake_send = Pipe(duplex=False)  # a new call, or stop
        self.stopped = False
        self.thread = threading.Thread(target=self._dispatch, name="dsrl-reward-dispatch", daemon=True)
        self.thread.start()

    def _spawn(self) -> tuple[subprocess.Popen, Connection]:
        process, sock = spawn_worker(self.spec, self.plain)
        return process, Connection(sock.detach())

    def submit(self, items: list[Item], fail_fast: bool = False) -> Future:
        """A future of (value, None) or (None, why it failed) per item; a batched reward function gets them
        in one call, any other one call per item. `fail_fast`: settle at the first failure."""
        request = _Request(items, Future(), fail_fast, [(None, NOT_SCORED)] * len(items))
        calls = [list(range(len(items)))] if self.batched else [[i] for i in range(len(items))]
        request.left = len(calls)
        if not calls:
            request.future.set_result([])
        with self.lock:
            self.queue.extend((request, call) for call in calls)
            self.wake_send.send_bytes(b"\0")  # one small write: atomic between callers anyway
        return request.future

    async def run_async(self, items: list[Item], fail_fast: bool = False) -> list[tuple[object, str | None]]:
        return await asyncio.wrap_future(self.submit(items, fail_fast))

    def _dispatch(self) -> None:
        busy: dict[int, tuple[_Request, list[int], float]] = {}  # worker -> (request, item indices, deadline)
        try:
            self._dispatch_until_stopped(busy)
        except BaseException as e:  # every caller hears of it: a dead dispatcher would leave them waiting forever
            log.exception("the worker pool's dispatcher failed")
            with self.lock:
                pending = [(r, c) for r, c, _ in busy.values()] + list(self.queue)
                self.queue.clear()
            for request, call in pending:
                request.settle(call, [(None, f"the worker pool failed: {e!r}")] * len(call))
            raise

    def _dispatch_until_stopped(self, busy: dict) -> None:
        while not self.stopped:
            with self.lock:
                self.queue = deque(c for c in self.queue if not c[0].future.done())  # their group failed already
                for w in [w for w in range(len(self.workers)) if w not in busy and w not in self.starting]:
                    if not self.queue:
                        break
                    request, call = self.queue.popleft()
                    self.workers[w][1].send((0, [request.items[i] for i in call]))
                    busy[w] = (request, call, time.monotonic() + self.timeout_s)
            timeout = max(0.0, min((d for _, _, d in busy.values()), default=time.monotonic() + 1) - time.monotonic())
            watched = [self.workers[w][1] for w in list(busy) + sorted(self.starting)]
            ready = wait(watched + [self.wake_recv], timeout=timeout)
            if self.wake_recv in ready:
                while self.wake_recv.poll():
                    self.wake_recv.recv_bytes()
            for w in [w for w in sorted(self.starting) if self.workers[w][1] in ready]:
                self._started(w)
            for w in list(busy):
                self._check(w, busy, ready)

    def _started(self, w: int) -> None:
        """A starting worker is ready, or died importing its function: the next queued call fails with that."""
        process, conn = self.workers[w]
        try:
            conn.recv()
            self.starting.discard(w)
            return
        except (EOFError, OSError):
            code = process.wait(5)
        with self.lock:
            failed = self.queue.popleft() if self.queue else None
        if failed is not None:
            why = f"its worker process could not start (exit code {code}; its log is above)"
            failed[0].settle(failed[1], [(None, why)] * len(failed[1]))
        self._replace(w)

    def _check(self, w: int, busy: dict, ready: list) -> None:
        request, call, deadline = busy[w]
        process, conn = self.workers[w]
        if conn in ready:
            try:
                _, values, error = conn.recv()
            except (EOFError, OSError):
                code = process.wait(5)
                self._replace(w)
                outcome = (None, f"its process exited (code {code}) while running it")
                outcomes = [outcome] * len(call)
            else:
                if error is None and len(values) != len(call):
                    error = f"returned {len(values)} values for {len(call)} rows (a batched reward returns a list)"
                outcomes = [(None, error)] * len(call) if error else [(v, None) for v in values]
        elif time.monotonic() >= deadline:
            self._replace(w)
            outcomes = [(None, replaced(self.timeout_flag, self.timeout_s))] * len(call)
        else:
            return
        del busy[w]
        request.settle(call, outcomes)

    def _replace(self, w: int) -> None:
        process, conn = self.workers[w]
        process.kill()
        process.wait(5)
        conn.close()
        self.workers[w] = self._spawn()
        self.starting.add(w)

    def close(self) -> None:
        self.stopped = True
        with self.lock:
            self.wake_send.send_bytes(b"\0")
        self.thread.join(5)
        for process, conn in self.workers:
            with contextlib.suppress(OSError):
                conn.send(None)
            try:
                process.wait(2)
            except subprocess.TimeoutExpired:
                process.kill()
        self.workers = []


class StickyPool:
    """Worker processes that keep what a caller left there (an agent's episode: its environment). `place` binds
    a caller to one worker; its calls are sent there from the caller's event loop (no thread between them), one at
    a time, each once the one before is answered and within `timeout_s` of being sent. (One at a time: a process
    that dies with calls unread in its socket resets the connection, and the answer it had already written to the
    call before was lost with it, failing an innocent call.) The function gets the keys released since
    its last call (what it may forget), then the call's arguments. A call that outlasts its time or whose
    process exits fails alone: the process is replaced, the calls behind it go to the new one, and what the
    old one kept for other callers is gone (their next call finds nothing: `dsrl.rollout.agents.env_step`)."""

    def __init__(self, spec: str, workers: int, timeout_s: float, timeout_flag: str):
        self.spec, self.timeout_s, self.timeout_flag = spec, timeout_s, timeout_flag
        self.workers = [spawn_worker(spec, plain=True) for _ in range(workers)]
        self.streams: list[tuple | None] = [None] * workers  # (reader, writer) once it is ready
        self.pending: list[deque] = [deque() for _ in range(workers)]  # (frame, future) sent, not answered
        self.serving: list[asyncio.Task | None] = [None] * workers  # reads the answers while calls are pending
        self.released: list[list[int]] = [[] for _ in range(workers)]  # keys, for the worker's next call
        self.keys = itertools.count()
        self.closed = False

    def place(self, owner) -> tuple[int, int]:
        """(worker, key) for `owner`, the workers in turn; released with `owner` (or by `release`)."""
        key = next(self.keys)
        weakref.finalize(owner, self.release, key)  # an episode dropped midway (a restarted group) frees it too
        return key % len(self.workers), key

    def release(self, key: int) -> None:
        self.released[key % len(self.workers)].append(key)

    def submit(self, worker: int, item: tuple) -> asyncio.Future:
        """A future of (value, None, when it came back) or (None, why it failed, when): fn(released keys, *item)
        in `worker`."""
        released, self.released[worker] = self.released[worker], []
        data = pickle.dumps((0, [(released, *item)]))
        frame = len(data).to_bytes(4, "big") + data  # multiprocessing.Connection's framing
        future = asyncio.get_running_loop().create_future()
        self.pending[worker].append((frame, future))
        if self.streams[worker] is not None and len(self.pending[worker]) == 1:  # else `_serve` sends it in turn
            self.streams[worker][1].write(frame)
        if self.serving[worker] is None:
            self.serving[worker] = asyncio.create_task(self._serve(worker))
        return future

    async def _serve(self, worker: int) -> None:
        pending = self.pending[worker]
        try:
            while pending:
                if self.closed:  # (runner.close(): no episode waits any more; a stopped worker is not replaced)
                    _settle(pending.popleft()[1], None, "its worker processes were stopped")
                    continue
                process, sock = self.workers[worker]
                try:
                    if self.streams[worker] is None:  # a new process: its imports are not timed
                        reader, writer = await asyncio.open_connection(sock=sock)
                        await _read_frame(reader)
                        self.streams[worker] = reader, writer
                        writer.write(pending[0][0])
                    reply = await asyncio.wait_for(_read_frame(self.streams[worker][0]), self.timeout_s)
                except TimeoutError:
                    why = replaced(self.timeout_flag, self.timeout_s)
                except (asyncio.IncompleteReadError, ConnectionError):
                    why = f"its process exited (code {await asyncio.to_thread(process.wait, 5)}) while running it"
                else:
                    _, values, error = pickle.loads(reply)
                    _settle(pending.popleft()[1], None if error is not None else values[0], error)
                    if pending:
                        self.streams[worker][1].write(pending[0][0])
                    continue
                _settle(pending.popleft()[1], None, why)
                process.kill()
                process.wait(5)
                if self.streams[worker] is not None:
                    self.streams[worker][1].close()
                self.streams[worker], self.released[worker] = None, []
                if not self.closed:
                    self.workers[worker] = spawn_worker(self.spec, plain=True)
        except Exception as e:  # every caller hears of it: a dead reader would leave them waiting forever
            log.exception("the environment workers' reader failed")
            while pending:
                _settle(pending.popleft()[1], None, f"the worker pool failed: {e!r}")
        finally:
            self.serving[worker] = None

    def close(self) -> None:
        self.closed = True  # a reader that sees its process go now replaces it no more
        for (process, sock), streams in zip(self.workers, self.streams):
            process.kill()
            process.wait(5)
            if streams is None:
                sock.close()


def _settle(future: asyncio.Future, value, error: str | None) -> None:
    if not future.done():  # (its caller may have stopped waiting: the episode's deadline)
        future.set_result((value, error, time.monotonic()))


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    return await reader.readexactly(int.from_bytes(await reader.readexactly(4), "big"))


if __name__ == "__main__":  # a worker: python -m dsrl.rewards.pool module:function FD PLAIN
    _worker(sys.argv[1], Connection(int(sys.argv[2])), sys.argv[3] == "1")
