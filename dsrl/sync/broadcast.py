"""Broadcast transport: trainer rank 0 broadcasts flattened buckets to every server rank in one group.

NCCL on GPUs, gloo on CPU. Each bucket is one uint8 tensor holding its tensors' bytes back to
back, sent with SGLang's `load_format: flattened_bucket` -- one broadcast and one request per
bucket, each request posted once the previous one is answered (the servers must see them in
order). While bucket i is broadcast, bucket i+1 is being gathered onto rank 0 (`FlatGatherer`),
and a failed reply aborts the wait at once.
"""

import asyncio
import logging
import time
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from dsrl.collectives import init_weight_update_group
from dsrl.config import SyncConfig
from dsrl.metrics import Timer
from dsrl.rundir import deadline
from dsrl.serving.client import RolloutClient
from dsrl.serving.servers import free_port, routable_address
from dsrl.sync.base import SyncError, Transport
from dsrl.zero.buckets import FlatBucket, FlatGatherer

log = logging.getLogger(__name__)
DISTRIBUTED = "/update_weights_from_distributed"


class BroadcastTransport(Transport):
    def __init__(self, cfg: SyncConfig, client: RolloutClient, root: Path, backend: str):
        super().__init__(cfg, client, root)
        self.backend = backend
        self.group: dist.ProcessGroup | None = None
        self.group_name = ""
        self.members: list[str] = []
        """(rank 0) the servers in the group, in rank order."""
        self.gatherer: FlatGatherer | None = None

    def connect(self) -> None:
        """Form the weight-update group: trainer rank 0 plus every tensor-parallel rank of every server."""
        client = self.client
        self.members = client.live_urls()
        tp_sizes = [int(info.get("tp_size", 1)) for info in client.call_all("/server_info", method="GET")]
        world = 1 + sum(tp_sizes)
        hosts = [urlparse(url).hostname for url in self.members]
        local = set(hosts) <= {"127.0.0.1", "localhost"}
        # Servers on other machines must reach trainer rank 0: its address on the route to them (not
        # gethostbyname(gethostname()), 127.0.1.1 on Debian-style hosts), or --sync.master_address.
        address = self.cfg.master_address or ("127.0.0.1" if local else routable_address(hosts[0]))
        port = free_port("127.0.0.1" if local else "")
        # torch refuses a second group of the same name in one process (e.g. after a server restart)
        self.group_name = f"dsrl_weight_update_{port}"
        requests = []
        for i, url in enumerate(self.members):
            body = {
                "master_address": address,
                "master_port": port,
                "rank_offset": 1 + sum(tp_sizes[:i]),
                "world_size": world,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            requests.append(client.request(url, "/init_weights_update_group", body, timeout_s=self.cfg.timeout_s))

        async def join_all():
            return await asyncio.gather(*requests)

        # The servers' calls block until every rank has joined, trainer included: run them meanwhile.
        replies = client.submit(join_all())
        try:
            self.group = init_weight_update_group(
                address, port, 0, world, self.group_name, self.backend, self.cfg.timeout_s
            )
        except Exception as e:
            raise SyncError(
                f"weight-update group ({self.backend}, {address}:{port}, world {world}) did not form within "
                f"{self.cfg.timeout_s:.0f}s: {e}; check that every server ({', '.join(self.members)}) can reach "
                f"{address}:{port} (--sync.master_address), and the server logs"
            ) from e
        replies.result(self.cfg.timeout_s)
        log.info("weight-update group %s: trainer + %d server ranks over %s", self.group_name, world - 1, self.backend)

    def send(self, module: torch.nn.Module, weight_version: int, flush_cache: bool) -> int:
        if self.gatherer is None or self.gatherer.bucket_bytes != self.cfg.bucket_bytes:
            self.gatherer = FlatGatherer(module, self.cfg.bucket_bytes, merge=self.merge, fp8=self.fp8)
        if not self.rank0:
            for _ in self.gatherer:  # join each bucket's gather onto rank 0
                pass
            return 0
        sent, in_flight, replies, failure = 0, None, [], None
        clock, n = Timer(), len(self.gatherer.plan)
        for i, bucket in enumerate(clock.each(self.gatherer, "gather")):  # gathering i+1 overlaps sending i
            if failure is not None:
                continue  # keep joining the other ranks' transfers, send nothing more
            try:
                if self.group is None:
                    with clock("connect"), self._deadline("forming the weight-update group"):
                        self.connect()
                if in_flight is not None:
                    with clock("broadcast"), self._deadline(f"the broadcast of bucket {i}/{n}"):
                        self._wait(in_flight, replies)  # its buffer is reused two buckets later
                self._check_members(f"bucket {i + 1}/{n}")
                with clock("post"), self._deadline(f"the broadcast of bucket {i + 1}/{n}"):
                    previous = replies[-1] if replies else None
                    reply, in_flight = self._send(bucket, weight_version, flush_cache, previous)
                replies.append(reply)
                sent += bucket.flat.numel()
            except Exception as e:  # noqa: BLE001 -- re-raised once the gathers are done
                failure = e
        try:
            with self._deadline(f"the broadcast of bucket {n}/{n} and the servers' replies"):
                if failure is None and in_flight is not None:
                    with clock("broadcast"):
                        self._wait(in_flight, replies)
                with clock("server_replies"):  # the last bucket's load and the KV flush
                    for reply in replies if failure is None else []:
                        reply.result(self.cfg.timeout_s)
        except Exception as e:  # noqa: BLE001
            failure = e
        self.profile = clock.seconds
        if failure is not None:
            self._abandon_group()
            raise SyncError(f"weight update to version {weight_version} failed: {failure}") from failure
        return sent

    def reset(self, numbers: list[int]) -> None:
        self.group = None

    def _check_members(self, what: str) -> None:
        """A server of the group that went down (a failed request, e.g. the /pause_generation before this update)
        fails the update before `what` is sent: gloo's root sends down its tree, and a dead peer it reaches first
        leaves the others waiting in the broadcast (seen on the embedded engine: a survivor held its weights'
        locks until the group's 600 s timeout)."""
        down = [url for url in self.members if url in self.client.down]
        if down:
            raise SyncError(f"{', '.join(down)} went down before {what} was sent")

    def _abandon_group(self, names: list[str] | None = None) -> None:
        """A failed group is never reused (the next update forms a new one), and the live servers are asked to
        destroy it (or the groups `names`), which ends a receive still waiting in it; a server that cannot is left
        to the next update."""
        self.group = None  # (rank 0 only: the other ranks return before they could fail)
        names = names or [self.group_name]
        live = [(url, name) for url in self.members if url not in self.client.down for name in names]

        async def destroy_all():
            calls = (self.client.request(url, "/destroy_weights_update_group", {"group_name": name}, timeout_s=30)
                     for url, name in live)  # fmt: skip
            return await asyncio.gather(*calls, return_exceptions=True)

        replies = self.client.run(destroy_all())
        for (url, name), reply in zip(live, replies):
            if isinstance(reply, BaseException):
                log.warning("%s did not destroy the failed weight-update group %s: %s", url, name, reply)

    def _deadline(self, what: str):
        """A wait NCCL may never return from (a peer that never joins, a broadcast nobody receives) ends the run,
        naming it, a little after the waits below have had their own chance to fail and be retried."""
        servers = ", ".join(self.client.live_urls())
        return deadline(f"weight update: {what} (servers {servers})", self.cfg.timeout_s + 10, "--sync.timeout_s")

    def _send(
        self, bucket: FlatBucket, weight_version: int, flush_cache: bool, previous: Future | None
    ) -> tuple[Future, dist.Work]:
        payload = {
            "names": bucket.names,
            "dtypes": bucket.dtypes,
            "shapes": bucket.shapes,
            "group_name": self.group_name,
            "load_format": "flattened_bucket",
            "flush_cache": flush_cache and bucket.last,
            "weight_version": str(weight_version) if bucket.last else None,
        }
        reply = self.client.submit(self._post_after(previous, payload))
        work = dist.broadcast(bucket.flat, group=self.group, group_src=0, async_op=True)
        return reply, work

    async def _post_after(self, previous: Future | None, payload: dict, path: str = DISTRIBUTED) -> list:
        """Post one bucket's request once the previous bucket's has been answered.

        The servers must receive the requests in bucket order: each one tells the server the names
        and shapes of the next broadcast it takes part in. Requests posted back to back travel on
        separate connections and can be handled out of order, and a broadcast that fits in NCCL's
        buffers completes on the trainer before the server has even read its request (seen on
        2xH200 with 64 MB buckets: the server loaded bytes under the wrong names).
        """
        if previous is not None:
            await asyncio.wrap_future(previous)  # a failed bucket stops the rest
        return await self.client.all_servers(path, payload)

    def _wait(self, work: dist.Work, replies: list[Future]) -> None:
        """Wait for a broadcast, failing fast when a server has already answered with an error."""
        due = time.monotonic() + self.cfg.timeout_s
        while not work.is_completed():
            failed = next((r.exception() for r in replies if r.done() and r.exception() is not None), None)
            if failed is not None:
                raise SyncError(f"a server failed during the weight update: {failed}") from failed
            if time.monotonic() > due:
                waiting = self.client.live_urls()
                raise SyncError(
                    f"a bucket broadcast did not finish within {self.cfg.timeout_s:.0f}s (--sync.timeout_s); "
                    f"one of the servers {', '.join(waiting)} may have died: check its log"
                )
            time.sleep(0.0005)
        work.wait()
