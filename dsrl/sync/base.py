"""The weight update's transports: one small interface, one transport per file, chosen by --sync.type.

A transport moves the trainer's parameters into every server, bucket by bucket, and makes
`weight_version` live with the last bucket; with a LoRA adapter served on its own (`--sync.lora
adapter`) those are the base's, and `load_adapter` moves the adapter. Every trainer rank runs both
(the parameters are gathered from every rank's ZeRO-3 partitions); only trainer rank 0 talks to the
servers. The rest of an update (pause, version check, verification, memory) is `WeightSync`'s.
"""

import shutil
from abc import ABC, abstractmethod
from pathlib import Path

import torch
import torch.distributed as dist

from dsrl.config import SyncConfig
from dsrl.serving.client import RolloutClient, ServerError
from dsrl.zero.lora import gathered_adapter, write_adapter


class SyncError(RuntimeError):
    """A weight update that did not complete, or left a server with other weights than the trainer's."""


SERVER_ERRORS = (SyncError, ServerError)
"""What a server can make an update fail with; anything else is a bug and propagates as it is."""


class Transport(ABC):
    def __init__(self, cfg: SyncConfig, client: RolloutClient, root: Path):
        self.cfg, self.client, self.root = cfg, client, root
        """`root`: where files for the servers go (--sync.disk_dir, default <run_dir>/weights)."""
        self.merge = cfg.lora != "adapter"
        """A LoRA model's adapters merged into the weights `send` sends (else the base alone)."""
        self.fp8 = False
        """FP8 servers (--rollout.precision fp8): the linear weights go quantized, each beside its scale."""
        self.rank0 = dist.get_rank() == 0
        """Only trainer rank 0 sends requests to the servers; the other ranks take part in the gathers."""
        self.profile: dict[str, float] = {}
        """Seconds spent per part of the last update (rank 0), for the sync metrics and tools/bench_sync.py."""
        self.stats: dict[str, float] = {}
        """Other figures of the last update, as sync metrics (the shard transport's delta: how much changed)."""

    @abstractmethod
    def send(self, module: torch.nn.Module, weight_version: int, flush_cache: bool) -> int:
        """Send every parameter; `weight_version` goes live with the last bucket. Returns bytes sent (rank 0).

        A failure on rank 0 must still let the other ranks finish their part (collectives), then raise."""

    def load_adapter(self, module: torch.nn.Module, name: str) -> int:
        """Every server loads `module`'s LoRA adapter under `name`; returns its bytes (rank 0). Here: rank 0
        writes it as PEFT does into <root>/<name> and the servers read it (/load_lora_adapter); the CUDA IPC
        transport hands them the tensors instead."""
        with gathered_adapter(module) as state:
            sent = write_adapter(module, state, self.root / name) if self.rank0 else 0
        body = {"lora_name": name, "lora_path": str((self.root / name).resolve())}
        if self.rank0:
            self.client.call_all("/load_lora_adapter", body)
        return sent

    def forget_adapter(self, name: str) -> None:
        """The servers have unloaded adapter `name`: what was kept for it goes (rank 0)."""
        shutil.rmtree(self.root / name, ignore_errors=True)

    def release(self) -> None:
        """Free what the transport keeps between updates (colocated: the server needs the memory)."""

    def reset(self, numbers: list[int]) -> None:
        """The fleet changed (a server restarted, joined or left): rebuild per-fleet state before the next send.
        `numbers`: each server's number, in the client's order."""
