"""Wrapping the same model again (autotune does, users do) leaks neither threads nor file descriptors (issue 20).

After a warm-up wrap and step, 20 further ``with_bagua`` calls, each followed by a training step, must leave the
process's thread count (``/proc/self/task``) and open file descriptors (``/proc/self/fd``) where they were, within
SLACK: the engine reuses the private groups it created for the module, and a re-wrap stops the previous engine's
communication thread (and the async averaging thread).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model

WRAPS = 20
SLACK = 2  # a thread or descriptor the runtime may open lazily (e.g. an intra-op pool), never one per wrap


def _counts():
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _worker(rank, world_size, name):
    from bagua.torch_api.algorithms import Algorithm

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kwargs = {"async": {"sync_interval_ms": 5}, "gradient_allreduce": {}}.get(name, {"hierarchical": False})

    def wrap_and_step(step):
        model.with_bagua([opt], Algorithm.init(name, **kwargs))
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    wrap_and_step(0)  # warm-up: private groups, the communication thread, torch's own pools
    before = _counts()
    for step in range(1, WRAPS + 1):
        wrap_and_step(step)
    after = _counts()
    if name == "async":
        model.bagua_algorithm.abort(model)
    return before, after


NAMES = ["async", "gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized"]


def _worker_all(rank, world_size):
    return {name: _worker(rank, world_size, name) for name in NAMES}  # one job: the test stays quick


@pytest.fixture(scope="module")
def counts():
    return run_workers(_worker_all, 2, timeout=150)


@pytest.mark.parametrize("name", NAMES)
def test_rewrapping_keeps_threads_and_descriptors_flat(counts, name):
    for rank, by_name in enumerate(counts):
        (threads0, fds0), (threads1, fds1) = by_name[name]
        assert threads0 > 1 and fds0 > 3  # the counts are read (the engine's threads and sockets exist)
        assert threads1 - threads0 <= SLACK, f"{name}: rank {rank} threads {threads0} -> {threads1} after {WRAPS} wraps"
        assert fds1 - fds0 <= SLACK, f"{name}: rank {rank} open fds {fds0} -> {fds1} after {WRAPS} wraps"


# -- DistributedDataParallel over a module that is already wrapped --------------------------------------------------


def _train(model, opt, rank, steps, first_step=0):
    for step in range(first_step, first_step + steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _worker_ddp_rewrap(rank, world_size):
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.data_parallel import DistributedDataParallel as DDP

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = DDP(model, optimizers=[opt], algorithm=ByteGradAlgorithm(hierarchical=False))
    _train(first, opt, rank, 2)
    second = DDP(model, optimizers=[opt], algorithm=GradientAllReduceAlgorithm())  # as the original switches
    start = [p.detach().clone() for p in model.parameters()]
    _train(second, opt, rank, 3, first_step=2)
    # the same three steps by hand: the average of both ranks' gradients, plain SGD
    ref = make_model(rank)
    with torch.no_grad():
        for p, s in zip(ref.parameters(), start):
            p.copy_(s)
    for step in range(2, 5):
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(batch(rank, step)[0]), batch(rank, step)[1]).backward()
        with torch.no_grad():
            for p in ref.parameters():
                torch.distributed.all_reduce(p.grad)
                p.sub_(0.05 * p.grad / world_size)
    second.inner.close()
    weights, reference = [p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()]
    return getattr(first.inner, "closed", False), weights, reference


def test_ddp_over_a_wrapped_module_replaces_the_earlier_engine():
    """Wrapping a module with Bagua's DistributedDataParallel again closes the earlier engine (the original reset the
    module's Bagua state): afterwards only the new algorithm communicates. Tolerance: float32 sums of 2 gradients in
    another order, rtol=1e-5, atol=1e-6."""
    for closed, weights, reference in run_workers(_worker_ddp_rewrap, 2, timeout=120):
        torch.testing.assert_close(weights, reference, rtol=1e-5, atol=1e-6)
        assert closed
