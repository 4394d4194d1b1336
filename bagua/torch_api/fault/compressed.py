"""A fault-tolerant round's compressed average: each member's pseudo-gradient encoded once and all-gathered.

Every member encodes its pseudo-gradient (plus its error-feedback residual) with the block codec of DiLoCo
(:mod:`bagua.torch_api.codecs.block`: ``"bf16"``, ``"uint8"``, ``"uint4"`` or ``"nf2"``), the round's gloo group
all-gathers the wires, and every member decodes and sums them in member order: the same bytes in the same order, so
every member ends with the same average, bit for bit. An all-gather rather than DiLoCo's scatter-reduce-gather: a
member sends its wire to each peer once (``members - 1`` wires, twice the scatter-reduce-gather's bytes at 4
members), and nothing is re-quantized, so a failed round leaves nothing half-reduced. The new residual is returned,
not kept: the caller keeps it only once the round's verdict is ``ok`` (a retried round starts again from the old
one).

Example:
    >>> residual = compressed_average(group, delta, [8, 8, 8], 1, "uint4", 4096, residual, 30.0)  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Sequence

import torch

from bagua.torch_api.codecs.block import decode, encode, wire_numel

__all__ = ["compressed_average", "wire_bytes"]


def wire_bytes(numel: int, codec: str, block_size: int, members: int) -> int:
    """Bytes one member sends in a round: its wire to each of the other members."""
    return (members - 1) * wire_numel(numel, codec, block_size)


@torch.no_grad()
def compressed_average(group: Any, delta: torch.Tensor, weights: Sequence[int], rank: int, codec: str,
                       block_size: int, residual: Optional[torch.Tensor], timeout_s: float) -> Optional[torch.Tensor]:
    """Average the 1-D float32 ``delta`` over ``group`` in place, each member weighted by ``weights`` (0: a healed
    member, which sends zeros); a plain mean of the decoded values when the weights are equal.

    Args:
        group: the round's ``ProcessGroupGloo``; ``rank``: this member's rank in it.
        residual: this member's error-feedback residual (added before encoding), or ``None`` without error feedback.

    Returns:
        The new residual (what encoding lost of ``delta + residual``), or ``None`` without error feedback.
    """
    flat = delta.detach().reshape(-1).float().cpu()
    if weights[rank] == 0:
        x = torch.zeros_like(flat)
    else:
        x = flat + residual.reshape(-1).cpu() if residual is not None else flat
    n = x.numel()
    wire = encode(x, codec, block_size)
    wires = [torch.empty_like(wire) for _ in weights]
    group.allgather([wires], [wire]).wait(datetime.timedelta(seconds=timeout_s))
    new_residual = None
    if residual is not None:
        new_residual = (x - decode(wire, n, codec, block_size)).to(residual.device)
    out = torch.zeros(n, dtype=torch.float32)
    if all(w == weights[0] for w in weights):
        for w in wires:
            decode(w, n, codec, block_size, out=out, accumulate=True)
        out.div_(len(weights))
    else:
        total = max(1, sum(weights))
        for w, weight in zip(wires, weights):
            if weight:
                out.add_(decode(w, n, codec, block_size), alpha=weight / total)
    delta.copy_(out.view_as(delta))
    return new_residual
