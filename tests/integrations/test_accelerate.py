"""Accelerate (``Accelerator`` + ``prepare``) with Bagua's ByteGrad DDP hook at 2 CPU ranks.

Reference: Bagua's own ByteGrad (``with_bagua``, one bucket) on the same model and data, bit for bit
(``torch.equal``), as in tests/contrib/test_ddp_hooks.py (same square MLP, so that both chunk the same elements):
plain steps, and accumulation over 2 micro-batches with ``accelerator.accumulate`` (which runs the first under
``no_sync()`` and divides the loss by 2, exactly) against Bagua's ``no_sync()`` with the loss divided by 2.
Also DiLoCoOptimizer under Accelerate (``local_hook`` on the prepared model, ``sync_every=2``): the ranks' weights
differ after local steps and are identical after each synchronization.

All cases train one after another in one job of 2 processes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("accelerate")

from tests.contrib.test_ddp_hooks import BIG_BUCKET, STEPS, _batch, _model, _params  # noqa: E402
from tests.harness import run_workers  # noqa: E402


def _accelerate(rank, micro_batches):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from bagua.torch_api.contrib.ddp_hooks import ByteGradState, bytegrad_hook

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=micro_batches,
                              kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=1024)])
    model = _model(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = ByteGradState()
    model.register_comm_hook(state, bytegrad_hook)
    history = []
    for step in range(1, STEPS + 1):
        for micro in range(micro_batches):
            x, y = _batch(rank, step, micro)
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        history.append(_params(model))
    state.close()
    accelerator.free_memory()
    return history, state.iter


def _bagua(rank, micro_batches):
    import bagua.torch_api  # noqa: F401  (installs with_bagua)
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm

    model = _model(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = model.with_bagua([optimizer], ByteGradAlgorithm(hierarchical=False))
    history = []
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        for micro in range(micro_batches):
            x, y = _batch(rank, step, micro)
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else model.bagua_ddp.no_sync():
                (torch.nn.functional.mse_loss(model(x), y) / micro_batches).backward()
        optimizer.step()
        history.append(_params(model))
    model.bagua_ddp.close()
    return history


def _diloco(rank):
    from accelerate import Accelerator

    from bagua.torch_api.contrib import DiLoCoOptimizer
    from bagua.torch_api.contrib.ddp_hooks import local_hook

    accelerator = Accelerator(cpu=True)
    model = _model(rank)
    model, inner = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model.register_comm_hook(None, local_hook)
    optimizer = DiLoCoOptimizer(inner.optimizer, sync_every=2)
    history = []
    for step in range(1, STEPS + 1):
        x, y = _batch(rank, step)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        inner.step()  # Accelerate's optimizer steps the inner one...
        optimizer.after_inner_step()  # ...and DiLoCo counts it
        inner.zero_grad()
        history.append(_params(model))
    return history, optimizer.syncs


def _worker(rank, world_size):
    return {
        "plain": (_accelerate(rank, 1), _bagua(rank, 1)),
        "accumulate": (_accelerate(rank, 2), _bagua(rank, 2)),
        "diloco": _diloco(rank),
    }


@pytest.fixture(scope="module")
def job():
    env = {**BIG_BUCKET, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # Accelerate asks; the harness rendezvoused
    return run_workers(_worker, 2, env=env, timeout=240)


@pytest.mark.parametrize("case", ["plain", "accumulate"])
def test_same_weights_as_bagua_bytegrad(job, case):
    for rank, result in enumerate(job):
        (hooked, iters), bagua = result[case]
        assert iters == STEPS
        for step, (a, b) in enumerate(zip(hooked, bagua), start=1):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"{case}, rank {rank}, step {step}: max diff {(x - y).abs().max()}"


def test_diloco_under_accelerate(job):
    (h0, syncs), (h1, _) = job[0]["diloco"], job[1]["diloco"]
    assert syncs == STEPS // 2
    for step, (a, b) in enumerate(zip(h0, h1), start=1):
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        assert same == (step % 2 == 0), f"step {step}: same weights on both ranks: {same}"
