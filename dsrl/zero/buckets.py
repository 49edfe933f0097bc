"""Buckets of gathered ZeRO-3 parameters, planned by bytes.

Every trainer rank must iterate `gathered_buckets` in step: each bucket is one
`deepspeed.zero.GatheredParameters` all-gather. The yielded tensors are full (unpartitioned) and
valid only until the next bucket is asked for, so a consumer that keeps them copies them out first.
"""

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist

from dsrl.fp8 import quantize_flat, quantize_named, unflatten
from dsrl.moe import expert_tensors, split_experts
from dsrl.zero.lora import ServedWeights

all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch 2.13's name, or before it (the GPU image's 2.11) the old one, which 2.13 deprecates."""

NamedTensors = list[tuple[str, torch.Tensor]]


def param_bytes(param: torch.nn.Parameter) -> int:
    return torch.Size(full_shape(param)).numel() * param.element_size()


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    return getattr(param, "ds_shape", param.shape)  # ZeRO-3 keeps the full shape in ds_shape


def local(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's piece of `param`, flat: its ZeRO-3 partition, or all of it (a replicated LoRA base, ZeRO-2
    adapters)."""
    return (param.ds_tensor if hasattr(param, "ds_tensor") else param).detach().view(-1)


def plan_buckets(named_params: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of at most `bucket_bytes`; a larger tensor gets a bucket of its own."""
    buckets, current, size = [], [], 0
    for i, (_, param) in enumerate(named_params):
        nbytes = param_bytes(param)
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def model_type(module: torch.nn.Module) -> str:
    """The Hugging Face model type of `module` (a PEFT model's base's), which names its FP8 KV-cache scales."""
    return getattr(getattr(module, "config", None), "model_type", "") or ""


def gathered_buckets(
    module: torch.nn.Module, bucket_bytes: int, merge: bool = True, fp8: bool = False
) -> Iterator[NamedTensors]:
    """Yield [(name, full tensor), ...] per bucket of the served weights (`ServedWeights`: a LoRA model's
    base, its adapters merged unless `merge` is False), in their order, fused experts one tensor each
    (`dsrl.moe.expert_tensors`); `fp8`: the linear weights in FP8, each with its scale (`dsrl.fp8.quantize_named`)."""
    served = ServedWeights(module, merge)
    named = served.named
    with served.gathered_adapters():
        for bucket in plan_buckets(named, bucket_bytes):
            params = [named[i][1] for i in bucket]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                out = []
                for name, param in (named[i] for i in bucket):
                    tensor = param.data
                    if name in served.deltas:
                        tensor = tensor.clone()
                        served.merge_into(name, tensor)
                    out.append((name, tensor))
                out = list(split_experts(out))
                yield quantize_named(out, model_type(module)) if fp8 else out


@dataclass
class FlatBucket:
    """One bucket in SGLang's flattened layout: every tensor's bytes back to back, in `names` order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    flat: torch.Tensor | None
    """uint8 tensor on rank 0; None on the other ranks."""
    last: bool


class FlatGatherer:
    """Gathers ZeRO-3 partitions bucket by bucket straight into SGLang's flat layout.

    `to_all=False` (broadcast and disk transports): onto rank 0 alone. Every other rank sends each
    of its partitions point to point and rank 0 receives each one at its final offset in the flat
    bucket (no packing or reordering copies; gloo's gather and all-gather are several times slower
    than its send/recv).

    `to_all=True` (CUDA IPC: every rank hands its own GPU's server a full copy): one all-gather per
    parameter, written in place into every rank's flat bucket.

    With one rank nothing is gathered: a bucket is a view of DeepSpeed's flat parameter buffer
    where its partitions lie back to back (always, so far), and copied otherwise. Nor is anything when every rank
    holds every parameter whole (a LoRA actor on a replicated base, `engine.replicated_base`): each rank is then
    as one rank alone.

    Either way `GatheredParameters` is not used: it allocates the full tensors on every rank each
    time, then the transport copies them once more into a flat buffer. Bucket i+1 is in flight
    while bucket i is being sent, and the three flat buffers are kept between syncs (fresh pages
    cost more than copies on small hosts; `release()` frees them, e.g. for a colocated server).

    With `fp8` each bucket is handed out with its linear weights in FP8 beside their scales (`dsrl.fp8.quantize_flat`),
    in a buffer of its own: quantized where it was gathered (the trainer's GPU), half the bytes of bf16 on the wire.
    """

    SLOTS = 3  # see __iter__ for why three flat buffers are needed

    def __init__(
        self, module: torch.nn.Module, bucket_bytes: int, to_all: bool = False, merge: bool = True, fp8: bool = False
    ):
        self.served = ServedWeights(module, merge)  # a LoRA model's base weights, adapters merged in (merge)
        self.named = self.served.named
        self.bucket_bytes, self.plan = bucket_bytes, plan_buckets(self.named, bucket_bytes)
        self.sizes = [sum(param_bytes(self.named[j][1]) for j in bucket) for bucket in self.plan]
        whole = not any(hasattr(p, "ds_tensor") for _, p in self.named)
        self.world, self.rank, self.to_all = 1 if whole else dist.get_world_size(), dist.get_rank(), to_all
        for name, p in self.named if not whole else []:
            if p.ds_tensor.ds_numel * self.world != p.ds_numel_aligned:
                raise ValueError(f"{name}: ZeRO-3 partition layout not understood (hpZ/MiCS are not supported)")
        self.buffers: dict[int, torch.Tensor] = {}
        self.unaligned: list[tuple[torch.Tensor, torch.Tensor]] = []  # (gathered with padding, its place)
        self.fp8, self.model_type = fp8, model_type(module)
        self.quantized: deque[torch.Tensor] = deque(maxlen=self.SLOTS)
        """The last FP8 buckets, kept as the gathered ones are: a server may still be reading one."""

    def release(self) -> None:
        self.buffers.clear()
        self.quantized.clear()

    def _params(self, i: int):
        """(param, offset in the flat bucket, bytes) of every parameter of bucket i."""
        dst = 0
        for j in self.plan[i]:
            p = self.named[j][1]
            full = param_bytes(p)
            yield p, dst, full
            dst += full

    def _pieces(self, i: int):
        """(param, rank, offset in the flat bucket, bytes) of every partition piece of bucket i."""
        for p, dst, full in self._params(i):
            part = local(p).numel() * p.element_size()
            for r in range(self.world):  # rank r holds bytes [r * part, (r + 1) * part); the last is padded
                n = min(part, full - r * part)
                if n > 0:
                    yield p, r, dst + r * part, n

    def _view(self, i: int) -> torch.Tensor | None:
        """With one rank, bucket i as a view of the memory its partitions already fill back to back
        (DeepSpeed keeps them in one flat buffer): sent from there, nothing is copied. None when
        they do not (another dtype, a sub-group boundary, or partitions moved separately)."""
        if self.world != 1 or any(self.named[j][0] in self.served.deltas for j in self.plan[i]):
            return None
        parts = [local(self.named[j][1]) for j in self.plan[i]]
        first = parts[0]
        storage, ptr = first.untyped_storage().data_ptr(), first.data_ptr()
        for t in parts:
            if t.data_ptr() != ptr or t.untyped_storage().data_ptr() != storage or not t.is_contiguous():
                return None
            ptr += t.numel() * t.element_size()
        view = torch.empty(0, dtype=torch.uint8, device=first.device)
        return view.set_(first.untyped_storage(), first.storage_offset() * first.element_size(), (self.sizes[i],))

    def _flat(self, i: int) -> torch.Tensor | None:
        if self.rank != 0 and not self.to_all:
            return None
        view = self._view(i)
        if view is not None:
            return view
        nbytes, device = self.sizes[i], local(self.named[self.plan[i][0]][1]).device
        buf = self.buffers.get(i % self.SLOTS)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self.buffers.pop(i % self.SLOTS, None)  # free the old one first
            buf = self.buffers[i % self.SLOTS] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def _post_transfers(self, i: int) -> list:
        """Start bucket i's transfers: all-gathers (to_all), or rank 0's receives and the others' sends."""
        flat, works = self._flat(i), []
        if self.world == 1:
            return works
        if self.to_all:
            for p, dst, full in self._params(i):
                part = local(p).view(torch.uint8)
                if part.numel() * self.world == full:
                    out = flat[dst : dst + full]
                else:  # the last rank's partition is padded: gather aside, copy the real bytes after
                    out = torch.empty(part.numel() * self.world, dtype=torch.uint8, device=flat.device)
                    self.unaligned.append((out[:full], flat[dst : dst + full]))
                works.append(all_gather(out, part, async_op=True))
            return works
        for p, r, offset, n in self._pieces(i):
            if self.rank == 0 and r != 0:
                works.append(dist.irecv(flat[offset : offset + n], src=r))
            elif self.rank == r and r != 0:
                works.append(dist.isend(local(p).view(torch.uint8)[:n], dst=0))
        return works

    def _copy_own(self, i: int) -> None:
        """Rank 0's own pieces (or everything, with one rank or parameters held whole) are copied rather than sent."""
        flat = self._flat(i)
        if flat is not None and (self.world == 1 or (self.rank == 0 and not self.to_all)):
            if self._view(i) is not None:
                return
            for p, r, offset, n in self._pieces(i):
                if r == 0:
                    flat[offset : offset + n].copy_(local(p).view(torch.uint8)[:n])

    def _finish(self, works: list, i: int) -> None:
        for work in works:
            work.wait()
        for gathered, place in self.unaligned:
            place.copy_(gathered)
        self.unaligned = []
        flat = self._flat(i)
        if flat is None or not self.served.deltas:
            return
        for j, (p, dst, full) in zip(self.plan[i], self._params(i)):
            name = self.named[j][0]
            if name in self.served.deltas:  # the gathered base weight, its adapter added in place
                self.served.merge_into(name, flat[dst : dst + full].view(p.dtype).view(full_shape(p)))

    def __iter__(self) -> Iterator[FlatBucket]:
        # Bucket i+1's transfers are posted before bucket i is handed out, and rank 0's own pieces of
        # i+1 are copied once the consumer has started sending i. At that point bucket i-1 may still
        # be on the wire (the consumer waits for it only before sending i), but i-2 is done: buffer
        # (i+1) % 3 is free.
        if not self.plan:
            return
        with self.served.gathered_adapters():
            yield from self._buckets()

    def _buckets(self) -> Iterator[FlatBucket]:
        works = self._post_transfers(0)
        self._copy_own(0)
        for i, bucket in enumerate(self.plan):
            self._finish(works, i)
            works = self._post_transfers(i + 1) if i + 1 < len(self.plan) else []
            # (as the servers load them: fused experts one tensor each, the same bytes)
            entries = [(piece, p.dtype, shape) for name, p in (self.named[j] for j in bucket)
                       for piece, shape in expert_tensors(name, full_shape(p))]  # fmt: skip
            flat = self._flat(i)
            if self.fp8 and flat is not None:
                named = [(name, t) for (name, _, _), t in zip(entries, unflatten(flat, entries))]
                entries, flat = quantize_flat(named, self.model_type)
                self.quantized.append(flat)
            yield FlatBucket(
                names=[name for name, _, _ in entries],
                dtypes=[str(dtype).removeprefix("torch.") for _, dtype, _ in entries],
                shapes=[shape for _, _, shape in entries],
                flat=flat,
                last=i + 1 == len(self.plan),
            )
            if i + 1 < len(self.plan):
                self._copy_own(i + 1)
