"""The weight update, with one owner: `WeightSync.update(version)` runs the whole sequence, in order.

    heal       the fleet's changes applied (`_heal`): dead servers set aside, queued joins and leaves;
               the transport's per-fleet state (the broadcast group) is rebuilt only when membership changed
    lend       colocated: the GPU goes to the update (`GpuLending.for_update`: the trainers'
               optimizer states leave it, the servers take their weights' memory back)
    pause      interrupt pause: the servers pause, their requests stay on them through the update
    send       the transport moves every bucket; the new weight_version goes live with the last
    continue   paused servers resume
    check      every server reports the new weight_version
    verify     the weights compared, or the trainer's half of the probe computed
    lend       colocated: the transport's buffers are freed and the GPU goes back to the servers
               (`GpuLending.to_servers`: the trainers' parameters leave, the KV cache comes back)
    probe      the servers' logprobs of fixed tokens against the trainer's, in the background beside
               the rollout's requests; checked before the servers sleep (colocated: before the step
               trains on what they generated) or at the next update (disaggregated)

Every trainer rank calls it (the parameters are gathered from every rank's partitions); only
trainer rank 0 talks to the servers, and a failure there surfaces on every rank (`agreed`). A
failed send is tried again after the fleet is healed (`_after_failure`). Which tenant of the GPU
sleeps, wakes or offloads, and when, is `dsrl.lending`'s.
"""

import logging
import time
from collections.abc import Awaitable
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist

