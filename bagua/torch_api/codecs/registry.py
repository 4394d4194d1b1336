"""The codec registry: every codec chosen by one name, for every algorithm that compresses.

=========  =======================================================================================================
name       code
=========  =======================================================================================================
``chunk``  MinMaxUInt8: 8 bits per value, one float32 min/max per rank chunk (the original Bagua's ByteGrad and
           QAdam code, kept bit for bit; :mod:`~bagua.torch_api.codecs.minmax_uint8`). Aliases: ``"MinMaxUInt8"``
           (the original's bucket API, ``compression=``), ``"minmax_uint8"``.
``bf16``   bfloat16, 16 bits per value (:mod:`~bagua.torch_api.codecs.block`).
``uint8``  8 bits per value, one min/max per block of ``block_size`` elements.
``uint4``  4 bits per value, one min/max per block.
``nf2``    2 bits per value at a normal distribution's levels about each block's mean and RMS
           (:mod:`~bagua.torch_api.codecs.normal2`).
``sign1``  1 bit per value: its side of each block's mean, scaled by the block's mean absolute deviation
           (:mod:`~bagua.torch_api.codecs.sign1`; 1.25 bits per value at ``block_size=256``).
``topk``   sparse: each block's 1/32 largest values by magnitude, their positions and 4 bits per value, exchanged
           by all-gather (:mod:`~bagua.torch_api.codecs.sparse`; 0.5 bits per value at ``block_size=256``).
=========  =======================================================================================================

The keyword is ``codec=`` (``ByteGradAlgorithm``, ``QAdamAlgorithm``, ``LowPrecisionDecentralizedAlgorithm``,
``contrib.ddp_hooks.ByteGradState``, ``ops.compressed.centralized_low_precision_op``); the original's bucket API keeps
its own ``compression=`` keyword and takes the same names. Aliases resolve to their codec's name, so an alias and the
name give bit-identical results. ``bf16``, ``nf2``, ``sign1`` and ``topk`` are registered for pseudo-gradients
(DiLoCo) and not offered for gradients (``for_gradients=False``): the gradient algorithms list and accept the others.

Each entry holds the factory of its workspace (the buffers and error-feedback residuals of one tensor's compressed
allreduce); :func:`bagua.torch_api.codecs.workspace.make_workspace` builds it by name.

Example:
    >>> resolve_codec("MinMaxUInt8").name, resolve_codec("uint4").block_codec
    ('chunk', 'uint4')
    >>> GlobalCodecRegistry.available(for_gradients=True)
    ['chunk', 'uint8', 'uint4']
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from bagua.torch_api.codecs.block_allreduce import BlockWorkspace
from bagua.torch_api.codecs.compressed_allreduce import Workspace

__all__ = ["CodecSpec", "CodecRegistry", "GlobalCodecRegistry", "resolve_codec"]

#: ``factory(numel, nranks, device, block_size, error_feedback, keep_previous) -> workspace``
WorkspaceFactory = Callable[[int, int, Optional[torch.device], int, bool, Optional[bool]], Any]


@dataclass(frozen=True)
class CodecSpec:
    """One registered codec.

    Fields: ``name`` (the registered name), ``description`` (one line, shown in error messages), ``workspace``
    (the factory of its workspace), ``block_codec`` (its name in :mod:`~bagua.torch_api.codecs.block`, or
    ``None`` for the per-rank-chunk code), ``for_gradients`` (offered to the gradient algorithms), ``aliases``.
    """

    name: str
    description: str
    workspace: WorkspaceFactory
    block_codec: Optional[str] = None
    for_gradients: bool = True
    aliases: tuple[str, ...] = ()

    @property
    def chunked(self) -> bool:
        """Whether the code cuts a bucket into one chunk per rank (the bucket is then padded to the group size)."""
        return self.block_codec is None


class CodecRegistry(dict):
    """Codec names to :class:`CodecSpec` s; ``register`` works as a call or a decorator and refuses duplicates."""

    def __init__(self) -> None:
        super().__init__()
        self._aliases: dict[str, str] = {}

    def register(self, name: str, workspace: Optional[WorkspaceFactory] = None, *, description: str,
                 block_codec: Optional[str] = None, for_gradients: bool = True,
                 aliases: tuple[str, ...] = ()) -> Any:
        """Register the codec ``name`` with its workspace factory; with ``workspace`` omitted, return a decorator.

        Example:
            >>> @GlobalCodecRegistry.register("my_uint8", description="...", block_codec="uint8")  # doctest: +SKIP
            ... def my_workspace(numel, nranks, device, block_size, error_feedback, keep_previous): ...
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"a codec name must be a non-empty str, got {name!r}")

        def do_register(factory: WorkspaceFactory) -> WorkspaceFactory:
            for key in (name, *aliases):
                if key in self or key in self._aliases:
                    owner = self._aliases.get(key, key)
                    raise ValueError(f"codec name {key!r} is already registered (for {owner!r}); pick another name")
            self[name] = CodecSpec(name, description, factory, block_codec, for_gradients, tuple(aliases))
            self._aliases.update((alias, name) for alias in aliases)
            return factory

        return do_register(workspace) if workspace is not None else do_register

    def get(self, name: str, *, for_gradients: Optional[bool] = None) -> CodecSpec:  # type: ignore[override]
        """Return the codec registered under ``name`` or one of its aliases; a ``ValueError`` listing the available
        ones (those offered for gradients, with ``for_gradients=True``) otherwise."""
        spec = super().get(self._aliases.get(name, name)) if isinstance(name, str) else None
        if spec is None or (for_gradients and not spec.for_gradients):
            raise ValueError(f"unknown codec {name!r}; available: {self.listing(for_gradients=for_gradients, near=name)}")
        return spec

    def canonical(self, name: str) -> str:
        """Return the registered name behind ``name`` (itself, or the codec an alias stands for)."""
        return self.get(name).name

    def available(self, *, for_gradients: Optional[bool] = None) -> list[str]:
        """Return the registered names, in registration order (only those offered for gradients, if asked)."""
        return [n for n, spec in self.items() if not for_gradients or spec.for_gradients]

    def listing(self, *, for_gradients: Optional[bool] = None, near: Optional[object] = None) -> str:
        """Return ``"'chunk' (...), 'uint8' (...), ..."`` for error messages (what is available), ending with the
        nearest name when ``near`` is a string close to one."""
        names = self.available(for_gradients=for_gradients)
        text = ", ".join(f"{n!r} ({self[n].description})" for n in names)
        aliases = [f"{a!r} for {n!r}" for a, n in self._aliases.items() if n in names]
        if aliases:
            text += "; aliases: " + ", ".join(aliases)
        others = [n for n in self if n not in names]
        if others:
            text += f"; {', '.join(map(repr, others))} only for pseudo-gradients (DiLoCo)"
        if isinstance(near, str):
            close = difflib.get_close_matches(near, [*names, *self._aliases], n=1)
            if close:
                text += f". Did you mean {close[0]!r}?"
        return text


