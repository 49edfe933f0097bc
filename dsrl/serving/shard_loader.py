"""The servers' half of the shard transport (`dsrl.sync.shards`): a custom weight loader (SGLang's stock hook,
`--custom-weight-loader dsrl.serving.shard_loader.load`, and the embedded engine's) that takes one bucket from every
trainer rank at once, each from the rank's own weight-update group: /update_weights_from_tensor with that load_format,
its one named tensor the bucket's JSON header (`encode_header`: tensors as name, dtype, shape and elements per rank;
groups in rank order; delta or not). Each rank broadcasts its 2-byte words of each tensor, back to back: in full, or
as [changed words, checksum] (int64) and the changed words' positions (int32) and values (int16), or [-1, checksum]
and every word where a third or more changed. After a delta the bucket's `checksum` must equal the sum of the ranks',
which holds only if this server held what the trainer last sent; a mismatch is counted, not raised (SGLang's
scheduler dies of a loader's exception), and a delta's last bucket reports the count to trainer rank 0 (an all-gather
in its group), which then sends everything in full.

The embedded engine's model has the trainer's layout: the words land in its parameters in place (through a copy where
its dtype is another). SGLang fuses and shards them: the loader keeps the weights as the trainer names them (`held`,
one more copy of the model on the GPU, with --sync.delta only) and loads each bucket from it (`model.load_weights`).
"""

import base64
import json
import pickle
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from dsrl.moe import split_experts

LOADER = f"{__name__}.load"
held: dict[str, torch.Tensor] = {}
"""(SGLang) each tensor as last loaded, in the trainer's names and layout: a delta applies to it."""
mismatched = 0
"""Buckets whose checksum failed since the last delta's report."""
abandoned: set[str] = set()
"""Groups the trainer gave up while a load may wait in them (the embedded engine's /destroy_weights_update_group)."""


def encode_header(header: dict) -> str:
    """The request's serialized named tensors for one TP rank: the header as a uint8 tensor, pickled with its bytes
    (not as SGLang's CUDA IPC handles: the server may be on another machine), base64."""
    tensor = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    return base64.b64encode(pickle.dumps([("dsrl_shard_header", tensor)])).decode()


def checksum(words: list[torch.Tensor]) -> int:
    """One number for the int16 words of a bucket's tensors (or of one rank's part of each): each tensor's sum times
    its place in the bucket, summed, mod 2**64. The ranks' checksums of their parts add up to the bucket's. The sums
    are float64's of chunks, exact (every partial sum stays under 2**53), so in any order: torch's int16 sum into
    int64 took 4.5x as long on CPU (2.4 s for 247M words, against 0.4 s)."""
    zero = torch.zeros((), dtype=torch.float64, device=words[0].device)
    sums = [torch.stack([c.double().sum() for c in w.split(1 << 20)]).sum() if w.numel() else zero for w in words]
    return sum((j + 1) * int(s) for j, s in enumerate(torch.stack(sums).tolist())) % (1 << 64)


def spans(tensors: list, rank: int) -> list[tuple[int, int]]:
    """(first word, words) of `rank`'s part of each of the header's tensors: elements [rank x part, (rank + 1) x part)
    of the flattened tensor, the last rank's cut at its end (ZeRO-3 pads it)."""
    out = []
    for _, dtype, shape, part in tensors:
        size, numel = getattr(torch, dtype).itemsize // 2, torch.Size(shape).numel()
        out.append((rank * part * size, max(0, min(part, numel - rank * part)) * size))
    return out


