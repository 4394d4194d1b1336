"""The original's MNIST example, on scikit-learn's digits (8x8 images, shipped with scikit-learn: no download).

A small CNN, the original's flags, any Bagua algorithm:

    python -m bagua.distributed.launch --nproc_per_node=2 examples/mnist.py --algorithm gradient_allreduce
    python -m bagua.distributed.launch --nproc_per_node=2 examples/mnist.py --algorithm qadam --lr 0.005

Runs on the GPUs when Bagua picked NCCL (CUDA present), otherwise on the CPU with gloo.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm

parser = argparse.ArgumentParser(description="Bagua digits (MNIST-style) example")
parser.add_argument("--batch-size", type=int, default=64, help="input batch size per rank for training")
parser.add_argument("--test-batch-size", type=int, default=256, help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=6, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
parser.add_argument("--gamma", type=float, default=0.8, help="learning rate decay per epoch")
parser.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
parser.add_argument("--seed", type=int, default=1, help="random seed")
parser.add_argument("--save-model", action="store_true", help="save the model (rank 0) to digits_cnn.pt")
parser.add_argument("--algorithm", default="gradient_allreduce",
                    choices=["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
                             "qadam", "async"])
parser.add_argument("--async-sync-interval", type=int, default=10, help="ms between async model averagings")
parser.add_argument("--fuse-optimizer", action="store_true", help="step the optimizer on flat fused tensors")
args = parser.parse_args()

torch.set_num_threads(1)
bagua.init_process_group()
rank, world = bagua.get_rank(), bagua.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if bagua.get_backend() == "nccl" else torch.device("cpu")
torch.manual_seed(args.seed)

# data: 1797 digits, scaled to [0, 1]; 80/20 split; rank r trains on every world-th sample from r
X, y = load_digits(return_X_y=True)
X = torch.tensor(X, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
y = torch.tensor(y)
perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
X, y = X[perm].to(device), y[perm].to(device)
n_train = int(0.8 * len(X))
X_train, y_train, X_test, y_test = X[:n_train][rank::world], y[:n_train][rank::world], X[n_train:], y[n_train:]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


model = Net().to(device)
if args.algorithm == "qadam":
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    steps_per_epoch = max(1, len(X_train) // args.batch_size)
    optimizer = QAdamOptimizer(model.parameters(), lr=args.lr, warmup_steps=steps_per_epoch)
    algorithm = QAdamAlgorithm(optimizer)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    kwargs = {"sync_interval_ms": args.async_sync_interval} if args.algorithm == "async" else {}
    algorithm = Algorithm.init(args.algorithm, **kwargs)
if args.fuse_optimizer:
    from bagua.torch_api.contrib import fuse_optimizer

    optimizer = fuse_optimizer(optimizer)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
model = model.with_bagua([optimizer], algorithm)
if args.algorithm == "async":
    model.bagua_algorithm.resume(model)


def train(epoch):
    model.train()
    order = torch.randperm(len(X_train), generator=torch.Generator().manual_seed(epoch)).to(device)
    steps = len(X_train) // args.batch_size
    for step in range(steps):
        idx = order[step * args.batch_size:(step + 1) * args.batch_size]
        optimizer.zero_grad()
        loss = F.nll_loss(model(X_train[idx]), y_train[idx])
        loss.backward()
        if args.fuse_optimizer:
            optimizer.fuse_step()
        else:
            optimizer.step()
        if step % args.log_interval == 0 and rank == 0:
            print(f"Train Epoch: {epoch} [{step * args.batch_size}/{len(X_train)}]\tLoss: {loss.item():.6f}")


def test():
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(X_test), args.test_batch_size):
            out = model(X_test[i:i + args.test_batch_size])
            loss += F.nll_loss(out, y_test[i:i + args.test_batch_size], reduction="sum").item()
            correct += (out.argmax(1) == y_test[i:i + args.test_batch_size]).sum().item()
    if rank == 0:
        print(f"\nTest set: Average loss: {loss / len(X_test):.4f}, "
              f"Accuracy: {correct}/{len(X_test)} ({100.0 * correct / len(X_test):.0f}%)\n")
    return correct / len(X_test)


start = time.perf_counter()
for epoch in range(1, args.epochs + 1):
    train(epoch)
    scheduler.step()
if args.algorithm == "async":
    model.bagua_algorithm.abort(model)
accuracy = test()
if rank == 0:
    print(f"algorithm {args.algorithm}: {world} ranks, {args.epochs} epochs in {time.perf_counter() - start:.1f} s, "
          f"test accuracy {accuracy * 100:.1f}%")
    if args.save_model:
        torch.save(model.state_dict(), "digits_cnn.pt")
