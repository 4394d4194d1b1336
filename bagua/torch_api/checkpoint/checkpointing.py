"""Save and load training checkpoints (original Bagua layout), atomically.

Layout under ``checkpoints_path``::

    iter_0000100/mp_rank_00_model_states.pt     {"iteration", "model", "optimizer", "lr_scheduler"}
    latest_checkpointed_iteration.txt           "100"

Every file is written to a temporary name in the same directory, flushed to disk, then renamed over the final
name, and the tracker is updated only after the checkpoint itself is complete: a crash while saving leaves the
previous checkpoint as "latest", never a corrupt one. Loading uses ``torch.load(weights_only=True)``, which
refuses to run code from the file.

Example:
    >>> save_checkpoint(step, "ckpt", model, optimizer)  # doctest: +SKIP
    >>> start = load_checkpoint("ckpt", model, optimizer)  # 0 when there is none  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.checkpoint.experts import load_experts, save_experts

__all__ = ["save_checkpoint", "load_checkpoint", "get_checkpoint_name", "TRACKER_FILENAME"]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def get_checkpoint_name(checkpoints_path: str, iteration: int, release: bool = False) -> str:
    """Path of the model-states file of ``iteration`` (or of the ``release`` tag)."""
    directory = "release" if release else f"iter_{iteration:07d}"
    return os.path.join(checkpoints_path, directory, "mp_rank_00_model_states.pt")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # Bagua's and torch's DDP wrappers keep the user's module as `.module`.
    return model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model


def _atomic_write(path: str, write: Any) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(
    iteration: int,
    checkpoints_path: str,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    lr_scheduler: Optional[Any] = None,
) -> None:
    """Save the model (and optimizer, LR scheduler) of ``iteration``; rank 0 writes, every rank waits.

    Args:
        iteration: the training iteration the state belongs to.
        checkpoints_path: directory of the checkpoints.
        model: the model (a Bagua- or torch-DDP-wrapped model is unwrapped).
        optimizer: optional optimizer whose ``state_dict`` is saved.
        lr_scheduler: optional LR scheduler whose ``state_dict`` is saved.
    """
    if save_experts(iteration, checkpoints_path, model, optimizer):  # MoE: every rank writes its experts first
        _barrier()
    if _is_writer():
        state = {
            "iteration": iteration,
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        }
        _atomic_write(get_checkpoint_name(checkpoints_path, iteration), lambda f: torch.save(state, f))
        tracker = os.path.join(checkpoints_path, TRACKER_FILENAME)
        _atomic_write(tracker, lambda f: f.write(str(iteration).encode()))
    _barrier()


def load_checkpoint(
    checkpoints_path: str,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    lr_scheduler: Optional[Any] = None,
    strict: bool = True,
) -> int:
    """Load the latest checkpoint into ``model`` (and optimizer, scheduler); return its iteration (0 if none).

    Raises:
        ValueError: the tracker file holds neither an iteration number nor ``release``.
    """
    tracker = os.path.join(checkpoints_path, TRACKER_FILENAME)
    if not os.path.isfile(tracker):
        return 0
    with open(tracker, encoding="utf-8") as f:
        text = f.read().strip()
    release = text == "release"
    if not release:
        try:
            iteration = int(text)
        except ValueError:
            raise ValueError(f"{tracker} holds {text!r}; expected an iteration number or 'release'") from None
    else:
        iteration = 0
    state = torch.load(get_checkpoint_name(checkpoints_path, iteration, release), map_location="cpu", weights_only=True)
    _unwrap(model).load_state_dict(state["model"], strict=strict)
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if lr_scheduler is not None and state.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    load_experts(iteration, checkpoints_path, model, optimizer, release)  # MoE: this rank's experts, optimizer
    _barrier()
    return int(state.get("iteration", iteration))