from dsrl.collectives import agreed
from dsrl.config import Config, SyncConfig
from dsrl.lending import GpuLending
from dsrl.metrics import Timer
from dsrl.rundir import deadline
from dsrl.serving.client import RolloutClient, ServerError
from dsrl.serving.servers import ExternalFleet, ServerFleet, ServersLost
from dsrl.sync.adapter import AdapterServing
from dsrl.sync.base import SERVER_ERRORS, SyncError, Transport
from dsrl.sync.verify import probe_reference, probe_servers, verify_weights
from dsrl.vision import image_probe
from dsrl.zero.lora import is_lora

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(
        self, cfg: Config, actor, fleet: ServerFleet, client: RolloutClient, transport: Transport, gpu: GpuLending
    ):
        self.cfg, self.actor, self.fleet, self.client, self.transport = cfg, actor, fleet, client, transport
        self.gpu = gpu  # colocated, it lends the GPU to the update and back to the servers
        self.rank0 = dist.get_rank() == 0
        """Only trainer rank 0 talks to the servers; the fields below marked (rank 0) are empty elsewhere."""
        r = cfg.rollout
        self.pause = r.pause_mode if not gpu.colocated and r.interrupt == "pause" else None
        """SGLang's pause mode when requests stay in flight through updates (interrupt pause), else None."""
        self.verified = False  # the first update is always verified
        self.version = -1  # the weight version of the last update that completed
        self.probe: Future | None = None
        """(rank 0) the last update's probe of the servers, running beside the rollout's requests."""
        self.probed: dict[str, float] = {}
        """(rank 0) the figures of the probe awaited last, until `check_probe` hands them on."""
        self.failing: set[str] = set()
        """(rank 0) servers that answer but failed the retried update: the next `_heal` replaces them."""
        self.adapters = AdapterServing(transport, client) if is_lora(actor.module) and not transport.merge else None
        """A LoRA actor whose adapter the servers serve on their own (`--sync.lora adapter`)."""

    def update(self, version: int) -> dict[str, float]:
        """Bring every server to weight `version`; returns the sync metrics (rank 0's are the real ones). An update
        that outlasts its tries ends the run on every rank, naming it: the ranks above 0 wait in collectives for
        rank 0 all along, whose own waits have deadlines of --sync.timeout_s."""
        what = f"the weight update to version {version} (servers {', '.join(self.client.urls)})"
        with deadline(what, 3 * self.cfg.sync.timeout_s + 30, "three times --sync.timeout_s, and 30 s"):
            return self._update(version)

    def _update(self, version: int) -> dict[str, float]:
        timer, metrics = Timer(), self.check_probe()
        for attempt in (1, 2, 3):
            with timer("heal"):
                self._heal()
            try:
                with agreed(f"the weight sync to version {version}", SERVER_ERRORS):
                    self.gpu.for_update(timer)
                    start = time.perf_counter()
                    if self.pause is not None:
                        with timer("pause"):
                            self._call("/pause_generation", {"mode": self.pause})
                    with timer("send"):  # paused requests stay on the servers, which then refuse a cache flush
                        sender = self.adapters or self.transport
                        sent = sender.send(self.actor.module, version, flush_cache=self.pause is None)
                    if self.pause is not None:
                        with timer("resume"):
                            self._call("/continue_generation", {})
                    with timer("version_check"):
                        self._check_versions(version)
                    seconds = time.perf_counter() - start
                self.version = version
                break
            except SERVER_ERRORS as e:
                if self.adapters is not None:
                    self.adapters.reset()  # the retry sends the base again, on every rank
                if not self._after_failure(version, e, attempt):
                    tries = "twice" if attempt == 2 else "three times"
                    raise SyncError(f"weight sync to version {version} failed {tries}") from e
        reference, verify = None, self._verifies(version)
        if verify == "weights":
            with timer("verify"), agreed(f"the weight check of version {version}", SERVER_ERRORS):
                verify_weights(
                    self.actor.module, self.client, self.cfg.sync.bucket_bytes, self.rank0, self.transport.merge
                )
        if verify == "probe":  # the trainer's side now, while its params are still on the GPU
            with timer("verify"):
                vocab = self.actor.module.config.get_text_config().vocab_size
                reference = (*probe_reference(self.actor, vocab), image_probe(self.actor))
        if self.gpu.colocated:
            with timer("offload"):  # the KV cache needs the memory the transport's buffers held
                self.transport.release()
        self.gpu.to_servers(timer)
        if self.client.held and dist.get_world_size() > 1:  # (the same on every rank) rank 0 woke them: requests
            dist.barrier()  # waiting for them on the other ranks (a lone server's replacement) go once it has
        self.client.release_held()  # servers that joined hold this version now, and their KV cache
        if reference is not None:
            self._probe(*reference)
        metrics |= {"sync/bytes": sent, "sync/seconds": seconds, "sync/gb_per_s": sent / max(seconds, 1e-9) / 1e9}
        metrics |= self.transport.stats
        if self.rank0:  # (since the run started)
            metrics |= {"fleet/server_deaths": self.fleet.deaths, "fleet/restarts": self.fleet.restarts}
        profile = self.adapters.profile if self.adapters is not None else self.transport.profile
        parts = {f"timing/sync_{part}": seconds for part, seconds in profile.items()}
        return metrics | timer.metrics("timing/sync_") | parts

    def _verifies(self, version: int) -> str:
        """--sync.verify for this update: every verify_every-th, the first and the last always."""
        s, first = self.cfg.sync, not self.verified
        self.verified = True
        due = first or version % s.verify_every == 0 or version >= self.cfg.trainer.total_steps
        return s.verify if due else "off"

    def check_probe(self) -> dict[str, float]:
        """The last update's probe, awaited if it still runs; a mismatch stops the run on every rank. Returns
        its figures once (rank 0's; empty elsewhere)."""
        self.await_probe()
        if self.adapters is not None and self.rank0:
            self.adapters.settle()
        out, self.probed = self.probed, {}
        return out

    def await_probe(self) -> None:
        """The last update's probe, awaited (a collective: colocated, before the servers sleep, so that a mismatch
        stops the run before it trains on what they generated); its figures wait for `check_probe`."""
        pending, self.probe = self.probe, None
        with agreed("the weight probe after the last sync", SERVER_ERRORS):
            try:
                if pending is not None:
                    self.probed["sync/probe_logprob_diff"], self.probed["sync/probe_seconds"] = pending.result()
            except ServerError as e:
                if not e.down:
                    raise
                log.warning("the probe of the last sync did not finish (%s): a replacement is probed at its sync", e)

    def recover(self, version: int) -> None:
        """Every server is down while the rollout waits for one (a lone server died): on every rank, the fleet is
        healed, waiting for the replacement, which gets weight `version` before the requests waiting for it go on."""
        if self.rank0:
            log.warning("every rollout server is down: the rollout waits for a replacement with weight version %d",
                        version)  # fmt: skip
        self.gpu.for_recovery()
        self.update(version)

    def _heal(self) -> None:
        """Apply the fleet's changes (dead servers restarted or set aside, queued joins and leaves); every
        rank adopts the new membership. A server that joins is held (no /generate) until this update has
        given it the weights; one that leaves has its requests aborted first, which the rollout schedule
        resubmits elsewhere."""
        world = dist.get_world_size()
        down = [self.client.down] if world == 1 else [None] * world  # (object collectives cost 0.7 ms on 1 GPU)
        if world > 1:
            dist.all_gather_object(down, self.client.down)
        decided: list = [None, [], None]  # (rank 0's) the fleet's change, the servers reported down that answer, and
        # why no server is left (`ServersLost`)
        if self.rank0:
            exited = self.fleet.exited()
            if exited is None:  # external servers: ask them
                exited = {url for url in self.client.urls if not self.client.responds(url, self.cfg.sync.timeout_s)}
            # A request that failed is no proof of death: a server that answers stays (killing it was the "-9 exit")
            reported = {url for urls in down for url in urls} - exited
            answering = [url for url in reported if self.client.responds(url, self.cfg.sync.timeout_s)]
            for url in answering:
                log.warning("rollout server %s answers again after a failed request: it stays in the fleet", url)
            try:
                decided = [self.fleet.heal(reported - set(answering) | exited | self.failing), answering, None]
            except ServersLost as e:
                decided[2] = str(e)
            self.failing = set()
            for url in decided[0].leaving if decided[0] else []:
                self.client.run(self.client.abort_server(url))
        if world > 1:
            dist.broadcast_object_list(decided, src=0)
        change, answering, lost = decided
        if lost is not None:
            raise ServersLost(lost)
        self.client.down = [url for url in self.client.down if url not in answering]
        if change is not None:
            self.client.set_urls(change.urls, held=change.joined)
            self.transport.reset(change.numbers)
            if self.adapters is not None:
                self.adapters.reset()
            self.gpu.fleet_changed(change.urls, change.joined)
        if self.rank0:
            for url in change.leaving if change else []:
                self.fleet.stop_server(url)

    def _after_failure(self, version: int, error: Exception, attempt: int) -> bool:
        """After a failed update: a server that does not answer is marked down, for `_heal` to replace, and the
        update is tried again. After a second failure with every server answering, the server whose error failed
        it is replaced as a dead one would be, if dsrl started it, and the update tried a third time without it.
        Returns whether to try again, on every rank."""
        again = [attempt == 1]
        if self.rank0 and attempt < 3:
            log.warning("weight sync to version %d failed (%s); checking the servers", version, error)
            silent = [url for url in self.client.live_urls() if not self.client.responds(url)]
            for url in silent:
                self.client.mark_down(url, "no answer after a failed weight sync")
            culprit = failing_server(error)
            if attempt == 2 and not silent and culprit in self.client.live_urls():
                if isinstance(self.fleet, ExternalFleet):
                    log.error(
                        "%s failed the retried weight update; dsrl cannot replace a server it did not start", culprit
                    )
                else:
                    log.warning("%s failed the retried weight update: replacing it, and syncing without it", culprit)
                    self.failing.add(culprit)
                    again = [True]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(again, src=0)
        return again[0]

    def _call(self, path: str, payload: dict) -> None:
        if self.rank0:
            self.client.call_all(path, payload)

    def _check_versions(self, version: int) -> None:
        if not self.rank0:
            return
        versions = self.client.weight_versions()  # SGLang's strings: the HTTP boundary
        stale = [f"{url} has {v!r}" for url, v in zip(self.client.live_urls(), versions) if v != str(version)]
        if stale:
            raise SyncError(f"after the update to weight version {version}: {', '.join(stale)}")

    def _probe(self, ids: list[list[int]], reference, image: tuple | None) -> None:
        """The servers' half of the probe, in the background: behind a busy server's queue it took 0.1 s per
        step on an H200, and 45 ms of a toy step colocated. No cache flush: the rollout's requests run
        meanwhile and SGLang refuses to flush then (seen: HTTP 400 under load); a probe matches no cached
        prefix past logprob_start_len 0 anyway. Colocated, `await_probe` checks it before the servers release
        their memory (SGLang dies generating asleep); disaggregated, the next update does."""
        if self.rank0:
            tolerance = self.cfg.sync.probe_tolerance
            probe = probe_servers(self.client, ids, reference, tolerance, False, self.transport.fp8, image)
            self.probe = self.client.submit(_timed(probe))


