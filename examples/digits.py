"""Train a small MLP on scikit-learn's digits with every Bagua algorithm and with torch DDP, then compare.

Run on 2 local CPU processes:

    python -m bagua.distributed.launch --nproc_per_node=2 examples/digits.py

Each algorithm trains the same model from the same initial weights on the same shards of the data; the final
table shows test accuracy, time per epoch and that time relative to torch DDP's. On one machine the network is
not the bottleneck, so the compressed algorithms are not faster here; see docs/benchmarks.md for shaped links.
"""

import argparse
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from tqdm import tqdm

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm, GlobalAlgorithmRegistry

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--algorithms", default="all", help="comma-separated names, or 'all'")
args = parser.parse_args()

torch.set_num_threads(1)
bagua.init_process_group()
rank, world = bagua.get_rank(), bagua.get_world_size()

# data: digits (1797 8x8 images, ships with scikit-learn), standardized; 80/20 split; each rank takes a shard
X, y = load_digits(return_X_y=True)
X = torch.tensor(X, dtype=torch.float32)
X = (X - X.mean(0)) / (X.std(0) + 1e-6)
y = torch.tensor(y)
perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
X, y = X[perm], y[perm]
n_train = int(0.8 * len(X))
X_train, y_train, X_test, y_test = X[:n_train], y[:n_train], X[n_train:], y[n_train:]
X_shard, y_shard = X_train[rank::world], y_train[rank::world]
steps_per_epoch = len(X_shard) // args.batch_size


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def make_run(name):
    """Model, optimizer and the object that runs steps for one system (torch DDP or a Bagua algorithm)."""
    model = make_model()
    if name == "torch_ddp":
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        return torch.nn.parallel.DistributedDataParallel(model), model, opt
    if name == "qadam":
        from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

        opt = QAdamOptimizer(model.parameters(), lr=0.003, warmup_steps=steps_per_epoch * 2)
        return model.with_bagua([opt], QAdamAlgorithm(opt)), model, opt
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    kwargs = {"sync_interval_ms": 20} if name == "async" else {}
    return model.with_bagua([opt], Algorithm.init(name, **kwargs)), model, opt


def evaluate(model):
    model.eval()
    with torch.no_grad():
        acc = (model(X_test).argmax(1) == y_test).float().mean().item()
    model.train()
    return acc


names = ["torch_ddp"] + (
    GlobalAlgorithmRegistry.available_algorithms() if args.algorithms == "all" else args.algorithms.split(",")
)
results = []
for name in names:
    runner, model, opt = make_run(name)
    if name == "async":
        model.bagua_algorithm.resume(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    start = time.perf_counter()
    bar = tqdm(total=args.epochs * steps_per_epoch, desc=f"{name:>28}", disable=rank != 0, leave=True)
    for epoch in range(args.epochs):
        order = torch.randperm(len(X_shard), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps_per_epoch):
            idx = order[step * args.batch_size : (step + 1) * args.batch_size]
            opt.zero_grad()
            loss = loss_fn(runner(X_shard[idx]), y_shard[idx])
            loss.backward()
            opt.step()
            bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    if name == "async":
        model.bagua_algorithm.abort(model)
    bar.close()
    dist.barrier()
    elapsed = (time.perf_counter() - start) / args.epochs
    acc = torch.tensor([evaluate(model)])
    dist.all_reduce(acc)  # mean over ranks (decentralized/async ranks may hold slightly different weights)
    results.append((name, acc.item() / world, elapsed))

if rank == 0:
    ddp_time = results[0][2]
    print(f"\n{'system':>28} | {'test acc':>8} | {'s/epoch':>8} | {'time vs DDP':>11}")
    print("-" * 66)
    for name, acc, elapsed in results:
        print(f"{name:>28} | {acc * 100:7.2f}% | {elapsed:8.3f} | {elapsed / ddp_time:10.2f}x")
    print(f"\n{world} processes, {args.epochs} epochs, batch {args.batch_size} per rank, digits (sklearn)")
