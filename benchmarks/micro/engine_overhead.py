"""Engine overhead: Bagua gradient allreduce against torch DDP, same model, same run, alternating.

Goal: Bagua's step <= 1.05x DDP's on an unshaped link. Both train the comm-heavy 25.2 M-parameter MLP
(1024-4096-4096-1024, batch 32, MSE, SGD) on the same fixed batch; a third, unwrapped copy with no communication
gives the compute floor. Each repetition times ``--steps`` steps of each contender after ``--warmup`` untimed
ones, in alternating order (DDP first on even repetitions, Bagua first on odd ones) so that drift in the load of
a shared machine hits both alike. Rank 0 prints the medians over all timed steps and the median of the
per-repetition ratios.

Run (2 ranks on loopback; the launcher sets the allocator variables of bagua.torch_api.env.ALLOCATOR_ENV)::

    python -m bagua.distributed.launch --nproc_per_node=2 benchmarks/micro/engine_overhead.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# the clone's root, for `benchmarks` when run as a file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import bagua.torch_api as bagua
from benchmarks.common.workload import MODELS, build_model
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

__all__: list[str] = []

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--reps", type=int, default=6, help="repetitions (each times every contender)")
parser.add_argument("--steps", type=int, default=5, help="timed steps per contender per repetition")
parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender per repetition")
parser.add_argument("--model", default="mlp", help="mlp (25 M params) or tiny")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--set-to-none", type=int, default=1, help="optimizer.zero_grad(set_to_none=...), 1 or 0")
parser.add_argument("--json", default="", help="write the results here (rank 0)")
args = parser.parse_args()

torch.set_num_threads(1)
bagua.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()

# -- the three contenders, built from the same weights -----------------------------------------------------------
ddp_model = DDP(build_model(args.model, seed=0))
ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
bagua_model = build_model(args.model, seed=0)
bagua_opt = torch.optim.SGD(bagua_model.parameters(), lr=0.01)
bagua_model = bagua_model.with_bagua([bagua_opt], GradientAllReduceAlgorithm())
local_model = build_model(args.model, seed=0)
local_opt = torch.optim.SGD(local_model.parameters(), lr=0.01)
contenders = {"ddp": (ddp_model, ddp_opt), "bagua": (bagua_model, bagua_opt), "local": (local_model, local_opt)}

g = torch.Generator().manual_seed(rank)
x = torch.randn(args.batch_size, *MODELS[args.model].in_shape, generator=g)
with torch.no_grad():
    y = torch.randn_like(ddp_model.module(x))


def run_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> list[float]:
    """Time ``n`` full training steps."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=bool(args.set_to_none))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


# -- alternate ---------------------------------------------------------------------------------------------------
samples: dict[str, list[float]] = {name: [] for name in contenders}
ratios = []
for rep in range(args.reps):
    order = ["ddp", "bagua", "local"] if rep % 2 == 0 else ["bagua", "ddp", "local"]
    rep_median = {}
    for name in order:
        model, opt = contenders[name]
        dist.barrier()
        run_steps(model, opt, args.warmup)
        times = run_steps(model, opt, args.steps)
        samples[name] += times
        rep_median[name] = statistics.median(times)
    ratios.append(rep_median["bagua"] / rep_median["ddp"])

# the slowest rank bounds the step: take, per contender, the largest per-rank median
medians = torch.tensor([statistics.median(samples[n]) for n in contenders], dtype=torch.float64)
dist.all_reduce(medians, op=dist.ReduceOp.MAX)
med = dict(zip(contenders, medians.tolist()))

if rank == 0:
    ratio = med["bagua"] / med["ddp"]
    params = sum(p.numel() for p in local_model.parameters())
    print(f"model {args.model} ({params / 1e6:.1f} M params), {world} ranks, batch {args.batch_size}, "
          f"{args.reps} reps x {args.steps} timed steps, zero_grad(set_to_none={bool(args.set_to_none)})")
    print(f"median step  torch DDP: {med['ddp'] * 1e3:8.1f} ms")
    print(f"median step  Bagua gradient_allreduce: {med['bagua'] * 1e3:8.1f} ms")
    print(f"median step  local, no communication: {med['local'] * 1e3:8.1f} ms")
    print(f"ratio Bagua / DDP (medians): {ratio:.3f}   median of per-repetition ratios: "
          f"{statistics.median(ratios):.3f}   goal <= 1.05: {'MET' if ratio <= 1.05 else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "params": params, "world_size": world, "batch_size": args.batch_size,
                       "reps": args.reps, "steps": args.steps, "set_to_none": bool(args.set_to_none),
                       "median_step_s": med, "ratio": ratio, "per_rep_ratios": ratios,
                       "samples_s": samples}, f, indent=1)

bagua_model.bagua_ddp.close()
dist.barrier()
dist.destroy_process_group()
