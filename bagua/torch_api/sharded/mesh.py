"""Which ranks are replicas of each other on a 2-D ``DeviceMesh``, and which parameters form each FSDP2 unit.

A user shards each replica with FSDP2 over one dimension of the mesh (``fully_shard(block, mesh=mesh["shard"])``)
and hands Bagua the other (``replicate_dim``). The ranks along the replicate dimension hold the same shard of the
model, one per replica: Bagua exchanges that shard among them, on a process group of its own.

Example:
    >>> import torch
    >>> replica_groups(torch.arange(4).view(2, 2), 0)  # mesh (replicate=2, shard=2)
    [[0, 2], [1, 3]]
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["replica_groups", "check_mesh", "fsdp_units", "local_shard"]


def replica_groups(mesh_ranks: torch.Tensor, replicate_index: int) -> list[list[int]]:
    """The global ranks of every replica group: the ranks along ``replicate_index`` of ``mesh_ranks``, one list
    per position on the other dimension, in mesh order (the same on every rank)."""
    moved = mesh_ranks.movedim(replicate_index, -1)
    return [row.tolist() for row in moved.reshape(-1, moved.shape[-1])]


def check_mesh(device_mesh: Any, replicate_dim: Any) -> tuple[int, str]:
    """Return the index of ``replicate_dim`` and the name of the shard dimension; raise ``ValueError`` saying what to
    pass otherwise."""
    names = getattr(device_mesh, "mesh_dim_names", None)
    if names is None or getattr(device_mesh, "ndim", None) != 2:
        raise ValueError("with_bagua(device_mesh=...) needs a 2-D DeviceMesh with named dimensions, e.g. "
                         "init_device_mesh('cpu', (replicas, shards), mesh_dim_names=('replicate', 'shard'))")
    if replicate_dim not in names:
        raise ValueError(f"with_bagua(replicate_dim={replicate_dim!r}) is not a dimension of the mesh; its "
                         f"dimensions are {list(names)}: pass the one FSDP2 does not shard over")
    index = names.index(replicate_dim)
    return index, names[1 - index]


def fsdp_units(module: torch.nn.Module) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The parameters of each FSDP2 unit (each ``fully_shard``-ed module, without its nested units), in the order
    of ``module.named_parameters()``; a parameter no unit manages raises ``ValueError``."""
    from torch.distributed.fsdp import FSDPModule

    owner: dict[int, int] = {}
    units: list[torch.nn.Module] = []
    for sub in module.modules():  # pre-order: a nested unit overwrites its parent's claim
        if isinstance(sub, FSDPModule):
            units.append(sub)
            for p in sub.parameters():
                owner[id(p)] = len(units) - 1
    if not units:
        raise ValueError("with_bagua(device_mesh=...) needs a model sharded with FSDP2: call fully_shard(block, "
                         "mesh=mesh[shard_dim]) on its blocks and on the model first")
    grouped: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in module.named_parameters():
        if id(p) not in owner:
            raise ValueError(f"parameter {name!r} is not managed by FSDP2: call fully_shard on the model itself too")
        grouped.setdefault(owner[id(p)], []).append((name, p))
    return list(grouped.values())


def local_shard(name: str, param: torch.nn.Parameter, shard_ranks: list[int]) -> torch.Tensor:
    """This rank's shard of ``param`` (a view: writing it writes the parameter); checks that FSDP2 shards it over
    exactly ``shard_ranks`` (a 1-D mesh), not over the replicas too (native HSDP)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        raise ValueError(f"parameter {name!r} is not a DTensor: shard the model with fully_shard first")
    if mesh.ndim != 1:
        raise ValueError(f"parameter {name!r} is sharded on a {mesh.ndim}-D mesh (native HSDP): shard it with "
                         "fully_shard(module, mesh=mesh[shard_dim]) only; Bagua does the replicate dimension")
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks != sorted(shard_ranks):
        raise ValueError(f"parameter {name!r} is sharded over ranks {ranks}, but the mesh's shard dimension holds "
                         f"{sorted(shard_ranks)} for this rank: shard with fully_shard(module, mesh=mesh[shard_dim])")
    return param.to_local()
