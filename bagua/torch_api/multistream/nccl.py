"""NCCL's socket transport: the environment variables that open several TCP sockets per peer.

Part of :mod:`bagua.torch_api.multistream` (the NCCL half of the Bagua-Net role; gloo's is the group).
"""

from __future__ import annotations

from typing import Mapping, MutableMapping, Optional

__all__ = ["NCCL_SOCKET_DEFAULTS", "nccl_socket_env", "apply_nccl_socket_env"]

#: NCCL socket transport settings used by :func:`nccl_socket_env` when ``--enable_bagua_net`` is on. NCCL's own
#: defaults are 1 thread x 1 socket per peer; its documentation caps the product at 64. These were NOT measured
#: here (NCCL over TCP needs two GPUs); they match the 4 streams per peer that gloo used best on the emulated
#: hosts, and the buffer stays at NCCL's 4 MiB default. Autotune records them; see docs/tcp_tuning.md.
NCCL_SOCKET_DEFAULTS: dict[str, str] = {
    "NCCL_SOCKET_NTHREADS": "2",
    "NCCL_NSOCKS_PERTHREAD": "2",
    "NCCL_BUFFSIZE": str(4 << 20),
}


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
