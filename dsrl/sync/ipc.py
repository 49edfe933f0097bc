"""CUDA IPC transport, for servers colocated on the trainer's GPUs.

Every trainer rank gathers each bucket straight into a flat buffer on its own GPU
(`FlatGatherer(to_all=True)`: one all-gather per parameter, written in place) and hands the
server rank on that GPU a CUDA IPC handle to it (`/update_weights_from_tensor`,
`flattened_bucket`, one entry per tensor-parallel rank). Only handles cross the wire; the server
copies the bytes GPU-to-GPU. The next bucket is gathered while the server loads the current one.
With one trainer rank nothing is gathered: the whole model goes as one bucket, a view of
DeepSpeed's flat parameter buffer.
"""

import asyncio
import base64
import io
import logging
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.distributed as dist

from dsrl.config import SyncConfig
from dsrl.metrics import Timer
from dsrl.serving.client import RolloutClient
from dsrl.sync.base import Transport
from dsrl.zero.buckets import FlatBucket, FlatGatherer
from dsrl.zero.lora import adapter_config, gathered_adapter

log = logging.getLogger(__name__)


def serialize(obj) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True): ForkingPickler + base64."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


class IpcTransport(Transport):
    def __init__(self, cfg: SyncConfig, client: RolloutClient, root: Path, tp_size: int):
        super().__init__(cfg, client, root)
        self.tp_size = tp_size
        self.gatherer: FlatGatherer | None = None
        self.numbers: list[int] | None = None
        """Each server's number, in the client's order (None: 0, 1, ...): server n sits on the GPUs from n x tp."""
        # SGLang's unpickler only accepts its own metadata class, and CUDA handles must carry the
        # device UUID (its patched reductions) so the server finds the right GPU.
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        monkey_patch_torch_reductions()
        self.metadata_cls = FlattenedTensorMetadata

    def _handle(self, bucket: FlatBucket) -> str:
        metadata, offset = [], 0
        for name, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes):
            dtype = getattr(torch, dtype)
            n = torch.Size(shape).numel() * dtype.itemsize
            metadata.append(self.metadata_cls(name, torch.Size(shape), dtype, offset, offset + n, n))
            offset += n
        return serialize({"flattened_tensor": bucket.flat, "metadata": metadata})

    def _handles(self, bucket: FlatBucket) -> list[str | None] | None:
        """Every rank's handle to its copy of `bucket`, on rank 0 in rank order (None elsewhere). A rank whose GPU
        has no server (it died; its replacement is starting) makes none: torch keeps a block whose handle was made
        until a receiver lets it go, and with no receiver that was a whole copy of the weights a sync, for good."""
        torch.cuda.current_stream().synchronize()  # the server reads it from another process
        numbers = self.numbers if self.numbers is not None else range(len(self.client.urls))
        served = dist.get_rank() // self.tp_size in numbers
        handle = self._handle(bucket) if served else None
        if dist.get_world_size() == 1:
            return [handle]
        handles = [None] * dist.get_world_size() if self.rank0 else None
        dist.gather_object(handle, handles, dst=0)
        return handles

    def send(self, module: torch.nn.Module, weight_version: int, flush_cache: bool) -> int:
        world = dist.get_world_size()
        # With one rank the buckets are views of the parameters' own memory (nothing is allocated), and
        # each bucket costs SGLang a handle opening and a load: one bucket is fastest (3B on an H200: 22 ms
        # whole vs 39 ms in 1 GB buckets).
        bucket_bytes = self.cfg.bucket_bytes if world > 1 else 1 << 62
        if self.gatherer is None or self.gatherer.bucket_bytes != bucket_bytes:
            self.gatherer = FlatGatherer(module, bucket_bytes, to_all=True, merge=self.merge, fp8=self.fp8)
        sent, pending, clock = 0, None, Timer()
        for bucket in clock.each(self.gatherer, "gather"):
            with clock("handles"):
                handles = self._handles(bucket)
            with clock("server_load"):
                self._wait_loaded(pending)  # bucket i-1; its buffer is gathered into two buckets later
            if self.rank0:
                body = {
                    "load_format": "flattened_bucket",
                    "flush_cache": flush_cache and bucket.last,
                    "weight_version": str(weight_version) if bucket.last else None,
                }
                pending = self._post("/update_weights_from_tensor", handles, body)
            sent += bucket.flat.numel()
        with clock("server_load"):
            self._wait_loaded(pending)
        self.profile = clock.seconds
        return sent if self.rank0 else 0

    def load_adapter(self, module: torch.nn.Module, name: str) -> int:
        """The LoRA adapter as one flat bucket on each rank's GPU, its CUDA IPC handle posted to the servers
        (/load_lora_adapter_from_tensors): nothing touches the disk or the host."""
        with gathered_adapter(module) as state:
            names = list(state)
            tensors = [state[n].detach().contiguous() for n in names]
            flat = torch.cat([t.view(-1).view(torch.uint8) for t in tensors])
            dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
            bucket = FlatBucket(names, dtypes, [list(t.shape) for t in tensors], flat, last=True)
            handles = self._handles(bucket)
            pending = None
            if self.rank0:
                body = {"lora_name": name, "config_dict": adapter_config(module), "load_format": "flattened_bucket"}
                pending = self._post("/load_lora_adapter_from_tensors", handles, body)
            self._wait_loaded(pending)  # the servers have copied it before the buffer goes
        return flat.numel() if self.rank0 else 0

    def release(self) -> None:
        """Colocated: give the flat buffers back before the server's KV cache returns."""
        if self.gatherer is not None:
            self.gatherer.release()
        torch.cuda.ipc_collect()  # buffers the server has let go of

    def reset(self, numbers: list[int]) -> None:
        self.numbers = numbers

    def _post(self, path: str, handles: list[str], body: dict) -> Future:
        """`body` to every server with its own handles: server s covers GPUs [s * tp, (s + 1) * tp), and
        trainer rank g sits on GPU g (a replacement keeps the number, and the GPUs, of the server it replaced)."""
        tp, urls = self.tp_size, self.client.urls
        numbers = self.numbers or range(len(urls))
        bodies = [{**body, "serialized_named_tensors": handles[s * tp : (s + 1) * tp]} for s in numbers]

        async def post_all():
            calls = [self.client.request(url, path, b, timeout_s=self.cfg.timeout_s) for url, b in zip(urls, bodies)]
            return await asyncio.gather(*calls)

        return self.client.submit(post_all())

    def _wait_loaded(self, pending: Future | None) -> None:
        """Every rank waits until the servers have loaded the last posted bucket (rank 0 holds the reply)."""
        try:
            if pending is not None:
                pending.result(self.cfg.timeout_s)
        finally:
            if dist.get_world_size() > 1:
                dist.barrier()  # the other ranks must not be left waiting when rank 0 fails
