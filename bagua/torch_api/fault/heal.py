"""Heal a joining DiLoCo worker from a live peer: the global weights, outer state and counters, never a checkpoint.

A worker that restarts (or joins) at a synchronization calls :func:`heal_driver`; one live peer calls
:func:`serve_driver` with it. The peer sends, through :func:`~bagua.torch_api.fault.transfer.send_state`
(checksummed, never unpickled):

1. the step counters (``steps``, ``processed``, ``syncs``), so the joiner keeps the job's schedule;
2. each fragment's global weights and outer-optimizer tensors (e.g. Nesterov momentum), the same on every rank;
3. an exchange in flight, if any (its average, which is the same on every rank);
4. the inner optimizer's hyper-parameters (``param_groups``: a scheduled learning rate), and its state tensors
   (Adam's moments) only with ``inner_state=True``: measured, a fresh inner state lands at the same loss
   (docs/fault_tolerance.md), so the default, :data:`TAKE_INNER_STATE`, leaves them out.

The joiner then sets its weights to the global weights (``x = g``, as after an outer step with ``tau = 0``) and
starts its per-rank state empty: the codec residuals (error feedback) are this rank's own compression error, which
a new worker has not made, so they start at zero rather than as a copy of the peer's.

Example:
    >>> group = heal_group()  # collective, every rank, at start-up  # doctest: +SKIP
    >>> if rank == 0: serve_driver(opt, dst=1, group=group, optimizer=opt.inner)  # doctest: +SKIP
    >>> if rank == 1: heal_driver(opt, src=0, group=group, optimizer=opt.inner)  # doctest: +SKIP
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch

from bagua.torch_api.fault.transfer import receive_state, send_state
from bagua.torch_api.ops.diloco_driver import DiLoCoDriver

__all__ = ["TAKE_INNER_STATE", "INNER_PREFIX", "driver_heal_state", "serve_driver", "heal_driver",
           "flatten_optimizer_state", "unflatten_optimizer_state"]

#: whether :func:`serve_driver` sends the inner optimizer's state tensors by default (measured: no better loss)
TAKE_INNER_STATE = False
#: the keys of the inner optimizer's part of a healing state
INNER_PREFIX = "inner."
_TREE = "__tree__"


# -- an optimizer's state dict as flat tensors plus one JSON tree ----------------------------------------------


def flatten_optimizer_state(state_dict: dict[str, Any], prefix: str = INNER_PREFIX) -> dict[str, torch.Tensor]:
    """Flatten ``optimizer.state_dict()`` into tensors ``<prefix><i>`` and a JSON tree of the rest, ``<prefix>__tree__``
    (a uint8 tensor), so that it travels without pickle; :func:`unflatten_optimizer_state` reverses it.

    Dicts keep their int or str keys, tuples stay tuples; leaves other than tensors must be None, bool, int, float
    or str (what torch's optimizers hold).

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.9)
        >>> flat = flatten_optimizer_state(opt.state_dict())
        >>> unflatten_optimizer_state(flat)["param_groups"][0]["lr"]
        0.1
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any) -> Any:
        if torch.is_tensor(obj):
            key = f"{prefix}{len(tensors)}"
            tensors[key] = obj
            return {"t": key}
        if isinstance(obj, dict):
            if not all(isinstance(k, (int, str)) and not isinstance(k, bool) for k in obj):
                raise ValueError(f"an optimizer state dict key must be int or str, got {list(obj)!r}")
            return {"d": [[k, walk(v)] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            return {"l" if isinstance(obj, list) else "u": [walk(v) for v in obj]}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return {"v": obj}
        raise ValueError(f"cannot send an optimizer state leaf of type {type(obj).__name__}; only tensors, None, "
                         "bool, int, float and str travel (never pickled)")

    tree = json.dumps(walk(state_dict)).encode()
    tensors[prefix + _TREE] = torch.frombuffer(bytearray(tree), dtype=torch.uint8)
    return tensors


def unflatten_optimizer_state(flat: dict[str, torch.Tensor], prefix: str = INNER_PREFIX) -> dict[str, Any]:
    """Rebuild the state dict that :func:`flatten_optimizer_state` flattened; raise ``ValueError`` on a malformed
    tree (one node kind per dict, tensor names that exist).

    Example:
        >>> unflatten_optimizer_state(flatten_optimizer_state({"state": {}, "param_groups": []}))
        {'state': {}, 'param_groups': []}
    """
    if prefix + _TREE not in flat:
        raise ValueError(f"no {prefix + _TREE!r} in the state: it holds no flattened optimizer state")
    tree = json.loads(flat[prefix + _TREE].numpy().tobytes().decode())

    def build(node: Any) -> Any:
        if not (isinstance(node, dict) and len(node) == 1):
            raise ValueError(f"malformed optimizer state tree node {node!r}")
        (kind, value), = node.items()
        if kind == "t":
            if value not in flat or not value.startswith(prefix):
                raise ValueError(f"the optimizer state tree names a tensor {value!r} that did not travel")
            return flat[value]
        if kind == "d":
            return {k: build(v) for k, v in value}
        if kind in ("l", "u"):
            items = [build(v) for v in value]
            return items if kind == "l" else tuple(items)
        if kind == "v":
            return value
        raise ValueError(f"malformed optimizer state tree node kind {kind!r}")

    return build(tree)


# -- a DiLoCo driver ----------------------------------------------------------------------------------------


def _driver(obj: Any) -> DiLoCoDriver:
    driver = obj if isinstance(obj, DiLoCoDriver) else getattr(obj, "driver", None)
    if not isinstance(driver, DiLoCoDriver):
        raise ValueError(f"expected a DiLoCoDriver, or what holds one as .driver (a DiLoCoOptimizer, "
                         f"model.bagua_algorithm of DiLoCoAlgorithm); got {type(obj).__name__}")
    if not driver.fragments:
        raise ValueError(f"{driver.owner}: the fragments are not built yet (still warming up, or before the first "
                         "step): heal after the warm-up, at a synchronization")
    return driver


def driver_heal_state(driver: Any) -> dict[str, torch.Tensor]:
    """What a joining worker takes from a live peer's driver: its ``state_dict`` (counters, global weights, outer
    optimizer tensors, an exchange in flight) and ``syncs``, without the codec residuals (``*.codec.*``), which
    are the peer's own.

    Example:
        >>> sorted(driver_heal_state(opt))  # doctest: +SKIP
        ['0.global', '0.outer.momentum_buffer', 'processed', 'steps', 'syncs']
    """
    d = _driver(driver)
    state = {k: v for k, v in d.state_dict(("steps", "processed")).items() if ".codec." not in k}
    state["syncs"] = torch.tensor(d.syncs)
    return state


def serve_driver(driver: Any, dst: int, group: Any = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 inner_state: bool = TAKE_INNER_STATE) -> int:
    """Send this live rank's DiLoCo state to the joining global rank ``dst`` (which calls :func:`heal_driver`);
    return the bytes sent.

    Args:
        driver: a :class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver`, or what holds one as ``.driver``.
        dst: the joiner's global rank.
        group: the group to send on (default: :func:`~bagua.torch_api.fault.transfer.heal_group`'s).
        optimizer: the inner optimizer: its ``param_groups`` travel, and its state tensors with ``inner_state``.
        inner_state: send the inner optimizer's state (Adam's moments); default :data:`TAKE_INNER_STATE`.

    Example:
        >>> serve_driver(model.bagua_algorithm, dst=3, optimizer=opt)  # doctest: +SKIP
    """
    state = driver_heal_state(driver)
    if optimizer is not None:
        inner = optimizer.state_dict()
        state.update(flatten_optimizer_state({"state": _local(inner["state"]) if inner_state else {},
                                              "param_groups": inner["param_groups"]}))
    return send_state(state, dst, group)


def _local(state: dict[Any, Any]) -> dict[Any, Any]:
    """An optimizer's per-parameter state with each DTensor (a sharded parameter's, FSDP2) as this rank's shard."""
    return {k: {n: v.to_local() if hasattr(v, "to_local") else v for n, v in entry.items()}
            for k, entry in state.items()}


def _sharded_like(optimizer: torch.optim.Optimizer, state: dict[Any, Any]) -> dict[Any, Any]:
    """The inverse of :func:`_local` on this rank: each shard of a sharded parameter's state as a DTensor laid out
    as the parameter (the same shard of the same parameter, sent by the same shard's rank of a peer)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {}
    for k, entry in state.items():
        p = params[int(k)]
        if isinstance(p, DTensor):
            local = p.to_local()
            entry = {n: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
                     if torch.is_tensor(v) and v.shape == local.shape and v.dim() > 0 else v
                     for n, v in entry.items()}
        out[k] = entry
    return out


@torch.no_grad()
def heal_driver(driver: Any, src: int, group: Any = None, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
    """Take the DiLoCo state of the live global rank ``src`` (which calls :func:`serve_driver`) into this joining
    rank's driver and weights; return whether the inner optimizer's state tensors came too.

    1. receive the state (checksummed; nothing is changed here unless it is whole);
    2. start the per-rank state empty: no exchange in flight, codec residuals (error feedback) at zero;
    3. load counters, global weights, outer state (``driver.load_state_dict``) and ``syncs``;
    4. set the weights to the global weights (``x = g``);
    5. with ``optimizer``: load the peer's ``param_groups``, and its state, or an empty (fresh) state when it did
       not travel.

    Example:
        >>> heal_driver(model.bagua_algorithm, src=0, optimizer=opt)  # doctest: +SKIP
    """
    d = _driver(driver)
    state = receive_state(src, group)
    inner = {k: v for k, v in state.items() if k.startswith(INNER_PREFIX)}
    for fragment in d.fragments:
        fragment.workspace = None  # a new workspace's residuals start at zero
        fragment.pending = None
    d.load_state_dict({k: v for k, v in state.items() if not k.startswith(INNER_PREFIX) and k != "syncs"})
    d.syncs = int(state["syncs"])
    for fragment in d.fragments:
        offset = 0
        for p in fragment.params:
            p.copy_(fragment.global_[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    if optimizer is None or not inner:
        return False
    peer = unflatten_optimizer_state(inner)
    peer["state"] = _sharded_like(optimizer, peer["state"])
    optimizer.load_state_dict(peer)  # an empty "state": the moments start fresh, as a new optimizer's
    return bool(peer["state"])
