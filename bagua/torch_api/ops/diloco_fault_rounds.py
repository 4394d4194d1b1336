"""DiLoCo's fault-tolerant rounds: the part of :class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver` that runs
each exchange as a round of :class:`~bagua.torch_api.fault.replica.FaultTolerance` (start the round, average over
its members, commit on its verdict) and heals a joiner through the driver's own state.

:class:`FaultRounds` is a base class of the driver (it reads the driver's fragments, counters and pace); nothing
here is used alone.

Example:
    >>> driver.join(optimizer)  # a DiLoCoDriver(..., fault=ft), once its fragments are built  # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from bagua.torch_api.ops.diloco import Fragment
from bagua.torch_api.ops.diloco_exchange import MemberResiduals, OverMembers

__all__ = ["FaultRounds"]


class FaultRounds:
    """Rounds over the live workers, healing through the driver's own state (a base class of
    :class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver`)."""

    fault: Any
    pace: Any
    hyper: Any
    fragments: list[Fragment]
    syncs: int
    bytes_sent: int
    processed: int

    def settings_text(self) -> str:
        """What every worker of a fault-tolerant job must share: the exchange's shape and the outer step ("auto"
        resolved; each worker takes it on the same average, so different ones would part the weights)."""
        h = self.hyper
        outer = ("custom" if h.outer_optimizer is not None else
                 f"lr={h.outer_lr} momentum={h.outer_momentum} nesterov={h.nesterov} lr_warmup={h.outer_lr_warmup}")
        pace = (f" rounds={h.rounds} speed_tolerance={h.speed_tolerance} sync_every_max={h.sync_every_max} "
                f"max_exchange_share={h.max_exchange_share}" if self.pace.active else "")
        return (f"sync_every={h.sync_every} fragments={h.fragments} compression={h.compression} "
                f"block_size={h.block_size} outer: {outer}{pace}")

    def join(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Register the driver's state with the fault-tolerance communicator and join the job (the first worker's
        weights at the start, a live peer's state later); ``optimizer``: the inner one, whose state heals too."""
        assert self.fault is not None, "join() is for a driver with fault tolerance"
        self.fault.register(self.heal_state_dict, self.load_heal_state_dict, self.settings_text(),
                            needs="the same sync_every, fragments, compression and outer step", optimizer=optimizer)
        self._fault_round(None)

    def _fault_round(self, fragment: Optional[Fragment]) -> bool:
        """Average ``fragment.delta`` over a round's live workers, retrying without those that fail; ``None``: join.

        Returns False when this worker healed in the round instead (it was joining, or left out): it then holds a
        peer's state (weights, counters) with that round's outer step taken, so the caller skips its own.
        """
        ft = self.fault
        assert ft is not None
        saved = fragment.delta.clone() if fragment is not None else None
        if fragment is not None and self.pace.active:
            self.pace.take_samples(fragment.index)  # the round weighs the fault layer's count
        while True:
            started, table = time.monotonic(), None
            rnd = ft.start_round(self.syncs, fragment.index if fragment is not None else -1)
            if rnd.part >= 0:
                if not rnd.healed and fragment is not None and fragment.index != rnd.part:
                    ft.fail(ValueError(f"worker {ft.worker!r} synchronizes fragment {fragment.index} while the "
                                       f"others synchronize {rnd.part}: the workers' DiLoCo settings differ"))
                else:
                    if self.pace.active:  # every member's report row: the plan, and the wait it absorbed
                        table = OverMembers(ft, rnd).report(self.pace.row(rnd.weights[rnd.rank]))
                        self.pace.wait_s += time.monotonic() - started
                    exchanged = time.monotonic()
                    self.bytes_sent += self.fragments[rnd.part].exchange(
                        OverMembers(ft, rnd), self.hyper.compression, self.hyper.block_size, self.error_feedback)
                    self.pace.exchange_s += time.monotonic() - exchanged
            if ft.should_commit():
                if table is not None and rnd.part == len(self.fragments) - 1:
                    self._round_end(table, rnd.rank, rnd.quorum.ids)
                if rnd.healed:
                    if rnd.part >= 0:
                        self.finish_now(self.fragments[rnd.part])
                        if self.pace.active and self.pace.round_over(self.processed):
                            self.pace.new_round(self.processed)  # the peer's round ended here
                    return False
                if rnd.part >= 0 and isinstance(self.fragments[rnd.part].workspace, MemberResiduals):
                    self.fragments[rnd.part].workspace.commit()  # the round is ok: its residual is ours now
                return True
            if fragment is not None and saved is not None:
                fragment.delta.copy_(saved)

    def heal_state_dict(self) -> dict[str, torch.Tensor]:
        """What a joining worker takes from this one: :meth:`state_dict` (counters, global weights, outer optimizer
        tensors, an exchange in flight) and ``syncs``, without the codec residuals (``*.codec.*``), which are this
        worker's own."""
        self._check_built()
        state = {k: v for k, v in self.state_dict(("steps", "processed")).items() if ".codec." not in k}
        state["syncs"] = torch.tensor(self.syncs)
        return state

    @torch.no_grad()
    def load_heal_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take a peer's :meth:`heal_state_dict`: start the per-rank state empty (no exchange in flight, residuals
        at zero), load the counters, global weights and outer state, and set the weights to the global ones
        (``x = g``)."""
        self._check_built()
        for fragment in self.fragments:
            fragment.workspace = None  # a new workspace's residuals start at zero
            fragment.pending = None
        self.load_state_dict({k: v for k, v in state.items() if k != "syncs"})
        self.syncs = int(state["syncs"])
        for fragment in self.fragments:
            offset = 0
            for p in fragment.params:
                p.copy_(fragment.global_[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