#: The one codec registry.
GlobalCodecRegistry = CodecRegistry()


def resolve_codec(name: str) -> CodecSpec:
    """Return the codec registered under ``name`` or an alias of it (``"MinMaxUInt8"`` -> ``"chunk"``).

    The entry point for an algorithm that takes a codec name (DiLoCo's ``compression=`` included): a ``ValueError``
    lists the available names when ``name`` is unknown.

    Example:
        >>> resolve_codec("minmax_uint8").name
        'chunk'
    """
    return GlobalCodecRegistry.get(name)


@GlobalCodecRegistry.register("chunk", aliases=("MinMaxUInt8", "minmax_uint8"),
                              description="MinMaxUInt8, 8 bits per value, a min/max per rank chunk: the original's")
def _chunk_workspace(numel: int, nranks: int, device: Optional[torch.device], block_size: int,
                     error_feedback: bool, keep_previous: Optional[bool]) -> Workspace:
    if device is None:
        raise ValueError("make_workspace('chunk', ...) allocates its buffers now: pass the tensor's device")
    return Workspace(numel, nranks, device, error_feedback)


def _block_workspace(codec: str) -> WorkspaceFactory:
    def make(numel: int, nranks: int, device: Optional[torch.device], block_size: int, error_feedback: bool,
             keep_previous: Optional[bool]) -> BlockWorkspace:
        keep = error_feedback if keep_previous is None else keep_previous
        return BlockWorkspace(numel, nranks, codec, block_size, keep_previous=keep)

    return make


GlobalCodecRegistry.register("bf16", _block_workspace("bf16"), block_codec="bf16", for_gradients=False,
                description="bfloat16, 16 bits per value")
GlobalCodecRegistry.register("uint8", _block_workspace("uint8"), block_codec="uint8",
                description="8 bits per value, a min/max per block of block_size elements")
GlobalCodecRegistry.register("uint4", _block_workspace("uint4"), block_codec="uint4",
                description="4 bits per value, block-wise, for very slow links")
GlobalCodecRegistry.register("nf2", _block_workspace("nf2"), block_codec="nf2", for_gradients=False,
                description="2 bits per value at normal levels about each block's mean and RMS")
GlobalCodecRegistry.register("sign1", _block_workspace("sign1"), block_codec="sign1", for_gradients=False,
                description="1 bit per value: its side of each block's mean, scaled by the mean deviation")
GlobalCodecRegistry.register("topk", _block_workspace("topk"), block_codec="topk", for_gradients=False,
                description="top 1/32 of each block by magnitude, their positions and 4-bit values (all-gather)")
