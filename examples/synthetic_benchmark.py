"""Synthetic training throughput (the original's synthetic benchmark): random images, a fixed model, img/s.

    python -m bagua.distributed.launch --nproc_per_node=2 examples/synthetic_benchmark.py --model resnet_tiny \
        --algorithm gradient_allreduce --batch-size 32 --num-iters 10

torchvision is not a dependency, so the models are small ones defined here: ``mlp``, ``cnn`` and ``resnet_tiny``
(a ResNet with two stages of basic blocks). Each iteration times ``--num-batches-per-iter`` steps; the result is
the mean +- 1.96 standard deviations of the per-iteration images per second of one rank, and that mean times
the number of ranks.
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm

parser = argparse.ArgumentParser(description="Bagua synthetic benchmark")
parser.add_argument("--model", default="resnet_tiny", choices=["mlp", "cnn", "resnet_tiny"])
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--num-classes", type=int, default=10)
parser.add_argument("--num-warmup-batches", type=int, default=3, help="steps before timing")
parser.add_argument("--num-batches-per-iter", type=int, default=5, help="steps per timed iteration")
parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
parser.add_argument("--algorithm", default="gradient_allreduce",
                    choices=["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
                             "qadam", "async"])
parser.add_argument("--lr", type=float, default=0.01)
args = parser.parse_args()

bagua.init_process_group()
rank, world = bagua.get_rank(), bagua.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if bagua.get_backend() == "nccl" else torch.device("cpu")


class Block(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.short = torch.nn.Identity() if stride == 1 and cin == cout else torch.nn.Sequential(
            torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


def make_model(name):
    s, c = args.image_size, args.num_classes
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * s * s, 512), torch.nn.ReLU(),
                                   torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, c))
    if name == "cnn":
        return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                   torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(64 * 16, c))
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
                               torch.nn.ReLU(), Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, c))


torch.manual_seed(0)
model = make_model(args.model).to(device)
if args.algorithm == "qadam":
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    optimizer = QAdamOptimizer(model.parameters(), lr=args.lr, warmup_steps=args.num_warmup_batches)
    algorithm = QAdamAlgorithm(optimizer)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    algorithm = Algorithm.init(args.algorithm)
model = model.with_bagua([optimizer], algorithm)
if args.algorithm == "async":
    model.bagua_algorithm.resume(model)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)


def step():
    optimizer.zero_grad()
    F.cross_entropy(model(data), target).backward()
    optimizer.step()


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


if rank == 0:
    print(f"Model: {args.model}, batch size: {args.batch_size}, algorithm: {args.algorithm}, "
          f"ranks: {world}, device: {device.type}")
for _ in range(args.num_warmup_batches):
    step()
rates = []
for i in range(args.num_iters):
    sync()
    start = time.perf_counter()
    for _ in range(args.num_batches_per_iter):
        step()
    sync()
    rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start)
    rates.append(rate)
    if rank == 0:
        print(f"Iter #{i}: {rate:.1f} img/sec per rank")
if args.algorithm == "async":
    model.bagua_algorithm.abort(model)

mean, conf = float(np.mean(rates)), 1.96 * float(np.std(rates))
if rank == 0:
    print(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    print(f"Total img/sec on {world} rank(s): {world * mean:.1f} +-{world * conf:.1f}")
