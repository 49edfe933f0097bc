"""CUDA IPC transport, for servers colocated on the trainer's GPUs.

Each trainer rank flattens its gathered copy of a bucket on its own GPU and hands the server
rank on that GPU a CUDA IPC handle to it (`/update_weights_from_tensor`, `flattened_bucket`,
one entry per tensor-parallel rank). Only handles cross the wire; the server copies the bytes
GPU-to-GPU. The next bucket is gathered and flattened while the server loads the current one.
"""

import base64
import io
import logging
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist

from dsrl.config import SyncConfig
from dsrl.serving.client import RolloutClient
from dsrl.sync.base import CheckpointEngine
from dsrl.zero.buckets import gathered_buckets, plan_buckets

log = logging.getLogger(__name__)


def serialize(obj) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True): ForkingPickler + base64."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


class IpcEngine(CheckpointEngine):
    def __init__(self, cfg: SyncConfig, client: RolloutClient | None, tp_size: int):
        super().__init__(cfg, client)
        self.tp_size = tp_size
        self.buffers: dict[int, torch.Tensor] = {}
        # SGLang's unpickler only accepts its own metadata class, and CUDA handles must carry the
        # device UUID (its patched reductions) so the server finds the right GPU.
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        monkey_patch_torch_reductions()
        self.metadata_cls = FlattenedTensorMetadata

    def _flatten(self, slot: int, bucket) -> tuple[torch.Tensor, list]:
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        buf = self.buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=bucket[0][1].device)
        flat, metadata, offset = buf[:nbytes], [], 0
        for name, t in bucket:
            n = t.numel() * t.element_size()
            flat[offset : offset + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            metadata.append(self.metadata_cls(name, t.shape, t.dtype, offset, offset + n, n))
            offset += n
        return flat, metadata

    def update_weights(self, module: torch.nn.Module, weight_version: str, flush_cache: bool) -> int:
        rank, world = dist.get_rank(), dist.get_world_size()
        num_buckets = len(plan_buckets(list(module.named_parameters()), self.cfg.bucket_bytes))
        sent, pending = 0, None
        for i, bucket in enumerate(gathered_buckets(module, self.cfg.bucket_bytes)):
            flat, metadata = self._flatten(i % 2, bucket)  # slot i % 2: bucket i-1 may still be loading
            torch.cuda.current_stream().synchronize()  # the server reads it from another process
            handle = serialize({"flattened_tensor": flat, "metadata": metadata})
            handles = [None] * world if rank == 0 else None
            dist.gather_object(handle, handles, dst=0)
            if i > 0:
                self._wait_loaded(pending)
            if rank == 0:
                last = i + 1 == num_buckets
                pending = self._post(handles, weight_version if last else None, flush_cache and last)
            sent += flat.numel()
        if num_buckets:
            self._wait_loaded(pending)
        return sent if rank == 0 else 0

    def _post(self, handles: list[str], weight_version: str | None, flush_cache: bool) -> Future:
        # Server s covers GPUs [s * tp, (s + 1) * tp); trainer rank g sits on GPU g.
        async def post_all():
            import asyncio

            return await asyncio.gather(
                *(
                    self.client.request(
                        url,
                        "/update_weights_from_tensor",
                        {
                            "serialized_named_tensors": handles[s * self.tp_size : (s + 1) * self.tp_size],
                            "load_format": "flattened_bucket",
                            "flush_cache": flush_cache,
                            "weight_version": weight_version,
                        },
                        timeout_s=self.cfg.timeout_s,
                    )
                    for s, url in enumerate(self.client.urls)
                )
            )

        return self.client.submit(post_all())

    def _wait_loaded(self, pending: Future | None) -> None:
        """Every rank waits until the servers have loaded the last posted bucket (rank 0 holds the reply)."""
        try:
            if pending is not None:
                pending.result(self.cfg.timeout_s)
        finally:
            dist.barrier()  # the other ranks must not be left waiting when rank 0 fails
