"""Benchmark: how evenly ranks share the work of a step, and what that buys synchronous training.

Part 1 (simulation, no training): lengths drawn from a log-normal distribution are dealt to ``--replicas`` ranks
by torch's ``DistributedSampler`` and by ``LoadBalancingDistributedSampler``. For every step (``batch`` samples
per rank) it computes each rank's work and reports max/mean over ranks (1.0 = nobody waits), averaged over the
steps of an epoch, plus the 95th percentile. Work is ``tokens`` (sum of lengths: a packed/varlen model) or
``padded`` (batch x longest sample: a padded batch).

Part 2 (end to end, ``--e2e``): 2 CPU ranks (gloo, one thread each) train a small Transformer encoder on padded
variable-length sequences with torch DDP, one epoch per setting, settings interleaved and repeated. A synchronous
step lasts as long as its slowest rank, so balanced steps raise throughput. Four settings, in two pairs that
differ only in cross-rank balance:

- ``DistributedSampler`` vs ``LoadBalancing``: fixed batches of ``--e2e-batch`` random-length sequences per rank;
- ``DistributedSampler, bucketed`` vs ``LB batch sampler (token budget)``: each rank sorts its sequences into
  batches of about ``batch x mean length`` tokens (little padding); the first shuffles batches per rank, the
  second is ``LoadBalancingDistributedBatchSampler``, whose step k holds similar batches on every rank.

Wall-clock throughput on a shared, oversubscribed machine is noisy, so each rank also records the CPU time of its
own compute per step (``time.thread_time``, which neither waiting nor other jobs inflate). From those, the table
reports the per-step max/mean over ranks and the throughput a synchronous run would reach on dedicated cores,
where every step lasts as long as its slowest rank.

    python benchmarks/micro/load_balancing.py --e2e --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from bagua.torch_api.contrib import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler



def lognormal_lengths(n: int, sigma: float, median: float = 64, cap: int = 1024, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(math.log(median), sigma, n), 4, cap).astype(int).tolist()


def step_ratios(orders: list[list[int]], lengths: list[int], batch: int, cost: str) -> list[float]:
    ratios = []
    for step in range(len(orders[0]) // batch):
        work = []
        for order in orders:
            chunk = [lengths[i] for i in order[step * batch:(step + 1) * batch]]
            work.append(sum(chunk) if cost == "tokens" else len(chunk) * max(chunk))
        ratios.append(max(work) / statistics.fmean(work))
    return ratios


# ------------------------------------------------------------------------- part 2: model and rank worker
class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 32, layers: int = 2, classes: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=0)
        layer = torch.nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=4 * dim, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        hidden = self.encoder(self.embed(tokens), src_key_padding_mask=pad)
        hidden = hidden.masked_fill(pad.unsqueeze(-1), 0).sum(1) / (~pad).sum(1, keepdim=True)
        return self.head(hidden)


def make_batch(sequences: list[torch.Tensor], labels: torch.Tensor, indices: list[int]):
    longest = max(len(sequences[i]) for i in indices)
    tokens = torch.zeros(len(indices), longest, dtype=torch.long)
    for row, i in enumerate(indices):
        tokens[row, : len(sequences[i])] = sequences[i]
    return tokens, labels[indices]


def e2e_worker(rank: int, world: int, store_path: str, n: int, batch: int, repeats: int, sigma: float, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    lens = lognormal_lengths(n, sigma, median=32, cap=256, seed=1)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(1, 1000, (length,), generator=gen) for length in lens]
    labels = torch.tensor([length % 4 for length in lens])
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyTransformer())
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    budget = batch * int(statistics.mean(lens))  # tokens per batch for the budgeted batch sampler

    def budget_batches(indices: list[int], shuffle_seed: int) -> list[list[int]]:
        """Cut ``indices``, sorted by length, into batches of at most ``budget`` tokens; shuffle their order."""
        batches, current, used = [], [], 0
        for i in sorted(indices, key=lambda i: lens[i]):
            if current and used + lens[i] > budget:
                batches.append(current)
                current, used = [], 0
            current.append(i)
            used += lens[i]
        batches = batches + [current] if current else batches
        # Shuffling positions with a permutation of range(n) keeps the same relative order on every rank that
        # uses the same seed, even if batch counts differ by one or two.
        order = torch.randperm(n, generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
        return [batches[j] for j in order if j < len(batches)]

    def batches_for(setting: str, epoch: int) -> list[list[int]]:
        if setting.startswith("DistributedSampler"):
            order = list(DistributedSampler(range(n), world, rank, seed=epoch))
            if setting.endswith("bucketed"):  # per-rank bucketing, each rank shuffling its own batches
                mine = budget_batches(order, shuffle_seed=1000 * epoch + rank)
                count = torch.tensor([len(mine)])
                dist.all_reduce(count, op=dist.ReduceOp.MIN)  # every rank must take the same number of steps
                return mine[: int(count)]
        else:
            sampler = LoadBalancingDistributedSampler(range(n), lens, world, rank, seed=epoch)
            if setting.endswith("budget)"):
                return list(LoadBalancingDistributedBatchSampler(sampler, lambda idx: budget_batches(idx, epoch)))
            order = list(sampler)
        return [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]

    settings = ["DistributedSampler", "LoadBalancing", "DistributedSampler, bucketed",
                "LB batch sampler (token budget)"]
    results = {s: [] for s in settings}
    plan = [s for _ in range(repeats) for s in settings]
    for run, setting in enumerate(tqdm(plan, desc="e2e epochs", disable=rank != 0)):
        model.load_state_dict(initial)
        steps = batches_for(setting, run)
        samples = sum(len(b) for b in steps) * world
        cpu = torch.zeros(len(steps), dtype=torch.float64)
        dist.barrier()
        start = time.perf_counter()
        for step, indices in enumerate(steps):
            began = time.thread_time()  # this thread's CPU: the compute, not the waiting nor other jobs' time
            tokens, target = make_batch(sequences, labels, indices)
            loss = torch.nn.functional.cross_entropy(model(tokens), target)
            optimizer.zero_grad()
            loss.backward()  # DDP's allreduce runs on gloo's threads; this thread only waits for it
            optimizer.step()
            cpu[step] = time.thread_time() - began
        dist.barrier()
        seconds = time.perf_counter() - start
        per_rank = [torch.zeros_like(cpu) for _ in range(world)]
        dist.all_gather(per_rank, cpu)
        table = torch.stack(per_rank)  # (ranks, steps)
        results[setting].append({
            "seconds": seconds, "samples": samples, "steps": len(steps),
            # a synchronous step lasts as long as its slowest rank's compute
            "sync_compute_s": float(table.max(0).values.sum()), "mean_compute_s": float(table.mean(0).sum()),
        })
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


if __name__ == "__main__":  # spawned ranks import this file; only the parent runs the benchmark
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal shape of the lengths")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--e2e", action="store_true", help="also run the 2-rank training comparison")
    parser.add_argument("--e2e-samples", type=int, default=1024)
    parser.add_argument("--e2e-batch", type=int, default=16)
    parser.add_argument("--e2e-repeats", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    # --------------------------------------------------------------------------------- part 1: simulation
    lengths = lognormal_lengths(args.samples, args.sigma)
    R = args.replicas
    samplers = {
        "DistributedSampler": [DistributedSampler(range(args.samples), R, r, seed=0) for r in range(R)],
        "LoadBalancing": [LoadBalancingDistributedSampler(range(args.samples), lengths, R, r, seed=0)
                          for r in range(R)],
    }
    simulation = []
    print(f"per-step max/mean rank work: {args.samples} log-normal lengths (median 64, sigma {args.sigma}), "
          f"{R} replicas")
    print(f"{'sampler':20} {'cost':7} {'batch':>5} {'mean':>7} {'p95':>7}")
    for cost in ("tokens", "padded"):
        for batch in args.batches:
            for name, group in samplers.items():
                ratios = []
                for epoch in range(3):
                    for s in group:
                        s.set_epoch(epoch)
                    ratios += step_ratios([list(s) for s in group], lengths, batch, cost)
                mean, p95 = statistics.fmean(ratios), float(np.percentile(ratios, 95))
                simulation.append({"sampler": name, "cost": cost, "batch": batch, "mean": mean, "p95": p95})
                print(f"{name:20} {cost:7} {batch:>5} {mean:>7.3f} {p95:>7.3f}")

    # --------------------------------------------------------------------------------- part 2: end to end
    e2e = {}
    if args.e2e:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=e2e_worker, args=(r, 2, os.path.join(tmp, "store"), args.e2e_samples,
                                                           args.e2e_batch, args.e2e_repeats, args.sigma, queue))
                     for r in range(2)]
            for p in procs:
                p.start()
            e2e = queue.get(timeout=3600)
            for p in procs:
                p.join(timeout=60)
        print(f"\nend to end: 2 ranks (gloo, 1 thread each), TinyTransformer, {args.e2e_samples} sequences, "
              f"batch {args.e2e_batch}/rank, median of {args.e2e_repeats} epochs")
        print("wall: measured samples/s (noisy on a shared machine); compute: from each rank's per-step CPU time,")
        print("max/mean over ranks per step, and samples/s if every step lasted its slowest rank's compute")
        print(f"{'setting':34} {'steps':>5} {'wall samples/s':>15} {'vs DS':>6} {'step max/mean':>14} "
              f"{'compute samples/s':>18} {'vs DS':>6}")

        def median_of(runs, fn):
            return statistics.median(fn(r) for r in runs)

        base_wall = median_of(e2e["DistributedSampler"], lambda r: r["samples"] / r["seconds"])
        base_sync = median_of(e2e["DistributedSampler"], lambda r: r["samples"] / r["sync_compute_s"])
        for setting, runs in e2e.items():
            wall = median_of(runs, lambda r: r["samples"] / r["seconds"])
            imbalance = median_of(runs, lambda r: r["sync_compute_s"] / r["mean_compute_s"])
            sync = median_of(runs, lambda r: r["samples"] / r["sync_compute_s"])
            print(f"{setting:34} {runs[0]['steps']:>5} {wall:>15.1f} {wall / base_wall:>5.2f}x {imbalance:>14.3f} "
                  f"{sync:>18.1f} {sync / base_sync:>5.2f}x")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "simulation": simulation, "e2e": e2e}, f, indent=2)
