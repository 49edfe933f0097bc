"""One async HTTP client for SGLang servers and the embedded engine alike.

It owns an asyncio loop on a background thread, so the (synchronous) trainer can call
``client.run(coro)`` or fire ``client.submit(coro)`` and keep working -- the weight sync posts
a bucket's request and broadcasts it at the same time. Requests are spread over the servers
(least in flight first), capped by a concurrency limit, bounded by timeouts, and the idempotent
control calls are retried on connection errors.
"""

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from dsrl.nodes import probing_socket

log = logging.getLogger(__name__)

# Control calls that are safe to repeat after a connection error.
IDEMPOTENT = {
    "/health",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/flush_cache",
    "/pause_generation",
    "/continue_generation",
    "/get_weights_by_name",
    "/abort_request",
}
KEEPALIVE_S = 2.0
"""Seconds an idle connection to a server is kept for reuse: under the servers' own (uvicorn's, SGLang's: 5 s; the
embedded engine's likewise), so that a request seldom goes out on a connection the server is closing."""
ABORTED_BEFORE_SENT = {"type": "abort", "message": "aborted while waiting for a concurrency slot; never sent"}


@dataclass(frozen=True)
class ServedAdapter:
    """The LoRA adapter the servers hold for a weight version (`--sync.lora adapter`): every /generate names it."""

    name: str
    version: int


class ServerError(RuntimeError):
    """A rollout server answered with an error, or did not answer in time."""

    def __init__(self, url: str, path: str, message: str, down: bool = False):
        self.url, self.path, self.down = url, path, down  # down: unreachable, or timed out
        super().__init__(f"{url}{path}: {message}")


class NoServerLeft(ServerError):
    """Every rollout server is down."""

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)
        self.url, self.path, self.down = "", "", True


