"""Broadcast transport: trainer rank 0 broadcasts flattened buckets to every server rank in one group.

NCCL on GPUs, gloo on CPU. Each bucket is one uint8 tensor holding its tensors' bytes back to
back, sent with SGLang's `load_format: flattened_bucket` -- one broadcast and one request per
bucket. The next bucket is gathered and flattened while the current one is in flight.
"""

import logging
import socket
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from dsrl.config import SyncConfig
from dsrl.serving.client import RolloutClient
from dsrl.serving.servers import free_port
from dsrl.sync.base import CheckpointEngine, SyncError
from dsrl.sync.group import init_weight_update_group
from dsrl.zero.buckets import NamedTensors

log = logging.getLogger(__name__)

GROUP_NAME = "dsrl_weight_update"


def flatten(bucket: NamedTensors) -> tuple[dict, torch.Tensor]:
    """SGLang's flattened-bucket layout: raw bytes of each tensor, in order, no padding."""
    meta = {
        "names": [name for name, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }
    flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in bucket])
    return meta, flat


class BroadcastEngine(CheckpointEngine):
    def __init__(self, cfg: SyncConfig, client: RolloutClient, backend: str):
        super().__init__(cfg, client)
        self.backend = backend
        self.group: dist.ProcessGroup | None = None

    def connect(self) -> None:
        infos = self.client.call_all("/server_info", method="GET")
        tp_sizes = [int(info.get("tp_size", 1)) for info in infos]
        world = 1 + sum(tp_sizes)
        hosts = {urlparse(url).hostname for url in self.client.urls}
        local = hosts <= {"127.0.0.1", "localhost"}
        address = "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())
        port = free_port("127.0.0.1" if local else "")
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]

        async def join_all():
            import asyncio

            return await asyncio.gather(
                *(
                    self.client.request(
                        url,
                        "/init_weights_update_group",
                        {
                            "master_address": address,
                            "master_port": port,
                            "rank_offset": offset,
                            "world_size": world,
                            "group_name": GROUP_NAME,
                            "backend": self.backend,
                        },
                        timeout_s=self.cfg.timeout_s,
                    )
                    for url, offset in zip(self.client.urls, offsets)
                )
            )

        # The servers' calls block until every rank has joined, trainer included: run them meanwhile.
        replies = self.client.submit(join_all())
        try:
            self.group = init_weight_update_group(address, port, 0, world, GROUP_NAME, self.backend, self.cfg.timeout_s)
        except Exception as e:
            raise SyncError(
                f"weight-update group ({self.backend}, {address}:{port}, world {world}) did not form within "
                f"{self.cfg.timeout_s:.0f}s: {e}; check that every server can reach {address}:{port}, "
                "and the server logs"
            ) from e
        replies.result(self.cfg.timeout_s)
        log.info(
            "weight-update group %s formed: trainer + %d server ranks over %s", GROUP_NAME, world - 1, self.backend
        )

    def update_weights(self, buckets: Iterator[NamedTensors], weight_version: str, flush_cache: bool) -> int:
        if self.group is None:
            self.connect()
        sent, in_flight, ready = 0, None, None
        for bucket in buckets:  # advancing gathers the next bucket while the previous is in flight
            flattened = flatten(bucket)
            if ready is not None:
                self._wait(in_flight)
                in_flight = self._send(*ready, weight_version=None, flush_cache=False)
            ready = flattened
            sent += flattened[1].numel()
        self._wait(in_flight)
        if ready is not None:
            self._wait(self._send(*ready, weight_version=weight_version, flush_cache=flush_cache))
        return sent

    def _send(self, meta: dict, flat: torch.Tensor, weight_version: str | None, flush_cache: bool):
        payload = {
            **meta,
            "group_name": GROUP_NAME,
            "load_format": "flattened_bucket",
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        reply = self.client.submit(self.client.all_servers("/update_weights_from_distributed", payload))
        work = dist.broadcast(flat, group=self.group, group_src=0, async_op=True)
        return reply, work, flat

    def _wait(self, in_flight: tuple[Future, dist.Work, torch.Tensor] | None) -> None:
        if in_flight is None:
            return
        reply, work, flat = in_flight
        try:
            work.wait(timedelta(seconds=self.cfg.timeout_s))
        except RuntimeError as e:
            raise SyncError(
                f"broadcast of a {flat.numel() / 1e6:.1f} MB bucket did not finish within {self.cfg.timeout_s:.0f}s "
                f"({e}); a server may have died -- check its log"
            ) from e
        reply.result(self.cfg.timeout_s)
