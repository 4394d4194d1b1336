"""Checkpoints of sharded replicas with ``torch.distributed.checkpoint`` (DCP): what Bagua adds to FSDP2's state.

``model.bagua_sharded`` (a :class:`~bagua.torch_api.sharded.replicas.ShardedReplicas`) is a DCP ``Stateful``: save
it beside the model's and the optimizer's state dicts, and a run loaded from the checkpoint trains on bit for bit as
the uninterrupted run would (checked with 2 replicas x 2 shards for DiLoCo with SGD, Adam and AdamW as its inner
optimizer, streaming DiLoCo with uint8 residuals and an exchange in flight, and ByteGrad with error feedback). Its
state, per rank:

- the step counters (the same on every rank: plain tensors);
- DiLoCo's outer state, the same on every replica: each fragment's global weights, the outer optimizer's
  per-element tensors (momentum) and an exchange's average waiting for its outer step (``overlap_steps > 0``),
  saved per parameter as DTensors with the parameter's own mesh and placements. DCP saves one copy of the replicas'
  identical shards, and loads them onto another number of shards per replica as it does the model;
- DiLoCo only: this replica's weights and inner optimizer state, keyed ``replica<r>.*`` (per-parameter DTensors).
  Between outer steps the replicas' weights differ, and their inner optimizers' state always does, while DCP keeps
  a single copy of what ``get_model_state_dict`` / ``get_optimizer_state_dict`` return under the keys all replicas
  share. Loading writes them into the parameters and the optimizer's state in place, after DCP filled the model's
  and the optimizer's entries (which share that storage, so ``set_*_state_dict`` afterwards keeps them);
- the error-feedback residuals, which differ between replicas and follow the layout of this rank's shard (ByteGrad's
  per FSDP2 unit, whose layout is FSDP2's padded unit buffer; DiLoCo's codec per fragment): one serialized entry per
  rank, keyed ``ranks.replica<r>.shard<s>``. They load only onto the mesh shape they were saved at; another shape
  raises ``ValueError`` naming them (a rank whose key the checkpoint lacks fails in DCP with a missing key).

Keys do not depend on the moment of the save (before DiLoCo's warm-up ended, before the first outer step, between
an exchange and its outer step): a fresh model's ``state_dict()`` is the template DCP loads into.

Example (a complete script that saves, loads and checks the resumed run, run by the tests as shown:
docs/fsdp.md, Checkpoints):
    >>> import torch.distributed.checkpoint as dcp  # doctest: +SKIP
    >>> from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
    ...     set_model_state_dict, set_optimizer_state_dict)  # doctest: +SKIP
    >>> def state(model, opt):  # doctest: +SKIP
    ...     return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
    ...             "bagua": model.bagua_sharded}
    >>> dcp.save(state(model, opt), checkpoint_id=path)  # doctest: +SKIP
    >>> # a fresh run: the same mesh, fully_shard and with_bagua(..., device_mesh=mesh) calls, then
    >>> loaded = state(model, opt)  # doctest: +SKIP
    >>> dcp.load(loaded, checkpoint_id=path)  # doctest: +SKIP
    >>> set_model_state_dict(model, loaded["model"])  # doctest: +SKIP
    >>> set_optimizer_state_dict(model, opt, loaded["optim"])  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import io
from typing import Any, Optional

import torch

__all__ = ["sharded_state_dict", "load_sharded_state_dict", "per_rank_key"]


def per_rank_key(position: tuple[int, int]) -> str:
    """The key of one rank's residuals: ``ranks.replica<r>.shard<s>`` for ``position = (r, s)``."""
    return f"ranks.replica{position[0]}.shard{position[1]}"


def _step_keys(optimizer: torch.optim.Optimizer, probes: list[torch.Tensor]) -> list[tuple[list[str], list[str]]]:
    """Step ``optimizer``, a throwaway over ``probes``, once with zero gradients; return each probe's state keys, per
    element and scalar. The real optimizers hold no state before their first step, and a checkpoint's keys must not
    depend on it."""
    for probe in probes:
        probe.grad = torch.zeros_like(probe)
    optimizer.step()
    keys = []
    for probe in probes:
        tensors = {k: v for k, v in optimizer.state.get(probe, {}).items() if torch.is_tensor(v)}
        elements = sorted(k for k, v in tensors.items() if v.numel() == probe.numel())
        keys.append((elements, sorted(k for k in tensors if k not in elements)))
    return keys