def load(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: one bucket from every trainer rank (see the module's docstring)."""
    header = json.loads(bytes(named_tensors[0][1].cpu().tolist()))
    by_name = {name: group for group, name in _world.pg_names.items()}  # (torch's registry of named groups)
    if missing := [name for name in header["groups"] if name not in by_name]:
        raise RuntimeError(f"no weight-update group {', '.join(missing)}: call /init_weights_update_group first")
    device, hf = next(model.parameters()).device, not hasattr(model, "load_weights")  # hf: the embedded engine
    params = getattr(model, "dsrl_params", {})  # (the embedded engine's names: a VL model's saved ones too)
    param_of = lambda name: params[name] if name in params else model.get_parameter(name)  # noqa: E731
    tensors, loads = [], []  # the words land in `tensors`; `loads` go into the model after
    for name, dtype, shape, _ in header["tensors"]:
        param = param_of(name).data if hf else None
        if param is not None and param.dtype == getattr(torch, dtype) and list(param.shape) == shape:
            tensors.append(param)
            continue
        if (t := held.get(name)) is None:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            if header["keep"]:
                held[name] = t
        tensors.append(t)
        loads.append((name, t))
    words, due = [t.view(-1).view(torch.int16) for t in tensors], time.monotonic() + header["timeout_s"]
    with torch.no_grad():
        _receive_bucket(words, header, [by_name[name] for name in header["groups"]], due)
        if not hf:
            model.load_weights(list(split_experts(loads)))
        for name, t in loads if hf else []:
            param_of(name).copy_(t)
    if header["report"]:
        _report(by_name[header["groups"][0]], device, header, due)


def _receive_bucket(words: list[torch.Tensor], header: dict, groups: list, due: float) -> None:
    """Every rank's words of the bucket, received at once, each written to its place; after a delta, the bucket's
    checksum compared with the ranks'."""
    global mismatched
    if header["delta"] and header["first"]:
        mismatched = 0  # (left from a delta that failed before its report)
    device, parts = words[0].device, [spans(header["tensors"], r) for r in range(len(groups))]
    heads = [torch.tensor([-1, 0], device=device) for _ in groups]
    if header["delta"]:
        _wait([_receive(h, g) for h, g in zip(heads, groups)], header, due)
    counts = [int(h[0]) for h in heads]
    sizes = [3 * k if k >= 0 else sum(n for _, n in part) for k, part in zip(counts, parts)]  # (-1: all its words)
    payloads = [torch.empty(size, dtype=torch.int16, device=device) for size in sizes]
    _wait([_receive(p, g) for p, g in zip(payloads, groups) if p.numel()], header, due)
    for k, payload, part in zip(counts, payloads, parts):
        if k < 0:  # every word, back to back
            offset = 0
            for w, (start, n) in zip(words, part):
                w[start : start + n].copy_(payload[offset : offset + n])
                offset += n
            continue
        positions, values = payload[: 2 * k].view(torch.int32).long(), payload[2 * k :]
        starts = torch.tensor([0] + [n for _, n in part], device=device).cumsum(0)
        bounds = torch.searchsorted(positions, starts).tolist()  # the changed words of each tensor, in order
        for w, (start, _), offset, a, b in zip(words, part, starts.tolist(), bounds, bounds[1:]):
            w[start - offset + positions[a:b]] = values[a:b]
    if header["delta"] and checksum(words) != sum(int(h[1]) for h in heads) % (1 << 64):
        mismatched += 1


def _report(group, device: torch.device, header: dict, due: float) -> None:
    """The buckets whose checksum failed since the last report, all-gathered in trainer rank 0's group."""
    global mismatched
    count = torch.tensor([mismatched], dtype=torch.int64, device=device)
    _wait([dist.all_gather([torch.zeros_like(count) for _ in range(group.size())], count, group=group, async_op=True)],
          header, due)  # fmt: skip
    mismatched = 0


def _receive(tensor: torch.Tensor, group) -> dist.Work:
    """Trainer rank `group`'s broadcast into `tensor`, as bytes (neither gloo nor NCCL has int16)."""
    return dist.broadcast(tensor.view(torch.uint8), group=group, group_src=0, async_op=True)


def _wait(works: list, header: dict, due: float) -> None:
    """Wait for the trainer's broadcasts, giving up when it destroys a group or the sync's timeout passes."""
    for work in works:
        while not work.is_completed():
            if abandoned & set(header["groups"]):
                raise RuntimeError("the trainer destroyed the weight-update groups while this update waited in them")
            if time.monotonic() > due:
                raise TimeoutError(f"no bucket from the trainer ranks within {header['timeout_s']:.0f}s")
            time.sleep(0.0005)
        work.wait()
