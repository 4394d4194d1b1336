"""Fault tolerance: a communicator over whichever workers are alive, for any algorithm, and healing from a peer.

- :mod:`~bagua.torch_api.fault.replica`: :class:`FaultTolerance`, the communicator: a quorum per round
  (:mod:`~bagua.torch_api.fault.quorum`, typed records in :mod:`~bagua.torch_api.fault.records`) agreed through
  the coordinator's ``TCPStore`` (:mod:`~bagua.torch_api.fault.coordinator`), weighted collectives over exactly
  the round's members, a commit verdict, and healing through the state callbacks the algorithm registers; a worker
  may be several ranks holding an FSDP2-sharded model, its first rank speaking for it
  (:mod:`~bagua.torch_api.fault.ranks`);
- :mod:`~bagua.torch_api.fault.transfer`: stream a flat dict of tensors between two ranks (a JSON manifest, the
  bytes in buckets, a SHA-256; never unpickled; every wait bounded by ``BAGUA_COMM_TIMEOUT_S``);
- :mod:`~bagua.torch_api.fault.heal`: a state and an optimizer's over that wire, sent by a live peer and taken by
  a joiner through the algorithm's ``heal_state_dict`` / ``load_heal_state_dict``;
- :mod:`~bagua.torch_api.fault.secret`: the job secret (only the job's workers take part; every record read from
  the store sealed with HMAC-SHA256) and :mod:`~bagua.torch_api.fault.screen`: one bad worker's contribution left
  out of a round (not finite, or far too large) and its sample claims bounded;
- :mod:`~bagua.torch_api.fault.synchronous`: :class:`SyncSteps`, a synchronous job's optimizer step as a round
  (gradient allreduce and ByteGrad with ``fault_tolerance=``): the quorum agreed behind the forward pass, the
  gradients averaged over the live members, a joiner healed with the optimizer's whole state.

Nothing here knows an algorithm: DiLoCo (:class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver`, and its
asynchronous log in :mod:`~bagua.torch_api.ops.diloco_async_ft`) and the synchronous algorithms call it.
See docs/fault_tolerance.md.

Example:
    >>> from bagua.torch_api.fault import FaultTolerance, heal_group, serve_driver, heal_driver  # doctest: +SKIP
"""

from __future__ import annotations

from bagua.torch_api.fault.heal import (
    TAKE_INNER_STATE, driver_heal_state, flatten_optimizer_state, heal_driver, heal_state, load_inner_state,
    serve_driver, serve_state, unflatten_optimizer_state,
)
from bagua.torch_api.fault.quorum import CoordinatorLost, JobEnded
from bagua.torch_api.fault.records import Member, Quorum, Round
from bagua.torch_api.fault.replica import FaultTolerance, SettingsDiffer
from bagua.torch_api.fault.secret import NotAdmitted, new_secret
from bagua.torch_api.fault.synchronous import SyncSteps
from bagua.torch_api.fault.transfer import DEFAULT_BUCKET_BYTES, heal_group, receive_state, send_state

__all__ = [
    "FaultTolerance", "SyncSteps", "SettingsDiffer", "CoordinatorLost", "JobEnded", "NotAdmitted", "new_secret",
    "Member", "Quorum", "Round", "DEFAULT_BUCKET_BYTES",
    "TAKE_INNER_STATE", "heal_group", "send_state", "receive_state", "serve_state", "heal_state",
    "load_inner_state", "serve_driver", "heal_driver", "driver_heal_state", "flatten_optimizer_state",
    "unflatten_optimizer_state",
]
