"""The fleet control endpoint: servers join and leave a live run (`dsrl fleet add|remove|list --run DIR`).

Trainer rank 0 serves it on its rollout client's event loop, bound to loopback (or --rollout.host
when the run spans nodes) on a free port, and writes the address to <run_dir>/fleet.json. A request
is queued on the fleet and applied at the next weight update (`Fleet.heal`), so a server that joins
gets the weights before its first request and one that leaves has its requests resubmitted
elsewhere. With --rollout.api_key the endpoint wants the same key as the servers.
"""

import hmac
import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import yaml
from aiohttp import web

from dsrl.config import Config
from dsrl.serving.client import RolloutClient
from dsrl.serving.servers import Fleet, server_host

FLEET_FILE = "fleet.json"


def start_control(cfg: Config, fleet: Fleet, client: RolloutClient, run_dir: Path) -> "FleetControl":
    """Trainer rank 0's endpoint, started on its client's event loop."""
    frozen = "CUDA IPC ties each server to a trainer rank's GPU: this run's fleet cannot change"
    r = cfg.rollout
    control = FleetControl(fleet, run_dir, server_host(r, bool(cfg.trainer.hostfile)), r.api_key,
                           frozen if cfg.sync.type == "ipc" else None)  # fmt: skip
    client.run(control.start())
    return control


class FleetControl:
    def __init__(self, fleet: Fleet, run_dir: Path, host: str, api_key: str | None, frozen: str | None):
        self.fleet, self.run_dir, self.host, self.api_key = fleet, run_dir, host, api_key
        self.frozen = frozen
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(middlewares=[self.auth])
        app.add_routes(
            [web.get("/fleet", self.list), web.post("/fleet/add", self.add), web.post("/fleet/remove", self.remove)]
        )
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, 0)
        await site.start()
        url = f"http://{self.host}:{site._server.sockets[0].getsockname()[1]}"
        (self.run_dir / FLEET_FILE).write_text(json.dumps({"control": url}))
        return url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        (self.run_dir / FLEET_FILE).unlink(missing_ok=True)

    @web.middleware
    async def auth(self, request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode()
        if self.api_key and not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            return web.json_response({"error": "this run wants --rollout.api_key (Authorization: Bearer)"}, status=401)
        return await handler(request)

    async def list(self, request: web.Request) -> web.Response:
        with self.fleet.lock:
            pending = [dict(r) for r in self.fleet.requests]
            outcomes = dict(self.fleet.outcomes)
        return web.json_response({"servers": list(self.fleet.urls), "pending": pending, "outcomes": outcomes})

    async def add(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "url" in body:
            change = {"add": str(body["url"]).rstrip("/")}
        elif isinstance(body.get("count"), int) and body["count"] >= 1:
            change = {"add": body["count"]}
        else:
            return web.json_response({"error": "give {'count': N >= 1} or {'url': 'http://host:port'}"}, status=400)
        return self.queue(change)

    async def remove(self, request: web.Request) -> web.Response:
        url = str((await request.json()).get("url", "")).rstrip("/")
        if url not in self.fleet.urls:
            return web.json_response({"error": f"{url!r} is not in the fleet {self.fleet.urls}"}, status=400)
        if len(self.fleet.urls) == 1:
            return web.json_response({"error": f"{url} is the last server: add another first"}, status=400)
        return self.queue({"remove": url})

    def queue(self, change: dict) -> web.Response:
        if self.frozen:
            return web.json_response({"error": self.frozen}, status=409)
        change["id"] = uuid.uuid4().hex[:12]
        with self.fleet.lock:
            self.fleet.requests.append(change)
        return web.json_response({**change, "status": "queued: applied at the next weight update"}, status=202)


def call(run_dir: str, method: str, path: str, body: dict | None = None) -> dict:
    """One request to a live run's control endpoint (the `dsrl fleet` command)."""
    info = Path(run_dir) / FLEET_FILE
    if not info.is_file():
        raise SystemExit(f"dsrl fleet: no {info}: is a run live in {run_dir} (its --logging.run_dir)?")
    url = json.loads(info.read_text())["control"] + path
    headers, config = {"Content-Type": "application/json"}, Path(run_dir) / "config.yaml"
    key = (yaml.safe_load(config.read_text()) or {}).get("rollout", {}).get("api_key") if config.is_file() else None
    if key:  # (the run's --rollout.api_key)
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"dsrl fleet: {json.loads(e.read()).get('error', e)}") from None
    except OSError as e:
        raise SystemExit(f"dsrl fleet: {url} does not answer ({e}); has the run ended?") from None


def wait_applied(run_dir: str, request_id: str, timeout_s: float) -> str:
    """Wait until the run has applied a queued request; its outcome ("done" or why it failed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcome = call(run_dir, "GET", "/fleet")["outcomes"].get(request_id)
        if outcome:
            return outcome
        time.sleep(1.0)
    raise SystemExit(f"dsrl fleet: not applied within {timeout_s:.0f}s (it waits for the next weight update)")