class RolloutClient:
    def __init__(
        self,
        urls: list[str],
        max_concurrency: int = 256,
        timeout_s: float = 600.0,
        retries: int = 3,
        api_key: str | None = None,
        route: str = "least_loaded",
        gone: Callable[[str], bool] | None = None,
        wait_s: float = 0.0,
    ):
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.retries = retries
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.gone = gone
        """Whether a server's process is known to have exited (the fleet that started it): its refused connection is
        final, not retried. None: retried (external servers)."""
        self.route = route
        """group: requests with the same `route_key` go to one server (`rollout.route`); else least loaded."""
        self.routes: OrderedDict[object, str] = OrderedDict()  # route key -> server, the most recent last
        self.held: set[str] = set()  # joined, not yet given the weights: control calls only, no /generate
        self.in_flight = dict.fromkeys(self.urls, 0)  # /generate requests at each server
        self.waiting: set[str] = set()  # request ids waiting for a concurrency slot
        self.cancelled: set[str] = set()  # ... and aborted meanwhile: never sent
        self.down: list[str] = []  # servers that stopped answering; the trainer restarts or drops them
        self.wait_s = wait_s
        """How long a /generate waits for a server when every one is down (a lone server died): the trainer ranks heal
        the fleet meanwhile (`dsrl.train.served`). 0: it fails at once (`NoServerLeft`)."""
        self.starving = 0  # /generate requests waiting for a server to come back
        self.wakers: set[threading.Event] = set()  # set when a request starts waiting (`wait_or_starve`)
        self.adapter: ServedAdapter | None = None
        """Set by the weight sync when the servers serve a LoRA adapter: every `generate` (and the probe) names it,
        so none can be served by the bare base, and its tokens are of the adapter's version (`adapter_version` in a
        reply). Not an LLM judge's requests (`request`): its servers hold another model."""
        self.adapter_requests: Counter[str] = Counter()  # /generate requests in flight per adapter name
        self.return_routed_experts = False
        """Every `generate` asks for the routed experts of its tokens (a mixture of experts' routing replay)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-client", daemon=True)
        self.thread.start()
        self.semaphore, self.session = self.run(self._on_loop(max_concurrency))

    async def _on_loop(self, n: int) -> tuple[asyncio.Semaphore, aiohttp.ClientSession]:
        """What belongs to the client's event loop: the concurrency limit and the HTTP session."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=30)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S, socket_factory=probing_socket)
        self.changed = asyncio.Condition()  # the fleet changed: a request waiting for a server looks again
        return asyncio.Semaphore(n), aiohttp.ClientSession(timeout=timeout, connector=connector, headers=self.headers)

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.run(self.session.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()

    async def request(
        self, url: str, path: str, payload: Any = None, method: str = "POST", timeout_s: float | None = None
    ) -> Any:
        """One call to one server; JSON replies are decoded, others returned as text."""
        attempts = self.retries + 1 if path in IDEMPOTENT else 1
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, sock_connect=30)
        attempt, resent = 0, False
        while True:
            try:
                async with self.session.request(
                    method, url + path, json=payload if method != "GET" else None, timeout=timeout
                ) as resp:
                    body = await (resp.json() if resp.content_type == "application/json" else resp.text())
                    if resp.status >= 400:
                        raise ServerError(url, path, f"HTTP {resp.status}: {_error_message(body)}")
                    if isinstance(body, dict) and body.get("success") is False:
                        raise ServerError(url, path, _error_message(body))
                    return body
            except (aiohttp.ClientConnectionError, ConnectionError) as e:
                # A server closes a keep-alive connection it found idle (SGLang's uvicorn after 5 s): a request sent
                # on it as it closes is never read. Sent again at once on a new connection, whatever its path: taken
                # for a dead server, a live one was set aside and killed (issue 60's "-9 exits").
                if isinstance(e, aiohttp.ServerDisconnectedError) and not resent:
                    resent = True
                    continue
                attempt += 1
                # A server found gone (by another request, or by its process) is not retried: the retries' 3.5 s
                # of a /pause_generation to a killed server were the whole stall of the update after its death.
                if attempt >= attempts or url in self.down or await self._gone(url):
                    message = f"connection failed: {e!r}; is the server running?"
                    raise ServerError(url, path, message, down=True) from e
                await asyncio.sleep(0.5 * 2 ** (attempt - 1))
            except TimeoutError as e:
                raise ServerError(url, path, f"no answer within {timeout.total:.0f}s", down=True) from e

    async def _gone(self, url: str) -> bool:
        return self.gone is not None and await asyncio.to_thread(self.gone, url)  # (a Ray fleet asks its actors)

    async def generate(self, payload: dict, route_key: object = None) -> dict:
        """POST /generate to a live server, within the concurrency limit: with `route` group, the server
        that `route_key` (a GRPO group) went to before, else the least busy one.

        A server that cannot be reached or does not answer in time is taken out of the rotation
        and the request goes to another one (requests carry their sampling seed, so this is safe).
        """
        rid = payload.get("rid")
        if isinstance(rid, str):
            self.waiting.add(rid)
        try:
            await self.semaphore.acquire()
        finally:
            self.waiting.discard(rid)
        adapter = self.adapter
        if self.return_routed_experts:  # (the policy's requests; not a judge's, on servers of its own)
            payload = {**payload, "return_routed_experts": True}
        if adapter is not None:
            payload = {**payload, "lora_path": adapter.name}
            self.adapter_requests[adapter.name] += 1
        try:
            if rid in self.cancelled:
                self.cancelled.discard(rid)
                return {"output_ids": [], "meta_info": {"id": rid, "finish_reason": ABORTED_BEFORE_SENT}}
            while True:
                url = await self._server(route_key)
                self.in_flight[url] = self.in_flight.get(url, 0) + 1
                try:
                    out = await self.request(url, "/generate", payload)
                    if isinstance(out, dict):
                        out["server"] = url  # which server answered (batched requests return a list)
                        if adapter is not None:  # what generated it, whatever the server's version is now
                            out["adapter_version"] = adapter.version
                    return out
                except ServerError as e:
                    if not e.down:
                        raise
                    self.mark_down(url, f"{e}; resubmitting its requests elsewhere")
                finally:
                    self.in_flight[url] -= 1
        finally:
            self.semaphore.release()
            if adapter is not None:
                self.adapter_requests[adapter.name] -= 1

    async def _server(self, route_key: object) -> str:
        """A live server for a request (`_pick`). With none (every one down: a lone server died), the request waits
        up to `wait_s` for the fleet to bring one back, with the current weights (`set_urls`, `release_held`)."""
        due = time.monotonic() + self.wait_s
        while not self._open() and self.wait_s:  # (again when the one that came back died before this request woke)
            self.starving += 1
            for wake in list(self.wakers):
                wake.set()
            try:
                async with self.changed:
                    await asyncio.wait_for(self.changed.wait_for(self._open), max(due - time.monotonic(), 0))
            except TimeoutError:
                raise NoServerLeft(f"every rollout server is down ({', '.join(self.down)}), and none came back "
                                   f"within {self.wait_s:.0f}s") from None  # fmt: skip
            finally:
                self.starving -= 1
        return self._pick(route_key)

    def _open(self) -> list[str]:
        """The servers that take /generate requests: live, and holding the current weights."""
        return [url for url in self.live_urls() if url not in self.held]

    def wait_or_starve(self, work: concurrent.futures.Future) -> bool:
        """(another thread) Wait until `work` is done, or until a request waits for a server because every one is
        down; returns whether one waits."""
        wake = threading.Event()
        self.wakers.add(wake)
        work.add_done_callback(lambda _: wake.set())

        def starved() -> bool:  # (a request that has not woken yet since a server came back does not count)
            return self.starving > 0 and not self._open()

        try:
            while not work.done() and not starved():
                wake.wait()
                wake.clear()
        finally:
            self.wakers.discard(wake)
        return not work.done() and starved()

    def _pick(self, route_key: object) -> str:
        live = self._open()
        if not live:
            raise NoServerLeft(f"every rollout server is down: {self.down}")
        if self.route == "group" and route_key is not None:
            url = self.routes.get(route_key)
            if url in live:
                self.routes.move_to_end(route_key)
                return url
        url = min(live, key=lambda u: self.in_flight.get(u, 0))
        if self.route == "group" and route_key is not None:
            self.routes[route_key] = url
            if len(self.routes) > 100_000:  # groups long finished
                self.routes.popitem(last=False)
        return url

    async def abort_all(self) -> None:
        """Abort every request of this client: one /abort_request {abort_all: true} per server running any.

        One call per server, not one per request: SGLang's scheduler scans its queues for each aborted
        id (and 0.5.17's HTTP layer ignores an id prefix), so ~1,300 single aborts held every weight
        update ~0.7 s on an H200. The servers are the run's own: another client's requests on them
        (another trainer rank's) are aborted too, which its manager handles as an interruption.
        A request still waiting for a concurrency slot is never sent and answers as aborted.
        """
        self.cancelled |= self.waiting
        calls = [self.request(url, "/abort_request", {"abort_all": True}) for url in self.busy_urls()]
        await _gather_aborts(calls)

    async def abort_server(self, url: str) -> None:
        """Abort every request on one server (it is leaving the fleet); they come back as aborted."""
        await _gather_aborts([self.request(url, "/abort_request", {"abort_all": True})])

    async def abort(self, rids: list[str]) -> None:
        """Abort these requests only: each is sent to every busy server (SGLang ignores an id it does not
        run); one still waiting for a concurrency slot is never sent. For a few requests: see abort_all."""
        self.cancelled |= self.waiting & set(rids)
        busy = self.busy_urls()
        calls = [self.request(url, "/abort_request", {"rid": rid}) for rid in rids for url in busy]
        await _gather_aborts(calls)

    def set_urls(self, urls: list[str], held: list[str] = ()) -> None:
        """Adopt a new fleet (after a restart, a join or a leave); forget which servers were down. `held`
        servers take control calls (the weight update) but no /generate until `release_held`."""
        self.urls, self.down, self.held = list(urls), [], set(held)
        self.submit(self._changed())

    def release_held(self) -> None:
        """The held servers have the current weights: they may take requests now."""
        self.held = set()
        self.submit(self._changed())

    async def _changed(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def all_servers(
        self, path: str, payload: Any = None, method: str = "POST", urls: list[str] | None = None
    ) -> list[Any]:
        """The same call to every live server (or to `urls`); the replies, in that order.

        A server that cannot be reached is marked down and left out (the trainer restarts or drops
        it before the next sync); any other error is raised.
        """
        urls = self.live_urls() if urls is None else urls
        replies = await asyncio.gather(
            *(self.request(url, path, payload, method) for url in urls), return_exceptions=True
        )
        out, failures = [], []
        for url, reply in zip(urls, replies):
            if isinstance(reply, ServerError) and reply.down:
                failures.append(str(reply))
                self.mark_down(url, str(reply))
            elif isinstance(reply, BaseException):
                raise reply
            else:
                out.append(reply)
        if not self.live_urls():
            raise NoServerLeft(f"every rollout server is down: {'; '.join(failures) or self.down}")
        return out

    def call_all(self, path: str, payload: Any = None, method: str = "POST") -> list[Any]:
        return self.run(self.all_servers(path, payload, method))

    def weight_versions(self) -> list[str]:
        """Each live server's weight version as SGLang reports it (a string), in `urls` order (down servers skipped)."""
        # /model_info, not /get_weight_version: SGLang 0.5.17 answers the latter with 404.
        return [str(info["weight_version"]) for info in self.call_all("/model_info", method="GET")]

    def responds(self, url: str, timeout_s: float = 30) -> bool:
        """Whether a server answers at all. Not /health: SGLang's runs a one-token generation, which takes a
        second and crashes a colocated server whose memory is released (seen on an H100/H200)."""
        try:
            self.run(self.request(url, "/model_info", method="GET", timeout_s=timeout_s))
            return True
        except ServerError:
            return False

    def mark_down(self, url: str, reason: str) -> None:
        """Take a server out of the rotation (once); the trainer restarts or drops it before the next sync."""
        if url not in self.down:
            log.warning("rollout server %s is down (%s)", url, reason)
            self.down.append(url)

    def busy_urls(self) -> list[str]:
        return [url for url, n in self.in_flight.items() if n]

    def live_urls(self) -> list[str]:
        return [url for url in self.urls if url not in self.down]


async def _gather_aborts(calls: list[Coroutine]) -> None:
    """Run abort calls; a server that cannot be reached is left to `generate`, which resubmits its requests."""
    for reply in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(reply, BaseException) and not (isinstance(reply, ServerError) and reply.down):
            raise reply


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]
