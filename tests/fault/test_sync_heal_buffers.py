"""A synchronous job's heal carries the model's buffers (BatchNorm's running statistics) with its weights.

Two workers' :class:`~bagua.torch_api.fault.synchronous.SyncSteps` on a real coordinator, each over its own model
with BatchNorm whose running statistics moved on its own data: what a joiner loads from a peer's heal leaves its
weights, buffers and optimizer state equal to the peer's, tensor for tensor; a peer whose buffers differ in shape
is refused with what to do.
"""

from __future__ import annotations

import pytest
import torch

from bagua.torch_api.fault.replica import FaultTolerance
from bagua.torch_api.fault.synchronous import SyncSteps


def _worker(coordinator: str, i: int) -> tuple[FaultTolerance, torch.nn.Module, SyncSteps]:
    torch.manual_seed(i)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3 + i):  # its own data: its own running statistics and Adam moments
        opt.zero_grad()
        model(torch.randn(8, 3) + i).pow(2).mean().backward()
        opt.step()
    ft = FaultTolerance(coordinator, f"w{i}", workers=2, timeout_s=30.0, prefix="buffers")
    return ft, model, SyncSteps(ft, list(model.parameters()), opt, buffers=list(model.buffers()))


def test_a_joiner_takes_the_peers_buffers_with_its_weights_or_a_clear_error(coordinator):
    (fa, a, sa), (fb, b, sb) = _worker(coordinator, 0), _worker(coordinator, 1)
    try:
        assert not torch.equal(a[1].running_mean, b[1].running_mean)
        sb.load_heal_state_dict(sa.heal_state_dict())
        for x, y in zip(a.state_dict().values(), b.state_dict().values()):  # weights and buffers
            assert torch.equal(x, y)
        assert int(b[1].num_batches_tracked) == 3
        moments_a = [s["exp_avg"] for s in sa.optimizer.state.values()]
        moments_b = [s["exp_avg"] for s in sb.optimizer.state.values()]
        assert all(torch.equal(x, y) for x, y in zip(moments_a, moments_b))
        state = sa.heal_state_dict()  # a peer whose model differs: refused, nothing of it loaded
        state["param.0"] = state["param.0"] + 1
        state["buffer.0"] = torch.zeros(5)
        with pytest.raises(ValueError, match="buffer 0 has shape .* every worker must build the same model"):
            sb.load_heal_state_dict(state)
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    finally:
        fa.close()
        fb.close()

