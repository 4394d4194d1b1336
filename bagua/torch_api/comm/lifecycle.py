"""Bagua's start and end: ``init_process_group``, the default group, new groups, and a clean exit.

Re-exported by :mod:`bagua.torch_api.communication` (the original's import path). Groups are created collectively:
every process of the job calls these functions in the same order, as ``torch.distributed.new_group`` requires.

Example:
    >>> import bagua.torch_api as bagua
    >>> bagua.init_process_group()  # doctest: +SKIP
    >>> group = bagua.communication.new_group([0, 1])  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import datetime
import gc
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api import env
from bagua.torch_api.comm import process_group as _process_group
from bagua.torch_api.comm.process_group import BaguaProcessGroup, new_torch_group

__all__ = [
    "init_process_group",
    "is_initialized",
    "new_group",
    "from_torch_group",
    "get_backend",
    "on_shutdown",
    "torch_group_of",
]

_default_pg: Optional[BaguaProcessGroup] = None
_group_count = 0
_world_layout: Optional[list[tuple[int, int]]] = None


def is_initialized() -> bool:
    """Whether :func:`init_process_group` has run in this process."""
    return _default_pg is not None


def _get_default_group() -> BaguaProcessGroup:
    if _default_pg is None:
        raise RuntimeError(
            "Bagua is not initialized: call bagua.torch_api.init_process_group() first "
            "(after `import bagua.torch_api as bagua`), under torchrun or `python -m bagua.distributed.launch`"
        )
    return _default_pg


def _device_for_backend(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_world_layout() -> list[tuple[int, int]]:
    global _world_layout
    if _world_layout is None:
        device = _device_for_backend()
        mine = torch.tensor([env.get_node_rank(), env.get_local_rank()], dtype=torch.int64, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        _world_layout = [(int(t[0]), int(t[1])) for t in gathered]
    return _world_layout


def init_process_group(
    store: Optional[dist.Store] = None,
    rank: int = -1,
    world_size: int = -1,
    local_world_size: int = -1,
    timeout: Optional[datetime.timedelta] = None,
) -> None:
    """Initialize Bagua and, unless already done, ``torch.distributed``.

    Under ``torchrun``, ``python -m bagua.distributed.launch`` or ``srun`` (Slurm, read from ``SLURM_*``; see
    :func:`bagua.torch_api.env.slurm_process_env`) call it with no arguments. With ``store``,
    ``rank``, ``world_size`` and ``local_world_size`` must be given. Without any launcher it starts a single
    process job. The backend is NCCL when CUDA and NCCL are available, otherwise gloo; on CUDA the device is
    chosen from ``LOCAL_RANK``.

    Args:
        store: a rendezvous store shared by all processes, or ``None`` to use the launcher's environment.
        rank: global rank of this process (with ``store``).
        world_size: number of processes (with ``store``).
        local_world_size: processes per node (with ``store``).
        timeout: limit for every collective; default ``BAGUA_COMM_TIMEOUT_S`` (300 s).

    Example:
        >>> import bagua.torch_api as bagua
        >>> bagua.init_process_group()  # doctest: +SKIP
    """
    global _default_pg, _shutdown_registered
    if _default_pg is not None:
        raise RuntimeError("trying to initialize the default process group twice!")
    if store is not None:
        if rank < 0 or world_size <= 0 or local_world_size <= 0:
            raise ValueError(
                "init_process_group(store=...) needs rank >= 0, world_size > 0 and local_world_size > 0, "
                f"got rank={rank}, world_size={world_size}, local_world_size={local_world_size}"
            )
        env._export(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank % local_world_size),
                "LOCAL_WORLD_SIZE": str(local_world_size),
            }
        )
    if store is None and not dist.is_initialized() and not env.is_launched() and env.is_slurm_job():
        env._export(env.slurm_process_env())  # `srun python train.py`: the SLURM_* variables describe this task
    timeout = timeout or datetime.timedelta(seconds=env.get_comm_timeout_s())
    use_cuda = torch.cuda.is_available() and dist.is_nccl_available()
    if use_cuda:
        torch.cuda.set_device(env.get_local_rank() % torch.cuda.device_count())
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if store is None and not env.is_launched():
            # A plain `python train.py`: a one-process job needs no network, so no port is opened.
            store, rank, world_size = dist.HashStore(), 0, 1
            env._export({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        attempt = env.get_elastic_attempt() if store is None else None
        if attempt is not None:
            # torchrun's agent hands every restart the same store, still holding the previous attempt's keys (the
            # dead workers' gloo addresses): a restarted worker could read a stale address and fail with "Gloo
            # connectFullMesh failed ... Connection refused", or hang. A prefix per attempt keeps each one apart.
            client = dist.TCPStore(env.get_master_addr(), env.get_master_port(), env.get_world_size(),
                                   is_master=False, timeout=timeout)
            store = dist.PrefixStore(f"bagua/attempt_{attempt}", client)
            rank, world_size = env.get_rank(), env.get_world_size()
        if store is None:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _default_pg = _bagua_group(list(range(dist.get_world_size())), dist.group.WORLD, "default", None)
    if not _shutdown_registered:
        atexit.register(_shutdown)
        _shutdown_registered = True


_shutdown_callbacks: list[tuple[int, Callable[[], None]]] = []
_shutdown_registered = False


def on_shutdown(callback: Callable[[], None], order: int = 0) -> None:
    """Run ``callback`` at interpreter exit, before ``torch.distributed`` is torn down, by ``order`` (stopping
    threads: 0; releasing the process groups they used: 1), then in registration order.

    Bagua's engines and background threads stop there, without any collective (peers may be gone already).
    """
    _shutdown_callbacks.append((order, callback))


def _shutdown() -> None:
    """At exit: stop Bagua's threads, destroy the process groups and let their C++ threads go, while the
    interpreter is still whole.

    A gloo worker thread finishes a collective shortly *after* the caller's ``wait()`` returned, and then drops the
    last reference to it; that can touch a Python object (the work keeps the caller's thread-local state). If the
    interpreter is finalizing by then, the thread is killed inside a C++ destructor: "terminate called without an
    active exception" (SIGABRT), in about a third of the runs on a busy machine, after which torchrun reports the
    job failed or restarts it. A process group's threads are joined when the group is freed, so the groups are
    destroyed and every reference Bagua holds to them is dropped here, then collected.
    """
    callbacks = sorted(_shutdown_callbacks, key=lambda oc: oc[0])
    _shutdown_callbacks.clear()
    for _, callback in callbacks:
        try:
            callback()
        except Exception:  # noqa: BLE001 - exit must go on; nothing is left to report to
            pass
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    _reset()
    gc.collect()  # frees the groups nothing references any more: their threads are joined now


def _bagua_group(
    ranks: list[int], group: Optional[dist.ProcessGroup], name: str, stream: Optional[Any]
) -> BaguaProcessGroup:
    """A :class:`BaguaProcessGroup` over the torch ``group``, with its intra-/inter-node communicators (collective:
    node layouts are exchanged once per job); a new high-priority CUDA stream on NCCL unless ``stream`` is given."""
    if stream is None and torch.cuda.is_available() and dist.get_backend() == "nccl":
        stream = torch.cuda.Stream(priority=-1)
    pg = BaguaProcessGroup(ranks, group, name, stream)
    pg._build_hierarchy(_gather_world_layout())
    return pg


def _reset() -> None:
    """Forget the default group (used when torch.distributed is destroyed and re-created, e.g. in tests)."""
    global _default_pg, _world_layout, _group_count
    _default_pg, _world_layout, _group_count = None, None, 0
    _process_group._ABORTED.clear()  # torch groups of aborted communicators: gone with torch.distributed


def torch_group_of(process_group: Any = None) -> Optional[dist.ProcessGroup]:
    """Return the torch group behind ``process_group`` (a :class:`BaguaProcessGroup`, a torch group, or ``None`` for the
    default group); ``None`` when ``torch.distributed`` is not initialized or this rank is outside the group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if process_group is None:
        process_group = _get_default_group() if is_initialized() else dist.group.WORLD
    return getattr(process_group, "group", process_group)  # a BaguaProcessGroup holds its torch group


def new_group(ranks: Optional[list[int]] = None, stream: Optional[Any] = None) -> BaguaProcessGroup:
    """Create a :class:`BaguaProcessGroup` over ``ranks`` (all ranks when ``None``).

    Every process of the job must call it, in the same order, as with ``torch.distributed.new_group``.

    Example:
        >>> group = bagua.communication.new_group([0, 1])  # doctest: +SKIP
    """
    global _group_count
    _get_default_group()
    ranks = sorted(set(ranks if ranks is not None else range(dist.get_world_size())))
    bad = [r for r in ranks if not 0 <= r < dist.get_world_size()]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are outside the job's {dist.get_world_size()} ranks")
    group = new_torch_group(ranks)
    _group_count += 1
    return _bagua_group(ranks, group, f"group{_group_count}", stream)


def from_torch_group(group: dist.ProcessGroup, stream: Optional[Any] = None) -> BaguaProcessGroup:
    """Wrap an existing torch process group as a :class:`BaguaProcessGroup`.

    Every process of the job must call it, in the same order (node layouts are exchanged collectively).
    """
    global _group_count
    _get_default_group()
    if group is None or group is dist.group.WORLD:
        ranks = list(range(dist.get_world_size()))
        group = dist.group.WORLD
    else:
        ranks = sorted(dist.get_process_group_ranks(group))
    _group_count += 1
    return _bagua_group(ranks, group, f"torch{_group_count}", stream)


def get_backend(model_name: str = "") -> str:
    """Return the ``torch.distributed`` backend name in use (``"gloo"`` or ``"nccl"``)."""
    _get_default_group()
    return dist.get_backend()
