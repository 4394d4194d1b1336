"""Per-rank expert files for checkpoints of models with :class:`~bagua.torch_api.model_parallel.moe.MoE` layers.

Each rank holds different experts, so beside the model file that rank 0 writes, every rank writes (the original's
names, under ``iter_XXXXXXX/``)::

    expert_{g}_mp_rank_00_model_states.pt        the parameters of global expert g, keys with the global id
    expp_rank_{r}_mp_rank_00_optim_states.pt     rank r's optimizer state (its experts' state differs by rank)

A key ``...bagua_moe.experts.bagua_experts.{j}.weight`` of rank ``r``'s local expert ``j`` is saved as
``...bagua_experts.{r * L + j}.weight`` (``L`` local experts per rank), and mapped back on load, so a checkpoint
can be loaded with another rank's placement as long as ``L`` and the world size are the same. Files are written
to a temporary name and renamed; they are read with ``torch.load(weights_only=True)``.

Example:
    >>> save_experts(100, "ckpt", model, optimizer)  # doctest: +SKIP
    >>> load_experts(100, "ckpt", model, optimizer)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.checkpoint.atomic import _atomic_write

__all__ = ["moe_layers", "expert_checkpoint_name", "optimizer_checkpoint_name", "split_expert_state",
           "save_experts", "load_experts"]

_EXPERTS_KEY = ".bagua_experts."
_EXPERT_ID = re.compile(r"(^|\.)bagua_moe\.experts\.bagua_experts\.(\d+)\.")


def moe_layers(model: torch.nn.Module) -> list[Any]:
    """The :class:`MoE` layers of ``model`` (a wrapped model is searched too), in module order."""
    from bagua.torch_api.model_parallel.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def _directory(checkpoints_path: str, iteration: int, release: bool) -> str:
    return os.path.join(checkpoints_path, "release" if release else f"iter_{iteration:07d}")


def expert_checkpoint_name(checkpoints_path: str, iteration: int, expert_id: int, release: bool = False) -> str:
    """Path of the file of global expert ``expert_id``."""
    name = f"expert_{expert_id}_mp_rank_00_model_states.pt"
    return os.path.join(_directory(checkpoints_path, iteration, release), name)


def optimizer_checkpoint_name(checkpoints_path: str, iteration: int, rank: int, release: bool = False) -> str:
    """Path of rank ``rank``'s optimizer-state file."""
    name = f"expp_rank_{rank}_mp_rank_00_optim_states.pt"
    return os.path.join(_directory(checkpoints_path, iteration, release), name)


def split_expert_state(
    state_dict: dict[str, Any], num_local_experts: int, rank: int
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """Split a model state dict into ``{global expert id: its entries (global-id keys)}`` and the other entries.

    Example:
        >>> experts, rest = split_expert_state({"m.bagua_moe.experts.bagua_experts.1.w": 1, "m.gate": 2}, 2, 1)
        >>> experts, rest
        ({3: {'m.bagua_moe.experts.bagua_experts.3.w': 1}}, {'m.gate': 2})
    """
    experts: dict[int, dict[str, Any]] = {}
    rest: dict[str, Any] = {}
    for key, value in state_dict.items():
        m = _EXPERT_ID.search(key)
        if m is None:
            rest[key] = value
            continue
        local = int(m.group(2))
        global_id = rank * num_local_experts + local
        experts.setdefault(global_id, {})[_with_id(key, m, global_id)] = value
    return experts, rest


def _with_id(key: str, m: re.Match, expert_id: int) -> str:
    return key[:m.start(2)] + str(expert_id) + key[m.end(2):]


def _layout(model: torch.nn.Module) -> Optional[tuple[int, int]]:
    """``(num_local_experts, rank)`` of the model's MoE layers, or ``None`` without MoE layers."""
    layers = moe_layers(model)
    if not layers:
        return None
    local = {layer.num_local_experts for layer in layers}
    if len(local) != 1:
        raise ValueError(f"MoE layers with different num_local_experts {sorted(local)} cannot share expert ids")
    group = layers[0].bagua_moe.group
    rank = 0 if group is None else dist.get_rank(group)
    return local.pop(), rank


def _atomic_save(obj: Any, path: str) -> None:
    """Write ``obj`` to ``path`` atomically, with the temp-file naming and clean-up of the main checkpoint file."""

    _atomic_write(path, lambda f: torch.save(obj, f))


def save_experts(
    iteration: int, checkpoints_path: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
    release: bool = False,
) -> bool:
    """Write this rank's expert files (and optimizer state); return whether ``model`` has MoE layers.

    Args:
        iteration: the training iteration.
        checkpoints_path: directory of the checkpoints.
        model: the model (wrapped or not).
        optimizer: its optimizer; saved per rank when given.
        release: write under ``release/`` instead of ``iter_XXXXXXX/``.

    Returns:
        ``False`` (and nothing written) for a model without MoE layers.
    """
    layout = _layout(model)
    if layout is None:
        return False
    num_local, rank = layout
    experts, _ = split_expert_state(model.state_dict(), num_local, rank)
    for expert_id, state in experts.items():
        _atomic_save(state, expert_checkpoint_name(checkpoints_path, iteration, expert_id, release))
    if optimizer is not None:
        _atomic_save({"optimizer": optimizer.state_dict()},
                     optimizer_checkpoint_name(checkpoints_path, iteration, rank, release))
    return True


def load_experts(
    iteration: int, checkpoints_path: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
    release: bool = False,
) -> bool:
    """Load this rank's experts (and optimizer state) written by :func:`save_experts`; return whether it did.

    Raises:
        FileNotFoundError: an expert file of this rank is missing (was the checkpoint saved with another world
            size or ``num_local_experts``?).
        ValueError: an expert file lacks some of the expert's parameters or has others.
    """
    layout = _layout(model)
    if layout is None:
        return False
    num_local, rank = layout
    mine, _ = split_expert_state(model.state_dict(), num_local, rank)
    local_state: dict[str, Any] = {}
    for expert_id, expected in mine.items():
        path = expert_checkpoint_name(checkpoints_path, iteration, expert_id, release)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint was saved with another world size or "
                                    f"num_local_experts than this run's ({num_local} local experts on rank {rank})")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if set(saved) != set(expected):
            raise ValueError(f"{path} holds {sorted(set(saved) ^ set(expected))} unlike the model's expert {expert_id}")
        for key, value in saved.items():
            m = _EXPERT_ID.search(key)
            local_state[_with_id(key, m, int(m.group(2)) - rank * num_local)] = value
    unexpected = model.load_state_dict(local_state, strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"expert keys {unexpected} do not belong to the model")
    if optimizer is not None:
        path = optimizer_checkpoint_name(checkpoints_path, iteration, rank, release)
        if os.path.isfile(path):
            optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["optimizer"])
    return True
