"""Several trainer ranks and the weight-update group: what once hung on GPUs, checked where CPUs can check it.

On 2 trainer ranks over NCCL the first broadcast to the servers hung forever (4xH100): torch built the weight-update
group by ncclCommSplit of the trainers' group, a collective only rank 0 entered. And no deadline fired, since the
wait sat in C++. NCCL itself needs GPUs (tools/gpu_run.sh's `placements` stage runs it); its two causes do not.
"""

import os
import subprocess
import sys
import time

from dsrl.serving.servers import free_port
from tests.conftest import ROOT, still_running

ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def test_the_weight_update_group_is_built_apart_from_the_trainers_group():
    """DeepSpeed binds a GPU to the trainers' default group when it has several ranks; torch splits every later
    group from a bound group (`_new_process_group_helper` reads `bound_device_id`). The weight-update group is
    built with the binding lifted, and it is back afterwards."""
    script = f"""
import torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from dsrl import collectives
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
dist.group.WORLD.bound_device_id = torch.device("cuda", 0)
seen, helper = [], collectives._new_process_group_helper
def spy(*args, **kwargs):
    seen.append(c10d._get_default_group().bound_device_id)
    return helper(*args, **kwargs)
collectives._new_process_group_helper = spy
group = collectives.init_weight_update_group("127.0.0.1", {free_port()}, 0, 1, "wu", "gloo", 30)
dist.broadcast(torch.ones(2), group=group, group_src=0)
print("seen", seen, "after", dist.group.WORLD.bound_device_id)
dist.destroy_process_group()  # every group: gloo's threads left to the exit aborted it once in CI ("terminate called")
"""
    out = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "seen [None] after cuda:0" in out.stdout


def test_a_rank_stuck_in_a_collective_ends_with_its_children_at_its_deadline():
    """Rank 0 waits in a gloo all-reduce (in C++, for up to 600 s) that rank 1, its child, never enters: at the
    2 s deadline it logs one line naming the wait and the flag, then where it waited, and both processes are gone."""
    start = time.monotonic()
    cmd = [sys.executable, str(ROOT / "tests/_stuck_rank.py"), "0", str(free_port())]
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert out.returncode == -9, out.stdout + out.stderr[-3000:]
    assert "the all-reduce returned" not in out.stdout
    lines = [line for line in out.stderr.splitlines() if "did not finish" in line]
    assert lines == [
        "the test's all-reduce did not finish within 2s (--test.timeout_s): this rank and the processes it started "
        "exit now; its main thread was at:"
    ]
    assert "dist.all_reduce(torch.ones(1))" in out.stderr, "where it waited, for a hang's post-mortem"
    assert took < 60  # the gloo wait alone would have taken 600 s
    peer = int(out.stdout.split("peer pid ")[1].split()[0])
    assert not still_running([peer])
