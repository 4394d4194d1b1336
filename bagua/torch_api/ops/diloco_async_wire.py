"""What asynchronous DiLoCo's exchanges carry: float32, or a codec of the registry with error feedback.

Uncompressed (``compression="none"``), a worker sends its float32 pseudo-gradient and receives the server's float32
global weights. With a codec (``"bf16"``, ``"uint8"``, ``"uint4"``, ``"nf2"``: the block codecs of
:mod:`bagua.torch_api.codecs.block`, chosen through :data:`~bagua.torch_api.codecs.registry.GlobalCodecRegistry`)
both directions are compressed and no error is lost:

- up: the worker encodes ``c = delta + e`` and keeps ``e = c - decode(encode(c))`` for its next round (error
  feedback, with ``error_feedback``); the server applies ``decode(encode(c))``, the same values the worker computed;
- down: the server keeps a *mirror* of the global weights each worker holds and sends ``encode(g - mirror)``; both
  add its decoding to their copy, so the worker's copy equals the mirror bit for bit and the next answer carries
  what this one missed. The final answer (``close()``) is float32: every rank ends with the server's exact weights.

The codecs are deterministic (the same bytes and values on every rank and device), so the decoded tensors agree.

Example:
    >>> wire = AsyncWire("uint8", numel=3, block_size=4096, error_feedback=True)
    >>> up = wire.encode_up(torch.tensor([0.0, 0.5, 1.0]))
    >>> wire.decode(up).tolist()
    [0.0, 0.501960813999176, 1.0]
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from bagua.torch_api.codecs import block

__all__ = ["AsyncWire", "pseudo_gradient"]


class AsyncWire:
    """Encode and decode one model's exchanges of asynchronous DiLoCo (see the module's docstring).

    Args:
        codec: ``"none"`` or a block codec's registered name.
        numel: the values of the flat model.
        block_size: elements per block of the codec.
        error_feedback: carry the worker's compression error to its next pseudo-gradient.

    Example:
        >>> AsyncWire("none", numel=4, block_size=4096, error_feedback=False).empty().dtype
        torch.float32
    """

    def __init__(self, codec: str, numel: int, block_size: int, error_feedback: bool) -> None:
        self.codec = codec
        self.numel = numel
        self.block_size = block_size
        self.error_feedback = error_feedback and codec != "none"
        self.residual: Optional[torch.Tensor] = None  # the worker's compression error

    @property
    def compressed(self) -> bool:
        """Whether a codec runs (else float32 travels)."""
        return self.codec != "none"

    def empty(self) -> torch.Tensor:
        """A buffer for one message: float32 values, or the codec's wire bytes."""
        if not self.compressed:
            return torch.empty(self.numel, dtype=torch.float32)
        return torch.empty(block.wire_numel(self.numel, self.codec, self.block_size), dtype=torch.uint8)

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        """The float32 values of a message."""
        if not self.compressed:
            return wire
        return block.decode(wire, self.numel, self.codec, self.block_size)

    def encode_up(self, delta: torch.Tensor) -> torch.Tensor:
        """The worker's message for its pseudo-gradient ``delta`` (CPU float32), keeping its compression error."""
        if not self.compressed:
            return delta.contiguous()
        if self.error_feedback and self.residual is not None:
            delta = delta + self.residual
        wire = block.encode(delta, self.codec, self.block_size)
        if self.error_feedback:
            self.residual = delta - self.decode(wire)
        return wire

    def encode_down(self, global_: torch.Tensor, mirror: torch.Tensor) -> torch.Tensor:
        """The server's answer to a worker whose copy of the global weights is ``mirror`` (updated in place to
        what the worker will hold): ``global_`` itself uncompressed, else the encoded change."""
        if not self.compressed:
            mirror.copy_(global_)
            return global_
        wire = block.encode(global_ - mirror, self.codec, self.block_size)
        mirror.add_(self.decode(wire))
        return wire

    def apply_down(self, held: torch.Tensor, wire: torch.Tensor) -> None:
        """On the worker: set its copy ``held`` of the global weights from the server's answer."""
        if not self.compressed:
            held.copy_(wire)
        else:
            held.add_(self.decode(wire))


@torch.no_grad()
def pseudo_gradient(fragment: Any, owner: str, who: str) -> torch.Tensor:
    """The ``fragment``'s pseudo-gradient as float32 on the CPU, refused (``FloatingPointError``, naming ``who``) when
    it holds NaN or Inf: a diverged worker's arrival is never sent."""
    delta = fragment.pseudo_gradient().to("cpu", torch.float32)
    if not bool(torch.isfinite(delta).all()):
        raise FloatingPointError(
            f"{owner}(asynchronous=True): {who}'s pseudo-gradient holds NaN or Inf (its weights diverged during the "
            "inner steps); it was not sent. Lower the inner learning rate, clip gradients, or use "
            "torch.amp.GradScaler")
    return delta
