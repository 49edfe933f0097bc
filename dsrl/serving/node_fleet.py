"""Servers dsrl starts on several trainer nodes (--trainer.hostfile, --rollout.fleet local): the first rank of each node
starts its node's share, on its node's GPUs (colocated: those of its own ranks) and bound to its node's address, and
trainer rank 0 holds them all. A server of another node that goes down is set aside and rejoins when it answers again,
as an external one does: only its own node's process sees it, and restarts are rank 0's (its node's servers)."""

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from dsrl.config import RolloutConfig
from dsrl.serving.servers import ServerFleet, answers, rejoin_when_answering, wait_healthy

log = logging.getLogger(__name__)


@dataclass
class NodeFleet(ServerFleet):
    """Trainer rank 0's fleet: its node's servers (started here) and those the other nodes started (`remote`)."""

    remote: list[str] = field(default_factory=list)

    def exited(self) -> set[str]:
        return super().exited() | {url for url in self.urls if url in self.remote and not answers(url)}

    def set_aside(self, url: str) -> int | None:
        if url not in self.remote:
            return super().set_aside(url)
        log.warning("rollout server %s of another trainer node is down: set aside until it answers again", url)
        self.urls.remove(url)
        rejoin_when_answering(self, url)
        return None

    def numbers(self) -> list[int]:  # (CUDA IPC's, which one node alone has)
        return list(range(len(self.urls)))

    def add(self, count: int = 0, url: str | None = None) -> list[str]:
        if url is None or url not in self.remote:
            return super().add(count, url)
        wait_healthy(url, self.startup_timeout_s)
        self.urls.append(url)
        return [url]


def start_on_every_node(cfg: RolloutConfig, model_path: str, run_dir: Path, seed: int, engine: str, role: str):
    """`cfg.num_servers` servers spread over the trainer nodes, in node order; every rank learns their URLs."""
    import torch.distributed as dist

    from dsrl.collectives import agreed
    from dsrl.nodes import local_ranks
    from dsrl.serving.fleet import await_fleet, launch_fleet

    rank, world, per_node = dist.get_rank(), dist.get_world_size(), local_ranks()
    nodes, node = world // per_node, dist.get_rank() // per_node
    share = [cfg.num_servers // nodes + (k < cfg.num_servers % nodes) for k in range(nodes)]
    own = None
    with agreed(f"starting the {role} servers of every trainer node", (RuntimeError, TimeoutError, OSError)):
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and share[node]:
            mine = replace(cfg, num_servers=share[node], host=cfg.host if node == 0 else None)  # (each node's own)
            own = await_fleet(launch_fleet(mine, model_path, run_dir, seed, engine, True, role, sum(share[:node])))
    gathered = [None] * world
    dist.all_gather_object(gathered, own.urls if own else [])
    urls = [url for urls in gathered for url in urls]
    if own is not None and node > 0:
        log.info("%s servers of this node (%s): %s", role, os.uname().nodename, ", ".join(own.urls))
    if rank != 0:
        if own is None:
            return ServerFleet(urls=urls)
        own.urls = urls  # (its client's; `exited` and `stop` are its own servers')
        return own
    own = own or ServerFleet(urls=[], startup_timeout_s=cfg.startup_timeout_s)
    remote = [url for url in urls if url not in own.urls]
    return NodeFleet(urls=urls, processes=own.processes, launch=own.launch, startup_timeout_s=own.startup_timeout_s,
                     remote=remote)  # fmt: skip
