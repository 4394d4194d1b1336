"""Bagua's collectives, each checked against ``torch.distributed`` (the original's communication example).

    python -m bagua.distributed.launch --nproc_per_node=2 examples/communication_primitives.py

Every rank builds random tensors, runs a Bagua primitive and the same operation with plain torch.distributed,
and asserts the results are equal; rank 0 prints one line per primitive.
"""

import argparse

import torch
import torch.distributed as dist

import bagua.torch_api as bagua
from bagua.torch_api import communication as comm

parser = argparse.ArgumentParser()
parser.add_argument("--size", type=int, default=1000, help="elements per tensor")
args = parser.parse_args()

bagua.init_process_group()
rank, world = bagua.get_rank(), bagua.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if bagua.get_backend() == "nccl" else torch.device("cpu")
torch.manual_seed(rank)
checked = []


def check(name, got, want):
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    checked.append(name)
    if rank == 0:
        print(f"{name:<30} ok")


# send / recv around a ring
t = torch.rand(args.size, device=device)
received = torch.zeros_like(t)
if world > 1:
    if rank % 2 == 0:
        bagua.send(t, dst=(rank + 1) % world)
        bagua.recv(received, src=(rank - 1) % world)
    else:
        bagua.recv(received, src=(rank - 1) % world)
        bagua.send(t, dst=(rank + 1) % world)
    ring = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(ring, t)
    check("send/recv", received, ring[(rank - 1) % world])

# allreduce (sum and average)
t = torch.rand(args.size, device=device)
want = t.clone()
dist.all_reduce(want)
got = torch.zeros_like(t)
bagua.allreduce(t, got)
check("allreduce(SUM)", got, want)
bagua.allreduce_inplace(t, op=bagua.ReduceOp.AVG)
check("allreduce_inplace(AVG)", t, want / world)

# broadcast from the last rank
t = torch.rand(args.size, device=device)
want = t.clone()
dist.broadcast(want, src=world - 1)
bagua.broadcast(t, src=world - 1)
check("broadcast", t, want)

# allgather
t = torch.rand(args.size, device=device)
want = [torch.zeros_like(t) for _ in range(world)]
dist.all_gather(want, t)
got = torch.zeros(world * args.size, device=device)
bagua.allgather(t, got)
check("allgather", got, torch.cat(want))

# reduce_scatter
t = torch.rand(world * args.size, device=device)
summed = t.clone()
dist.all_reduce(summed)
got = torch.zeros(args.size, device=device)
bagua.reduce_scatter(t, got)
check("reduce_scatter", got, summed[rank * args.size:(rank + 1) * args.size])

# alltoall
t = torch.rand(world * args.size, device=device)
want = torch.zeros_like(t)
dist.all_to_all_single(want, t)
got = torch.zeros_like(t)
bagua.alltoall(t, got)
check("alltoall", got, want)

# coalesced: several tensors as one message
a, b = torch.rand(3, 4, device=device), torch.rand(5, device=device)
want_a, want_b = a.clone(), b.clone()
dist.all_reduce(want_a)
dist.all_reduce(want_b)
comm.allreduce_coalesced_inplace([a, b])
check("allreduce_coalesced_inplace", torch.cat([a.flatten(), b]), torch.cat([want_a.flatten(), want_b]))

bagua.barrier()
if rank == 0:
    print(f"communication primitives: all {len(checked)} checks passed on {world} ranks ({bagua.get_backend()})")
