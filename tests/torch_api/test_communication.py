"""Every Bagua collective against its torch.distributed equivalent (exact: same data, same reductions)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.harness import run_workers


def _data(rank: int, n: int = 12, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) + rank).to(dtype)


def _worker_collectives(rank, world_size):
    import bagua.torch_api as bagua
    from bagua.torch_api import communication as C

    n = world_size
    out = {}
    x = _data(rank)

    # allreduce family, each op against torch
    for op, top in [(C.ReduceOp.SUM, dist.ReduceOp.SUM), (C.ReduceOp.MAX, dist.ReduceOp.MAX),
                    (C.ReduceOp.MIN, dist.ReduceOp.MIN), (C.ReduceOp.PRODUCT, dist.ReduceOp.PRODUCT)]:
        got, ref = x.clone(), x.clone()
        bagua.allreduce_inplace(got, op)
        dist.all_reduce(ref, top)
        out[f"allreduce_{op.name}"] = (got, ref)
    got = torch.empty_like(x)
    bagua.allreduce(x, got, C.ReduceOp.AVG)
    ref = x.clone()
    dist.all_reduce(ref)
    out["allreduce_AVG"] = (got, ref / n)
    ints = torch.tensor([rank * 3 + 1, 7], dtype=torch.int64)
    ref = ints.clone()
    dist.all_reduce(ref)
    bagua.allreduce_inplace(ints, C.ReduceOp.AVG)
    out["allreduce_AVG_int"] = (ints, ref // n)
    bits = torch.tensor([rank + 1, 6], dtype=torch.int64)
    for op, top in [(C.ReduceOp.BOR, dist.ReduceOp.BOR), (C.ReduceOp.BAND, dist.ReduceOp.BAND),
                    (C.ReduceOp.BXOR, dist.ReduceOp.BXOR)]:
        got, ref = bits.clone(), bits.clone()
        bagua.allreduce_inplace(got, op)
        dist.all_reduce(ref, top)
        out[f"allreduce_{op.name}"] = (got, ref)

    # broadcast / reduce
    got, ref = x.clone(), x.clone()
    bagua.broadcast(got, src=1)
    dist.broadcast(ref, src=1)
    out["broadcast"] = (got, ref)
    got, ref = x.clone(), x.clone()
    bagua.reduce_inplace(got, dst=1, op=C.ReduceOp.SUM)
    dist.reduce(ref, dst=1)
    if rank == 1:
        out["reduce_inplace"] = (got, ref)
    got = torch.zeros_like(x)
    bagua.reduce(x, got, dst=0, op=C.ReduceOp.AVG)
    ref = x.clone()
    dist.reduce(ref, dst=0)
    if rank == 0:
        out["reduce_AVG"] = (got, ref / n)

    # allgather / gather / scatter
    got = torch.empty(n * x.numel())
    bagua.allgather(x, got)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x)
    out["allgather"] = (got, torch.cat(parts))
    buf = torch.zeros(n * 3)
    buf[rank * 3:(rank + 1) * 3] = x[:3]
    bagua.allgather_inplace(buf)
    parts = [torch.empty(3) for _ in range(n)]
    dist.all_gather(parts, x[:3].clone())
    out["allgather_inplace"] = (buf, torch.cat(parts))
    got = torch.zeros(n * x.numel())
    bagua.gather(x, got, dst=0)
    if rank == 0:
        out["gather"] = (got, torch.cat([_data(r) for r in range(n)]))
    buf = torch.zeros(n * 3)
    buf[rank * 3:(rank + 1) * 3] = x[:3]
    bagua.gather_inplace(buf, 3, dst=1)
    if rank == 1:
        out["gather_inplace"] = (buf, torch.cat([_data(r)[:3] for r in range(n)]))
    src_tensor = torch.arange(n * 4, dtype=torch.float32) * (rank + 2)
    got = torch.zeros(4)
    bagua.scatter(src_tensor, got, src=1)
    out["scatter"] = (got, (torch.arange(n * 4, dtype=torch.float32) * 3)[rank * 4:(rank + 1) * 4])
    buf = src_tensor.clone()
    bagua.scatter_inplace(buf, 4, src=1)
    out["scatter_inplace"] = (buf[rank * 4:(rank + 1) * 4], (torch.arange(n * 4, dtype=torch.float32) * 3)[rank * 4:(rank + 1) * 4])

    # reduce_scatter / alltoall
    send = torch.arange(n * 4, dtype=torch.float32) + rank
    got = torch.zeros(4)
    bagua.reduce_scatter(send, got, C.ReduceOp.SUM)
    ref = torch.zeros(4)
    dist.reduce_scatter(ref, [t.clone() for t in send.chunk(n)])
    out["reduce_scatter"] = (got, ref)
    buf = send.clone()
    bagua.reduce_scatter_inplace(buf, C.ReduceOp.AVG)
    out["reduce_scatter_inplace_AVG"] = (buf[rank * 4:(rank + 1) * 4], ref / n)
    got = torch.zeros(n * 4)
    bagua.alltoall(send, got)
    ref = torch.zeros(n * 4)
    dist.all_to_all_single(ref, send)
    out["alltoall"] = (got, ref)
    buf = send.clone()
    bagua.alltoall_inplace(buf)
    out["alltoall_inplace"] = (buf, ref)
    counts = [r + 1 for r in range(n)]  # rank r sends r+1 elements to... every peer receives (sender+1)
    send_counts = [rank + 1] * n
    send_displs = [i * (rank + 1) for i in range(n)]
    send_v = torch.arange(n * (rank + 1), dtype=torch.float32) + 100 * rank
    recv_displs = [sum(counts[:i]) for i in range(n)]
    got = torch.zeros(sum(counts))
    bagua.alltoall_v(send_v, send_counts, send_displs, got, counts, recv_displs)
    # sender s sends its slice number `rank`, of s+1 elements, to this rank
    expected = [(torch.arange(n * (s + 1), dtype=torch.float32) + 100 * s)[rank * (s + 1):(rank + 1) * (s + 1)]
                for s in range(n)]
    out["alltoall_v"] = (got, torch.cat(expected))

    # point to point and barrier
    if rank == 0:
        bagua.send(x, dst=1)
    elif rank == 1:
        got = torch.zeros_like(x)
        bagua.recv(got, src=0)
        out["send_recv"] = (got, _data(0))
    bagua.barrier()

    # objects, groups
    obj = bagua.communication.broadcast_object({"rank": rank, "v": [1.5, None, "s"]} if rank == 0 else None, src=0)
    out["broadcast_object"] = (torch.tensor([obj["rank"], obj["v"][0]]), torch.tensor([0, 1.5]))
    assert bagua.communication.is_initialized()
    sub = bagua.communication.new_group([0, 1])
    got = x.clone()
    bagua.allreduce_inplace(got, C.ReduceOp.SUM, comm=sub)
    if rank in (0, 1):
        out["subgroup_allreduce"] = (got, _data(0) + _data(1))
    torch_sub = dist.new_group([0, 1])
    wrapped = bagua.communication.from_torch_group(torch_sub)
    if rank in (0, 1):
        assert wrapped.rank() == rank and wrapped.size() == 2
    else:
        assert wrapped.rank() == -1
    got = x.clone()
    bagua.allreduce_inplace(got, C.ReduceOp.SUM, comm=wrapped)  # no-op on non-members
    out["from_torch_group"] = (got, _data(0) + _data(1) if rank in (0, 1) else x)
    assert bagua.communication.get_backend() == "gloo"
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_match_torch(world_size):
    results = run_workers(_worker_collectives, world_size)
    names = set()
    for out in results:
        for name, (got, ref) in out.items():
            names.add(name)
            assert_close(got, ref, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert len(names) >= 25


def test_reduce_op_values_match_the_original():
    from bagua.torch_api import ReduceOp

    assert [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BOR, ReduceOp.BAND,
            ReduceOp.BXOR, ReduceOp.AVG] == [0, 1, 2, 3, 7, 8, 9, 10]
