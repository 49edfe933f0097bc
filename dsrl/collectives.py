"""torch.distributed helpers: agreement across trainer ranks, and the weight-update process group.

The trainer ranks use `all_ranks` and `agreed`; the weight-update group is built the same way on
both ends (trainer rank 0 here, the embedded engine and SGLang on the servers' side), so it lives
where the trainer and the embedded engine can both import it.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from dsrl.nodes import choose_gloo_interface


def reduce_device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only


def all_ranks(ok: bool) -> bool:
    """True on every rank when `ok` holds on every rank."""
    flag = torch.tensor([float(ok)], device=reduce_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@contextmanager
def agreed(what: str, errors: tuple[type[BaseException], ...]) -> Iterator[None]:
    """Run the block on every rank; when it raises one of `errors` on any rank, it raises on every rank.

    Only trainer rank 0 talks to the servers, so a server's failure surfaces there; a rank that went
    on alone would wait forever in the next collective (seen with a server dying mid-sync). Rank 0
    re-raises its own error, the others a `errors[0]` saying rank 0 has the details.
    """
    error = None
    try:
        yield
    except errors as e:
        error = e
    if not all_ranks(error is None):
        raise error or errors[0](f"{what} failed on trainer rank 0 (its log has the details)")


def init_weight_update_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """The group trainer rank 0 broadcasts weights in, built as SGLang builds its side
    (`init_custom_process_group` in sglang/srt/utils/common.py): a TCP rendezvous hosted by rank 0, a
    `PrefixStore(group_name, ...)`, then torch's group helper. Both ends must build it identically or
    the rendezvous keys never match and the set-up hangs."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        choose_gloo_interface(master_address)  # each end binds its address toward rank 0, not its hostname's
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    # DeepSpeed binds each rank's GPU to the trainers' default group when there are several ranks, and torch
    # then builds every later NCCL group by ncclCommSplit of the default group's communicator: a collective
    # of every trainer rank, which only rank 0 enters here. The first broadcast on this group hung forever
    # with 2 trainer ranks (4xH100). Unbound while it is built, the group gets a communicator of its own.
    default = dist.group.WORLD if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None)
    if bound is not None:
        default.bound_device_id = None
    try:
        # torch's helper is private; SGLang, verl and OpenRLHF all build the group through it, and the
        # trainer side must match SGLang's server side key for key.
        prefixed = PrefixStore(group_name, store)
        group, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), prefixed, group_name=group_name, timeout=timeout
        )
    finally:
        if bound is not None:
            default.bound_device_id = bound
    # Register its ranks, as SGLang does: torch's collectives log a failure with get_rank(group), which
    # raises "Group ... is not registered" on an unregistered group and hides the real error.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
