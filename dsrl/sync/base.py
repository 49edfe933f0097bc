"""The checkpoint engine's transports: one small interface, one transport per file, chosen by --sync.type.

A transport moves the trainer's parameters into every server, bucket by bucket, and makes
`weight_version` live with the last bucket. Every trainer rank runs `send` (the parameters are
gathered from every rank's ZeRO-3 partitions); only trainer rank 0 talks to the servers. The
rest of an update (pause, version check, verification, memory) is `WeightSync`'s.
"""

from abc import ABC, abstractmethod
from pathlib import Path

import torch
import torch.distributed as dist

from dsrl.config import SyncConfig
from dsrl.serving.client import RolloutClient


class SyncError(RuntimeError):
    """A weight update that did not complete, or left a server with other weights than the trainer's."""


class CheckpointEngine(ABC):
    def __init__(self, cfg: SyncConfig, client: RolloutClient):
        self.cfg, self.client = cfg, client
        self.rank0 = dist.get_rank() == 0
        """Only trainer rank 0 sends requests to the servers; the other ranks take part in the gathers."""
        self.profile: dict[str, float] = {}
        """Seconds spent per part of the last update (rank 0), for the sync metrics and tools/bench_sync.py."""

    @abstractmethod
    def send(self, module: torch.nn.Module, weight_version: int, flush_cache: bool) -> int:
        """Send every parameter; `weight_version` goes live with the last bucket. Returns bytes sent (rank 0).

        A failure on rank 0 must still let the other ranks finish their part (collectives), then raise."""

    def release(self) -> None:
        """Free what the transport keeps between updates (colocated: the server needs the memory)."""

    def reset(self) -> None:
        """The fleet changed (a server restarted, joined or left): rebuild per-fleet state before the next send."""


def make_checkpoint_engine(
    cfg: SyncConfig, client: RolloutClient, run_dir: Path, backend: str, tp_size: int = 1
) -> CheckpointEngine:
    """The transport named by --sync.type ('auto' must be resolved by the caller)."""
    if cfg.type == "ipc":
        from dsrl.sync.ipc import IpcEngine

        return IpcEngine(cfg, client, tp_size)
    if cfg.type == "broadcast":
        from dsrl.sync.broadcast import BroadcastEngine

        return BroadcastEngine(cfg, client, backend)
    if cfg.type == "disk":
        from dsrl.sync.disk import DiskEngine

        return DiskEngine(cfg, client, Path(cfg.disk_dir or run_dir / "weights"))
    raise ValueError(f"--sync.type={cfg.type!r}: expected ipc, broadcast or disk")
