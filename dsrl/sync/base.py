"""The checkpoint engine: one small interface, one transport per file, and the one place an update happens.

A weight update is send -> flush -> version check, tagged with a weight version
(`sync_weights`), with pause/continue around it when requests may be in flight. Every trainer
rank holds the transport and runs `update_weights`, because the parameters are gathered from
every rank's ZeRO-3 partitions; only rank 0 has a client and talks to the servers.
"""

import logging
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsrl.config import SyncConfig
from dsrl.serving.client import RolloutClient, ServerError
from dsrl.zero.buckets import gathered_buckets

log = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """A weight update that did not complete, or left a server with other weights than the trainer's."""


class CheckpointEngine(ABC):
    """Moves the trainer's weights into every rollout server. `client` is None except on rank 0."""

    def __init__(self, cfg: SyncConfig, client: RolloutClient | None):
        self.cfg, self.client = cfg, client
        self.profile: dict[str, float] = {}
        """Seconds spent per part of the last update (rank 0), for the sync metrics and tools/bench_sync.py."""

    @abstractmethod
    def update_weights(self, module: torch.nn.Module, weight_version: str, flush_cache: bool) -> int:
        """Send every parameter; `weight_version` goes live with the last bucket. Returns bytes sent (rank 0).

        A failure on rank 0 must still let the other ranks finish their part (collectives), then raise."""

    def release(self) -> None:  # noqa: B027 -- optional hook
        """Free what the transport keeps between updates (colocated: the server needs the memory)."""

    def reset(self) -> None:  # noqa: B027 -- optional hook
        """The fleet changed (a server restarted or was dropped): rebuild per-fleet state before the next update."""


class Clock:
    """Seconds per named part of an update: `with clock("load"):` or `for x in clock.timed(it, "gather")`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def timed(self, items, name: str):
        """Iterate `items`, counting the time spent producing each one under `name`."""
        it = iter(items)
        while True:
            with self(name):
                item = next(it, _END)
            if item is _END:
                return
            yield item


_END = object()


def make_checkpoint_engine(
    cfg: SyncConfig, client: RolloutClient | None, run_dir: Path, backend: str, tp_size: int = 1
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


@dataclass
class SyncStats:
    bytes: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase on rank 0: pause, send (gather + transfer + load), resume, version check."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def keeps_requests(pause: str | None) -> bool:
    """Whether requests stay queued on the servers through an update paused this way: then SGLang
    refuses /flush_cache (it needs an idle server), so neither the update nor the probe may flush."""
    return pause in ("in_place", "retract")


def sync_weights(
    module: torch.nn.Module, engine: CheckpointEngine, weight_version: str, pause: str | None = None
) -> SyncStats | None:
    """Push the current weights to every server as `weight_version`; the last bucket flushes the KV cache.

    `pause` ("abort", "in_place", "retract") pauses the servers around the update for callers that
    may have requests in flight. The trainer drains its own requests first (`RolloutManager`) and
    passes None, which saves a round trip per server per call, or, with `rollout.interrupt pause`,
    passes `rollout.pause_mode` and its requests stay on the servers. An in_place or retract pause
    keeps requests on the server, and SGLang refuses a flush it cannot run, so the KV cache is then kept.
    Call on every trainer rank; returns the stats on rank 0, None elsewhere.
    """
    client = engine.client
    flush = not keeps_requests(pause)
    if client is None:
        engine.update_weights(module, weight_version, flush_cache=flush)
        return None
    phases, start = {}, time.perf_counter()
    if pause is not None:
        client.call_all("/pause_generation", {"mode": pause})
        if flush:  # before the new weights arrive: nothing may be computed from both
            client.call_all("/flush_cache")
        phases["pause"] = time.perf_counter() - start
    mark = time.perf_counter()
    sent = engine.update_weights(module, weight_version, flush_cache=flush)
    phases["send"] = time.perf_counter() - mark
    if pause is not None:
        mark = time.perf_counter()
        client.call_all("/continue_generation", {})
        phases["resume"] = time.perf_counter() - mark
    mark = time.perf_counter()
    versions = client.weight_versions()
    phases["version_check"] = time.perf_counter() - mark
    seconds = time.perf_counter() - start
    stale = [f"{url} has {v!r}" for url, v in zip(client.live_urls(), versions) if v != weight_version]
    if stale:
        raise SyncError(f"after the update to weight version {weight_version!r}: {', '.join(stale)}")
    return SyncStats(sent, seconds, {**phases, **engine.profile})


def verify_weights(module: torch.nn.Module, client: RolloutClient | None, bucket_bytes: int) -> None:
    """Compare every server parameter with the trainer's gathered one; raise naming the first that differs.

    Uses /get_weights_by_name (the embedded engine; SGLang implements it for Llama-family models).
    Call on every rank; `client` is None except on rank 0. Rank 0 raises only once every bucket has
    been gathered: the other ranks are in those all-gathers too.
    """
    problem: Exception | None = None
    for bucket in gathered_buckets(module, bucket_bytes):
        for name, tensor in bucket if client is not None and problem is None else []:
            try:
                _check_parameter(client, name, tensor.detach().float().cpu())
            except (SyncError, ServerError) as e:
                problem = e
    if problem is not None:
        raise problem


def _check_parameter(client: RolloutClient, name: str, want: torch.Tensor) -> None:
    rows = want.shape[0] if want.dim() else 1
    replies = client.call_all("/get_weights_by_name", {"name": name, "truncate_size": rows})
    for url, got in zip(client.live_urls(), replies):
        got = torch.tensor(got, dtype=torch.float32)
        if got.shape != want.shape:
            raise SyncError(f"{url}: parameter {name!r} has shape {list(got.shape)}, trainer {list(want.shape)}")
        if not torch.equal(got, want):
            diff = (got - want).abs().max().item()
            raise SyncError(f"{url}: parameter {name!r} differs from the trainer's (max |diff| {diff:.3g})")


def probe_ids(vocab_size: int, sequences: int = 4, length: int = 32, seed: int = 1234) -> list[list[int]]:
    """Fixed pseudo-random token ids: the same probe for every check of a run."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (sequences, length), generator=gen).tolist()