def failing_server(error: BaseException | None) -> str | None:
    """The server that answered a request of the failed update with an error of its own (not a death), if one did."""
    while error is not None and not isinstance(error, ServerError):
        error = error.__cause__
    return error.url if error is not None and not error.down else None


async def _timed(work: Awaitable[float]) -> tuple[float, float]:
    """The result of `work` and the seconds it took (the probe's own time, off the critical path)."""
    start = time.perf_counter()
    return await work, time.perf_counter() - start


def make_transport(
    cfg: SyncConfig, client: RolloutClient, run_dir: Path, backend: str, tp_size: int = 1, fp8: bool = False
) -> Transport:
    """The transport named by --sync.type ('auto' must be resolved by the caller); `fp8`: for FP8 servers."""
    root = Path(cfg.disk_dir or run_dir / "weights")
    if cfg.type == "ipc":
        from dsrl.sync.ipc import IpcTransport

        transport = IpcTransport(cfg, client, root, tp_size)
    elif cfg.type == "broadcast" and (cfg.senders == "all" or cfg.delta):
        from dsrl.sync.shards import ShardTransport

        transport = ShardTransport(cfg, client, root, backend)
    elif cfg.type == "broadcast":
        from dsrl.sync.broadcast import BroadcastTransport

        transport = BroadcastTransport(cfg, client, root, backend)
    elif cfg.type == "disk":
        from dsrl.sync.disk import DiskTransport

        transport = DiskTransport(cfg, client, root)
    else:
        raise ValueError(f"--sync.type={cfg.type!r}: expected ipc, broadcast or disk")
    transport.fp8 = fp8
    return transport
