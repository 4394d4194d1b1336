"""Bagua: communication-efficient distributed data-parallel training for PyTorch.

Words used exactly throughout the package:

- **rank / world size**: a process and the number of processes in a group, as in ``torch.distributed``.
- **node**: the processes that share a machine (``LOCAL_WORLD_SIZE`` of them); local rank 0 is the node's leader.
- **hierarchical**: communicate inside each node first, then among node leaders only, then inside nodes again.
- **effective tensor**: the tensor an algorithm communicates for a parameter: its gradient (gradient
  algorithms), the parameter itself (decentralized, async) or an optimizer state (QAdam's momentum).
- **bucket**: an ordered group of effective tensors of one dtype, usually flattened into one buffer whose
  views the effective tensors become; a bucket is communicated as a whole, as soon as all its tensors are ready.
- **step**: one forward, backward and optimizer step of training.
- **peer**: another rank that a decentralized algorithm exchanges weights with in a step.
"""

from __future__ import annotations

from bagua.version import __version__

__all__ = ["__version__"]
