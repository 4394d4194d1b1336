"""``bagua.torch_api.data_parallel.functional.all_reduce`` on 2 ranks against the maths: the forward is the sum
(or maximum) over ranks, and the gradient of ``x_r`` is the sum over ranks of the gradients of the result."""

from __future__ import annotations

import torch

from tests.harness import run_workers


def _x(rank: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) * (rank + 1) + rank


def _c(rank: int) -> torch.Tensor:
    return torch.tensor([1.0, -2.0, 3.0, 0.5]) * (rank + 2)


def _worker(rank, world_size):
    import torch.distributed as dist

    import bagua.torch_api as bagua
    from bagua.torch_api.data_parallel.functional import all_reduce

    out = {}
    for name, op in [("torch_sum", dist.ReduceOp.SUM), ("bagua_sum", bagua.ReduceOp.SUM)]:
        x = _x(rank).requires_grad_()
        y = all_reduce(x, op)
        (y * _c(rank)).sum().backward()  # each rank's own loss on the shared result
        out[name] = (y.detach(), x.grad.clone(), _x(rank).equal(x.detach()))
    x = _x(rank).requires_grad_()
    out["max"] = all_reduce(x, dist.ReduceOp.MAX, group=bagua.communication._get_default_group()).detach()
    return out


def test_all_reduce_forward_and_backward_match_the_maths():
    results = run_workers(_worker, 2)
    total = _x(0) + _x(1)
    grad = _c(0) + _c(1)  # d/dx_r of sum_j (y . c_j) with y = x_0 + x_1
    for out in results:
        for name in ("torch_sum", "bagua_sum"):
            y, g, untouched = out[name]
            assert torch.equal(y, total) and torch.equal(g, grad) and untouched, name
        assert torch.equal(out["max"], torch.maximum(_x(0), _x(1)))
