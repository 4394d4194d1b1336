"""Per-rank state files for checkpoints of algorithms whose ranks diverge.

Decentralized SGD's ranks hold different weights (and optimizer states), low-precision decentralized SGD keeps
replicas of the neighbours, ByteGrad's error feedback keeps each rank's quantization residuals: rank 0's model
file cannot restore the other ranks. When the wrapped model's algorithm says it has such state
(:meth:`~bagua.torch_api.algorithms.AlgorithmImpl.state_dict` is not ``None``), every rank writes, under
``iter_XXXXXXX/``::

    rank_{r}_of_{n}_states.pt      {"rank", "world_size", "algorithm", "state", "model", "optimizer"}

and rank 0's model file records ``n`` (``"rank_states"``), so that loading knows the files must be there. Files
are written to a temporary name and renamed; they are read with ``torch.load(weights_only=True)``. The checkpoint
module knows no algorithm by name: what goes under ``"state"`` is the algorithm's own dict.

Example:
    >>> rank_state_name("ckpt", 100, 1, 2)
    'ckpt/iter_0000100/rank_1_of_2_states.pt'
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch

from bagua.torch_api.distributed import engine_of

__all__ = ["rank_state_name", "algorithm_of", "collect_rank_state", "restore_rank_state"]


def rank_state_name(checkpoints_path: str, iteration: int, rank: int, world_size: int, release: bool = False) -> str:
    """Path of rank ``rank``'s state file in a job of ``world_size`` ranks."""
    directory = "release" if release else f"iter_{iteration:07d}"
    return os.path.join(checkpoints_path, directory, f"rank_{rank}_of_{world_size}_states.pt")


def algorithm_of(model: torch.nn.Module) -> Any:
    """The algorithm implementation ``model`` (or the module it wraps) trains with, or ``None``."""
    engine = engine_of(model)
    return engine.impl if engine is not None else None


def collect_rank_state(
    model: torch.nn.Module, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], rank: int,
    world_size: int,
) -> Optional[dict[str, Any]]:
    """This rank's state file's content, or ``None`` when the model's algorithm keeps the ranks identical."""
    impl = algorithm_of(model)
    state = impl.state_dict() if impl is not None else None
    if state is None:
        return None
    return {
        "rank": rank,
        "world_size": world_size,
        "algorithm": type(impl).__name__,
        "state": state,
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
    }


def restore_rank_state(
    path: str, model: torch.nn.Module, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
    rank: int, world_size: int, strict: bool = True,
) -> None:
    """Load this rank's state file into the model, the optimizer and the algorithm.

    Raises:
        RuntimeError: ``model`` is not wrapped yet (``with_bagua`` would overwrite every rank's weights with
            rank 0's), or the file belongs to another rank or job size.
    """
    impl = algorithm_of(model)
    if impl is None:
        raise RuntimeError(
            f"load_checkpoint: {os.path.dirname(path)} holds per-rank state (weights, optimizer, algorithm state "
            "that differ between ranks), but the model is not wrapped yet, and with_bagua() would replace every "
            "rank's weights with rank 0's. Call load_checkpoint(...) after model.with_bagua(...)"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if (saved.get("rank"), saved.get("world_size")) != (rank, world_size):
        raise RuntimeError(f"load_checkpoint: {path} holds rank {saved.get('rank')} of {saved.get('world_size')}, "
                           f"not rank {rank} of {world_size}")
    module.load_state_dict(saved["model"], strict=strict)
    if optimizer is not None and saved.get("optimizer") is not None:
        optimizer.load_state_dict(saved["optimizer"])
    if saved.get("algorithm") != type(impl).__name__:
        warnings.warn(f"load_checkpoint: {path} holds the state of {saved.get('algorithm')}, the model now trains "
                      f"with {type(impl).__name__}: its algorithm state is not loaded", RuntimeWarning, stacklevel=3)
        return
    impl.load_state_dict(saved["state"])