def _outer_keys(driver: Any) -> tuple[list[str], list[str]]:
    """The state keys of DiLoCo's outer optimizers, per element and scalar."""
    probe = torch.zeros(3)
    return _step_keys(driver.outer_factory()([probe]), [probe])[0]


def _inner_keys(optimizer: torch.optim.Optimizer) -> dict[int, tuple[list[str], list[str]]]:
    """The state keys of the inner optimizer, per element and scalar, by parameter: ``id(param) -> keys``.

    The throwaway optimizer is a copy made as ``pickle`` and ``copy`` make one (``__getstate__``, then
    ``__setstate__`` on a new instance), with fresh state and one probe per parameter group, that group's
    hyper-parameters, device and dtype; the real one's parameters, state and hooks are not touched. It does not go
    through the constructor: ``defaults`` need not be its keywords (AdamW's hold ``decoupled_weight_decay``, which
    its constructor rejects in torch 2.13).
    """
    probes = [torch.zeros(3, dtype=group["params"][0].dtype, device=group["params"][0].device)
              if group["params"] else torch.zeros(3) for group in optimizer.param_groups]
    copied = dict(optimizer.__getstate__())
    copied.update(defaults=dict(copied["defaults"]), state=collections.defaultdict(dict),
                  param_groups=[dict(group, params=[probe]) for group, probe in zip(optimizer.param_groups, probes)])
    throwaway = type(optimizer).__new__(type(optimizer))
    throwaway.__setstate__(copied)
    keys = _step_keys(throwaway, probes)
    return {id(p): group_keys for group, group_keys in zip(optimizer.param_groups, keys) for p in group["params"]}


