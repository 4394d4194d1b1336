"""Several TCP streams per peer: the role Bagua-Net played, built from ``torch.distributed`` groups.

Bagua-Net was an NCCL network plugin that split every NCCL send over several TCP connections. With the
engines a PyTorch job uses today the same effect comes from two places:

- **gloo**: a :class:`MultiStreamGroup` is ``K`` torch groups over the same ranks; each has its own TCP
  connections and worker threads. A large tensor is cut into ``k <= K`` contiguous pieces (never smaller than
  ``min_chunk_bytes``) and piece ``i`` is allreduced on group ``i``, all at once (``async_op=True``); the
  result is the same as one allreduce of the whole tensor, element by element.
- **NCCL**: its own socket transport already opens several connections per peer when asked to
  (``NCCL_SOCKET_NTHREADS`` x ``NCCL_NSOCKS_PERTHREAD``); :func:`nccl_socket_env` returns those variables, which
  must be in the environment before the NCCL communicators are created.

Turn it on with ``--enable_bagua_net`` in Bagua's launchers (``BAGUA_NET=1``), or with one call:

Example:
    >>> import torch.distributed as dist
    >>> from bagua.torch_api import multistream
    >>> ddp = torch.nn.parallel.DistributedDataParallel(model)  # doctest: +SKIP
    >>> multistream.enable(ddp, num_streams=4)  # plain DDP: a comm hook  # doctest: +SKIP
    >>> multistream.enable(None, num_streams=4)  # Bagua: gradient allreduce of the default group  # doctest: +SKIP
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Mapping, MutableMapping, Optional, Union

import torch
import torch.distributed as dist

from bagua.torch_api import communication
from bagua.torch_api.communication import ReduceOp
from bagua.torch_api.process_group import BaguaCommunicator, BaguaProcessGroup

__all__ = [
    "MultiStreamGroup",
    "DEFAULT_NUM_STREAMS",
    "DEFAULT_MIN_CHUNK_BYTES",
    "NCCL_SOCKET_DEFAULTS",
    "enable",
    "disable",
    "calibrate",
    "StreamChooser",
    "get",
    "allreduce_inplace",
    "all_reduce_async",
    "MultiWork",
    "multistream_allreduce_hook",
    "nccl_socket_env",
    "apply_nccl_socket_env",
]

#: Streams created by :func:`enable` when none is given (:func:`calibrate` then keeps 1, 2 or 4). With a per-flow
#: cap, 4 streams gave the most on the emulated hosts (docs/tcp_tuning.md); Bagua-Net's own default was 2.
DEFAULT_NUM_STREAMS = 4
#: A piece smaller than this goes on fewer streams: below ~1 MiB the per-collective cost outweighs the gain
#: (Bagua-Net's BAGUA_NET_MIN_CHUNKSIZE was 1 MiB for the same reason).
DEFAULT_MIN_CHUNK_BYTES = 1 << 20
#: Size :func:`calibrate` measures: about the engine's 10 MiB default bucket.
DEFAULT_CALIBRATION_BYTES = 16 << 20

#: NCCL socket transport settings used by :func:`nccl_socket_env` when ``--enable_bagua_net`` is on. NCCL's own
#: defaults are 1 thread x 1 socket per peer; its documentation caps the product at 64. These were NOT measured
#: here (NCCL over TCP needs two GPUs); they match the 4 streams per peer that gloo used best on the emulated
#: hosts, and the buffer stays at NCCL's 4 MiB default. Autotune records them; see docs/tcp_tuning.md.
NCCL_SOCKET_DEFAULTS: dict[str, str] = {
    "NCCL_SOCKET_NTHREADS": "2",
    "NCCL_NSOCKS_PERTHREAD": "2",
    "NCCL_BUFFSIZE": str(4 << 20),
}

Comm = Union[BaguaCommunicator, BaguaProcessGroup, dist.ProcessGroup, None]


def _torch_group_and_ranks(group: Comm) -> tuple[Optional[dist.ProcessGroup], list[int]]:
    """The torch group and global ranks behind any kind of ``group`` (``None``: the default group)."""
    if group is None:
        c = communication._get_default_group().get_global_communicator() if communication.is_initialized() else None
        if c is None:
            return dist.group.WORLD, list(range(dist.get_world_size()))
        return c.group, list(c.ranks)
    if isinstance(group, BaguaProcessGroup):
        c = group.get_global_communicator()
        return c.group, list(c.ranks)
    if isinstance(group, BaguaCommunicator):
        return group.group, list(group.ranks)
    if group is dist.group.WORLD:
        return group, list(range(dist.get_world_size()))
    return group, sorted(dist.get_process_group_ranks(group))


def _group_key(group: Optional[dist.ProcessGroup]) -> int:
    return id(group if group is not None else dist.group.WORLD)


class MultiStreamGroup:
    """``max_streams`` torch groups over the same ranks, used in parallel for large allreduces.

    Creating one is collective: **every** process of the job calls the constructor, in the same order (each
    stream is a ``torch.distributed.new_group``). Stream 0 is ``group`` itself, so with one active stream this
    is exactly a plain allreduce.

    Args:
        group: the group to speed up (a Bagua group or communicator, a torch group, or ``None`` for the default).
        max_streams: groups to create (1 to 16); :attr:`num_streams` may later be lowered, e.g. by autotune.
        min_chunk_bytes: the smallest piece a tensor is cut into; smaller tensors use fewer streams.

    Example:
        >>> msg = MultiStreamGroup(max_streams=4)  # doctest: +SKIP
        >>> msg.allreduce_(flat)  # sum over all ranks, in place  # doctest: +SKIP
    """

    __slots__ = ("ranks", "groups", "min_chunk_bytes", "_num_streams", "chooser", "calls", "split_calls")

    def __init__(self, group: Comm = None, max_streams: int = DEFAULT_NUM_STREAMS,
                 min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES) -> None:
        if not 1 <= max_streams <= 16:
            raise ValueError(f"max_streams must be between 1 and 16, got {max_streams}; 2 to 4 is usually enough")
        if min_chunk_bytes < 1:
            raise ValueError(f"min_chunk_bytes must be a positive number of bytes, got {min_chunk_bytes}")
        if not dist.is_initialized():
            raise RuntimeError("MultiStreamGroup needs torch.distributed to be initialized first")
        base, ranks = _torch_group_and_ranks(group)
        # user settings
        self.ranks = ranks
        self.min_chunk_bytes = min_chunk_bytes
        # internal state: every process creates the same groups in the same order (dist.new_group's contract)
        extra = [dist.new_group(ranks) for _ in range(max_streams - 1)]
        self.groups: list[Optional[dist.ProcessGroup]] = [base] + extra if base is not None else []
        self._num_streams = max_streams
        self.chooser: Optional[StreamChooser] = None
        # stats
        self.calls = 0
        self.split_calls = 0

    @property
    def max_streams(self) -> int:
        """Number of streams created."""
        return max(len(self.groups), 1)

    @property
    def num_streams(self) -> int:
        """Streams a large tensor is spread over (at most :attr:`max_streams`)."""
        return self._num_streams

    @num_streams.setter
    def num_streams(self, value: int) -> None:
        if not 1 <= int(value) <= self.max_streams:
            raise ValueError(f"num_streams must be between 1 and {self.max_streams} (the streams created), got {value}")
        self._num_streams = int(value)

    def is_member(self) -> bool:
        """Whether the calling rank belongs to the group."""
        return bool(self.groups)

    def pieces(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Cut a contiguous ``tensor`` into at most :attr:`num_streams` contiguous views of about equal size."""
        flat = tensor.view(-1)
        nbytes = flat.numel() * flat.element_size()
        k = max(1, min(self._num_streams, nbytes // self.min_chunk_bytes, flat.numel()))
        return list(torch.tensor_split(flat, k)) if k > 1 else [flat]

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Allreduce ``tensor`` in place, its pieces on parallel streams; ``ReduceOp.AVG`` averages.

        Returns ``tensor``. A non-contiguous tensor goes through a contiguous copy.
        """
        if not self.is_member() or len(self.ranks) < 2:
            return tensor
        if not tensor.is_contiguous():
            work = tensor.contiguous()
            self.allreduce_(work, op)
            tensor.copy_(work)
            return tensor
        for work in self.allreduce_async(tensor, op):
            work.wait()
        _finish(tensor, op, len(self.ranks))
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> list[Any]:
        """Launch the pieces' allreduces (SUM for ``AVG``; the caller divides) and return their works."""
        torch_op = dist.ReduceOp.SUM if ReduceOp(op) == ReduceOp.AVG else getattr(dist.ReduceOp, ReduceOp(op).name)
        return self._launch(tensor, torch_op)

    def _launch(self, tensor: torch.Tensor, torch_op: Any) -> list[Any]:
        pieces = self.pieces(tensor)
        self.calls += 1
        self.split_calls += len(pieces) > 1
        return [dist.all_reduce(p, op=torch_op, group=g, async_op=True) for p, g in zip(pieces, self.groups)]

    def __repr__(self) -> str:
        return (f"MultiStreamGroup(ranks={self.ranks}, num_streams={self._num_streams}/{self.max_streams}, "
                f"min_chunk_bytes={self.min_chunk_bytes})")


def _finish(tensor: torch.Tensor, op: ReduceOp, n: int) -> None:
    if ReduceOp(op) == ReduceOp.AVG:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(n)
        else:
            tensor.floor_divide_(n)


# -- the registry: which groups allreduce over several streams ------------------------------------------------

_registry: dict[int, MultiStreamGroup] = {}
communication.on_shutdown(_registry.clear, order=1)  # at exit: let the streams' groups (and threads) go


def get(group: Comm = None) -> Optional[MultiStreamGroup]:
    """The :class:`MultiStreamGroup` enabled for ``group`` (``None``: the default group), if any."""
    base, _ = _torch_group_and_ranks(group)
    return _registry.get(_group_key(base))


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Comm = None) -> None:
    """Allreduce ``tensor`` in place over ``comm``: on several streams when :func:`enable` was called for it,
    else exactly :func:`bagua.torch_api.communication.allreduce_inplace`.

    This is the operation Bagua's full-precision bucket allreduce dispatches to.
    """
    base, _ = _torch_group_and_ranks(comm)
    msg = _registry.get(_group_key(base))
    if msg is None or msg.num_streams == 1:
        communication.allreduce_inplace(tensor, op, comm)
        return
    msg.allreduce_(tensor, op)


class StreamChooser:
    """Choose the stream count from real training iterations; every rank ends with the same choice.

    Steps, driven by :meth:`on_iteration` (called once per iteration, at the same point on every rank):

    1. ``warmup`` iterations run as they are;
    2. each candidate (1, 2, 4, ... up to ``msg.max_streams``) runs ``probe`` iterations; the first after a
       switch is not timed, the others are (the time between consecutive calls);
    3. the ranks take the slowest rank's median per candidate (one ``all_reduce`` on a group of their own) and
       keep the fastest, unless it is less than ``margin`` faster than one stream; then the chooser is done.

    This is what makes ``enable(ddp)`` safe where the CPU, not the network, is the limit: extra streams that
    speed up a lone allreduce can still slow training by competing with backward for cores.

    Args:
        msg: the :class:`MultiStreamGroup` to set.
        warmup: iterations before the first probe.
        probe: iterations per candidate.
        margin: how much faster than one stream a candidate must be.
    """

    __slots__ = ("msg", "candidates", "warmup", "probe", "margin", "chosen", "_group", "_iter", "_t_last", "_times")

    def __init__(self, msg: MultiStreamGroup, warmup: int = 3, probe: int = 4, margin: float = 0.05) -> None:
        if warmup < 0 or probe < 2:
            raise ValueError(f"need warmup >= 0 and probe >= 2 iterations, got {warmup}, {probe}")
        # user settings
        self.msg = msg
        self.candidates = [k for k in (1, 2, 4, 8, 16) if k <= msg.max_streams]
        self.warmup = warmup
        self.probe = probe
        self.margin = margin
        # internal state
        self.chosen: Optional[int] = None if len(self.candidates) > 1 else 1
        self._group = dist.new_group(msg.ranks)  # collective, like the MultiStreamGroup itself
        self._iter = 0
        self._t_last: Optional[float] = None
        self._times: list[list[float]] = [[] for _ in self.candidates]

    def on_iteration(self) -> None:
        """Call once per training iteration, at the same point on every rank."""
        if self.chosen is not None:
            return
        now = time.perf_counter()
        previous = self._iter - 1 - self.warmup  # the iteration that just ended, counted from the first probe
        if previous >= 0 and previous // self.probe < len(self.candidates) and previous % self.probe > 0:
            assert self._t_last is not None
            self._times[previous // self.probe].append(now - self._t_last)
        self._t_last = now
        current = self._iter - self.warmup
        self._iter += 1
        if current < 0:
            return
        slot = current // self.probe
        if slot < len(self.candidates):
            self.msg.num_streams = self.candidates[slot]
            return
        medians = torch.tensor([sorted(t)[len(t) // 2] for t in self._times], dtype=torch.float64)
        if dist.get_backend(self._group) == "nccl":
            medians = medians.cuda()
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self._group)
        medians_list = medians.cpu().tolist()
        best = min(range(len(self.candidates)), key=lambda i: medians_list[i])
        self.chosen = self.candidates[best] if medians_list[best] < (1 - self.margin) * medians_list[0] else 1
        self.msg.num_streams = self.chosen


class MultiWork:
    """The works of one multistream allreduce, waited as one (the interface of ``torch.distributed.Work``
    that Bagua's engine uses: ``wait``, ``is_completed``, ``get_future``)."""

    __slots__ = ("works", "tensor")

    def __init__(self, works: list[Any], tensor: torch.Tensor) -> None:
        self.works = works
        self.tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        """Wait for every piece (each at most ``timeout``, a ``timedelta``, when given)."""
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        """Whether every piece has finished."""
        return all(work.is_completed() for work in self.works)

    def get_future(self) -> torch.futures.Future:
        """A future completed with ``[tensor]`` once every piece has finished."""
        tensor = self.tensor
        return torch.futures.collect_all([w.get_future() for w in self.works]).then(lambda _: [tensor])


def all_reduce_async(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                     group: Optional[dist.ProcessGroup] = None) -> Any:
    """``torch.distributed.all_reduce(tensor, op, group, async_op=True)``, on several streams when
    :func:`enable` was called for ``group``; returns the work (a :class:`MultiWork` when split).

    This is the call for engines that launch a bucket's allreduce and wait on it later.
    """
    msg = _registry.get(_group_key(group))
    if msg is None or msg.num_streams == 1 or not tensor.is_contiguous():
        return dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return MultiWork(msg._launch(tensor, op), tensor)


def multistream_allreduce_hook(
    state: MultiStreamGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over ``state``'s ranks, its pieces on parallel streams.

    Same arithmetic as torch's ``default_hooks.allreduce_hook`` (divide by the world size, then sum), so the
    result equals DDP's default bucket by bucket.

    Example:
        >>> ddp.register_comm_hook(MultiStreamGroup(ddp.process_group), multistream_allreduce_hook)  # doctest: +SKIP
    """
    if state.chooser is not None and bucket.index() == 0:
        state.chooser.on_iteration()  # the first bucket of every iteration: the clock of the online choice
    buffer = bucket.buffer()
    buffer.div_(len(state.ranks))
    futures = [work.get_future() for work in state.allreduce_async(buffer, ReduceOp.SUM)]
    return torch.futures.collect_all(futures).then(lambda _: buffer)


# DDP's register_comm_hook compares the annotations with the real classes; ``from __future__ import
# annotations`` turned them into strings, so give the hook the objects back.
multistream_allreduce_hook.__annotations__.update(bucket=dist.GradBucket, state=MultiStreamGroup)
multistream_allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def calibrate(msg: MultiStreamGroup, nbytes: int = DEFAULT_CALIBRATION_BYTES, repeats: int = 3,
              margin: float = 0.1) -> int:
    """Measure the stream counts on this network and keep the fastest; collective over ``msg``'s ranks.

    Times an allreduce of ``nbytes`` with 1, 2, 4, ... streams (up to ``msg.max_streams``), ``repeats``
    rounds after one warm-up round, settings interleaved. Every rank takes the slowest rank's median, so all
    choose alike. More than one stream is kept only when it is at least ``margin`` faster than one: where one
    TCP stream already fills the link (or the CPU is the limit) the answer is 1, so enabling costs nothing.

    Returns:
        The chosen stream count (also set as ``msg.num_streams``).

    Example:
        >>> calibrate(MultiStreamGroup(max_streams=4))  # doctest: +SKIP
        4
    """
    if not msg.is_member() or len(msg.ranks) < 2:
        return msg.num_streams
    group = msg.groups[0]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else \
        torch.device("cpu")
    x = torch.zeros(max(nbytes // 4, 1), device=device)
    candidates = [k for k in (1, 2, 4, 8, 16) if k <= msg.max_streams]
    times = torch.zeros(len(candidates), repeats, dtype=torch.float64)
    for r in range(repeats + 1):
        for i, k in enumerate(candidates):
            msg.num_streams = k
            dist.barrier(group=group)
            t0 = time.perf_counter()
            msg.allreduce_(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r > 0:
                times[i, r - 1] = time.perf_counter() - t0
    medians = times.median(dim=1).values.to(device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    medians = medians.cpu().tolist()
    best = min(range(len(candidates)), key=lambda i: medians[i])
    chosen = candidates[best] if medians[best] < (1 - margin) * medians[0] else 1
    msg.num_streams = chosen
    msg.calls = msg.split_calls = 0
    return chosen


def enable(target: Any = None, num_streams: int = DEFAULT_NUM_STREAMS,
           min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES, calibrate_streams: bool = True) -> MultiStreamGroup:
    """Allreduce over several TCP streams; collective: every process calls it, in the same order.

    Args:
        target: a ``torch.nn.parallel.DistributedDataParallel`` (a comm hook is registered on it), a module
            wrapped by Bagua (its group is used), a Bagua or torch group, or ``None`` (Bagua's default group).
            For Bagua, gradient allreduce buckets of that group then go through :func:`all_reduce_async` /
            :func:`allreduce_inplace`.
        num_streams: streams to create (the most that will be used).
        min_chunk_bytes: the smallest piece a tensor is cut into.
        calibrate_streams: choose the stream count by measurement. For DDP: on the first training iterations
            (a :class:`StreamChooser`: 3 warmup iterations, then 4 iterations each of 1, 2, 4 ... streams, then
            the fastest, all ranks alike). For a Bagua group: :func:`calibrate` (a lone allreduce, timed now);
            with ``--enable_bagua_net`` the engine uses autotune instead, on real steps. ``False`` uses
            ``num_streams`` as given.

    Returns:
        The :class:`MultiStreamGroup`; change its ``num_streams`` at any time between steps (autotune does).

    Example:
        >>> msg = multistream.enable(ddp_model, num_streams=4)  # doctest: +SKIP
    """
    if isinstance(target, torch.nn.parallel.DistributedDataParallel):
        msg = MultiStreamGroup(target.process_group, num_streams, min_chunk_bytes)
        if msg.groups and dist.get_backend(msg.groups[0]) != "gloo":
            warnings.warn("multistream splitting is meant for gloo; with NCCL set nccl_socket_env() before "
                          "init_process_group instead", stacklevel=2)
        if calibrate_streams:
            msg.num_streams = 1
            msg.chooser = StreamChooser(msg)
        target.register_comm_hook(msg, multistream_allreduce_hook)
        return msg
    bagua_ddp = getattr(target, "bagua_ddp", None)
    if bagua_ddp is not None:
        target = bagua_ddp.process_group
    elif target is not None and hasattr(target, "process_group") and hasattr(target, "bagua_buckets"):
        target = target.process_group  # the engine object itself
    msg = get(target)
    if msg is None:
        msg = MultiStreamGroup(target, num_streams, min_chunk_bytes)
        base, _ = _torch_group_and_ranks(target)
        _registry[_group_key(base)] = msg
    if calibrate_streams:
        calibrate(msg)
    else:
        msg.num_streams = min(num_streams, msg.max_streams)
    return msg


def disable(group: Comm = None) -> None:
    """Go back to one stream for ``group`` (the created groups stay alive until the process group is destroyed)."""
    base, _ = _torch_group_and_ranks(group)
    _registry.pop(_group_key(base), None)


# -- NCCL's socket transport ---------------------------------------------------------------------------------


def nccl_socket_env(nthreads: Optional[int] = None, nsocks_per_thread: Optional[int] = None,
                    buffsize: Optional[int] = None) -> dict[str, str]:
    """Return the NCCL variables that open ``nthreads * nsocks_per_thread`` TCP sockets per peer.

    NCCL reads them once, when it creates its first communicator, so they must be in the environment before
    ``init_process_group``. Missing arguments take :data:`NCCL_SOCKET_DEFAULTS`.

    Args:
        nthreads: ``NCCL_SOCKET_NTHREADS``, 1 to 16.
        nsocks_per_thread: ``NCCL_NSOCKS_PERTHREAD``; ``nthreads * nsocks_per_thread`` must be at most 64.
        buffsize: ``NCCL_BUFFSIZE`` in bytes (a power of two is best).

    Example:
        >>> nccl_socket_env(4, 2)["NCCL_NSOCKS_PERTHREAD"]
        '2'
    """
    nt = int(NCCL_SOCKET_DEFAULTS["NCCL_SOCKET_NTHREADS"]) if nthreads is None else int(nthreads)
    ns = int(NCCL_SOCKET_DEFAULTS["NCCL_NSOCKS_PERTHREAD"]) if nsocks_per_thread is None else int(nsocks_per_thread)
    bs = int(NCCL_SOCKET_DEFAULTS["NCCL_BUFFSIZE"]) if buffsize is None else int(buffsize)
    if not 1 <= nt <= 16:
        raise ValueError(f"NCCL_SOCKET_NTHREADS must be between 1 and 16, got {nt}")
    if ns < 1 or nt * ns > 64:
        raise ValueError(f"NCCL allows at most 64 sockets per peer; {nt} threads x {ns} sockets is {nt * ns}")
    if bs < 1 << 16:
        raise ValueError(f"NCCL_BUFFSIZE={bs} is too small; use at least 64 KiB (NCCL's default is 4 MiB)")
    return {"NCCL_SOCKET_NTHREADS": str(nt), "NCCL_NSOCKS_PERTHREAD": str(ns), "NCCL_BUFFSIZE": str(bs)}


def apply_nccl_socket_env(environ: MutableMapping[str, str], values: Optional[Mapping[str, str]] = None) -> None:
    """Set :func:`nccl_socket_env` (or ``values``) in ``environ`` where the user has not set them already.

    Example:
        >>> import os
        >>> apply_nccl_socket_env(os.environ)  # before torch.distributed.init_process_group  # doctest: +SKIP
    """
    for key, value in (values or nccl_socket_env()).items():
        environ.setdefault(key, value)
