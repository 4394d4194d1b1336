"""A communicator of one's own over the ranks of a user's group, for the DDP hooks, optimizers and replica groups.

What a hook state or an optimizer sends belongs to it alone (docs/conventions: "the communication plane"): each
gets a torch group of its own over the user's ranks, created at construction, collectively, with Bagua's timeout,
so nothing it sends can be matched with DDP's own collectives, the user's, or another state's. Works with or
without :func:`bagua.torch_api.init_process_group` (plain ``torch.distributed.init_process_group`` is enough).

At interpreter exit, while the interpreter is still whole, every owner registered with :func:`release_at_exit`
stops its thread and drops its group, which is then collected: a gloo group freed during finalization joins its
C++ threads there, and one of them dropping the last reference to a finished work can abort the process with
"terminate called without an active exception" (see :func:`bagua.torch_api.comm.lifecycle._shutdown`).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import weakref
from typing import Any, Optional

import torch.distributed as dist

from bagua.torch_api import env
from bagua.torch_api.comm.process_group import BaguaCommunicator, new_torch_group

__all__ = ["group_ranks", "own_communicator", "release_at_exit"]

_owners: "weakref.WeakSet[Any]" = weakref.WeakSet()


def group_ranks(process_group: Any, owner: str) -> list[int]:
    """The global ranks of ``process_group``: ``None`` (the default group), a torch ``ProcessGroup`` or a
    :class:`~bagua.torch_api.comm.process_group.BaguaProcessGroup`."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{owner} needs torch.distributed: call torch.distributed.init_process_group() (or "
                         "bagua.torch_api.init_process_group()) first, on every rank")
    if process_group is None or process_group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    ranks = getattr(process_group, "ranks", None)  # a BaguaProcessGroup
    if ranks is not None:
        return sorted(ranks)
    if isinstance(process_group, dist.ProcessGroup):
        return sorted(dist.get_process_group_ranks(process_group))
    raise ValueError(f"{owner}(process_group=...) must be None (the default group), a torch.distributed "
                     f"ProcessGroup or a BaguaProcessGroup, got {type(process_group).__name__}")


def own_communicator(ranks: list[int], timeout_s: Optional[float] = None) -> BaguaCommunicator:
    """A new torch group over ``ranks`` wrapped as a communicator (``group=None`` on ranks outside it).

    Collective: every process of the job calls it, in the same order (``torch.distributed.new_group``). Its
    collectives fail after ``timeout_s`` seconds (default ``BAGUA_COMM_TIMEOUT_S``) instead of hanging on a peer
    that is gone.
    """
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else env.get_comm_timeout_s())
    return BaguaCommunicator(new_torch_group(ranks, private=True, timeout=timeout), ranks)


def release_at_exit(owner: Any) -> None:
    """Call ``owner._release_for_exit()`` at interpreter exit (it stops the owner's thread and drops its group)."""
    _owners.add(owner)


def _release_owners() -> None:
    for owner in list(_owners):
        try:
            owner._release_for_exit()
        except Exception:  # noqa: BLE001 - exit goes on; nothing is left to report to
            pass
    gc.collect()  # frees the groups nothing references any more: their threads are joined now


atexit.register(_release_owners)
