"""Multistream allreduce (the gloo "Bagua-Net") against one plain allreduce.

Tolerance: exact (rtol=0, atol=0). With 2 ranks every element is ``a + b`` (or ``a/2 + b/2`` for the DDP
hook) computed once, whatever piece or stream carries it, and float addition of two numbers is commutative.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of

EXACT = dict(rtol=0, atol=0)


def _worker_allreduce(rank, world_size, numel, num_streams, op_name):
    from bagua.torch_api import ReduceOp
    from bagua.torch_api.multistream import MultiStreamGroup

    op = ReduceOp[op_name]
    g = torch.Generator().manual_seed(17 + rank)
    x = torch.randn(numel, generator=g)
    expected = x.clone()
    dist.all_reduce(expected)
    if op == ReduceOp.AVG:
        expected /= world_size
    msg = MultiStreamGroup(max_streams=num_streams, min_chunk_bytes=4096)
    got = x.clone()
    msg.allreduce_(got, op)
    strided = torch.randn(numel, 2, generator=g)[:, 0]  # non-contiguous input goes through a copy
    strided_expected = strided.clone()
    dist.all_reduce(strided_expected)
    if op == ReduceOp.AVG:
        strided_expected /= world_size
    msg.allreduce_(strided, op)
    # the engine-facing call: an async allreduce of the enabled group, waited later
    from bagua.torch_api import multistream

    enabled = multistream.enable(None, num_streams=num_streams, min_chunk_bytes=4096,
                                 calibrate_streams=False)
    launched = x.clone()
    work = multistream.all_reduce_async(launched)
    work.wait()
    assert_close(launched, expected * (world_size if op == ReduceOp.AVG else 1), **EXACT)
    return expected, got, strided_expected, strided, len(msg.pieces(x)), msg.split_calls, enabled.split_calls


@pytest.mark.parametrize("numel,num_streams,op_name", [(300_001, 4, "SUM"), (300_001, 3, "AVG"), (100, 4, "SUM")])
def test_multistream_equals_single_allreduce(numel, num_streams, op_name):
    results = run_workers(_worker_allreduce, 2, numel, num_streams, op_name, init_bagua=True)
    for expected, got, s_expected, s_got, n_pieces, split_calls, async_split_calls in results:
        assert_close(got, expected, **EXACT)
        assert_close(s_got, s_expected, **EXACT)
        if numel * 4 >= num_streams * 4096:
            assert n_pieces == num_streams and split_calls == 2 and async_split_calls == 1
        else:
            assert n_pieces == 1 and split_calls == 0 and async_split_calls == 0
    assert_close(results[0][1], results[1][1], **EXACT)


def _train_step(model, opt, rank, step):
    opt.zero_grad()
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _train(model, opt, rank, steps=4):
    for step in range(steps):
        _train_step(model, opt, rank, step)


def _worker_ddp_hook(rank, world_size):
    from bagua.torch_api import multistream

    reference = make_model(rank)
    ddp_ref = torch.nn.parallel.DistributedDataParallel(reference)
    _train(ddp_ref, torch.optim.SGD(ddp_ref.parameters(), lr=0.05, momentum=0.9), rank)

    model = make_model(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    msg = multistream.enable(ddp, num_streams=3, min_chunk_bytes=256, calibrate_streams=False)
    _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), rank)
    return params_of(reference), params_of(model), msg.split_calls


def _worker_ddp_chooser(rank, world_size):
    from bagua.torch_api import multistream

    reference = make_model(rank)
    ddp_ref = torch.nn.parallel.DistributedDataParallel(reference)
    _train(ddp_ref, torch.optim.SGD(ddp_ref.parameters(), lr=0.05, momentum=0.9), rank, steps=20)

    model = make_model(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    msg = multistream.enable(ddp, num_streams=4, min_chunk_bytes=256)  # chooses on the first iterations
    seen = []
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(20):
        _train_step(ddp, opt, rank, step)
        seen.append(msg.num_streams)
    return params_of(reference), params_of(model), msg.chooser.chosen, seen


def test_ddp_chooses_streams_on_real_iterations():
    results = run_workers(_worker_ddp_chooser, 2)
    for expected, got, chosen, seen in results:
        assert_close(got, expected, **EXACT)  # switching streams mid-training changes nothing numerically
        assert chosen in (1, 2, 4) and seen[-1] == chosen
        assert {1, 2, 4} <= set(seen)  # every candidate ran
    assert results[0][2] == results[1][2] and results[0][3] == results[1][3]


def test_ddp_comm_hook_equals_default_ddp():
    for expected, got, split_calls in run_workers(_worker_ddp_hook, 2):
        assert_close(got, expected, **EXACT)
        assert split_calls > 0


def _worker_bagua(rank, world_size):
    from bagua.torch_api import multistream
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    out = []
    for use_multistream in (False, True):
        model = make_model(rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if use_multistream:  # enabled for the default group: the engine's own group gets the same streams
            multistream.enable(None, num_streams=2, min_chunk_bytes=256, calibrate_streams=False)
        model.with_bagua([opt], GradientAllReduceAlgorithm())
        own = multistream.get(model.bagua_ddp.process_group)
        _train(model, opt, rank)
        out.append(params_of(model))
        model.bagua_ddp.close()
    return out[0], out[1], own.split_calls


def test_bagua_gradient_allreduce_uses_enabled_streams():
    for plain, multi, split_calls in run_workers(_worker_bagua, 2):
        assert_close(multi, plain, **EXACT)
        assert split_calls > 0


def _worker_calibrate(rank, world_size):
    from bagua.torch_api.multistream import MultiStreamGroup, calibrate

    msg = MultiStreamGroup(max_streams=4)
    chosen = calibrate(msg, nbytes=1 << 20, repeats=2)
    x = torch.full((1000,), float(rank + 1))
    msg.allreduce_(x)
    return chosen, msg.num_streams, x


def test_calibration_chooses_alike_on_every_rank():
    results = run_workers(_worker_calibrate, 2)
    assert results[0][0] == results[1][0] == results[0][1] == results[1][1]
    assert results[0][0] in (1, 2, 4)
    for _, _, x in results:
        assert_close(x, torch.full((1000,), 3.0), **EXACT)


def test_nccl_socket_env_validates():
    from bagua.torch_api.multistream import apply_nccl_socket_env, nccl_socket_env

    assert nccl_socket_env(4, 8) == {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "8",
                                     "NCCL_BUFFSIZE": str(4 << 20)}
    with pytest.raises(ValueError, match="64 sockets"):
        nccl_socket_env(16, 8)
    with pytest.raises(ValueError, match="between 1 and 16"):
        nccl_socket_env(0, 1)
    environ = {"NCCL_SOCKET_NTHREADS": "8"}
    apply_nccl_socket_env(environ)
    assert environ["NCCL_SOCKET_NTHREADS"] == "8" and environ["NCCL_NSOCKS_PERTHREAD"] == "2"
