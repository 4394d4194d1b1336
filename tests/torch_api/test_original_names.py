"""The original's small public names: utils, bagua_define, coalesced collectives and communicator methods."""

from __future__ import annotations

import time

import pytest
import torch

from bagua.bagua_define import BaguaHyperparameter, TensorDeclaration, TensorDtype
from bagua.torch_api.utils import (
    StatisticalAverage, apply_flattened_call, check_contiguous, flatten, to_bagua_datatype, to_bagua_reduce_op,
    unflatten,
)
from tests.harness import run_workers


def test_flatten_unflatten_round_trip_and_contiguity():
    ts = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    flat = flatten(ts)
    assert flat.shape == (12,)
    views = unflatten(flat, ts)
    for t, v in zip(ts, views):
        torch.testing.assert_close(t, v, rtol=0, atol=0)
    assert check_contiguous(views)
    assert not check_contiguous([views[1], views[0]])
    assert not check_contiguous(ts)  # separate allocations
    with pytest.raises(ValueError, match="elements"):
        unflatten(flat[:5], ts)


def test_apply_flattened_call_runs_once_on_the_flat_tensor():
    ts = [torch.ones(2), torch.full((3,), 2.0)]
    calls = []
    apply_flattened_call(ts, lambda t, k: (calls.append(t.numel()), t.mul_(k)), extra_args=[3.0])
    assert calls == [5]
    assert ts[0].tolist() == [3.0, 3.0] and ts[1].tolist() == [6.0, 6.0, 6.0]