def _dtensor(values: torch.Tensor, param: Any, local: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(values.view_as(local), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _param_offsets(driver: Any) -> dict[int, tuple[int, int]]:
    """Where each local shard sits in its fragment's flat tensors: ``id(shard) -> (fragment, offset)``."""
    where = {}
    for fragment in driver.fragments:
        offset = 0
        for local in fragment.params:
            where[id(local)] = (fragment.index, offset)
            offset += local.numel()
    return where


def _diloco_state(replicas: Any, codecs: dict[int, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """DiLoCo's part: the driver's flat per-fragment state, cut per parameter; ``codecs`` receives the residuals."""
    driver, hyper = replicas.driver, replicas.algorithm
    driver.wait_pending()
    flat = driver.state_dict()
    state: dict[str, Any] = {"diloco.steps": flat["steps"], "diloco.processed": flat["processed"],
                             "diloco.built": torch.tensor(int(bool(driver.fragments)))}
    elements, scalars = _outer_keys(driver)
    suffixes = ["global"] + [f"outer.{k}" for k in elements] + (["pending_average"] if hyper.overlap_steps else [])
    where = _param_offsets(driver)
    for name, param, local in replicas.named_shards:
        if not local.numel():
            continue
        index, offset = where.get(id(local), (-1, 0))
        for suffix in suffixes:
            # absent (before the warm-up ended, before the first outer step, no exchange in flight): zeros, which
            # the flags below tell the load to ignore
            source: Optional[torch.Tensor] = flat.get(f"{index}.{suffix}")
            values = (torch.zeros(local.numel()) if source is None else
                      source[offset : offset + local.numel()].clone())
            state[f"diloco.{suffix}.{name}"] = _dtensor(values, param, local)
    stepped = {f.index for f in driver.fragments if f.outer.state.get(f.global_)}
    for i in range(hyper.fragments):
        state[f"diloco.fragment{i}.outer_stepped"] = torch.tensor(int(i in stepped))
        for key in scalars:
            state[f"diloco.fragment{i}.outer.{key}"] = flat.get(f"{i}.outer.{key}", torch.tensor(0.0)).clone()
        if hyper.overlap_steps:
            state[f"diloco.fragment{i}.pending_finish"] = flat.get(f"{i}.pending_finish", torch.tensor(-1))
        codec = {k.split(".", 2)[2]: v for k, v in flat.items() if k.startswith(f"{i}.codec.")}
        if codec:
            codecs[i] = codec
    return state


def _load_diloco(replicas: Any, state: dict[str, Any], codecs: dict[int, dict[str, torch.Tensor]]) -> None:
    """Rebuild the driver's flat per-fragment state from the per-parameter DTensors and load it."""
    driver, hyper = replicas.driver, replicas.algorithm
    flat: dict[str, torch.Tensor] = {"steps": state["diloco.steps"], "processed": state["diloco.processed"]}
    if int(state["diloco.built"]):
        if not driver.fragments:
            replicas._build_fragments()  # saved after the warm-up: the fragments exist from then on
        elements, scalars = _outer_keys(driver)
        names = {id(local): name for name, _, local in replicas.named_shards}
        for fragment in driver.fragments:
            i = fragment.index
            # what the checkpoint lacks was absent at the save: drop this run's own
            fragment.outer.state.clear()
            fragment.pending = fragment.workspace = None
            stepped = bool(int(state[f"diloco.fragment{i}.outer_stepped"]))
            finish = int(state[f"diloco.fragment{i}.pending_finish"]) if hyper.overlap_steps else -1
            suffixes = ["global"] + ([f"outer.{k}" for k in elements] if stepped else []) + (
                ["pending_average"] if finish >= 0 else [])
            for suffix in suffixes:
                flat[f"{i}.{suffix}"] = torch.cat([state[f"diloco.{suffix}.{names[id(local)]}"].to_local().reshape(-1)
                                                   for local in fragment.params])
            if stepped:
                flat.update({f"{i}.outer.{k}": state[f"diloco.fragment{i}.outer.{k}"] for k in scalars})
            if finish >= 0:
                flat[f"{i}.pending_finish"] = torch.tensor(finish)
            flat.update({f"{i}.codec.{k}": v for k, v in codecs.get(i, {}).items()})
    driver.load_state_dict(flat)


def _replica_state(replicas: Any) -> dict[str, Any]:
    """This replica's weights and inner optimizer state under keys naming it: DiLoCo's replicas differ between
    outer steps (the inner optimizer's state always), and DCP keeps one copy of a key the replicas share."""
    prefix, optimizer = f"replica{replicas.position[0]}", replicas.optimizer
    keys = _inner_keys(optimizer)
    # a parameter whose group keeps no state (SGD without momentum) does not count
    stepped = all(optimizer.state.get(p) for _, p, local in replicas.named_shards
                  if local.numel() and any(keys.get(id(p), ((), ()))))
    state: dict[str, Any] = {f"{prefix}.optim_stepped": torch.tensor(int(stepped))}
    for name, param, local in replicas.named_shards:
        if not local.numel():
            continue
        elements, scalars = keys.get(id(param), ([], []))
        mine = optimizer.state.get(param, {}) if stepped else {}
        state[f"{prefix}.param.{name}"] = _dtensor(local.detach().clone(), param, local)
        for key in elements:
            value = mine[key].to_local().detach().clone() if key in mine else torch.zeros_like(local)
            state[f"{prefix}.optim.{key}.{name}"] = _dtensor(value, param, local)
        for key in scalars:
            state[f"{prefix}.optim.{key}.{name}"] = mine[key].detach().clone() if key in mine else torch.tensor(0.0)
    return state


@torch.no_grad()
def _load_replica(replicas: Any, state: dict[str, Any]) -> None:
    """Write this replica's weights and inner optimizer state in place (what ``get_model_state_dict`` and
    ``get_optimizer_state_dict`` returned share their storage, so ``set_*_state_dict`` afterwards keeps them)."""
    prefix, optimizer = f"replica{replicas.position[0]}", replicas.optimizer
    keys = _inner_keys(optimizer)
    stepped = bool(int(state[f"{prefix}.optim_stepped"]))
    for name, param, local in replicas.named_shards:
        if not local.numel():
            continue
        local.copy_(state[f"{prefix}.param.{name}"].to_local())
        elements, scalars = keys.get(id(param), ([], []))
        if not stepped or not elements + scalars:
            continue
        mine = optimizer.state[param]
        for key in elements + scalars:
            value = state[f"{prefix}.optim.{key}.{name}"]
            value = value.to_local() if key in elements else value
            if torch.is_tensor(mine.get(key)):
                target = mine[key].to_local() if key in elements else mine[key]
                target.copy_(value)
            else:
                mine[key] = _dtensor(value.clone(), param, local) if key in elements else value.clone()


def _bytegrad_state(replicas: Any) -> dict[int, tuple[int, dict[str, torch.Tensor]]]:
    """ByteGrad's residuals, per FSDP2 unit: ``unit -> (numel, residuals)``."""
    return {unit: (ws.numel, ws.state_dict()) for unit, ws in replicas._workspaces.items()}


def _load_bytegrad(replicas: Any, saved: dict[int, tuple[int, dict[str, torch.Tensor]]]) -> None:
    """Rebuild ByteGrad's workspaces with the residuals saved (a unit saved without any gets none: zeros)."""
    from bagua.torch_api.codecs.workspace import make_workspace

    a = replicas.algorithm
    device = replicas.named_shards[0][2].device
    replicas._workspaces.clear()
    for unit, (numel, residuals) in saved.items():
        ws = make_workspace(a.codec, numel, replicas.communicator.nranks(), device, a.block_size, a.error_feedback)
        ws.load_state_dict(residuals)
        replicas._workspaces[unit] = ws


def _has_residuals(replicas: Any) -> bool:
    """Whether the replica exchange keeps codec residuals: asked of its hook (``replicas.hook``, what the algorithm
    answered), never of the algorithm's class name, so a user's subclass saves them too."""
    a = replicas.algorithm
    if replicas.hook == "bytegrad":
        return bool(a.error_feedback)
    return replicas.hook == "diloco" and replicas.driver.error_feedback and a.compression != "none"


def sharded_state_dict(replicas: Any) -> dict[str, Any]:
    """Return the checkpoint state of ``replicas`` (a :class:`~bagua.torch_api.sharded.replicas.ShardedReplicas`),
    keyed the same at every moment of training (see the module docstring)."""
    state: dict[str, Any] = {"steps": torch.tensor(replicas.steps)}
    codecs: dict[int, dict[str, torch.Tensor]] = {}
    if replicas.driver is not None:
        state.update(_diloco_state(replicas, codecs))
        state.update(_replica_state(replicas))
    if _has_residuals(replicas):
        ranks = {"mesh_shape": replicas.mesh_shape, "diloco": codecs, "bytegrad": _bytegrad_state(replicas)}
        buffer = io.BytesIO()
        torch.save(ranks, buffer)
        # bytes, not tensors: DCP saves every rank's own key, and loads it whatever its shapes
        state[per_rank_key(replicas.position)] = buffer.getvalue()
    return state


def load_sharded_state_dict(replicas: Any, state: dict[str, Any]) -> None:
    """Restore ``replicas`` from ``state`` as ``torch.distributed.checkpoint.load`` filled it.

    Raises:
        ValueError: the checkpoint holds error-feedback residuals saved at another mesh shape.
    """
    ranks: dict[str, Any] = {"diloco": {}, "bytegrad": {}}
    key = per_rank_key(replicas.position)
    if key in state:
        ranks = torch.load(io.BytesIO(state[key]), weights_only=True)
        if tuple(ranks["mesh_shape"]) != tuple(replicas.mesh_shape):
            raise ValueError(
                "cannot reshard the error-feedback residuals (ByteGrad's, laid out as FSDP2's padded unit buffer; "
                "DiLoCo's codec residuals, over this rank's shard of each fragment): saved at (replicas, shards) = "
                f"{tuple(ranks['mesh_shape'])}, loading at {tuple(replicas.mesh_shape)}. Load at the mesh shape of "
                "the save, or train without error feedback (compression='none' for DiLoCo)")
    if replicas.driver is not None:  # its step counters come back with it ("steps" is saved as a summary)
        _load_diloco(replicas, state, ranks["diloco"])
        _load_replica(replicas, state)
    if ranks["bytegrad"]:
        _load_bytegrad(replicas, ranks["bytegrad"])
