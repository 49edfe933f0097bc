"""A LoRA adapter served on its own (`--sync.lora adapter`): the base once, then the adapter alone.

    base     the base weights, adapters not merged, through the transport: at the first update, and
             again whenever the fleet changed (a server joined or was restarted: it has no base yet)
    load     the adapter, gathered from ZeRO-3 alone, loads under a new name per version, dsrl-v<N>:
             SGLang refuses to replace an adapter in place, and a request keeps the adapter it named
             until it ends, so the name tags all of its tokens with their version exactly
    version  the servers report weight_version N (/update_weight_version; no request is aborted)
    name     every rank's client names dsrl-v<N> in each /generate from now on
    unload   older adapters that no rank's request still uses are unloaded in the background (SGLang
             answers once their last request has ended), checked at the next update

Every trainer rank calls `send` (the gathers are collectives); only rank 0 talks to the servers.
"""

import asyncio
import logging
from concurrent.futures import Future

import torch
import torch.distributed as dist

from dsrl.collectives import agreed
from dsrl.metrics import Timer
from dsrl.serving.client import RolloutClient, ServedAdapter
from dsrl.sync.base import SERVER_ERRORS, Transport

log = logging.getLogger(__name__)


class AdapterServing:
    def __init__(self, transport: Transport, client: RolloutClient):
        self.transport, self.client = transport, client
        self.rank0 = dist.get_rank() == 0
        self.needs_base = True
        """Some server lacks the trainer's base weights (the same on every rank: a collective follows)."""
        self.loaded: list[str] = []
        """(rank 0) the adapter names the servers hold, oldest first."""
        self.unloading: Future | None = None
        """(rank 0) the last update's unloads, running beside the rollout."""
        self.profile: dict[str, float] = {}
        """Seconds per part of the last update: base, adapter (gather and load), version, unload."""

    def reset(self) -> None:
        """The fleet changed: a new or restarted server needs the base (and holds no old adapter)."""
        self.needs_base = True

    def send(self, module: torch.nn.Module, version: int, flush_cache: bool) -> int:
        """Bring every server to `version`: the base if needed, then the adapter; returns the bytes sent. Each
        part fails on every rank or on none (`agreed`): the next part's collectives need them all."""
        clock, base = Timer(), 0
        if self.needs_base:
            with clock("base"), agreed(f"the base weights for version {version}", SERVER_ERRORS):
                base = self.transport.send(module, version, flush_cache)
            self.needs_base = False
        name = f"dsrl-v{version}"
        with agreed(f"the adapter {name}", SERVER_ERRORS):
            if self.rank0:
                with clock("unload"):
                    self.settle()
                    if name in self.loaded:  # a retried update: the first try may have loaded it
                        self.loaded.remove(name)
                        self.client.run(self._unload([name]))
            with clock("adapter"):
                sent = self.transport.load_adapter(module, name)
            if self.rank0:
                self.loaded.append(name)
                with clock("version"):
                    body = {"new_version": str(version), "abort_all_requests": False}
                    self.client.call_all("/update_weight_version", body)
        self.client.adapter = ServedAdapter(name, version)
        self._unload_unused()
        self.profile = clock.seconds
        return base + sent

    def _unload_unused(self) -> None:
        """Start unloading the adapters older than the current one that no rank's request uses any more."""
        in_use = {n for n, count in self.client.adapter_requests.items() if count > 0}
        if dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, in_use)
            in_use = set().union(*every)
        old = [n for n in self.loaded[:-1] if n not in in_use] if self.rank0 else []
        if old:
            self.loaded = [n for n in self.loaded if n not in old]
            self.unloading = self.client.submit(self._unload(old))

    def settle(self) -> None:
        """(rank 0) Wait for the last update's unloads."""
        pending, self.unloading = self.unloading, None
        if pending is not None:
            pending.result(self.transport.cfg.timeout_s)

    async def _unload(self, names: list[str]) -> None:
        """Unload `names` from every server; a server that lacks one (restarted since) is fine."""
        calls = [
            self.client.request(url, "/unload_lora_adapter", {"lora_name": n})
            for n in names
            for url in self.client.live_urls()
        ]
        for reply in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(reply, Exception):
                log.debug("unloading an old adapter: %s", reply)
        for name in names:
            self.transport.forget_adapter(name)
