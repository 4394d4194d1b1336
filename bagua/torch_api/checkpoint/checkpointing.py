"""Save and load training checkpoints (original Bagua layout), atomically.

Layout under ``checkpoints_path``::

    iter_0000100/mp_rank_00_model_states.pt     {"iteration", "model", "optimizer", "lr_scheduler", "rank_states"}
    iter_0000100/rank_{r}_of_{n}_states.pt       every rank's own state, for algorithms whose ranks diverge
    latest_checkpointed_iteration.txt           "100"

Rank 0's file restores every rank when the ranks' states are identical (gradient allreduce, ByteGrad without
error feedback, QAdam). When the wrapped model's algorithm keeps state that differs between ranks (decentralized
weights, low-precision replicas, error-feedback residuals; ``AlgorithmImpl.state_dict()`` is not ``None``),
every rank also writes its own file (:mod:`bagua.torch_api.checkpoint.rank_state`), and loading gives each rank
its own back; it must then run on the wrapped model, with the same number of ranks.

Every file is written to a temporary name in the same directory, flushed to disk, then renamed over the final
name, and the tracker is updated only after the checkpoint itself is complete: a crash while saving leaves the
previous checkpoint as "latest", never a corrupt one. A temporary name carries its writer's host and pid
(``.tmp-<host>-<pid>-<random>``); the next save removes the temporary files of writers that are dead on this
host (a SIGKILL during ``torch.save`` leaves one behind), never one a live process is still writing. Loading uses
``torch.load(weights_only=True)``, which refuses to run code from the file.

Loading is a collective when ``torch.distributed`` is initialized: every rank reads its own tracker (ranks need
not share a filesystem), the ranks exchange what they found, and every rank loads the same iteration, the oldest
"latest" among them, or every rank raises the same error naming the ranks that lack it. No rank waits for another
that has already failed.

Example:
    >>> save_checkpoint(step, "ckpt", model, optimizer)  # doctest: +SKIP
    >>> start = load_checkpoint("ckpt", model, optimizer)  # 0 when there is none  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.checkpoint.atomic import STALE_TMP_AGE_S, _atomic_write, _remove_stale_tmp_files
from bagua.torch_api.checkpoint.experts import load_experts, save_experts
from bagua.torch_api.checkpoint.rank_state import collect_rank_state, rank_state_name, restore_rank_state
from bagua.torch_api.distributed import engine_of

__all__ = ["save_checkpoint", "load_checkpoint", "get_checkpoint_name", "TRACKER_FILENAME", "STALE_TMP_AGE_S"]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
# what load_checkpoint's ranks exchange besides an iteration number (>= 0)
_NONE, _RELEASE, _UNREADABLE = -1, -2, -3


def get_checkpoint_name(checkpoints_path: str, iteration: int, release: bool = False) -> str:
    """Path of the model-states file of ``iteration`` (or of the ``release`` tag)."""
    directory = "release" if release else f"iter_{iteration:07d}"
    return os.path.join(checkpoints_path, directory, "mp_rank_00_model_states.pt")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # Bagua's and torch's DDP wrappers keep the user's module as `.module`.
    return model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model


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

    Example:
        >>> save_checkpoint(100, "ckpt", model, optimizer)  # doctest: +SKIP
    """
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    own = collect_rank_state(model, _unwrap(model), optimizer, rank, world_size)
    if own is not None:  # ranks that diverge: every rank writes its own state first
        path = rank_state_name(checkpoints_path, iteration, rank, world_size)
        _atomic_write(path, lambda f: torch.save(own, f))
    if save_experts(iteration, checkpoints_path, model, optimizer) or own is not None:  # MoE: experts per rank
        _barrier()
    if _is_writer():
        _remove_stale_tmp_files_under(checkpoints_path)
        engine = engine_of(model)
        state = {
            "iteration": iteration,
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "rank_states": world_size if own is not None else 0,
            "rank_states_of": own["algorithm"] if own is not None else "",
            "bagua_train_step_counter": engine.bagua_train_step_counter if engine is not None else -1,
        }
        _atomic_write(get_checkpoint_name(checkpoints_path, iteration), lambda f: torch.save(state, f))
        tracker = os.path.join(checkpoints_path, TRACKER_FILENAME)
        _atomic_write(tracker, lambda f: f.write(str(iteration).encode()))
    _barrier()


