"""The first-sync hang of several trainer ranks, at its smallest, on 3 GPUs: two trainer ranks (GPUs 0-1) whose
default NCCL group is bound to a device, as DeepSpeed binds it with several ranks, and one receiver on GPU 2 in a
weight-update group with trainer rank 0, built as SGLang builds its side.

    python tools/gpu_split_hang.py --limit 40     # as the group was built before the fix, then as dsrl builds it

Before the fix torch built the weight-update group by ncclCommSplit of the trainers' communicator (a collective of
both trainer ranks, which only rank 0 enters): rank 0's first broadcast never returns. Prints one line per way.
"""

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsrl.collectives import init_weight_update_group  # noqa: E402
from dsrl.serving.servers import free_port  # noqa: E402

NUMEL = 64 << 20  # 256 MB of fp32, a bucket's worth


def as_before_the_fix(port: int, rank: int) -> dist.ProcessGroup:
    """The weight-update group as dsrl built it before the fix: the default group's device binding left on."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    timeout = timedelta(seconds=600)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, 2, timeout=timeout))
    group, _ = _new_process_group_helper(
        world, rank, [], Backend("nccl"), PrefixStore("wu", store), group_name="wu", timeout=timeout
    )
    return group


def trainer(rank: int, port: int, wport: int, way: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device)
    dist.all_reduce(torch.ones(1, device=device))  # the trainers' communicator is up, as ZeRO-3 leaves it
    if rank == 0:
        start = time.perf_counter()
        group = as_before_the_fix(wport, 0) if way == "before" else init_weight_update_group(
            "127.0.0.1", wport, 0, 2, "wu", "nccl", 600
        )  # fmt: skip
        dist.broadcast(torch.arange(NUMEL, dtype=torch.float32, device=device), group=group, group_src=0)
        torch.cuda.synchronize()
        print(f"trainer rank 0: broadcast done in {time.perf_counter() - start:.2f} s", flush=True)
    dist.barrier()  # rank 1 waits for rank 0 here, as in dsrl's agreement after a sync


def receiver(wport: int, way: str) -> None:
    torch.cuda.set_device(0)  # GPU 2 (CUDA_VISIBLE_DEVICES)
    group = as_before_the_fix(wport, 1) if way == "before" else init_weight_update_group(
        "127.0.0.1", wport, 1, 2, "wu", "nccl", 600
    )  # fmt: skip
    got = torch.empty(NUMEL, dtype=torch.float32, device="cuda")
    dist.broadcast(got, group=group, group_src=0)
    equal = torch.equal(got, torch.arange(NUMEL, dtype=torch.float32, device="cuda"))
    print(f"receiver: {'received the bytes sent' if equal else 'received OTHER bytes'}", flush=True)


def run(way: str, limit: float) -> str:
    port, wport = free_port(), free_port()
    env = dict(os.environ, NCCL_CUMEM_ENABLE="0")
    me = [sys.executable, __file__]
    procs = [
        subprocess.Popen(me + ["--role", f"trainer{r}", "--port", str(port), "--wport", str(wport), "--way", way],
                         env=env) for r in (0, 1)
    ] + [subprocess.Popen(me + ["--role", "receiver", "--wport", str(wport), "--way", way],
                          env=dict(env, CUDA_VISIBLE_DEVICES="2"))]  # fmt: skip
    start = time.monotonic()
    while time.monotonic() - start < limit and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    hung = [p for p in procs if p.poll() is None]
    for p in hung:
        p.kill()
    codes = [p.wait() for p in procs]
    if hung:
        return f"{way} the fix: HANG (no end within {limit:.0f} s; exit codes {codes})"
    return f"{way} the fix: {'OK' if not any(codes) else 'FAIL'} in {time.monotonic() - start:.1f} s ({codes})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", default=None)
    parser.add_argument("--port", type=int)
    parser.add_argument("--wport", type=int)
    parser.add_argument("--way", default="after", choices=["before", "after"])
    parser.add_argument("--limit", type=float, default=40.0, help="Seconds before a way is called hung.")
    args = parser.parse_args()
    if args.role == "receiver":
        return receiver(args.wport, args.way)
    if args.role:
        return trainer(int(args.role.removeprefix("trainer")), args.port, args.wport, args.way)
    for way in ("before", "after"):
        print("split hang:", run(way, args.limit), flush=True)


if __name__ == "__main__":
    main()
