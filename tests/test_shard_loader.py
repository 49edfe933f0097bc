"""The shard transport's weight loader as SGLang runs it: into a model of its own layout (fused, loaded by
`load_weights`), from the weights it holds in the trainer's. Two gloo processes: a bare trainer rank that
broadcasts as `dsrl.sync.shards` does, and the loader. (The embedded engine's in-place path: tests/test_sync.py.)"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsrl.serving.servers import free_port


class FusedModel(torch.nn.Module):
    """SGLang's way: `q` and `k` loaded into one fused parameter, so no trainer tensor is a parameter here."""

    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(2, 6))

    def load_weights(self, named):
        for name, tensor in named:
            self.qk.data[0 if name == "q" else 1].copy_(tensor)


def words(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.int16)


def run(rank: int, port: int, out: str) -> None:
    from dsrl.collectives import init_weight_update_group
    from dsrl.serving import shard_loader

    init_weight_update_group("127.0.0.1", port, rank, 2, "g0", "gloo", 60)
    q, k = torch.arange(6.0), -torch.arange(6.0)
    tensors = [["q", "float32", [6], 6], ["k", "float32", [6], 6]]
    header = {"groups": ["g0"], "tensors": tensors, "keep": True, "timeout_s": 60, "first": True}
    q2, k2 = q.clone(), k.clone()
    q2[2], k2[5] = 7.5, 0.25
    steps = [(False, False, q, k), (True, True, q2, k2), (True, True, q2, k2)]  # (delta, report, new q, new k)
    result, last = {}, None
    for i, (delta, report, new_q, new_k) in enumerate(steps):
        head = header | {"delta": delta, "report": report}
        if rank == 1:
            if i == 2:  # the weights held drift behind the trainer's back: the delta's checksum must fail
                shard_loader.held["k"][0] = 99.0
            model = result.setdefault("model", FusedModel())
            named = [("h", torch.frombuffer(bytearray(json.dumps(head).encode()), dtype=torch.uint8))]
            shard_loader.load(model, named)
            result[f"qk_{i}"] = model.qk.tolist()
            continue
        group = next(g for g, n in dist.distributed_c10d._world.pg_names.items() if n == "g0")
        now = torch.cat([words(new_q), words(new_k)])
        if not delta:
            dist.broadcast(now.view(torch.uint8), group=group, group_src=0)
            last = now
            continue
        where = (now != last).nonzero().view(-1)
        total = shard_loader.checksum([words(new_q), words(new_k)])
        count = torch.tensor([where.numel(), total - (1 << 64) if total >> 63 else total])
        dist.broadcast(count.view(torch.uint8), group=group, group_src=0)
        if where.numel():
            payload = torch.cat([where.int().view(torch.int16), now[where]])
            dist.broadcast(payload.view(torch.uint8), group=group, group_src=0)
        last = now
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(gathered, torch.zeros(1, dtype=torch.int64), group=group)
        result[f"mismatched_{i}"] = int(gathered[1])
    result.pop("model", None)
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def test_the_loader_applies_a_delta_to_the_weights_it_holds_and_loads_them(tmp_path):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    mp.start_processes(run, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    server = json.loads((tmp_path / "1.json").read_text())
    trainer = json.loads((tmp_path / "0.json").read_text())
    q, k = list(range(6)), [-x for x in range(6)]
    assert server["qk_0"] == [q, k]  # the full bucket, through load_weights
    q[2], k[5] = 7.5, 0.25
    assert server["qk_1"] == [q, k] and trainer["mismatched_1"] == 0  # two words changed
    assert trainer["mismatched_2"] == 1  # the drifted copy fails the checksum (the trainer then sends in full)
