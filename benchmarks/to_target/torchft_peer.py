"""torchft's ``DiLoCo`` as a measured peer of the network suite: ``--systems torchft_diloco:sync_every=10``.

torchft (https://github.com/pytorch/torchft) runs DiLoCo through its fault-tolerance ``Manager``: every replica
(here, one emulated host) asks a *lighthouse* for a quorum at each synchronization, then averages the
pseudo-gradients over a ``torchft.ProcessGroupGloo`` and applies the outer optimizer. This module starts that
machinery inside the suite's hosts: rank 0 serves the lighthouse on its host address, every rank a replica-group
store and a manager bound to its own host address (torchft 0.2.0 binds its manager to ``[::]`` and its recovery
HTTP server to every interface; :func:`bind_to` pins both to the host's address, so nothing listens beyond the
emulated link). The lighthouse's address reaches the other ranks as bytes in a broadcast tensor, never pickled.

With ``init_sync=False`` torchft's DiLoCo gives weights bit-identical to Bagua's ``diloco`` with
``compression="none"`` (tests/torch_api/test_diloco_torchft.py), so the two differ in time only: torchft's quorum
round trip per synchronization and its float32 pseudo-gradients (its quantized path needs CUDA and Triton). It is
an optional peer (``pip install -e '.[bench-torchft]'``) and never part of ``--systems all``; a timed run
has no communication timer (``comm_busy_s`` is empty), as for plain DDP.

Example (as root, 2 emulated hosts at 100 Mbit/s)::

    python -m benchmarks.network --hosts 2 --bandwidths 100mbit --models gpt \\
        --systems "diloco:sync_every=10:compression=none,torchft_diloco:sync_every=10"
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api import env
from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

__all__ = ["NAME", "available", "bind_to", "torchft_diloco"]

NAME = "torchft_diloco"
_ADDRESS_BYTES = 256


def available() -> bool:
    """Whether torchft can be imported here."""
    import importlib.util

    return importlib.util.find_spec("torchft") is not None


def bind_to(host: str) -> None:
    """Make torchft 0.2.0's servers listen on ``host`` only: its manager server binds ``[::]`` and its recovery
    HTTP server every interface (and advertises the machine's hostname) unless told otherwise."""
    from http.server import ThreadingHTTPServer

    import torchft.checkpointing.http_transport as http_transport
    import torchft.manager as manager_module

    class _HostHTTPServer(ThreadingHTTPServer):
        request_queue_size = 1024

        def __init__(self, server_address, handler):
            super().__init__((host, 0), handler)

    http_transport._IPv6HTTPServer = _HostHTTPServer
    address = http_transport.HTTPTransport.address
    http_transport.HTTPTransport.address = lambda self: address(self).replace(f"//{socket.gethostname()}:",
                                                                              f"//{host}:")
    server = manager_module.ManagerServer
    manager_module.ManagerServer = lambda **kw: server(**{**kw, "bind": kw["bind"].replace("[::]", host)})


def _share_address(address: Optional[str]) -> str:
    """Rank 0's ``address`` on every rank, as bytes in a broadcast uint8 tensor."""
    buf = torch.zeros(_ADDRESS_BYTES, dtype=torch.uint8)
    if address is not None:
        data = address.encode()
        if len(data) > _ADDRESS_BYTES:
            raise ValueError(f"lighthouse address too long: {address!r}")
        buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return bytes(buf[buf != 0].tolist()).decode()


def torchft_diloco(model: torch.nn.Module, make_inner: Callable, sync_every: int = DiLoCoAlgorithm.sync_every,
                   outer_lr: float = DiLoCoAlgorithm.outer_lr, outer_momentum: float = DiLoCoAlgorithm.outer_momentum,
                   nesterov: bool = DiLoCoAlgorithm.nesterov,
                   timeout_s: float = 300.0) -> tuple[torch.optim.Optimizer, Callable[[], None], str]:
    """``model`` trained by torchft's ``DiLoCo`` across the default group's ranks, one replica per rank.

    ``make_inner(params)`` builds the inner optimizer; the outer one is SGD with ``outer_lr``, ``outer_momentum``
    and Nesterov (when the momentum is not 0). The defaults are ``diloco``'s, so that the two systems named without
    arguments train alike (and the suite times whole rounds of either,
    :func:`~benchmarks.common.systems.steps_per_round`). Returns the inner optimizer (the one the loop steps),
    ``close`` (leaves the DiLoCo context, shuts the manager down and, on rank 0, the lighthouse, after a barrier: no
    rank is still in a quorum) and a note for the results.
    """
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    rank, world = dist.get_rank(), dist.get_world_size()
    host = env.node_address()
    bind_to(host)
    lighthouse = None
    if rank == 0:
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(bind=f"{host}:0", min_replicas=world)
    # the lighthouse advertises the machine's hostname, which inside an emulated host does not lead back to it
    own = None if lighthouse is None else f"http://{host}:{lighthouse.address().rsplit(':', 1)[1]}"
    address = _share_address(own)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's own store
    store_alive = [store]  # held by close(): a collected master store stops serving the quorum's rendezvous
    timeout = timedelta(seconds=timeout_s)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world, use_async_quorum=False,
                      init_sync=False, rank=0, world_size=1, store_addr=host, store_port=store.port,
                      lighthouse_addr=address, replica_id=str(rank), hostname=host, port=0,
                      load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                      state_dict=lambda: {"model": model.state_dict()},
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    inner = make_inner(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum,
                            nesterov=nesterov and outer_momentum > 0)
    diloco = DiLoCo(manager, [model], inner, outer, sync_every=sync_every, backup_device=torch.device("cpu"),
                    pin_memory=False)
    diloco.__enter__()

    def close() -> None:
        diloco.__exit__(None, None, None)
        dist.barrier()
        manager.shutdown(wait=False)
        del store_alive[:]  # the replica group's store served the other replicas until here
        if lighthouse is not None:
            lighthouse.shutdown()

    return inner, close, (f"torchft {_version()} DiLoCo (init_sync=False), sync_every={sync_every}, outer SGD lr "
                          f"{outer_lr} momentum {outer_momentum}; float32 pseudo-gradients over its gloo group")


def _version() -> str:
    from importlib.metadata import version

    return version("torchft")
