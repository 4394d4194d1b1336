"""DiLoCo's pieces as plain functions and one state object: fragments, their schedule and the outer step.

:class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver` drives them; nothing here knows the engine. For one
fragment (a group of parameters) with ``g`` its global weights (float32, the same on every rank) and ``x`` this
rank's weights after its inner steps::

    delta = g - x                       (the pseudo-gradient, float32)
    avg   = mean over ranks of delta    (exact, or through a block codec: bf16, uint8, uint4, nf2)
    g     = OuterOptimizer(g, grad=avg) (SGD with Nesterov momentum by default, in float32)
    x     = g                           (tau = 0)
    x     = alpha * x + (1 - alpha) * g (tau > 0: x made tau more inner steps while avg travelled)

Eager updates (``eager=True``, after arXiv 2502.12996) instead stand in for the average while it travels with this
rank's own pseudo-gradient, then correct once it arrives::

    e     = OuterOptimizer(g, grad=delta) on a copy of the outer state   (when the exchange starts)
    x     = e                                                            (then tau inner steps move x on)
    g     = OuterOptimizer(g, grad=avg)                                  (when avg arrives)
    x     = x + (g - e)

With ``overlap_keep=True`` the weights instead keep the ``tau`` inner steps made while ``avg`` travelled and take
the outer step whole: ``x = g + (x - x_sent)``, with ``x_sent`` the local weights when the exchange started.

Fragments (Streaming DiLoCo, https://arxiv.org/abs/2501.18512) split the parameters, in model order, into groups
of about equal bytes; fragment ``p`` of ``F`` starts its exchange at the inner steps ``s`` with
``s % H == offset(p) % H``, ``offset(p) = round((p + 1) * H / F)``, so the fragments take turns at evenly spaced
moments of each round of ``H`` steps and each synchronizes once per round.

Example:
    >>> sync_offsets(100, 4)
    [25, 50, 75, 100]
    >>> due_fragments(50, 100, [25, 50, 75, 100])
    [1]
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from bagua.torch_api.codecs.compressed_allreduce import all_finite

__all__ = ["FRAGMENT_LAYOUTS", "split_fragments", "sync_offsets", "due_fragments", "Fragment"]

#: how parameters are dealt into fragments
FRAGMENT_LAYOUTS = ("contiguous", "strided")

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def _equal_byte_parts(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Cut indices ``0..len(sizes)-1``, in order, into ``parts`` non-empty runs of about equal total size."""
    total, bounds, acc = sum(sizes), [], 0
    for i, size in enumerate(sizes):
        acc += size
        # close a run once it reaches its share; leave at least one index for each run still to come
        while len(bounds) < parts - 1 and acc >= total * (len(bounds) + 1) / parts and len(sizes) - i - 1 >= (
                parts - 1 - len(bounds)):
            bounds.append(i + 1)
            break
    while len(bounds) < parts - 1:  # tiny tensors at the end: give each remaining run one index
        bounds.append(len(sizes) - (parts - 1 - len(bounds)))
    edges = [0] + bounds + [len(sizes)]
    return [list(range(edges[k], edges[k + 1])) for k in range(parts)]


def split_fragments(sizes: Sequence[int], fragments: int, layout: str = "contiguous") -> list[list[int]]:
    """Deal parameter indices (model order, ``sizes`` in bytes) into ``fragments`` groups of about equal bytes.

    ``"contiguous"``: consecutive runs (fragment 0 holds the first layers). ``"strided"``: the parameters are cut
    into ``4 * fragments`` consecutive runs and fragment ``p`` takes runs ``p, p + F, p + 2F, p + 3F`` (as Streaming
    DiLoCo's strided fragments, each spans the depth of the model).

    Example:
        >>> split_fragments([4, 4, 4, 4], 2)
        [[0, 1], [2, 3]]
        >>> split_fragments([1] * 8, 2, "strided")
        [[0, 2, 4, 6], [1, 3, 5, 7]]
    """
    if fragments > len(sizes):
        raise ValueError(f"fragments={fragments} is more than the {len(sizes)} parameters to split; use at most "
                         f"{len(sizes)}")
    if layout == "contiguous" or fragments == 1:
        return _equal_byte_parts(sizes, fragments)
    runs = _equal_byte_parts(sizes, min(4 * fragments, len(sizes)))
    return [sorted(i for run in runs[p::fragments] for i in run) for p in range(fragments)]


def sync_offsets(sync_every: int, fragments: int) -> list[int]:
    """The step within each round (1..H) at which each fragment starts its exchange: ``round((p + 1) * H / F)``."""
    return [max(1, round((p + 1) * sync_every / fragments)) for p in range(fragments)]


