"""Train a small MLP on scikit-learn's digits with every Bagua algorithm and with torch DDP, then compare.

Run on 2 local CPU processes:

    python -m bagua.distributed.launch --nproc_per_node=2 examples/digits.py

Each algorithm trains the same model from the same initial weights on the same shards of the data, and is
scored on the held-out test set; then again with mixed precision (bf16 autocast and ``torch.amp.GradScaler``, the
loop a GPU user writes; ``--no-amp`` skips it). Then every system's training step is timed: after a warm-up, the systems take
turns (``--rounds`` rounds of ``--timed-steps`` steps each, the order rotated every round so that none is always
first), each rank takes the median step of every turn, the slowest rank's counts, and the table shows the median
over rounds and the speedup over torch DDP (DDP's step / the system's step in the same round, median over
rounds; higher is better), with its interquartile range. On one machine the network is not the bottleneck, so
the compressed algorithms are not faster here; see docs/benchmarks.md for shaped links.
"""

import argparse
import statistics
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
parser.add_argument("--rounds", type=int, default=15, help="timing: turns per system")
parser.add_argument("--timed-steps", type=int, default=30, help="timing: steps per turn (after 5 untimed ones)")
parser.add_argument("--no-amp", action="store_true", help="skip the mixed-precision (bf16 autocast + GradScaler) runs")
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
    # One process per emulated host: the decentralized algorithms and DiLoCo exchange between the two ranks
    # (hierarchical=True would average inside the one machine and show nothing of them). DiLoCo: 10 local steps
    # between synchronizations, plain averaging as the outer step (what suits 2 ranks, docs/algorithms/diloco.md).
    kwargs = {
        "async": {"sync_interval_ms": 20},
        "decentralized": {"hierarchical": False},
        "low_precision_decentralized": {"hierarchical": False},
        "diloco": {"sync_every": 10, "outer_lr": 1.0, "outer_momentum": 0.0, "hierarchical": False},
    }.get(name, {})
    return model.with_bagua([opt], Algorithm.init(name, **kwargs)), model, opt


def evaluate(model):
    model.eval()
    with torch.no_grad():
        acc = (model(X_test).argmax(1) == y_test).float().mean().item()
    model.train()
    return acc


def train_step(runner, opt, loss_fn, idx, scaler=None):
    opt.zero_grad()
    if scaler is None:
        loss = loss_fn(runner(X_shard[idx]), y_shard[idx])
        loss.backward()
        opt.step()
        return loss
    # mixed precision as a GPU user writes it: bf16 autocast for the forward, fp16-style loss scaling with
    # GradScaler (a skipped step on overflow, identical on every rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(runner(X_shard[idx]), y_shard[idx])
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def train(name, amp):
    """Train one system for --epochs; return its (runner, model, optimizer) and its test accuracy."""
    runner, model, opt = make_run(name)
    scaler = torch.amp.GradScaler("cpu") if amp else None
    if name == "async":
        model.bagua_algorithm.resume(model)
    desc = f"{name + (' + AMP' if amp else ''):>28}"
    bar = tqdm(total=args.epochs * steps_per_epoch, desc=desc, disable=rank != 0, leave=True)
    for epoch in range(args.epochs):
        order = torch.randperm(len(X_shard), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps_per_epoch):
            idx = order[step * args.batch_size : (step + 1) * args.batch_size]
            loss = train_step(runner, opt, loss_fn, idx, scaler)
            bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    if name == "async":
        model.bagua_algorithm.abort(model)
    bar.close()
    dist.barrier()
    acc = torch.tensor([evaluate(model)])
    dist.all_reduce(acc)  # mean over ranks (decentralized/async ranks may hold slightly different weights)
    return (runner, model, opt), acc.item() / world


names = ["torch_ddp"] + (
    GlobalAlgorithmRegistry.available_algorithms() if args.algorithms == "all" else args.algorithms.split(",")
)
loss_fn = torch.nn.CrossEntropyLoss()
systems, accuracy, amp_accuracy = {}, {}, {}
for name in names:
    systems[name], accuracy[name] = train(name, amp=False)
    if not args.no_amp:
        _, amp_accuracy[name] = train(name, amp=True)

# timing: the systems take turns, the order rotated every round; one turn = 5 untimed steps (caches and buffers
# warm up after the previous system) and --timed-steps timed ones, of which each rank keeps the median
batches = [torch.arange(i, i + args.batch_size) % len(X_shard) for i in range(0, len(X_shard), args.batch_size)]
turns = {name: [] for name in names}
bar = tqdm(total=args.rounds * len(names), desc=f"{'timing':>28}", disable=rank != 0, leave=True)
for r in range(args.rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
        runner, model, opt = systems[name]
        if name == "async":
            model.bagua_algorithm.resume(model)
        dist.barrier()
        durations = []
        for i in range(5 + args.timed_steps):
            t0 = time.perf_counter()
            train_step(runner, opt, loss_fn, batches[i % len(batches)])
            durations.append(time.perf_counter() - t0)
        if name == "async":
            model.bagua_algorithm.abort(model)
        step = torch.tensor([statistics.median(durations[5:])])
        dist.all_reduce(step, op=dist.ReduceOp.MAX)  # the slowest rank's step, as the benchmarks report
        turns[name].append(step.item())
        bar.update(1)
bar.close()

if rank == 0:
    ddp = turns["torch_ddp"]
    print(f"\n{'system':>28} | {'test acc':>8} | {'AMP acc':>8} | {'step ms':>7} | {'speedup vs DDP (IQR)':>21}")
    print("-" * 86)
    for name in names:
        ratios = [d / t for d, t in zip(ddp, turns[name])]  # DDP's step / this system's, in the same round
        q1, speedup, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        amp = f"{amp_accuracy[name] * 100:7.2f}%" if name in amp_accuracy else f"{'-':>8}"
        print(f"{name:>28} | {accuracy[name] * 100:7.2f}% | {amp} | {statistics.median(turns[name]) * 1e3:7.2f} | "
              f"{speedup:8.2f}x ({q1:.2f}-{q3:.2f})")
    print(f"\n{world} processes, {args.epochs} epochs, batch {args.batch_size} per rank, digits (sklearn). step: "
          f"median over {args.rounds} rounds of the slowest rank's median of {args.timed_steps} steps; speedup "
          "(higher is better): median over rounds of DDP's step / the system's step in the same round, with its "
          "interquartile range. async's step does not include its averaging, which runs on a background thread; "
          "diloco's median step is a local one (it synchronizes on one step in 10, which a median does not show). "
          "AMP acc: the same training under bf16 autocast with torch.amp.GradScaler.")
