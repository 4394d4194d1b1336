"""Heal a joining worker from a live peer through the algorithm's own state callbacks, never a checkpoint.

The fault layer knows no algorithm: what travels is whatever the algorithm's ``heal_state_dict()`` returns (a flat
dict of tensors; DiLoCo's: its counters, each fragment's global weights and outer-optimizer tensors, an exchange in
flight), and the joiner hands the same dict to its ``load_heal_state_dict(state)``. One live peer calls
:func:`serve_state` (or :func:`serve_driver` with the object that holds the callbacks), the joiner
:func:`heal_state` (or :func:`heal_driver`); the state travels through
:func:`~bagua.torch_api.fault.transfer.send_state` (checksummed, never unpickled), with

- the inner optimizer's hyper-parameters (``param_groups``: a scheduled learning rate), and its state tensors
  (Adam's moments) only with ``inner_state=True``: measured, a fresh inner state lands at the same loss
  (docs/fault_tolerance.md), so the default, :data:`TAKE_INNER_STATE`, leaves them out.

Per-rank state (DiLoCo's codec residuals, which are this rank's own compression error) does not travel: the
algorithm's ``load_heal_state_dict`` starts it empty.

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

__all__ = ["TAKE_INNER_STATE", "INNER_PREFIX", "serve_state", "heal_state", "load_inner_state", "driver_heal_state",
           "serve_driver", "heal_driver", "flatten_optimizer_state", "unflatten_optimizer_state"]

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


# -- a state and an optimizer's, over the wire -------------------------------------------------------------


def serve_state(state: dict[str, torch.Tensor], dst: int, group: Any = None,
                optimizer: Optional[torch.optim.Optimizer] = None, inner_state: bool = TAKE_INNER_STATE,
                key: Optional[bytes] = None) -> int:
    """Send ``state`` (the algorithm's heal state) and ``optimizer``'s (``param_groups``, and its state tensors with
    ``inner_state``) to the joining global rank ``dst``, which calls :func:`heal_state`; return the bytes sent.
    ``key``: sign it (HMAC-SHA256, see :func:`~bagua.torch_api.fault.transfer.send_state`)."""
    state = dict(state)
    if optimizer is not None:
        inner = optimizer.state_dict()
        state.update(flatten_optimizer_state({"state": _local(inner["state"]) if inner_state else {},
                                              "param_groups": inner["param_groups"]}))
    return send_state(state, dst, group, key=key)


def heal_state(src: int, group: Any = None, key: Optional[bytes] = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Receive what :func:`serve_state` sent from global rank ``src`` (checksummed, or signed under ``key``:
    nothing is returned unless it is whole); return the algorithm's state and the inner optimizer's part (empty
    when none travelled)."""
    state = receive_state(src, group, key=key)
    inner = {k: v for k, v in state.items() if k.startswith(INNER_PREFIX)}
    return {k: v for k, v in state.items() if not k.startswith(INNER_PREFIX)}, inner


def load_inner_state(optimizer: Optional[torch.optim.Optimizer], inner: dict[str, torch.Tensor]) -> bool:
    """Load the peer's ``param_groups`` into ``optimizer``, and its state, or an empty (fresh) state when it did not
    travel; return whether the state tensors came."""
    if optimizer is None or not inner:
        return False
    peer = unflatten_optimizer_state(inner)
    peer["state"] = _sharded_like(optimizer, peer["state"])
    optimizer.load_state_dict(peer)  # an empty "state": the moments start fresh, as a new optimizer's
    return bool(peer["state"])


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


# -- what holds the callbacks (DiLoCo's optimizer, algorithm or driver) -------------------------------------


def _healable(obj: Any) -> Any:
    if not (callable(getattr(obj, "heal_state_dict", None)) and callable(getattr(obj, "load_heal_state_dict", None))):
        raise ValueError(f"expected what heals through heal_state_dict() / load_heal_state_dict(): a "
                         f"DiLoCoOptimizer, model.bagua_algorithm of DiLoCoAlgorithm, or a DiLoCoDriver; got "
                         f"{type(obj).__name__}")
    return obj


def driver_heal_state(holder: Any) -> dict[str, torch.Tensor]:
    """What a joining worker takes from ``holder`` (anything with ``heal_state_dict()``: a DiLoCoOptimizer,
    ``model.bagua_algorithm`` of DiLoCoAlgorithm, a DiLoCoDriver).

    Example:
        >>> sorted(driver_heal_state(opt))  # doctest: +SKIP
        ['0.global', '0.outer.momentum_buffer', 'processed', 'steps', 'syncs']
    """
    return _healable(holder).heal_state_dict()


def serve_driver(holder: Any, dst: int, group: Any = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 inner_state: bool = TAKE_INNER_STATE) -> int:
    """Send ``holder``'s heal state to the joining global rank ``dst`` (which calls :func:`heal_driver`); return
    the bytes sent.

    Args:
        holder: what holds the state callbacks (a DiLoCoOptimizer, ``model.bagua_algorithm`` of DiLoCoAlgorithm, a
            DiLoCoDriver).
        dst: the joiner's global rank.
        group: the group to send on (default: :func:`~bagua.torch_api.fault.transfer.heal_group`'s).
        optimizer: the inner optimizer: its ``param_groups`` travel, and its state tensors with ``inner_state``.
        inner_state: send the inner optimizer's state (Adam's moments); default :data:`TAKE_INNER_STATE`.

    Example:
        >>> serve_driver(model.bagua_algorithm, dst=3, optimizer=opt)  # doctest: +SKIP
    """
    return serve_state(driver_heal_state(holder), dst, group, optimizer, inner_state)


@torch.no_grad()
def heal_driver(holder: Any, src: int, group: Any = None, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
    """Take the state of the live global rank ``src`` (which calls :func:`serve_driver`) into ``holder`` (its
    ``load_heal_state_dict``) and ``optimizer``; return whether the inner optimizer's state tensors came too.

    Example:
        >>> heal_driver(model.bagua_algorithm, src=0, optimizer=opt)  # doctest: +SKIP
    """
    target = _healable(holder)
    state, inner = heal_state(src, group)
    target.load_heal_state_dict(state)
    return load_inner_state(optimizer, inner)
