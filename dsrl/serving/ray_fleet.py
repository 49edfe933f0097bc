"""Rollout servers placed by Ray (--rollout.fleet ray): one placement-group bundle and one actor per server.

Trainer rank 0 joins the Ray cluster (--rollout.ray_address, default: the running one, else a local
one) and reserves one bundle per server -- `cpus_per_server` CPUs, and `tp_size` GPUs for SGLang --
in one placement group spread by --rollout.placement_strategy. Each actor owns its server's process
on the node Ray put it on (`ServerActor.start`). The server dies with its actor (the embedded engine
watches its parent; SGLang gets SIGKILL from the kernel when the actor goes), so a killed actor
leaves no orphan. The trainer keeps the deepspeed launcher; Ray only places servers.

Servers added to a live run (`dsrl fleet add`) get a placement group of their own; a dead actor is
replaced in its bundle. dsrl must be importable on every node (installed there, or on a shared path).
"""

import contextlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dsrl.config import RolloutConfig
from dsrl.nodes import routable_address
from dsrl.serving.servers import (
    PORT_TAKEN,
    Fleet,
    ServerProcess,
    free_port,
    server_command,
    server_env,
    spawn,
    wait_healthy,
    with_server_args,
)

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=0)
class ServerActor:
    """Owns one rollout server process on the node this actor was placed on."""

    def __init__(self):
        self.server: ServerProcess | None = None

    def start(self, cfg: RolloutConfig, engine: str, model_path: str, log_path: str, seed: int) -> tuple[str, str]:
        """Start the server and wait until it answers; returns its URL and the Ray node it runs on. A server
        that lost its port to another process while starting is started once more, on a new port."""
        host = ray.util.get_node_ip_address()  # this node's (`ray start --node-ip-address`), not --rollout.host's
        env = server_env(engine)
        if "CUDA_VISIBLE_DEVICES" in os.environ:  # the GPUs Ray gave this actor (the bundle's)
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        for attempt in (1, 2):
            port = free_port(host)
            cmd = server_command(cfg, engine, model_path, host, port, seed, None, Path(log_path).parent)
            self.server = spawn(cmd, env, Path(log_path), f"http://{host}:{port}")
            try:
                wait_healthy(self.server, cfg.startup_timeout_s)
                return self.server.url, ray.get_runtime_context().get_node_id()
            except RuntimeError as e:
                self.server.stop(grace_s=5)
                if attempt == 2 or not any(sign in str(e) for sign in PORT_TAKEN):
                    raise RuntimeError(f"on node {ray.util.get_node_ip_address()}: {e}") from None

    def poll(self) -> int | None:
        return self.server.proc.poll() if self.server else None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def connect(address: str) -> None:
    """Join the Ray cluster at `address`; with auto and none running, start a local one."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:
        if address != "auto":  # Ray's driver needs a raylet of the cluster on its own node
            raise ConnectionError(
                f"--rollout.ray_address={address}: trainer rank 0's node ({socket.gethostname()}) cannot join that Ray "
                f"cluster ({e.__cause__ or e}). Ray runs a driver only on a node of the cluster: make it one first, "
                f"with no resources: ray start --address {address} --num-cpus 0 --num-gpus 0 --node-ip-address "
                f"{routable_address(address.rsplit(':', 1)[0])}"
            ) from None
        log.info("no running Ray cluster: starting a local one for the rollout servers")
        ray.init(include_dashboard=False, log_to_driver=False)
    log.info("Ray cluster: %s", {k: v for k, v in ray.cluster_resources().items() if "/" not in k})


@dataclass
class RayFleet(Fleet):
    urls: list[str]
    cfg: RolloutConfig
    engine: str
    model_path: str
    run_dir: Path
    seed: int
    actors: list = field(default_factory=list)
    """Parallel to `urls`."""
    slots: list[tuple[int, PlacementGroup, int]] = field(default_factory=list)
    """Parallel to `urls`: (server number, placement group, bundle index); a replacement takes the same."""
    groups: list[PlacementGroup] = field(default_factory=list)
    detached: dict[str, object] = field(default_factory=dict)
    namespace: str = field(default_factory=lambda: f"dsrl-{uuid.uuid4().hex[:8]}")

    @classmethod
    def start(cls, cfg: RolloutConfig, model_path: str, run_dir: Path, seed: int, engine: str) -> "RayFleet":
        connect(cfg.ray_address)
        if Path(model_path).exists():  # (not a hub id) an actor's working directory is its raylet's, not this rank's
            model_path = str(Path(model_path).resolve())
        fleet = cls([], cfg, engine, model_path, Path(run_dir).resolve(), seed)
        try:
            fleet.add(cfg.num_servers)
        except BaseException:
            fleet.stop()
            raise
        return fleet

    def _bundle(self) -> dict[str, float]:
        gpus = {"GPU": float(self.cfg.tp_size)} if self.engine == "sglang" else {}
        return {"CPU": float(self.cfg.cpus_per_server), **gpus}

    def _reserve(self, count: int) -> PlacementGroup:
        group = placement_group([self._bundle()] * count, strategy=self.cfg.placement_strategy)
        self.groups.append(group)
        ready, _ = ray.wait([group.ready()], timeout=self.cfg.startup_timeout_s)
        if not ready:
            raise TimeoutError(
                f"Ray could not place {count} rollout servers of {self._bundle()} each with strategy "
                f"{self.cfg.placement_strategy} within {self.cfg.startup_timeout_s:.0f}s "
                f"(--rollout.startup_timeout_s); the cluster has {ray.available_resources()} free"
            )
        return group

    def _actor(self, number: int, group: PlacementGroup, bundle: int):
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
        gpus = self.cfg.tp_size if self.engine == "sglang" else 0
        return ServerActor.options(
            scheduling_strategy=strategy,
            num_cpus=self.cfg.cpus_per_server,
            num_gpus=gpus,
            name=f"server-{number}",
            namespace=self.namespace,
        ).remote()

    def _start(self, actors: list, numbers: list[int], args: dict | None = None) -> list[str]:
        logs = [str(self.run_dir / "logs" / f"server_{n}.log") for n in numbers]
        cfg = with_server_args(self.cfg, args)
        refs = [
            a.start.remote(cfg, self.engine, self.model_path, p, self.seed + n)
            for a, p, n in zip(actors, logs, numbers)
        ]
        started = ray.get(refs)  # (each actor's wait ends: its server exits, answers, or its log falls silent)
        for n, (url, node), path in zip(numbers, started, logs):
            log.info("rollout server %d ready at %s on Ray node %s (its log there: %s)", n, url, node, path)
        return [url for url, _ in started]

    def add(self, count: int = 0, url: str | None = None) -> list[str]:
        if url is not None:
            raise ValueError(f"this run starts its own servers (--rollout.fleet ray): add a count, not {url}")
        group = self._reserve(count)
        first = max((n for n, _, _ in self.slots), default=-1) + 1
        numbers = list(range(first, first + count))
        actors = [self._actor(n, group, b) for b, n in enumerate(numbers)]
        urls = self._start(actors, numbers)
        self.actors += actors
        self.slots += [(n, group, b) for b, n in enumerate(numbers)]
        self.urls += urls
        return urls

    def exited(self) -> set[str]:
        """Servers whose process exited or whose actor is gone (killed, its node lost): one Ray call each."""
        refs = [actor.poll.remote() for actor in self.actors]
        dead = set()
        for url, ref in zip(self.urls, refs):
            try:
                if ray.get(ref, timeout=30) is not None:
                    dead.add(url)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.add(url)
        return dead

    @property
    def startup_timeout_s(self) -> float:
        return self.cfg.startup_timeout_s

    def numbers(self) -> list[int]:
        return [number for number, _, _ in self.slots]

    def set_aside(self, url: str) -> tuple[int, PlacementGroup, int]:
        i = self.urls.index(url)
        self.urls.pop(i)
        slot = self.slots.pop(i)
        ray.kill(self.actors.pop(i), no_restart=True)
        log.warning("rollout server %d at %s is down: starting a new actor in its placement bundle", slot[0], url)
        return slot

    def start_replacement(self, slot: tuple[int, PlacementGroup, int]) -> tuple[int, object]:
        return slot[0], self._actor(*slot)

    def await_started(self, handle: tuple[int, object]) -> str:
        number, actor = handle
        return self._start([actor], [number], self.replacement_args)[0]

    def adopt(self, slot: tuple[int, PlacementGroup, int], handle: tuple[int, object], url: str) -> None:
        self.actors.append(handle[1])
        self.slots.append(slot)
        self.urls.append(url)

    def discard(self, handle: tuple[int, object]) -> None:
        ray.kill(handle[1], no_restart=True)

    def detach(self, url: str) -> None:
        i = self.urls.index(url)
        self.urls.pop(i)
        self.slots.pop(i)
        self.detached[url] = self.actors.pop(i)

    def stop_server(self, url: str) -> None:
        actor = self.detached.pop(url, None)
        if actor is not None:
            _stop(actor)

    def stop(self) -> None:
        for actor in self.actors + list(self.detached.values()) + [actor for _, actor in self.starting]:
            _stop(actor)
        for group in self.groups:
            remove_placement_group(group)
        self.actors, self.detached, self.groups = [], {}, []
        ray.shutdown()


def _stop(actor) -> None:
    with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        ray.get(actor.stop.remote(), timeout=30)
    ray.kill(actor, no_restart=True)
