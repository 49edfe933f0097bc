"""GPU lending: colocated, the trainers and the servers take turns on the GPU. Which tenant gives up what, and when:

    to_trainers     the batch is generated: the servers (the rollout servers, the reward model's, the teacher's) release
                    their KV cache, and their weights unless they keep them (an adapter's base, one-step-off);
                    offloaded trainers' states come back
    wake_kv_cache   one-step-off, after the update's last backward pass: the KV cache comes back for the batch
                    generated beside the optimizer step
    for_update      in the weight update, before the send: offloaded trainers' optimizer states leave, the
                    servers' weights come back
    to_servers      in the weight update, after its checks: the trainers' parameters leave (offloaded "all"; else
                    the allocator's cached blocks), the servers' KV cache comes back (the reward model's whole)

A tenant of `servers` has `release(tags)` and `resume(tag)`; a new one is one more entry. Disaggregated nothing was
released, so nothing wakes; `offload` (None, "moments" or "all") is decided at start-up (the memory plan,
`dsrl.zero.memory`). Every rank measures what the servers on its GPU released, and a wake its GPU has no room for
stops the run with the numbers, before the server is asked (SGLang dies of a wake that runs out of memory).
"""

import logging
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

from dsrl.collectives import agreed
from dsrl.config import Config
from dsrl.metrics import Timer
from dsrl.plan import Plan
from dsrl.serving.client import RolloutClient, ServerError
from dsrl.zero.engine import free_cached_memory, offload_states, reload_states
from dsrl.zero.memory import GB, PEAK_SLACK, MemoryPlan, replacement_fits, replacement_room, server_weight_bytes

log = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache")


class ServerMemory:
    """(rank 0) The rollout servers as a tenant; a retried update wakes only what is still asleep (SGLang refuses to
    resume memory that is not released)."""

    def __init__(self, client: RolloutClient):
        self.client, self.released = client, {}

    def release(self, tags: tuple[str, ...]) -> None:
        if self.client.live_urls():  # (none: every one died, and the run stops for want of one)
            self.client.call_all("/release_memory_occupation", {"tags": list(tags)})
        self.released = {url: set(tags) for url in self.client.live_urls()}

    def put_to_sleep(self, url: str, tags: tuple[str, ...]) -> None:
        """A server about to join releases `tags` as the others did (called on a replacement's own thread: the
        fleet's `prepare_join`); `joined` records it once it is a member."""
        self.client.run(self.client.request(url, "/release_memory_occupation", {"tags": list(tags)}))

    def resume(self, tag: str) -> None:
        asleep = [url for url in self.client.live_urls() if tag in self.released.get(url, ())]
        if asleep:
            self.client.run(self.client.all_servers("/resume_memory_occupation", {"tags": [tag]}, urls=asleep))
            for url in asleep:
                self.released[url].discard(tag)


def kv_tokens(client: RolloutClient) -> int:
    """The servers' KV cache in tokens, as SGLang's /server_info says it (0: not said, e.g. an SGLang before 0.5)."""
    try:
        info = client.run(client.request(client.live_urls()[0], "/server_info", method="GET"))
    except ServerError:
        return 0
    return int(info.get("max_total_num_tokens", 0)) if isinstance(info, dict) else 0


