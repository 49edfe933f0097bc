"""A rank stuck in a collective its peer never enters, under `dsrl.rundir.deadline` (tests/test_deadlines.py).

Rank 0 starts rank 1 as its child; rank 1 joins the gloo group, then never enters the all-reduce rank 0 waits in.
"""

import logging
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dsrl.rundir import deadline

rank, port = int(sys.argv[1]), sys.argv[2]
if rank == 0:
    peer = subprocess.Popen([sys.executable, __file__, "1", port])
    print(f"peer pid {peer.pid}", flush=True)
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=600)
)
if rank == 1:
    time.sleep(600)
logging.basicConfig(level="INFO", format="%(message)s")
with deadline("the test's all-reduce", 2, "--test.timeout_s"):
    dist.all_reduce(torch.ones(1))  # gloo waits in C++ for up to the group's 600 s
print("the all-reduce returned", flush=True)
