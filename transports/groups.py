"""Weight-update process groups beside the default one: what the trainer side (dist.py) and every
engine side (receiver.py, the SGLang client, Ray rank 0) share to meet on one group."""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta
from typing import Any

DEFAULT_GROUP = "weight_update_group"


def init_custom_process_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, timeout_s: float = 300.0) -> Any:
    """Join a process group that lives beside (not inside) the default one; blocks until all ranks join.

    Uses torch's group constructor the way SGLang's engines do (TCP rendezvous, then a store prefixed by
    the group name), since both sides must agree on the store's keys to meet.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                              c10d.PrefixStore(group_name, store), group_name=group_name,
                                              timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # lets dist.broadcast(group=) map ranks
    return group


def destroy_group(group: Any) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if group in c10d._world.pg_map:  # a trainer's destroy_process_group() may have removed every group
        dist.destroy_process_group(group)


def unused_group_name(name: str) -> str:
    """``name``, or ``name-2``, ``name-3``... : torch keeps one registry of group names per process, and a
    group a dead peer never left (or another transport in this process) may still hold the name."""
    from torch.distributed import distributed_c10d as c10d

    taken = set(c10d._world.pg_names.values())
    n = 1
    while (candidate := name if n == 1 else f"{name}-{n}") in taken:
        n += 1
    return candidate


def free_port(address: str = "127.0.0.1") -> int:
    return free_ports(1, address)[0]


def free_ports(n: int, address: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free now: all held open together while they are picked. Picked one at a time,
    before the server given the last one has bound it, the kernel may hand out the same port twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((address, 0))
        return [s.getsockname()[1] for s in socks]
