"""Gradient allreduce against torch DDP: same final weights to float tolerance.

Tolerance: rtol=1e-5, atol=1e-6 (the two sum the same numbers, possibly in another bucket layout; after 6 SGD
steps with momentum differences stay at the level of float32 rounding).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of

STEPS = 6
TOL = dict(rtol=1e-5, atol=1e-6)


def _train(model, opt, rank, steps=STEPS, accumulate=1, use_side=None, set_to_none=True):
    loss_fn = torch.nn.MSELoss()
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for micro in range(accumulate):
            x, y = batch(rank, step * accumulate + micro)
            side = use_side(rank, step) if use_side else False
            last = micro == accumulate - 1
            ctx = model.no_sync() if (accumulate > 1 and not last) else _null()
            with ctx:
                loss_fn(model(x, side) if use_side else model(x), y).backward()
        opt.step()
    return model


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _ddp_reference(rank, steps=STEPS, accumulate=1, use_side=None, unused=False):
    model = make_model(rank, unused_branch=unused)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = ddp

        def forward(self, x, side=False):
            return self.m(x, side) if use_side else self.m(x)

        def no_sync(self):
            return ddp.no_sync()

    _train(Wrapped(), opt, rank, steps, accumulate, use_side)
    return params_of(model), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _worker_parity(rank, world_size, variant):
    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.data_parallel import DistributedDataParallel

    expected, _ = _ddp_reference(rank)
    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if variant == "ddp_api":
        wrapped = DistributedDataParallel(model, optimizers=[opt], algorithm=GradientAllReduceAlgorithm())
        _train(wrapped, opt, rank)
    else:
        model.with_bagua([opt], GradientAllReduceAlgorithm(), do_flatten=(variant != "no_flatten"))
        _train(model, opt, rank, set_to_none=(variant != "zero_grad_keep"))
    assert bagua.get_world_size() == world_size
    return expected, params_of(model), len(model.bagua_buckets) if variant != "ddp_api" else len(wrapped.bagua_buckets)


@pytest.mark.parametrize(
    "world_size,variant,bucket_size",
    [
        (2, "flatten", None),
        (2, "no_flatten", None),
        (2, "flatten", 1024),  # many small buckets
        (2, "zero_grad_keep", 1024),
        (2, "ddp_api", None),
        (4, "flatten", 2048),
    ],
)
def test_matches_torch_ddp(world_size, variant, bucket_size):
    env = {"BAGUA_DEFAULT_BUCKET_SIZE": str(bucket_size)} if bucket_size else None
    results = run_workers(_worker_parity, world_size, variant, env=env)
    for expected, got, n_buckets in results:
        assert_close(got, expected, **TOL)
        if bucket_size:
            assert n_buckets > 1
    for _, got, _ in results[1:]:
        assert_close(got, results[0][1], rtol=0, atol=0)  # every rank holds identical weights


def _worker_hierarchical(rank, world_size):
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    out = {}
    for hierarchical in (False, True):
        model = make_model(rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model.with_bagua([opt], GradientAllReduceAlgorithm(hierarchical=hierarchical))
        _train(model, opt, rank)
        out[hierarchical] = params_of(model)
    pg = model.bagua_ddp.process_group
    return out, pg.is_hierarchical_possible(), pg.get_intra_node_communicator().ranks


def test_hierarchical_equals_flat_on_two_nodes_of_two():
    results = run_workers(_worker_hierarchical, 4, local_size=2)
    for rank, (out, possible, intra) in enumerate(results):
        assert possible
        assert intra == ([0, 1] if rank < 2 else [2, 3])
        assert_close(out[True], out[False], **TOL)


def _worker_no_sync(rank, world_size):
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    expected, _ = _ddp_reference(rank, steps=3, accumulate=3)
    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    _train(model, opt, rank, steps=3, accumulate=3)
    return expected, params_of(model)


def test_no_sync_gradient_accumulation_matches_ddp():
    for expected, got in run_workers(_worker_no_sync, 2):
        assert_close(got, expected, **TOL)


def _use_side(rank, step):
    # the side branch is used by rank 0 on even steps only, and never by rank 1
    return rank == 0 and step % 2 == 0


def _never(rank, step):
    return False


def _worker_unused(rank, world_size, side_fn_name):
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.data_parallel import DistributedDataParallel

    side_fn = {"sometimes": _use_side, "never": _never}[side_fn_name]
    expected, expected_grads = _ddp_reference(rank, use_side=side_fn, unused=True)
    model = make_model(rank, unused_branch=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wrapped = DistributedDataParallel(
        model, optimizers=[opt], algorithm=GradientAllReduceAlgorithm(), find_unused_parameters=True
    )

    class Caller(torch.nn.Module):
        def forward(self, x, side=False):
            return wrapped(x, side)

        def no_sync(self):
            return wrapped.no_sync()

    _train(Caller(), opt, rank, use_side=side_fn)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return expected, params_of(model), expected_grads, grads


@pytest.mark.parametrize("side", ["sometimes", "never"])
def test_unused_parameters_match_ddp(side):
    for expected, got, expected_grads, grads in run_workers(_worker_unused, 2, side):
        assert_close(got, expected, **TOL)
        assert [g is None for g in grads] == [g is None for g in expected_grads]


def _worker_rewrap(rank, world_size):
    from bagua.torch_api.algorithms import Algorithm

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for name, kwargs in [("gradient_allreduce", {}), ("gradient_allreduce", {"average": False})]:
        model.with_bagua([opt], Algorithm.init(name, **kwargs))
        _train(model, opt, rank, steps=2)
    # after re-wrapping, only the new engine's hooks run: one bucket set, grads equal the summed gradients
    x, y = batch(rank, 99)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()], params_of(model)


def test_rewrap_with_another_algorithm():
    (g0, p0), (g1, p1) = run_workers(_worker_rewrap, 2)
    assert_close(g0, g1, rtol=0, atol=0)
    assert_close(p0, p1, rtol=0, atol=0)


def _worker_optimizer_state_broadcast(rank, world_size):
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    model = make_model(rank)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (rank + 1))
    # give each rank a different Adam state before wrapping
    for step in range(rank + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    state = [(s["step"].clone(), s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in opt.state.values()]
    return params_of(model), state, opt.param_groups[0]["lr"]


def test_wrap_broadcasts_parameters_and_optimizer_state():
    (p0, s0, lr0), (p1, s1, lr1) = run_workers(_worker_optimizer_state_broadcast, 2)
    assert_close(p1, p0, rtol=0, atol=0)
    assert_close(s1, s0, rtol=0, atol=0)
    assert lr0 == lr1 == 1e-3
