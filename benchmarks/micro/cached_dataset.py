"""Benchmark: first vs second epoch through CachedDataset, on LMDB (default) and Redis, at 1/2/4 DataLoader workers.

Each sample costs ``--work-ms`` of work (``sleep``: waiting, like reading from a slow disk or network; ``cpu``: a
busy loop, like decoding) and is a float32 image plus an int label. Epoch 1 computes and stores every sample;
epoch 2 reads them back. Workers are persistent, so worker start-up is paid in epoch 1 only, as in training.
Every (backend, workers) cell starts from an empty cache and is repeated ``--repeats`` times; the table shows
medians. "no-work ceiling" is the same DataLoader over samples that cost nothing: no cache can make epoch 2
faster than that. Goal from issue 5: epoch 2 >= 20x faster than epoch 1.

    python benchmarks/micro/cached_dataset.py --work sleep --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from bagua.torch_api.contrib import CachedDataset

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--samples", type=int, default=4000)
parser.add_argument("--work-ms", type=float, default=2.0)
parser.add_argument("--work", choices=["sleep", "cpu"], default="sleep")
parser.add_argument("--shape", type=int, nargs="+", default=[3, 32, 32])
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
parser.add_argument("--backends", nargs="+", default=["lmdb", "redis"])
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--json", default="", help="also write the results to this file")
args = parser.parse_args()


class SlowDataset(Dataset):
    """``work_ms`` of work per sample, then a deterministic (image, label) pair."""

    def __init__(self, n: int, work_ms: float, work: str, shape: list[int]):
        self.n, self.seconds, self.work, self.shape = n, work_ms / 1000, work, shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.work == "sleep":
            time.sleep(self.seconds)
        else:
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                pass
        return torch.full(self.shape, float(i)), i


def timed_epoch(loader: DataLoader) -> float:
    start = time.perf_counter()
    count = 0
    for images, labels in loader:
        count += len(labels)
    assert count == len(loader.dataset)
    return time.perf_counter() - start


def timeit_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


redis_store = None
if "redis" in args.backends:
    from bagua.torch_api.contrib.utils.redis_store import RedisStore

    redis_store = RedisStore(capacity_per_node=4 * 1024**3)  # one local redis-server for the whole run

scratch = tempfile.mkdtemp(prefix="bagua-bench-cache-")
dataset = SlowDataset(args.samples, args.work_ms, args.work, args.shape)
rows = []
cells = [(b, w) for b in args.backends for w in args.workers]
for run, (backend, workers) in enumerate(tqdm([c for c in cells for _ in range(args.repeats)], desc="runs")):
    if backend == "lmdb":
        cached = CachedDataset(dataset, dataset_name=f"bench{run}", path=os.path.join(scratch, f"run{run}"))
    else:
        redis_store.clear()
        cached = CachedDataset(dataset, backend=redis_store, dataset_name=f"bench{run}")
    loader = DataLoader(cached, batch_size=args.batch_size, num_workers=workers, persistent_workers=workers > 0)
    first, second = timed_epoch(loader), timed_epoch(loader)
    assert cached.cache_loader.num_keys() == args.samples
    del loader  # stops the persistent workers
    rows.append({"backend": backend, "workers": workers, "epoch1_s": first, "epoch2_s": second})

# The same DataLoader over samples that cost nothing: the fastest any epoch 2 could be on this machine.
ceiling = {}
for workers in args.workers:
    free = DataLoader(SlowDataset(args.samples, 0.0, "sleep", args.shape), batch_size=args.batch_size,
                      num_workers=workers, persistent_workers=workers > 0)
    timed_epoch(free)
    ceiling[workers] = args.samples / statistics.median(timed_epoch(free) for _ in range(args.repeats))
    del free

print(f"\n{args.samples} samples of {'x'.join(map(str, args.shape))} float32, {args.work_ms} ms {args.work} work "
      f"each, batch {args.batch_size}, median of {args.repeats}")
print(f"{'backend':8} {'workers':>7} {'epoch 1 samples/s':>18} {'epoch 2 samples/s':>18} {'speed-up':>9} "
      f"{'(min-max)':>13} {'no-work ceiling':>16}")
summary = []
for backend, workers in cells:
    mine = [r for r in rows if r["backend"] == backend and r["workers"] == workers]
    first = statistics.median(r["epoch1_s"] for r in mine)
    second = statistics.median(r["epoch2_s"] for r in mine)
    speedups = [r["epoch1_s"] / r["epoch2_s"] for r in mine]
    speedup = statistics.median(speedups)
    summary.append({"backend": backend, "workers": workers, "epoch1_samples_per_s": args.samples / first,
                    "epoch2_samples_per_s": args.samples / second, "speedup": speedup,
                    "no_work_ceiling_samples_per_s": ceiling[workers]})
    spread = f"({min(speedups):.0f}-{max(speedups):.0f}x)"
    print(f"{backend:8} {workers:>7} {args.samples / first:>18.0f} {args.samples / second:>18.0f} {speedup:>8.1f}x "
          f"{spread:>13} {ceiling[workers]:>16.0f}")

# The cache alone, without the DataLoader, in this process: wall time (best of --repeats passes over all samples)
# and CPU time (this process, plus the redis-server's own CPU for Redis), which contention from other jobs on a
# shared machine does not inflate.
def redis_cpu_s() -> float:
    import redis

    total = 0.0
    for host in redis_store.hosts:
        info = redis.Redis(host=host["host"], port=host["port"], password=host["password"]).info("cpu")
        total += info["used_cpu_user"] + info["used_cpu_sys"]
    return total


batches = [list(range(i, min(i + args.batch_size, args.samples))) for i in range(0, args.samples, args.batch_size)]
work_us = min(timeit_once(lambda: [dataset[i] for i in range(200)]) for _ in range(args.repeats)) / 200 * 1e6
print(f"\nin-process cost per sample: the work itself {work_us:.0f} us (best of {args.repeats})")
hit_cost = {}
for backend in args.backends:
    if backend == "lmdb":
        cached = CachedDataset(dataset, dataset_name="hits", path=os.path.join(scratch, "hits"))
    else:
        redis_store.clear()
        cached = CachedDataset(dataset, backend=redis_store, dataset_name="hits")
    for batch in batches:  # fill
        cached.__getitems__(batch)
    walls, cpus = [], []
    for _ in range(args.repeats):
        cpu0, server0 = time.process_time(), redis_cpu_s() if backend == "redis" else 0.0
        walls.append(timeit_once(lambda: [cached.__getitems__(b) for b in batches]))
        server = redis_cpu_s() - server0 if backend == "redis" else 0.0
        cpus.append(time.process_time() - cpu0 + server)
    wall_us, cpu_us = min(walls) / args.samples * 1e6, statistics.median(cpus) / args.samples * 1e6
    hit_cost[backend] = {"wall_us": wall_us, "cpu_us": cpu_us}
    print(f"{backend:8} cache hit: wall {wall_us:6.1f} us (best of {args.repeats}), CPU {cpu_us:5.1f} us (median)"
          f" -> {work_us / cpu_us:.0f}x less CPU than the work takes in wall time")

if redis_store is not None:
    redis_store.shutdown()
shutil.rmtree(scratch, ignore_errors=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "runs": rows, "summary": summary, "work_us": work_us,
                   "hit_us": hit_cost}, f, indent=2)
