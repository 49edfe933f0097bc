"""The weight-update process group shared by trainer rank 0 and every rollout-server rank.

Built the way SGLang builds its side (`init_custom_process_group` in sglang/srt/utils/common.py):
a TCP rendezvous hosted by rank 0, a `PrefixStore(group_name, ...)`, then torch's group helper.
Both ends must build it identically or the rendezvous keys never match and the set-up hangs.
"""

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous


def init_weight_update_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    # torch's helper is private; SGLang, verl and OpenRLHF all build the group through it, and the
    # trainer side must match SGLang's server side key for key.
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    # Register its ranks, as SGLang does: torch's collectives log a failure with get_rank(group), which
    # raises "Group ... is not registered" on an unregistered group and hides the real error.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