def due_fragments(step: int, sync_every: int, offsets: Sequence[int]) -> list[int]:
    """The fragments whose exchange starts after inner step ``step`` (1-based)."""
    return [p for p, offset in enumerate(offsets) if step % sync_every == offset % sync_every]


class Fragment:
    """One fragment's outer state: global weights, outer optimizer, exchange buffer and codec workspace.

    Args:
        index: the fragment's number (names its checkpoint keys).
        params: its parameters, in model order.
        outer_factory: builds the outer optimizer over ``[global]``.
        offload: keep the global weights and the outer optimizer's state in (pinned, with CUDA) CPU memory.
    """

    __slots__ = ("index", "params", "numel", "device", "global_", "outer", "delta", "grad", "workspace", "pending",
                 "eager")

    def __init__(self, index: int, params: list[torch.nn.Parameter], outer_factory: OuterFactory,
                 offload: bool = False) -> None:
        # what it covers
        self.index = index
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.device = params[0].device
        # outer state, the same on every rank
        home = torch.device("cpu") if offload else self.device
        pin = offload and torch.cuda.is_available()
        self.global_ = torch.empty(self.numel, dtype=torch.float32, device=home, pin_memory=pin)
        self._gather_into(self.global_)
        self.outer = outer_factory([self.global_])
        # the pseudo-gradient, then its average (on the parameters' device: what the network sends)
        self.delta = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        self.grad = self.delta if home == self.device else torch.empty_like(self.global_, pin_memory=pin)
        self.workspace: Optional[Any] = None  # the codec's buffers and error-feedback residuals (either exchange)
        self.pending: Optional[tuple[int, object]] = None  # (finish step, job) of an exchange in flight
        self.eager: Optional[torch.Tensor] = None  # with eager updates: the stand-in global weights (built on use)

    def _views(self, flat: torch.Tensor):
        offset = 0
        for p in self.params:
            yield p, flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    @torch.no_grad()
    def _gather_into(self, flat: torch.Tensor) -> None:
        for p, view in self._views(flat):
            view.copy_(p)

    @torch.no_grad()
    def pseudo_gradient(self) -> torch.Tensor:
        """``delta = global - local`` in float32, into :attr:`delta`, which the exchange then averages in place."""
        self.delta.copy_(self.global_, non_blocking=True)
        for p, view in self._views(self.delta):
            view.sub_(p)
        return self.delta

    def exchange(self, over: Any, compression: str, block_size: int, error_feedback: bool) -> int:
        """Average :attr:`delta` in place over ``over`` (an :class:`~bagua.torch_api.ops.diloco_exchange.OverRanks`
        or :class:`~bagua.torch_api.ops.diloco_exchange.OverMembers`): in float32 (``"none"``), or through the
        block codec, whose residuals live in :attr:`workspace`; return the bytes this rank sent."""
        if compression == "none":
            return over.average(self.delta)
        return over.compressed_average(self, compression, block_size, error_feedback)

    @torch.no_grad()
    def keep_step(self) -> None:
        """Remember this rank's weights as the exchange starts (in :attr:`eager`), so that :meth:`outer_step`
        (``eager=True``) later sets ``x = g + (x - x_sent)``: the whole outer step plus the inner steps made while
        the average travelled. Nothing stands in for the average; the weights are left where they are."""
        if self.eager is None:
            self.eager = torch.empty_like(self.global_)
        self._gather_into(self.eager)

    @torch.no_grad()
    def eager_step(self, stand_in: Optional[torch.Tensor] = None) -> None:
        """Stand in for the average about to travel with this rank's own pseudo-gradient (in :attr:`delta`, read
        before the exchange starts): take the outer step on copies of the global weights and the outer state, keep
        the result in :attr:`eager` and set the local weights to it. The global weights and the outer state are left
        as they were (the same on every rank, bit for bit) for the outer step with the average, after which
        :meth:`outer_step` (``eager=True``) moves the local weights by ``global - eager``. ``stand_in``: what
        stands in for the average instead of :attr:`delta` (a simulation's other choices)."""
        g = self.global_
        if self.eager is None:
            self.eager = torch.empty_like(g)
        saved = g.clone()
        state = self.outer.state[g] if g in self.outer.state else None
        if state is not None:  # the trial step runs on a copy: the real one takes the average later
            self.outer.state[g] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        if stand_in is not None:
            g.grad = stand_in
        else:
            if self.grad is not self.delta:
                self.grad.copy_(self.delta)
            g.grad = self.grad
        self.outer.step()
        g.grad = None
        self.eager.copy_(g)
        g.copy_(saved)
        if state is None:
            self.outer.state.pop(g, None)
        else:
            self.outer.state[g] = state
        for p, view in self._views(self.eager):
            p.copy_(view)

    def finish(self, timeout_s: float, alpha: float, owner: str, eager: bool = False) -> None:
        """Wait for the exchange in flight (if any), check the average is finite (the same verdict on every rank:
        they hold the same bytes) and take the outer step (``eager``: correct an :meth:`eager_step`); ``owner``
        names the caller in the error."""
        assert self.pending is not None
        _, job = self.pending
        if job is not None:
            job.wait(timeout_s)
        self.pending = None
        if not all_finite(self.delta):
            raise FloatingPointError(
                f"{owner}: the averaged pseudo-gradient of fragment {self.index} holds NaN or Inf, so some rank's "
                "weights diverged during the inner steps; the global weights were left as they were. Lower the inner "
                "learning rate, clip gradients, or use torch.amp.GradScaler (which skips non-finite steps)"
            )
        self.outer_step(alpha, eager)

    @torch.no_grad()
    def outer_step(self, alpha: float = 0.0, eager: bool = False) -> None:
        """Apply the outer optimizer to the global weights with the averaged pseudo-gradient in :attr:`delta`,
        then set the local weights: ``x = g`` (``alpha = 0``), ``x = alpha * x + (1 - alpha) * g``, or, after an
        :meth:`eager_step` (``eager``), ``x = x + (g - e)`` with ``e`` its stand-in global weights."""
        if eager and self.eager is None:
            raise RuntimeError(f"DiLoCo fragment {self.index}: an eager outer step without its stand-in; the exchange "
                               "was started (or checkpointed) with eager=False: resume with the setting it ran with")
        if self.grad is not self.delta:
            self.grad.copy_(self.delta)
        self.global_.grad = self.grad
        self.outer.step()
        self.global_.grad = None
        if eager:  # the correction g - e, exact in float32 (negation rounds nothing)
            self.eager.sub_(self.global_).neg_()
        target = self.eager if eager else self.global_
        if target.device != self.device:
            self.delta.copy_(target, non_blocking=True)
            source = self.delta
        else:
            source = target
        for p, view in self._views(source):
            if eager:
                p.add_(view.to(p.dtype))
            elif alpha == 0.0:
                p.copy_(view)
            else:
                p.lerp_(view.to(p.dtype), 1.0 - alpha)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def state_dict(self, timeout_s: float) -> dict[str, torch.Tensor]:
        """The global weights, the outer optimizer's tensors, the codec's residuals and, for an exchange in flight
        (waited for, at most ``timeout_s``), its finish step and result; keyed ``<index>.<name>``."""
        p = self.index
        state = {f"{p}.global": self.global_.detach().clone()}
        if self.pending is not None:
            finish_step, job = self.pending
            if job is not None:
                job.wait(timeout_s)
            self.pending = (finish_step, None)  # the average is in self.delta
            state[f"{p}.pending_finish"] = torch.tensor(finish_step)
            state[f"{p}.pending_average"] = self.delta.detach().clone()
            if self.eager is not None:
                state[f"{p}.pending_eager"] = self.eager.detach().clone()
        for key, value in self.outer.state.get(self.global_, {}).items():
            if torch.is_tensor(value):
                state[f"{p}.outer.{key}"] = value.detach().clone()
        if self.workspace is not None and hasattr(self.workspace, "state_dict"):
            for key, value in self.workspace.state_dict().items():
                state[f"{p}.codec.{key}"] = value.detach().clone()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], make_workspace: Callable[[], object]) -> None:
        """Restore what :meth:`state_dict` returned (``make_workspace`` builds the codec's buffers to load into)."""
        p = self.index
        saved = state[f"{p}.global"]
        if saved.numel() != self.numel:
            raise ValueError(f"DiLoCo fragment {p} holds {self.numel} values, the checkpoint {saved.numel()}: it was "
                             "saved with another model or another number of fragments")
        self.global_.copy_(saved)
        outer = {k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"{p}.outer.")}
        if outer:
            self.outer.state[self.global_] = {k: v.to(self.global_.device).clone() for k, v in outer.items()}
        codec = {k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"{p}.codec.")}
        if codec:
            self.workspace = make_workspace()
            self.workspace.load_state_dict(codec)  # type: ignore[attr-defined]
        if f"{p}.pending_finish" in state:
            self.delta.copy_(state[f"{p}.pending_average"])
            self.pending = (int(state[f"{p}.pending_finish"]), None)
            if f"{p}.pending_eager" in state:
                self.eager = state[f"{p}.pending_eager"].to(self.global_.device).clone()
