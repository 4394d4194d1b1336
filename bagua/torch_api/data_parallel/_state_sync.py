"""Wrap-time agreement across ranks: consistency checks and rank 0's parameters and optimizer state.

Both run once when a module is wrapped (and again when an algorithm asks for a reset). The check is a single
small all-gather, so a model or optimizer that differs on some rank fails on *every* rank with the same message
instead of hanging in a later collective. Optimizer state travels as tensors plus a JSON description (no pickle).
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from bagua.torch_api import communication as comm
from bagua.torch_api.comm.process_group import BaguaProcessGroup

__all__ = ["check_consistency", "broadcast_module_and_optimizers"]

_ERR_FOREIGN_PARAMS = 1

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]


def _crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def _device(group: BaguaProcessGroup) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if group.stream is not None else torch.device("cpu")


def check_consistency(
    module: torch.nn.Module, params: NamedParams, optimizers: Sequence[torch.optim.Optimizer], group: BaguaProcessGroup
) -> None:
    """Raise ``ValueError`` on every rank unless all ranks have the same parameters, buffers and optimizers.

    Also rejects, on every rank, an optimizer that holds parameters the module does not have.
    """
    param_sig = "|".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in params)
    buffer_sig = "|".join(f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers())
    opt_sig = "|".join(
        f"{type(o).__name__}:{[len(g['params']) for g in o.param_groups]}" for o in optimizers
    )
    model_ids = {id(p) for p in module.parameters()}
    foreign = [
        tuple(p.shape) for o in optimizers for g in o.param_groups for p in g["params"] if id(p) not in model_ids
    ]
    mine = torch.tensor(
        [_crc(param_sig), len(params), _crc(opt_sig), _ERR_FOREIGN_PARAMS if foreign else 0, _crc(buffer_sig)],
        dtype=torch.int64,
        device=_device(group),
    )
    c = group.get_global_communicator()
    if c.group is None:
        return
    table = [torch.zeros_like(mine) for _ in range(c.nranks())]
    dist.all_gather(table, mine, group=c.group)
    rows = [t.tolist() for t in table]
    problems = []
    bad_foreign = [c.ranks[r] for r, row in enumerate(rows) if row[3] == _ERR_FOREIGN_PARAMS]
    if bad_foreign:
        problems.append(
            f"the optimizer on rank(s) {bad_foreign} holds parameters that are not in the wrapped module "
            f"(shapes {foreign[:3] if foreign else '...'}); pass the optimizers of this module only"
        )
    diff_params = [c.ranks[r] for r, row in enumerate(rows) if row[:2] != rows[0][:2]]
    if diff_params:
        problems.append(
            f"the model on rank(s) {diff_params} differs from rank {c.ranks[0]}'s (parameter names, shapes or dtypes); "
            "build the same model on every rank"
        )
    diff_buffers = [c.ranks[r] for r, row in enumerate(rows) if row[4] != rows[0][4]]
    if diff_buffers:
        problems.append(
            f"the model's buffers on rank(s) {diff_buffers} differ from rank {c.ranks[0]}'s (names, shapes or dtypes, "
            "e.g. BatchNorm running statistics); build the same model on every rank"
        )
    diff_opts = [c.ranks[r] for r, row in enumerate(rows) if row[2] != rows[0][2]]
    if diff_opts:
        problems.append(
            f"the optimizers on rank(s) {diff_opts} differ from rank {c.ranks[0]}'s (type or parameter groups); "
            "create the same optimizers on every rank"
        )
    if problems:
        raise ValueError("with_bagua: " + "; ".join(problems))


def _coalesced_broadcast(tensors: list[torch.Tensor], src: int, group: BaguaProcessGroup) -> None:
    """Broadcast ``tensors`` from group rank ``src`` with one collective per dtype and device."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for kind in sorted(by_kind, key=str):
        ts = by_kind[kind]
        # NCCL moves only CUDA tensors: CPU state such as Adam's `step` travels through the group's device
        flat = torch.cat([t.detach().reshape(-1) for t in ts]).to(_device(group))
        comm.broadcast(flat, src, group.get_global_communicator())
        offset = 0
        with torch.no_grad():
            for t in ts:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _describe_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A JSON-able description of the optimizer's per-parameter state: keys, tensor shapes/dtypes, scalars."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    desc: dict[str, Any] = {}
    for p, state in optimizer.state.items():
        entry = {}
        for key, value in sorted(state.items(), key=lambda kv: str(kv[0])):
            if isinstance(value, torch.Tensor):
                entry[str(key)] = {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
            elif isinstance(value, (int, float, bool)) or value is None:
                entry[str(key)] = {"scalar": value}
        desc[str(index[id(p)])] = entry
    return desc


def _broadcast_optimizer_state(optimizer: torch.optim.Optimizer, group: BaguaProcessGroup) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    desc = comm.broadcast_object(_describe_state(optimizer), 0, group.get_global_communicator())
    hyper = comm.broadcast_object(
        [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, type(None)))}
         for g in optimizer.param_groups],
        0,
        group.get_global_communicator(),
    )
    for g, h in zip(optimizer.param_groups, hyper):
        g.update(h)
    tensors = []
    for i, entry in sorted(desc.items(), key=lambda kv: int(kv[0])):
        p = params[int(i)]
        state = optimizer.state[p]
        for key, spec in entry.items():
            if "scalar" in spec:
                state[key] = spec["scalar"]
                continue
            dtype = getattr(torch, spec["dtype"])
            current = state.get(key)
            if not (isinstance(current, torch.Tensor) and list(current.shape) == spec["shape"]
                    and current.dtype == dtype):
                device = p.device if spec["shape"] else torch.device("cpu")
                current = torch.zeros(spec["shape"], dtype=dtype, device=device)
                state[key] = current
            tensors.append(current)
    _coalesced_broadcast(tensors, 0, group)


def broadcast_module_and_optimizers(
    module: torch.nn.Module, params: NamedParams, optimizers: Sequence[torch.optim.Optimizer], group: BaguaProcessGroup
) -> None:
    """Make every rank start from group rank 0's parameters, buffers and optimizer state."""
    if group.get_global_communicator().group is None or group.size() == 1:
        return
    buffers = [b for b in module.buffers() if b.is_floating_point() or b.dtype in (torch.int64, torch.int32)]
    _coalesced_broadcast([p.data for _, p in params] + [b.data for b in buffers], 0, group)
    for optimizer in optimizers:
        _broadcast_optimizer_state(optimizer, group)