def _remove_stale_tmp_files_under(checkpoints_path: str) -> None:
    """Sweep the checkpoint directory and its iteration directories, where earlier crashed saves left files."""
    if not os.path.isdir(checkpoints_path):
        return
    _remove_stale_tmp_files(checkpoints_path)
    for name in os.listdir(checkpoints_path):
        if re.fullmatch(r"iter_\d{7,}|release", name) and os.path.isdir(os.path.join(checkpoints_path, name)):
            _remove_stale_tmp_files(os.path.join(checkpoints_path, name))


def _read_tracker(tracker: str) -> tuple[int, str]:
    """This rank's latest checkpoint: an iteration, ``_NONE``, ``_RELEASE`` or ``_UNREADABLE``, and the text."""
    if not os.path.isfile(tracker):
        return _NONE, ""
    try:
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        return _UNREADABLE, str(error)
    if text == "release":
        return _RELEASE, text
    return (int(text), text) if text.isascii() and text.isdigit() else (_UNREADABLE, text)


def _all_gather_ints(value: int) -> list[int]:
    """Every rank's ``value``, in rank order (a fixed-size tensor: nothing is pickled)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [int(t.item()) for t in out]


def _ranks(flags: list[int], wanted: Any) -> list[int]:
    return [r for r, v in enumerate(flags) if wanted(v)]


def _agree_on_iteration(latest: int, text: str, tracker: str) -> int:
    """Collective: the iteration every rank loads (or ``_NONE``/``_RELEASE``); the same error on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if latest == _UNREADABLE:
            raise ValueError(f"{tracker} holds {text!r}; expected an iteration number or 'release'")
        return latest
    everyone = _all_gather_ints(latest)
    rank = dist.get_rank()
    unreadable = _ranks(everyone, lambda v: v == _UNREADABLE)
    if unreadable:
        mine = f" (this rank's {tracker} holds {text!r})" if rank in unreadable else ""
        raise ValueError(f"load_checkpoint: the tracker file of rank(s) {unreadable} holds neither an iteration "
                         f"number nor 'release'{mine}; fix or remove it there")
    if all(v == _NONE for v in everyone):
        return _NONE
    missing = _ranks(everyone, lambda v: v == _NONE)
    if missing:
        raise FileNotFoundError(
            f"load_checkpoint: rank(s) {missing} have no checkpoint under their checkpoints_path while rank(s) "
            f"{_ranks(everyone, lambda v: v != _NONE)} do (this rank reads {tracker}). Without a shared filesystem "
            "only rank 0 writes checkpoints: put checkpoints_path on a filesystem every node sees, or copy the "
            "checkpoint to every node, or remove it everywhere to start afresh")
    if any(v == _RELEASE for v in everyone):
        if all(v == _RELEASE for v in everyone):
            return _RELEASE
        raise ValueError(f"load_checkpoint: rank(s) {_ranks(everyone, lambda v: v == _RELEASE)} point to the "
                         f"'release' checkpoint, the others to iterations {sorted(set(everyone) - {_RELEASE})}; "
                         "give every rank the same checkpoint")
    target = min(everyone)
    lacking = _ranks(_all_gather_ints(int(not os.path.isfile(get_checkpoint_name(os.path.dirname(tracker), target)))),
                     lambda v: v == 1)
    if lacking:
        raise FileNotFoundError(
            f"load_checkpoint: the ranks' latest iterations are {everyone}; rank(s) {lacking} lack iteration "
            f"{target}, the newest one every rank could load. Put checkpoints_path on a filesystem every node sees, "
            "or copy the same checkpoint to every node")
    if latest != target:
        warnings.warn(f"load_checkpoint: this rank's latest checkpoint is iteration {latest}, but rank(s) "
                      f"{_ranks(everyone, lambda v: v == target)} only have up to {target}; every rank loads "
                      f"{target}", RuntimeWarning, stacklevel=3)
    return target


