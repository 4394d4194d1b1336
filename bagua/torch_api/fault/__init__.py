"""Fault tolerance: heal a restarted or joining worker from a live peer instead of a checkpoint.

- :mod:`~bagua.torch_api.fault.transfer`: stream a flat dict of tensors between two ranks (a JSON manifest, the
  bytes in buckets, a SHA-256; never unpickled; every wait bounded by ``BAGUA_COMM_TIMEOUT_S``);
- :mod:`~bagua.torch_api.fault.heal`: what a joining DiLoCo worker takes from a live peer, and how it loads it.

- :mod:`~bagua.torch_api.fault.replica`: :class:`FaultTolerance`, DiLoCo over whichever workers are alive (each
  worker a job of its own), a quorum per synchronization (:mod:`~bagua.torch_api.fault.quorum`) agreed through
  the coordinator's ``TCPStore`` (:mod:`~bagua.torch_api.fault.coordinator`); a worker may be several ranks
  holding an FSDP2-sharded model, its first rank speaking for it (:mod:`~bagua.torch_api.fault.ranks`).

See docs/fault_tolerance.md.

Example:
    >>> from bagua.torch_api.fault import heal_group, serve_driver, heal_driver  # doctest: +SKIP
"""

from __future__ import annotations

from bagua.torch_api.fault.heal import (
    TAKE_INNER_STATE, driver_heal_state, flatten_optimizer_state, heal_driver, serve_driver,
    unflatten_optimizer_state,
)
from bagua.torch_api.fault.quorum import CoordinatorLost
from bagua.torch_api.fault.replica import FaultTolerance
from bagua.torch_api.fault.transfer import DEFAULT_BUCKET_BYTES, heal_group, receive_state, send_state

__all__ = [
    "FaultTolerance", "CoordinatorLost", "DEFAULT_BUCKET_BYTES", "TAKE_INNER_STATE", "heal_group", "send_state",
    "receive_state", "serve_driver", "heal_driver", "driver_heal_state", "flatten_optimizer_state",
    "unflatten_optimizer_state",
]
