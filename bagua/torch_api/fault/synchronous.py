"""Synchronous steps that outlive a dead replica: gradient averaging over a quorum of live workers at every step.

:class:`SyncSteps` runs one optimizer step of a synchronous job (gradient allreduce, ByteGrad) as a round of
:class:`~bagua.torch_api.fault.replica.FaultTolerance`; each worker is a job of its own (one process):

1. before the forward (:meth:`SyncSteps.before_forward`), the step's agreement on its members
   (:meth:`~bagua.torch_api.fault.replica.FaultTolerance.agree`, waits on the coordinator only) starts on a thread,
   so that its cost hides behind the forward and backward passes;
2. after the backward (:meth:`SyncSteps.after_backward`), the round starts on that quorum (a joiner heals from a
   live peer: weights, step counter and the whole optimizer state, through :meth:`SyncSteps.heal_state_dict`), and
   the flat gradient is averaged over the live members, weighted by the samples each contributed (a dead
   replica's share goes to the living); float32, or a block codec by all-gather (ByteGrad: ``"uint8"``,
   ``"uint4"``, with error feedback);
3. the gradients are written back only when the round commits
   (:meth:`~bagua.torch_api.fault.replica.FaultTolerance.should_commit`); otherwise the survivors run the round
   again, without the dead, from the gradients they held before it. The user's ``optimizer.step()`` then applies
   the same average on every member: the members keep bit-identical weights.

A worker joins (at the job's start, after a restart, or after it was left out) at a step boundary: before its first
forward it takes the first worker's state (the job's start) or a live peer's (a running job); in a running job it
also takes that step's average, which its next ``optimizer.step()`` applies in place of its own gradients (they
were computed before it joined).

Example:
    >>> steps = SyncSteps(ft, params, optimizer)  # GradientAllReduceAlgorithm(fault_tolerance=ft)'s  # doctest: +SKIP
    >>> steps.before_forward(); loss(model(x)).backward(); steps.after_backward(); optimizer.step()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional, Sequence

import torch

from bagua.torch_api.codecs.block import decode
from bagua.torch_api.codecs.workspace import allgather_average
from bagua.torch_api.fault.heal import flatten_optimizer_state, unflatten_optimizer_state
from bagua.torch_api.fault.records import Quorum, Round
from bagua.torch_api.fault.replica import FaultTolerance

__all__ = ["SyncSteps", "OPTIMIZER_PREFIX"]

_log = logging.getLogger(__name__)
#: the keys of the optimizer's state in a synchronous heal state (all of it: Adam's moments included)
OPTIMIZER_PREFIX = "optimizer."


class _Agreement:
    """One step's agreement, run on a thread (:meth:`FaultTolerance.agree`); :meth:`result` re-raises its error."""

    def __init__(self, ft: FaultTolerance, round: int, part: int) -> None:
        self.quorum: Optional[Quorum] = None
        self.error: Optional[BaseException] = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(ft, round, part), name="bagua-ft-agree",
                                        daemon=True)
        self._thread.start()

    def _run(self, ft: FaultTolerance, round: int, part: int) -> None:
        started = time.monotonic()
        try:
            self.quorum = ft.agree(round, part)
        except BaseException as exc:  # re-raised on the training thread
            self.error = exc
        self.seconds = time.monotonic() - started

    def result(self) -> Quorum:
        """The quorum, once agreed (re-raising what the agreement raised)."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.quorum is not None
        return self.quorum


class SyncSteps:
    """Average each step's gradients over a quorum of live workers, healing joiners (see the module docstring).

    Args:
        ft: this worker's :class:`~bagua.torch_api.fault.replica.FaultTolerance`.
        params: the trainable parameters, in the same order on every worker.
        optimizer: the optimizer that steps them (its whole state heals a joiner).
        codec: ``None`` (float32 average) or a block codec of the registry (``"uint8"``, ``"uint4"``): each
            member's gradient is encoded once and all-gathered, every member decodes the same wires in member order.
        block_size: the codec's block size.
        error_feedback: with a codec, add this worker's quantization error of the earlier steps to its gradient
            (kept only from rounds that commit; a joiner's starts at zero).
        name: the algorithm, in the settings every member must share.
        buffers: the model's buffers (BatchNorm's running statistics), in the same order on every worker: a joiner
            takes them with the weights; they are not averaged (each worker keeps its own, as ``with_bagua``).

    Attributes: ``steps`` (the job's committed steps, also after a heal), ``wait_seconds`` (per step, how long the
    training thread waited for the agreement after the backward: the part of the quorum's cost not hidden),
    ``agree_seconds`` (per step, the agreement's own time).

    Example:
        >>> steps = SyncSteps(ft, list(model.parameters()), opt, codec="uint8")  # doctest: +SKIP
    """

    def __init__(self, ft: FaultTolerance, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 codec: Optional[str] = None, block_size: int = 4096, error_feedback: bool = False,
                 name: str = "gradient_allreduce", buffers: Sequence[torch.Tensor] = ()) -> None:
        # user settings
        self.ft, self.params, self.optimizer = ft, list(params), optimizer
        self.buffers = list(buffers)  # healed with the weights (BatchNorm's running statistics), never averaged
        self.codec, self.block_size, self.error_feedback = codec, block_size, error_feedback
        # internal state
        self.steps = 0
        self._joined = False
        self._agreement: Optional[_Agreement] = None
        self._pending: Optional[torch.Tensor] = None  # a joiner's first step: the average it took while joining
        self._residual: Optional[torch.Tensor] = None  # error feedback: this worker's quantization error
        self._candidate: Optional[torch.Tensor] = None  # the round's new residual, kept when it commits
        self._buffer: Optional[torch.Tensor] = None  # the float32 average's, reused (written back before the next)
        # stats
        self.wait_seconds: list[float] = []
        self.agree_seconds: list[float] = []
        ft.register(self.heal_state_dict, self.load_heal_state_dict, *self._settings(name, codec, block_size))

    #: what the settings' message asks of a worker whose settings differ
    NEEDS = "the same model, algorithm and codec"

    def _settings(self, name: str, codec: Optional[str], block_size: int) -> tuple[str, str]:
        """What every worker must share (checked when it joins), and :attr:`NEEDS`, over :meth:`_whole`."""
        whole = self._whole()
        settings = f"{name} params={len(whole)} numel={sum(p.numel() for p in whole)} codec={codec}"
        if codec is not None:
            settings += f" block_size={block_size}"
        return settings, self.NEEDS

    def _whole(self) -> list[torch.Tensor]:
        """The parameters as every worker sees them whole (the settings name these)."""
        return self.params

    # -- the moments of a step -------------------------------------------------------------------------------------

    def before_forward(self) -> None:
        """Join the job when not yet in it (at a step boundary, before the forward), count the step's samples and
        start its agreement on a thread."""
        if not self._joined:
            self._join()
        if self._pending is not None or self._agreement is not None:
            self.ft.step_counted = True
            return  # a joiner's first step takes the average it already holds; or an agreement is under way
        self.ft.count_step(1)
        self.ft.step_counted = True  # until the backward ends: later samples would count in the next step
        self._agreement = _Agreement(self.ft, self.steps, 0)

    def after_backward(self) -> None:
        """Average the step's gradients over the live members (retrying without the dead) and write the average
        into the parameters' ``.grad``: what ``optimizer.step()`` applies next, the same on every member."""
        try:
            self._after_backward()
        finally:
            self.ft.step_counted = False  # the next step counts from here

    def _after_backward(self) -> None:
        if self._pending is not None:
            self.ft.count_step(0)  # the joiner's own step is not averaged: its samples count for nothing
            self._write(self._pending)
            self._pending = None
            self.steps += 1
            return
        if self._agreement is None:  # a backward without a forward under the hooks: agree now
            self.before_forward()
        agreement, self._agreement = self._agreement, None
        assert agreement is not None
        waited = time.monotonic()
        quorum = agreement.result()
        self.wait_seconds = (self.wait_seconds + [time.monotonic() - waited])[-1024:]
        self.agree_seconds = (self.agree_seconds + [agreement.seconds])[-1024:]
        while True:
            rnd = self.ft.enter_round(quorum)
            out = self._exchange(rnd)
            if self.ft.should_commit():
                break
            _log.info("worker %r: step %d is run again over the live workers", self.ft.worker, self.steps)
            quorum = self.ft.agree(self.steps, 0)
        if self._candidate is not None:
            self._residual, self._candidate = self._candidate, None
        self._write(out)
        self.steps += 1

    # -- joining and healing --------------------------------------------------------------------------------------

    def _join(self) -> None:
        """Take the first worker's state (the job's start) or a live peer's (a running job), before the forward."""
        while True:
            rnd = self.ft.enter_round(self.ft.agree(self.steps, 0))
            out = self._exchange(rnd, zeros=True) if rnd.part >= 0 else None
            if self.ft.should_commit():
                break
        self._joined = True
        self._pending = out
        if out is not None:
            _log.info("worker %r joined the job at step %d from a live peer", self.ft.worker, self.steps)

    def heal_state_dict(self) -> dict[str, torch.Tensor]:
        """What a joiner takes from this worker: the step counter, the weights, the buffers and the optimizer's whole
        state."""
        state = {"steps": torch.tensor(self.steps)}
        state.update({f"param.{i}": p.detach() for i, p in enumerate(self.params)})
        state.update({f"buffer.{i}": b.detach() for i, b in enumerate(self.buffers)})
        state.update(flatten_optimizer_state(self.optimizer.state_dict(), prefix=OPTIMIZER_PREFIX))
        return state

    @torch.no_grad()
    def load_heal_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take a peer's :meth:`heal_state_dict`; this worker's own error-feedback residual starts at zero. A peer
        whose tensors differ in shape is refused before anything is written."""
        pairs = [(f"parameter {i}", p, state[f"param.{i}"]) for i, p in enumerate(self.params)]
        pairs += [(f"buffer {i}", b, state[f"buffer.{i}"]) for i, b in enumerate(self.buffers)]
        for what, mine, src in pairs:
            if src.shape != mine.shape:
                raise ValueError(f"a peer's {what} has shape {tuple(src.shape)}, this worker's "
                                 f"{tuple(mine.shape)}: every worker must build the same model")
        for _, mine, src in pairs:
            mine.copy_(src)
        self.optimizer.load_state_dict(
            unflatten_optimizer_state({k: v for k, v in state.items() if k.startswith(OPTIMIZER_PREFIX)},
                                      prefix=OPTIMIZER_PREFIX))
        self.steps = int(state["steps"])
        self._residual = self._candidate = None

    # -- gradients ------------------------------------------------------------------------------------------------

    def _numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @torch.no_grad()
    def _flat_grads(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gradients as one float32 CPU vector (a parameter without one counts zeros), into ``out`` if given."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                          for p in self.params], out=out)

    @torch.no_grad()
    def _write(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            view = flat[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = view.to(device=p.device, dtype=p.dtype).clone()
            else:
                p.grad.copy_(view)
            offset += p.numel()

    @torch.no_grad()
    def _exchange(self, rnd: Round, zeros: bool = False) -> torch.Tensor:
        """The round's average of the gradients (``zeros``: of zeros, a joiner's; a new tensor); errors are
        recorded by ``ft`` (verdict: retry)."""
        self._candidate = None
        if self.codec is None:  # one allreduce, the screen's norms in a slot per member after the gradients
            if self._buffer is None or self._buffer.numel() != self._numel() + rnd.size:
                self._buffer = torch.empty(self._numel() + rnd.size)  # kept: its pages are touched already
            buf = self._buffer
            refill = (lambda data: data.zero_()) if zeros else (lambda data: self._flat_grads(out=data))
            refill(buf[:-rnd.size])
            self.ft.allreduce(buf, refill=refill)  # weighted by samples; a healed member adds zeros
            return buf[:-rnd.size]
        flat = torch.zeros(self._numel()) if zeros else self._flat_grads()
        if rnd.healed or rnd.weights[rnd.rank] == 0:
            x = torch.zeros_like(flat)
        elif self.error_feedback and self._residual is not None:
            x = flat + self._residual
        else:
            x = flat
        weights = self.ft.screen(x)  # not finite or far too large: left out, on every member
        if weights is None:
            return flat
        averaged = allgather_average(x, self.codec, self.ft.allgather, self.block_size,
                                     weights=None if weights == rnd.weights and rnd.equal_weights() else weights)
        if averaged is None:
            return flat
        out, wire = averaged
        if self.error_feedback and not rnd.healed and weights[rnd.rank] > 0:
            self._candidate = x - decode(wire, x.numel(), self.codec, self.block_size)
        return out