def test_submodules_are_attributes_of_the_package():
    """``import bagua.torch_api as bagua`` then ``bagua.utils.flatten(...)``, as the original's tests do; checked in
    a fresh interpreter so that no earlier import has loaded the submodules already."""
    import subprocess
    import sys

    code = (
        "import bagua.torch_api as bagua, sys\n"
        "assert 'bagua.torch_api.utils' in sys.modules and 'bagua.torch_api.moe' in sys.modules\n"
        "print(bagua.utils.flatten.__module__, bagua.moe.MoE.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["bagua.torch_api.utils", "MoE"]


def test_dtype_and_op_names():
    assert [to_bagua_datatype(d) for d in (torch.float32, torch.float16, torch.uint8, torch.int64)] == [
        "f32", "f16", "u8", "i64"]
    with pytest.raises(ValueError, match="supported"):
        to_bagua_datatype(torch.bfloat16)
    assert to_bagua_reduce_op(torch.distributed.ReduceOp.MAX) == 3


def test_statistical_average_matches_time_weighted_means():
    # The original's scenario: a history, one second passes, 6.0 is recorded; the means over the last n seconds
    # weight 6.0 by 1 s and the old history by n - 1 s. Tolerance 0.1: windows between powers of two interpolate.
    m = StatisticalAverage(
        last_update_time=time.time() - 1.0,
        records=[5.0, 4.5005175, 3.5034241850204078],
        record_tail=(2.0166309999999985, 2.499061185570463),
    )
    m.record(6.0)
    expected = {
        1.0: 6.0,
        2.0: (6.0 + 5.0) / 2.0,
        3.0: (6.0 + 4.5005175 * 2.0) / 3.0,
        5.0: (6.0 + 3.5034241850204078 * 4.0) / 5.0,
        7.0: (6.0 + 2.499061185570463 * (4.0 + 2.0166309999999985)) / 7.0,
    }
    for n, want in expected.items():
        assert abs(m.get_records_mean(n) - want) < 0.1, (n, m)
    assert abs(m.total_recording_time() - (4.0 + 2.0166309999999985 + 1.0)) < 0.1
    fresh = StatisticalAverage()
    assert fresh.get(5.0) == 0.0
    fresh.last_update_time -= 3.0
    fresh.record(2.0)
    assert abs(fresh.get_records_mean(3.0) - 2.0) < 1e-9 and abs(fresh.total_recording_time() - 3.0) < 0.05


def test_bagua_hyperparameter_update():
    hp = BaguaHyperparameter(is_hierarchical_reduce=False)
    buckets = [[TensorDeclaration({"name": "A", "num_elements": 123, "dtype": TensorDtype.F32})]]
    assert hp.update({"buckets": buckets}) is hp
    assert hp.buckets == buckets and hp.is_hierarchical_reduce is False
    assert hp.dict()["buckets"][0][0]["dtype"] == "f32"
    with pytest.raises(ValueError, match="available"):
        hp.update({"bucket": []})


def _worker_coalesced(rank, world_size):
    import bagua.torch_api as bagua
    from bagua.torch_api import communication as C

    torch.manual_seed(rank)
    a, b = torch.randn(3, 2), torch.randn(5)
    ref_a, ref_b = a.clone(), b.clone()
    torch.distributed.all_reduce(ref_a)
    torch.distributed.all_reduce(ref_b)
    C.allreduce_coalesced_inplace([a, b], op=bagua.ReduceOp.AVG)
    torch.testing.assert_close(a, ref_a / world_size)
    torch.testing.assert_close(b, ref_b / world_size)

    x, y = torch.full((2,), float(rank)), torch.full((3,), float(rank) + 10)
    C.broadcast_coalesced([x, y], src=1)
    assert x.tolist() == [1.0, 1.0] and y.tolist() == [11.0] * 3
    only_zero = C.new_group([0])
    torch_only_zero = torch.distributed.new_group([0])
    return (C._rank_not_in_group(only_zero), C._rank_not_in_group(torch_only_zero), C._rank_not_in_group(None),
            C._rank_not_in_group(C._get_default_group()))


def test_coalesced_collectives_and_rank_not_in_group():
    assert run_workers(_worker_coalesced, 2, timeout=60) == [(False, False, False, False), (True, True, False, False)]


def _worker_empty_group(rank, world_size):
    from bagua.torch_api import communication as C

    nobody = C.new_group([])  # the original's test_decentralized asks for (world_size - 1) // 2 * 2 ranks: 0 at 2
    t = torch.full((2,), float(rank))
    C.allreduce_inplace(t, comm=nobody.get_global_communicator())  # a non-member returns at once
    both = C.new_group([0, 1])  # later groups are still created collectively, in the same order on every rank
    C.allreduce_inplace(t, comm=both.get_global_communicator())
    return C._rank_not_in_group(nobody), nobody.size(), nobody.rank(), t.tolist()


def test_group_without_members():
    assert run_workers(_worker_empty_group, 2, timeout=60) == [(True, 0, -1, [1.0, 1.0])] * 2


def _worker_communicator(rank, world_size):
    import threading

    import bagua.torch_api as bagua
    from bagua.torch_api.communication import init_bagua_communicator

    comm = init_bagua_communicator(model_name="test_comm")
    t = torch.tensor([1.0, 2.0]) * (rank + 1)
    comm.allreduce_inplace(t, int(bagua.ReduceOp.AVG))
    assert t.tolist() == [1.5, 3.0]
    out = torch.zeros(2)
    comm.allreduce(torch.ones(2), out, int(bagua.ReduceOp.SUM))
    assert out.tolist() == [2.0, 2.0]
    gathered = torch.zeros(4)
    comm.allgather(torch.full((2,), float(rank)), gathered)
    assert gathered.tolist() == [0.0, 0.0, 1.0, 1.0]
    b = torch.full((3,), float(rank))
    comm.broadcast(b, 1)
    assert b.tolist() == [1.0] * 3
    p = torch.full((2,), float(rank) + 5)
    if rank == 0:
        comm.send(p, 1)
    else:
        comm.recv(p, 0)
        assert p.tolist() == [5.0, 5.0]
    r = torch.full((2,), float(rank) + 1)
    comm.reduce_inplace(r, 0, int(bagua.ReduceOp.MAX))
    if rank == 0:
        assert r.tolist() == [2.0, 2.0]
    comm.barrier()
    # Abort: rank 1 starts one allreduce more than rank 0; aborting it from another thread ends the wait.
    data = torch.rand(10)
    for _ in range(rank + 1):
        if rank == 1 and _ == 1:
            threading.Timer(0.5, comm.abort).start()
        comm.allreduce_inplace(data, 10)
    torch.distributed.barrier()  # rank 0 stays until rank 1 has aborted (its exit would also end the wait)
    return comm.check_abort()


def test_communicator_methods_and_abort():
    assert run_workers(_worker_communicator, 2, timeout=60) == [False, True]
