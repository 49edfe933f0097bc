"""Which servers a run gets: external URLs, Ray actors (`ray_fleet.py`), or subprocesses here (`servers.py`)."""

import logging
from pathlib import Path

from dsrl.config import Config, RolloutConfig
from dsrl.serving.client import RolloutClient
from dsrl.serving.servers import (
    ExternalFleet,
    Fleet,
    ServerFleet,
    ServerProcess,
    free_port,
    server_command,
    server_env,
    server_host,
    spawn,
    wait_healthy,
    with_server_args,
)

log = logging.getLogger(__name__)


def start_fleet(
    cfg: RolloutConfig,
    model_path: str,
    run_dir: Path,
    seed: int,
    engine: str,
    multi_node: bool = False,
    role: str = "rollout",
) -> Fleet:
    """The run's servers: external URLs, Ray actors, or `cfg.num_servers` subprocesses here (the
    embedded engine, or SGLang on consecutive GPUs from `first_gpu`). The reward model's and the teacher's (`role`
    reward, teacher) log to <role>_server_<i>.log and keep their port when restarted: every trainer rank holds their
    URLs."""
    kind = cfg.fleet_kind
    if kind == "external":
        urls = [url.rstrip("/") for url in cfg.server_urls]
        for url in urls:
            wait_healthy(url, cfg.startup_timeout_s)
        return ExternalFleet(urls=urls, startup_timeout_s=cfg.startup_timeout_s)
    if engine not in ("embedded", "sglang"):
        raise ValueError(f"--rollout.engine={engine!r}: expected embedded or sglang")
    if kind == "ray":
        try:
            from dsrl.serving.ray_fleet import RayFleet
        except ImportError as e:
            raise ImportError(f"--rollout.fleet ray needs Ray ({e}): pip install 'dsrl[ray]'") from e

        return RayFleet.start(cfg, model_path, run_dir, seed, engine)
    return await_fleet(launch_fleet(cfg, model_path, run_dir, seed, engine, multi_node, role), role)


def launch_fleet(cfg: RolloutConfig, model_path: str, run_dir: Path, seed: int, engine: str, multi_node: bool = False,
                 role: str = "rollout", first: int = 0) -> ServerFleet:  # fmt: skip
    """`start_fleet`'s subprocesses here, started and not yet waited for (`await_fleet`): servers `first` on (their
    logs' numbers; GPUs from `cfg.first_gpu` on this node)."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env, host, ports = server_env(engine), server_host(cfg, multi_node), {}

    def launch(i: int, args: dict | None = None) -> ServerProcess:
        port = ports[i] = (ports.get(i) if role != "rollout" else None) or free_port(host)
        given = with_server_args(cfg, args)
        gpu = cfg.first_gpu + (i - first) * cfg.tp_size
        cmd = server_command(given, engine, model_path, host, port, seed + i, gpu, log_dir)
        log.info("starting %s server %d: %s", role, i, " ".join(cmd))
        prefix = f"{role}_" if role != "rollout" else ""
        return spawn(cmd, env, log_dir / f"{prefix}server_{i}.log", f"http://{host}:{port}")

    fleet = ServerFleet(urls=[], launch=launch, startup_timeout_s=cfg.startup_timeout_s)
    try:
        for i in range(first, first + cfg.num_servers):
            server = launch(i)
            fleet.processes.append(server)
            fleet.urls.append(server.url)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def await_fleet(fleet: ServerFleet, role: str = "rollout") -> ServerFleet:
    """Wait for every server `launch_fleet` started to answer; any that fails stops them all."""
    try:
        for i in range(len(fleet.processes)):
            fleet.wait_started(i)
            log.info("%s server ready at %s (log: %s)", role, fleet.urls[i], fleet.processes[i].log_path)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def start_fleet_for_ranks(cfg: RolloutConfig, model_path: str, run_dir: Path, seed: int, engine: str, multi_node: bool,
                          role: str = "rollout", launched: ServerFleet | None = None) -> Fleet:  # fmt: skip
    """Trainer rank 0 starts the servers (`start_fleet`; or waits for those it `launched`) and every rank learns
    their URLs (on the other ranks the fleet is only that list: rank 0 alone changes it)."""
    import torch.distributed as dist  # (this module is imported before the launcher, where torch is not)

    if multi_node and cfg.fleet_kind == "local" and launched is None:  # each trainer node starts its own
        from dsrl.serving.node_fleet import start_on_every_node

        return start_on_every_node(cfg, model_path, run_dir, seed, engine, role)
    fleet = None
    if dist.get_rank() == 0 and launched is not None:
        fleet = await_fleet(launched, role)
    elif dist.get_rank() == 0:
        fleet = start_fleet(cfg, model_path, run_dir, seed, engine, multi_node, role)
    urls = [None if fleet is None else fleet.urls]
    dist.broadcast_object_list(urls, src=0)
    return fleet or ServerFleet(urls=urls[0])


def start_rollout_servers(cfg: Config, model_dir: str, run_dir: Path, launched: ServerFleet | None = None,
                          ) -> tuple[Fleet, RolloutClient]:  # fmt: skip
    """The run's rollout servers (`start_fleet_for_ranks`; reachable from every node on several), and this rank's
    client of them: every rank generates through its own, only rank 0's talks to the servers about weights."""
    r = cfg.rollout
    multi_node = bool(cfg.trainer.hostfile)
    fleet = start_fleet_for_ranks(r, model_dir, run_dir, cfg.seed, r.engine, multi_node, launched=launched)
    fleet.max_restarts = r.max_restarts
    wait_s = (r.max_restarts + 1) * r.startup_timeout_s  # (a bound behind the heal's own: every try of a restart)
    client = RolloutClient(fleet.urls, r.max_concurrency, r.request_timeout_s, api_key=r.api_key, route=r.route,
                           gone=fleet.gone, wait_s=wait_s)  # fmt: skip
    return fleet, client
