"""The engine's two uses of autograd internals, isolated (STYLE.md habit 8): the end-of-backward callback and the
id of the running backward pass, with the error raised when a reentrant checkpoint nests one backward in another.

Example:
    >>> graph_task_id()  # outside backward
    -1
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["REENTRANT_MESSAGE", "graph_task_id", "queue_backward_end_callback"]


def queue_backward_end_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished.

    Autograd has no public "end of backward" hook; torch's own FSDP2 and DDP's Python reducer use this engine
    callback for the same purpose, so it is isolated in this module (STYLE.md habit 8).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def graph_task_id() -> int:
    """The id of the autograd graph task (one ``backward()`` call) running on this thread; -1 outside backward.

    Ids grow with every new backward, so a task that started *before* one that has already ended is an outer
    backward still running around a nested one (reentrant activation checkpointing). No public API tells that;
    the private call is isolated in this module (STYLE.md habit 8).
    """
    return int(torch._C._current_graph_task_id())


REENTRANT_MESSAGE = (
    "rank {rank}: {name}: a backward pass ran nested inside another (reentrant activation checkpointing, "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=True)), and Bagua's end-of-backward came from the inner "
    "one, before every gradient existed: the buckets would be communicated twice. Use "
    "checkpoint(..., use_reentrant=False), which torch recommends and Bagua supports."
)
