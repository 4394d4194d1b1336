"""Micro benchmark of Bagua's collectives: algorithm bandwidth (GB/s) of each, next to the raw torch call.

For each size, every rank runs ``--warmup`` untimed then ``--iters`` timed rounds, each round calling every
collective once in turn (a barrier before each call), and rank 0 prints the median time and the *algorithm
bandwidth* ``bytes / time``, where bytes is the size of one rank's input (as in nccl-tests' algbw). ``bagua.*``
rows go through :mod:`bagua.torch_api.communication`; ``torch.*`` rows call ``torch.distributed`` directly, so
the difference is Bagua's wrapper cost (``AVG`` on gloo is a sum followed by a division, which torch's gloo
lacks). Runs on CPU with gloo, or on CUDA with NCCL when the launcher gives each rank a GPU.

The MinMaxUInt8 codec has its own micro benchmark, ``benchmarks/codecs/codec.py`` (encode/decode GB/s on CPU and GPU).

Run::

    python -m bagua.distributed.launch --nproc_per_node=2 benchmarks/micro/collectives.py --sizes-mb 1,25,100
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

import bagua.torch_api as bagua
from bagua.torch_api import communication as C

__all__: list[str] = []

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--sizes-mb", default="1,25,100", help="comma list of per-rank input sizes in MB (fp32)")
parser.add_argument("--iters", type=int, default=5, help="timed calls per collective and size")
parser.add_argument("--warmup", type=int, default=2, help="untimed calls first")
parser.add_argument("--ops", default="all", help="'all' or a comma list of the names in the table")
parser.add_argument("--json", default="", help="write the results here (rank 0)")
args = parser.parse_args()

# torch 2.13 announces a rename of all_gather_into_tensor; the call still works and this is not the place for it
warnings.filterwarnings("ignore", category=FutureWarning)
torch.set_num_threads(1)
bagua.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def collectives(n: int) -> dict[str, Callable[[], None]]:
    """The collectives on ``n`` fp32 elements per rank (``n`` divisible by the world size)."""
    x = torch.randn(n, device=device)
    gathered = torch.empty(n * world, device=device)
    out = torch.empty(n, device=device)
    chunk = torch.empty(n // world, device=device)
    u8 = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    u8_gathered = torch.empty(n * world, dtype=torch.uint8, device=device)
    return {
        "bagua.allreduce_inplace SUM": lambda: C.allreduce_inplace(x, C.ReduceOp.SUM),
        "torch.all_reduce SUM": lambda: dist.all_reduce(x),
        "bagua.allreduce_inplace AVG": lambda: C.allreduce_inplace(x, C.ReduceOp.AVG),
        "bagua.allgather": lambda: C.allgather(x, gathered),
        "torch.all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered, x),
        "bagua.allgather uint8": lambda: C.allgather(u8, u8_gathered),
        "bagua.reduce_scatter": lambda: C.reduce_scatter(x, chunk),
        "bagua.alltoall": lambda: C.alltoall(x, out),
        "torch.all_to_all_single": lambda: dist.all_to_all_single(out, x),
        "bagua.broadcast": lambda: C.broadcast(x, 0),
    }


def time_ops(ops: dict[str, Callable[[], None]], names: list[str]) -> dict[str, float]:
    """Median seconds of one call of each op; rounds go over all ops in turn, so drift in the load of the
    machine hits every op alike."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.warmup + args.iters):
        for name in names:
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            ops[name]()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


results = []
for size_mb in [float(s) for s in args.sizes_mb.split(",")]:
    n = int(size_mb * 1e6 / 4) // world * world
    ops = collectives(n)
    names = list(ops) if args.ops == "all" else [o.strip() for o in args.ops.split(",")]
    medians = time_ops(ops, names)
    for name in names:
        seconds = torch.tensor(medians[name], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank finishes the collective
        nbytes = n * (1 if "uint8" in name else 4)
        results.append({"op": name, "bytes": nbytes, "median_s": seconds.item(),
                        "algbw_GBps": nbytes / seconds.item() / 1e9})

if rank == 0:
    print(f"{world} ranks, {dist.get_backend()} on {device.type}, median of {args.iters} calls "
          f"(algbw = bytes of one rank's input / time)")
    print(f"{'collective':32s} {'MB':>8s} {'ms':>10s} {'GB/s':>8s}")
    for r in results:
        print(f"{r['op']:32s} {r['bytes'] / 1e6:8.1f} {r['median_s'] * 1e3:10.2f} {r['algbw_GBps']:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": world, "backend": dist.get_backend(), "device": device.type,
                       "iters": args.iters, "results": results}, f, indent=1)

dist.barrier()
dist.destroy_process_group()
