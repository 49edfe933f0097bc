"""Buckets of gathered ZeRO-3 parameters, planned by bytes.

Every trainer rank must iterate `gathered_buckets` in step: each bucket is one
`deepspeed.zero.GatheredParameters` all-gather. The yielded tensors are full (unpartitioned) and
valid only until the next bucket is asked for, so a consumer that keeps them copies them out first.
"""

from collections.abc import Iterator

import deepspeed
import torch

NamedTensors = list[tuple[str, torch.Tensor]]


def param_bytes(param: torch.nn.Parameter) -> int:
    shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 keeps the full shape in ds_shape
    return torch.Size(shape).numel() * param.element_size()


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


def gathered_buckets(module: torch.nn.Module, bucket_bytes: int) -> Iterator[NamedTensors]:
    """Yield [(name, full tensor), ...] per bucket, in `named_parameters()` order."""
    named = list(module.named_parameters())
    for bucket in plan_buckets(named, bucket_bytes):
        params = [named[i][1] for i in bucket]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield [(named[i][0], named[i][1].data) for i in bucket]
