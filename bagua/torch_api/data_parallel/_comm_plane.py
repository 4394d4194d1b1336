"""The engine's communication plane: its own process groups, and the engines alive in this process.

What an engine sends belongs to it alone. :func:`private_group` gives each wrapped model torch groups of its own
over the user's ranks (created collectively at wrap time, kept per module so a re-wrap reuses them), so nothing it
sends can interleave with the user's collectives, Lightning's, another wrapped model's or an asynchronous
background round. The thread that runs the buckets' operations is :mod:`bagua.torch_api.comm.worker`'s.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from bagua.torch_api import communication as comm
from bagua.torch_api.comm.process_group import BaguaProcessGroup

__all__ = ["private_group", "enable_multistream_like", "register_engine", "open_engines_of"]

_engine_count = 0  # private groups created in this process; the same on every rank, since wrapping is collective
_private_groups: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def private_group(module: torch.nn.Module, group: BaguaProcessGroup) -> BaguaProcessGroup:
    """The engine's own copy of ``group`` (collective the first time), per module: a re-wrap reuses it, so
    wrapping a model again and again creates no new connections or threads."""
    global _engine_count
    cached = _private_groups.setdefault(module, {})
    key = (tuple(group.ranks), group.group_name, id(group))
    if key not in cached:
        _engine_count += 1
        cached[key] = group.private_copy(f"engine{_engine_count}")
    return cached[key]


def enable_multistream_like(user_group: BaguaProcessGroup, own_group: BaguaProcessGroup) -> None:
    """Carry ``multistream.enable(user_group)`` (several TCP streams, e.g. for the default group) over to the
    engine's own group, with the same number of streams (collective, like the enable call itself)."""
    from bagua.torch_api import multistream

    msg = multistream.get(user_group)
    if msg is not None and multistream.get(own_group) is None:
        own = multistream.enable(own_group, num_streams=msg.max_streams, min_chunk_bytes=msg.min_chunk_bytes,
                                 calibrate_streams=False)
        own.num_streams = msg.num_streams


_live_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_engine(engine: Any) -> None:
    """Let the exit handler release ``engine``'s process groups (see :func:`bagua.torch_api.comm.lifecycle._shutdown`)."""
    _live_engines.add(engine)


def open_engines_of(module: Any) -> list:
    """The engines that train ``module`` and are not closed (at most one, see the engine's constructor)."""
    return [e for e in list(_live_engines) if getattr(e, "module", None) is module and not e.closed]


def _release_groups_at_exit() -> None:
    # a group's C++ threads are joined when the group is freed: drop every reference the engines hold
    for engine in list(_live_engines):
        engine._release_for_exit()
    _private_groups.clear()


comm.on_shutdown(_release_groups_at_exit, order=1)