def load_checkpoint(
    checkpoints_path: str,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    lr_scheduler: Optional[Any] = None,
    strict: bool = True,
) -> int:
    """Load the latest checkpoint into ``model`` (and optimizer, scheduler); return its iteration (0 if none).

    Collective when ``torch.distributed`` is initialized: the ranks agree on one iteration (the oldest of their
    latest ones; see the module docstring) before any of them reads a file, and a rank that fails to load makes
    every rank raise.

    Args:
        checkpoints_path: directory of the checkpoints (this rank's view of it).
        model: the model to load into (a Bagua- or torch-DDP-wrapped model is unwrapped).
        optimizer: optional optimizer to restore.
        lr_scheduler: optional LR scheduler to restore.
        strict: passed to ``load_state_dict`` of the model.

    Returns:
        The iteration loaded, 0 when no rank has a checkpoint.

    Raises:
        ValueError: a tracker file holds neither an iteration number nor ``release``, or ranks disagree on
            ``release``.
        FileNotFoundError: some ranks lack the checkpoint the others would load (the message names them).
        RuntimeError: loading failed on some rank (every rank raises, naming it).

    Example:
        >>> start = load_checkpoint("ckpt", model, optimizer)  # doctest: +SKIP
    """
    tracker = os.path.join(checkpoints_path, TRACKER_FILENAME)
    target = _agree_on_iteration(*_read_tracker(tracker), tracker)
    if target == _NONE:
        return 0
    release = target == _RELEASE
    iteration = 0 if release else target
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    own_path = rank_state_name(checkpoints_path, iteration, rank, world_size, release)
    lacking = _ranks(_all_gather_ints(int(not os.path.isfile(own_path))), lambda v: v == 1) if (
        dist.is_initialized() and world_size > 1) else ([] if os.path.isfile(own_path) else [0])
    error: Optional[BaseException] = None
    try:
        state = torch.load(get_checkpoint_name(checkpoints_path, iteration, release), map_location="cpu",
                           weights_only=True)
        saved_ranks = int(state.get("rank_states") or 0)
        if saved_ranks and saved_ranks != world_size:
            raise ValueError(
                f"load_checkpoint: iteration {target} holds per-rank states of {saved_ranks} ranks "
                f"({state.get('rank_states_of')}: their weights or algorithm states differ), but this job has "
                f"{world_size}; resume with {saved_ranks} ranks")
        if saved_ranks and lacking:
            names = [os.path.basename(rank_state_name(checkpoints_path, iteration, r, world_size)) for r in lacking]
            raise FileNotFoundError(
                f"load_checkpoint: iteration {target} holds per-rank states, but rank(s) {lacking} lack their file "
                f"{names} under {os.path.dirname(own_path)}; copy them there, or resume from another iteration")
        _unwrap(model).load_state_dict(state["model"], strict=strict)
        if optimizer is not None and state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])
        if lr_scheduler is not None and state.get("lr_scheduler") is not None:
            lr_scheduler.load_state_dict(state["lr_scheduler"])
        load_experts(iteration, checkpoints_path, model, optimizer, release)  # MoE: this rank's experts, optimizer
        if saved_ranks:  # this rank's own weights, optimizer and algorithm state
            restore_rank_state(own_path, model, _unwrap(model), optimizer, rank, world_size, strict)
        engine = engine_of(model)
        if engine is not None and int(state.get("bagua_train_step_counter", -1)) >= 0:
            engine.bagua_train_step_counter = int(state["bagua_train_step_counter"])
    except Exception as caught:  # noqa: BLE001 - reported to every rank below, then re-raised here
        error = caught
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            raise
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = _ranks(_all_gather_ints(int(error is not None)), lambda v: v == 1)
        if failed:
            raise RuntimeError(f"load_checkpoint: loading iteration {target} failed on rank(s) {failed}"
                               + (f": {error}" if error is not None else "")) from error
    return int(state.get("iteration", iteration))
