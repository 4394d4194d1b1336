"""A communicator of one's own over the ranks of a user's group, for the DDP hooks and optimizers of ``contrib``.

What a hook state or an optimizer sends belongs to it alone (docs/conventions: "the communication plane"): each
gets a torch group of its own over the user's ranks, created at construction, collectively, with Bagua's timeout,
so nothing it sends can be matched with DDP's own collectives, the user's, or another state's. Works with or
without :func:`bagua.torch_api.init_process_group` (plain ``torch.distributed.init_process_group`` is enough).
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch.distributed as dist

from bagua.torch_api import env
from bagua.torch_api.process_group import BaguaCommunicator, new_torch_group

__all__ = ["group_ranks", "own_communicator"]


def group_ranks(process_group: Any, owner: str) -> list[int]:
    """The global ranks of ``process_group``: ``None`` (the default group), a torch ``ProcessGroup`` or a
    :class:`~bagua.torch_api.process_group.BaguaProcessGroup`."""
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
