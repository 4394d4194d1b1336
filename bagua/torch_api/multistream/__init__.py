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

from bagua.torch_api.multistream.choice import DEFAULT_CALIBRATION_BYTES, StreamChooser, calibrate
from bagua.torch_api.multistream.group import DEFAULT_MIN_CHUNK_BYTES, DEFAULT_NUM_STREAMS, Comm, MultiStreamGroup
from bagua.torch_api.multistream.nccl import NCCL_SOCKET_DEFAULTS, apply_nccl_socket_env, nccl_socket_env
from bagua.torch_api.multistream.registry import (
    MultiWork, all_reduce_async, allreduce_inplace, disable, enable, get, multistream_allreduce_hook,
)

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
# Public before the split though never listed above; still importable from here.
__all__ += ["DEFAULT_CALIBRATION_BYTES", "Comm"]
