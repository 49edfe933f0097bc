"""GPU lending: colocated, the trainers and the servers take turns on the GPU. Which tenant gives up what, and when:

    to_trainers     the batch is generated: the servers (the rollout servers, then the reward model's) release
                    their KV cache, and their weights unless they keep them (an adapter's base, one-step-off);
                    offloaded trainers' states come back
    wake_kv_cache   one-step-off, after the update's last backward pass: the KV cache comes back for the batch
                    generated beside the optimizer step
    for_update      in the weight update, before the send: offloaded trainers' optimizer states leave, the
                    servers' weights come back
    to_servers      in the weight update, after its checks: the trainers' parameters leave (offloaded "all"; else
                    the allocator's cached blocks), the servers' KV cache comes back (the reward model's whole)

A tenant of `servers` has `release(tags)` and `resume(tag)`; a new one is one more entry. Disaggregated nothing was
released, so nothing wakes; `offload` (None, "moments" or "all") is decided at start-up (`dsrl.auto.decide_offload`).
"""

from contextlib import contextmanager

import torch.distributed as dist

from dsrl.collectives import agreed
from dsrl.config import Config
from dsrl.metrics import Timer
from dsrl.serving.client import RolloutClient, ServerError
from dsrl.zero.engine import free_cached_memory, offload_states, reload_states

MEMORY_TAGS = ("weights", "kv_cache")


class ServerMemory:
    """(rank 0) The rollout servers as a tenant; a retried update wakes only what is still asleep (SGLang refuses to
    resume memory that is not released)."""

    def __init__(self, client: RolloutClient):
        self.client, self.released = client, {}

    def release(self, tags: tuple[str, ...]) -> None:
        self.client.call_all("/release_memory_occupation", {"tags": list(tags)})
        self.released = {url: set(tags) for url in self.client.live_urls()}

    def resume(self, tag: str) -> None:
        asleep = [url for url in self.client.live_urls() if tag in self.released.get(url, ())]
        if asleep:
            self.client.run(self.client.all_servers("/resume_memory_occupation", {"tags": [tag]}, urls=asleep))
            for url in asleep:
                self.released[url].discard(tag)


class GpuLending:
    def __init__(self, cfg: Config, client: RolloutClient, trainers: list, offload: str | None = None, reward=None):
        """`trainers`: the engines with states (actor, critic); `reward` (rank 0): the reward model's servers."""
        self.trainers, self.offload = trainers, offload
        self.colocated = cfg.rollout.placement == "colocate"
        self.ahead = self.colocated and cfg.rollout.max_staleness > 0
        """One-step-off colocated: the servers generate the next batch beside the last optimizer step."""
        adapter = cfg.model.lora_rank > 0 and cfg.sync.lora == "adapter"
        self.sleep_tags = MEMORY_TAGS if not adapter and not self.ahead else ("kv_cache",)
        """What the servers release while the trainers train; serving an adapter (whose base is sent once: SGLang drops
        released weights' contents), or generating ahead (with the weights just trained on), they keep their weights."""
        self.memory = ServerMemory(client)
        self.servers = [self.memory, *([reward] if reward is not None else [])] if dist.get_rank() == 0 else []
        """The tenants, in the order they go to sleep (they wake the other way round)."""

    def to_trainers(self) -> None:
        """Colocated, once every rank has its samples: the servers give their memory to the trainers."""
        for tenant in self.servers:
            tenant.release(self.sleep_tags)
        self.trainers_back()

    def wake_kv_cache(self) -> None:
        """One-step-off, after the update's last backward pass (every rank waits until the servers have it)."""
        free_cached_memory()
        with agreed("waking the servers to generate ahead", (ServerError,)):
            self.wake("kv_cache")

    def for_update(self, timer: Timer) -> None:
        """In the weight update, before the send: the trainers' optimizer states off the GPU, the weights back."""
        if self.offload:
            with timer("offload"):
                self.offload_trainers(params=False)
        with timer("wake"):
            self.wake("weights")

    def to_servers(self, timer: Timer) -> None:
        """In the weight update, after its checks: the KV cache needs the memory the trainers' parameters held."""
        if self.colocated:
            with timer("offload"):
                if self.offload == "all":
                    self.offload_trainers(params=True)
                else:
                    free_cached_memory()
        with timer("wake"):
            self.wake("kv_cache")

    def wake(self, tag: str) -> None:
        """The servers that released `tag` take it back, the last to sleep first."""
        for tenant in reversed(self.servers):
            tenant.resume(tag)

    def fleet_changed(self, urls: list[str]) -> None:
        self.memory.released = {url: tags for url, tags in self.memory.released.items() if url in urls}

    def offload_trainers(self, params: bool) -> None:  # (optimizer states; with `params` the parameters too)
        for engine in self.trainers:
            offload_states(engine, self.offload, params)

    def trainers_back(self) -> None:  # (where they were offloaded)
        for engine in self.trainers if self.offload else []:
            reload_states(engine)

    @contextmanager
    def trainers_on_gpu(self):
        """The trainers' states on the GPU for the block (a checkpoint reads them), then off it again."""
        self.trainers_back()
        yield
        if self.offload:
            self.offload_trainers(params=True)