class GpuLending:
    def __init__(
        self, cfg: Config, client: RolloutClient, trainers: list, run: Plan, memory: MemoryPlan | None = None,
        tenants=(), fleet=None,
    ):  # fmt: skip
        """`trainers`: the engines with states (actor, critic); `run`: the run's plan (colocated, on CUDA); `memory`:
        the memory plan's decisions; `tenants` (rank 0): the reward model's and the teacher's servers; `fleet` (rank
        0): the rollout servers' (a replacement or a new server joins asleep, as the others are)."""
        memory = memory or MemoryPlan()
        self.trainers, self.offload, self.moments_share = trainers, memory.offload, memory.share
        self.colocated = run.colocated
        self.ahead = self.colocated and cfg.rollout.max_staleness > 0
        """One-step-off colocated: the servers generate the next batch beside the last optimizer step."""
        adapter = cfg.model.lora_rank > 0 and cfg.sync.lora == "adapter"
        self.sleep_tags = MEMORY_TAGS if not adapter and not self.ahead else ("kv_cache",)
        """What the servers release while the trainers train; serving an adapter (whose base is sent once: SGLang drops
        released weights' contents), or generating ahead (with the weights just trained on), they keep their weights."""
        self.memory = ServerMemory(client)
        self.servers = [self.memory, *tenants] if dist.get_rank() == 0 else []
        """The tenants, in the order they go to sleep (they wake the other way round)."""
        self.fleet = fleet if self.colocated and dist.get_rank() == 0 else None
        self.startup_timeout_s = cfg.rollout.startup_timeout_s
        self.measured = self.colocated and run.cuda
        """Colocated on GPUs: every rank measures what the servers on its GPU release, and checks a wake has room."""
        self.weight_bytes = server_weight_bytes(cfg, trainers[0].module) if self.measured else 0.0
        self.total = torch.cuda.mem_get_info()[1] if self.measured else 0
        self.share = cfg.rollout.mem_fraction_static * self.total
        self.peak = PEAK_SLACK * memory.peak
        """What a GPU holds at the update's peak, the largest of every rank's and step's: measured at each update's end
        (the allocator keeps its blocks until `to_servers`), the plan's estimate until then (`measured_peak`)."""
        self.measured_peak = False
        self.kv_tokens = 0
        """(rank 0) The servers' KV cache in tokens: a replacement beside the trainers gets no more."""
        if self.fleet is not None:
            self.fleet.prepare_join = lambda url: self.memory.put_to_sleep(url, self.sleep_tags)
            if self.measured:
                self.kv_tokens = kv_tokens(client)
                self.size_replacements()
        self.asleep = 0.0
        """Bytes the servers released on this rank's GPU at the last `to_trainers`."""
        self.sleeping: set[str] = set()
        """The tags the servers released and have not taken back (the same on every rank)."""

    def to_trainers(self) -> None:
        """Colocated, once every rank has its samples: the servers give their memory to the trainers. A replacement
        still starting beside them has its KV cache capped at the room their update leaves (`size_replacements`);
        one started without (too little room) holds what it finds free: the trainers wait until it released it."""
        if self.fleet is not None and self.fleet.unsized:
            log.warning("waiting for %d replacement rollout server(s) to start: colocated, with too little room beside "
                        "the update's peak, each must release its memory before the trainers take the GPU",
                        len(self.fleet.unsized))  # fmt: skip
            self.fleet.await_replacements(self.startup_timeout_s)
        between = self.measured and dist.get_world_size() > 1  # rank 0 releases every GPU's servers, between barriers
        before = torch.cuda.mem_get_info()[0] if self.measured else 0.0
        if between:
            dist.barrier()
        for tenant in self.servers:
            tenant.release(self.sleep_tags)
        if between:
            dist.barrier()
        self.asleep = torch.cuda.mem_get_info()[0] - before if self.measured else 0.0
        self.sleeping = set(self.sleep_tags)
        for engine in self.trainers if self.offload else []:  # (where they were offloaded)
            reload_states(engine)

    def for_recovery(self) -> None:
        """Mid-rollout, before a lone server's replacement gets its weights (`WeightSync.recover`): the trainers' states
        that left come back, as in `to_trainers` (the servers hold nothing: the dead one's memory is free, the
        replacement's released), so that the update finds them where it expects them."""
        for engine in self.trainers if self.offload else []:
            reload_states(engine)

    def check_room(self, tag: str) -> None:
        """Before the servers take `tag` back: every rank's GPU has room for what they released there, else the run
        stops with the numbers (SGLang's scheduler dies of a wake that runs out of memory, and takes its server)."""
        if tag not in self.sleeping:  # (the same on every rank: `agreed` below is a collective)
            return
        self.sleeping.discard(tag)
        if not self.measured:
            return
        weights = self.weight_bytes if "weights" in self.sleep_tags else 0.0
        need = weights if tag == "weights" else max(0.0, self.asleep - weights)
        if torch.cuda.mem_get_info()[0] < need:
            free_cached_memory()
        free, held = torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated()
        if free < need and self.offload == "moments" and self.moments_share < 1:  # the plan's share left too little
            log.warning("waking the rollout servers' %s needs %.1f GB and %.1f GB are free: the rest of Adam's moments "
                        "leave the GPU too, from now on", tag, need / GB, free / GB)  # fmt: skip
            self.moments_share = 1.0
            self.offload_trainers(params=False)
            free, held = torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated()
        with agreed(f"waking the rollout servers' {tag}", (MemoryError,)):
            if free < need:
                raise MemoryError(
                    f"waking the rollout servers' {tag} needs {need / GB:.1f} GB on GPU {torch.cuda.current_device()} "
                    f"(what they released there), and {free / GB:.1f} GB are free: this trainer rank holds "
                    f"{held / GB:.1f} GB (the memory plan at start-up gives its sums). Lower "
                    "--rollout.mem_fraction_static or --trainer.max_tokens_per_micro_batch, or let the trainers' "
                    "states leave the GPU (--trainer.offload_states)"
                )

    def wake_kv_cache(self) -> None:
        free_cached_memory()
        with agreed("waking the servers to generate ahead", (ServerError,)):
            self.wake("kv_cache")

    def size_replacements(self) -> None:
        """(rank 0) A dead server's replacement starts beside the trainers, its KV cache capped at the room their
        peak leaves (`replacement_room`; SGLang sizes it from the memory free at its start, which the trainers
        change); where that is less than half the others', it starts as they did and the trainers wait for it."""
        cell = (self.share - self.weight_bytes) / max(self.kv_tokens, 1)  # (a token's KV bytes, or a little more)
        tokens = min(self.kv_tokens, int(replacement_room(self.total, self.peak, self.weight_bytes) / cell))
        beside = self.kv_tokens > 0 and replacement_fits(tokens, self.kv_tokens)
        self.fleet.replacement_args = {"mem_fraction_static": 0.95, "max_total_tokens": tokens} if beside else None

    def measure_peak(self) -> None:
        """At the update's end, before anything leaves: what each GPU holds (the allocator's blocks), the largest."""
        held = torch.tensor([float(torch.cuda.memory_reserved())], device="cuda")
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        self.peak = max(held.item(), self.peak if self.measured_peak else 0.0)  # (the largest since the first)
        self.measured_peak = True
        if self.fleet is not None:
            self.size_replacements()

    def for_update(self, timer: Timer) -> None:
        if self.measured and self.sleeping:  # (after an update: the servers slept for it)
            self.measure_peak()
        if self.offload:
            with timer("offload"):
                self.offload_trainers(params=False)
        with timer("wake"):
            self.wake("weights")

    def to_servers(self, timer: Timer) -> None:
        if self.colocated:
            with timer("offload"):
                if self.offload == "all":
                    self.offload_trainers(params=True)
                else:
                    free_cached_memory()
        with timer("wake"):
            self.wake("kv_cache")

    def wake(self, tag: str) -> None:
        """The servers that released `tag` take it back, the last to sleep first, once there is room (`check_room`)."""
        self.check_room(tag)
        for tenant in reversed(self.servers):
            tenant.resume(tag)

    def fleet_changed(self, urls: list[str], joined: list[str]) -> None:
        """Colocated, who sleeps now: the members that did, and those that joined (asleep: `prepare_join`)."""
        if self.colocated:
            members = {url: tags for url, tags in self.memory.released.items() if url in urls}
            self.memory.released = members | {url: set(self.sleep_tags) for url in joined}

    def offload_trainers(self, params: bool) -> None:  # (optimizer states; with `params` the parameters too)
        for engine in self.trainers:
            offload_states(engine, self.offload, params, self.moments_share)

    @contextmanager
    def trainers_on_gpu(self, resync: Callable[[], object] | None):
        """The trainers' states on the GPU for the block (a checkpoint, the export read them). Where they left it for
        the servers, the servers give the GPU back first, as for an update (the states did not fit beside them: a 7B
        run with its moments on the host died of the reload at its end), unless they already did; `resync` sends them
        their weights again after (None: nothing follows, the run ends)."""
        if not self.offload:
            yield
            return
        if not self.sleeping:
            self.to_trainers()
        yield
        if resync is not None:
            resync()  # (a weight update: the states leave again, the servers wake)