@torch.no_grad()
def probe_reference(engine, vocab_size: int) -> tuple[list[list[int]], torch.Tensor]:
    """The probe token ids and the trainer's logprobs of them (call on every rank: a ZeRO-3 forward)."""
    ids = probe_ids(vocab_size)
    tokens = torch.tensor(ids, device=engine.device)
    logits = engine(input_ids=tokens).logits[:, :-1].float()
    return ids, torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0].cpu()


def verify_probe(
    client: RolloutClient, ids: list[list[int]], reference: torch.Tensor, tolerance: float, flush: bool = True
) -> float:
    """Compare each server's logprobs of the probe tokens with the trainer's; return the worst mean |diff|.

    Works for any model (SGLang 0.5.17 has no /get_weights_by_name for Qwen2): prompt logprobs
    come from /generate with logprob_start_len=0, after /flush_cache. SGLang matches no cached
    prefix past logprob_start_len anyway (`Req._compute_max_prefix_len`), so `flush` False (with
    requests running, which SGLang's flush refuses) checks the same. The servers must hold their KV
    cache: SGLang dies generating while it is released.
    """
    return client.run(probe_servers(client, ids, reference, tolerance, flush))


async def probe_servers(
    client: RolloutClient, ids: list[list[int]], reference: torch.Tensor, tolerance: float, flush: bool = True
) -> float:
    """`verify_probe` on the client's loop: the trainer may go on while it runs (`client.submit`)."""
    if flush:
        await client.all_servers("/flush_cache")
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    worst = 0.0
    urls = client.live_urls()
    replies = await client.all_servers("/generate", payload, urls=urls)  # those that answered, in order
    for url, outs in zip([u for u in urls if u not in client.down], replies):
        got = torch.tensor([[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]] for o in outs])
        diff = (got - reference).abs()
        if diff.mean() > tolerance:
            raise SyncError(
                f"{url}: logprobs of the probe tokens differ from the trainer's by {diff.mean():.3g} on average "
                f"(max {diff.max():.3g}, --sync.probe_tolerance {tolerance}): the server holds other weights"
            )
        worst = max(worst, diff.mean().item())
    return worst
