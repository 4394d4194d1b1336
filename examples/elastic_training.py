"""Elastic training: checkpoint every epoch, resume from the latest one whenever the job (re)starts.

Under the elastic launcher a failed or rescaled job restarts every worker; each one loads the latest checkpoint
and goes on from the next epoch:

    python -m bagua.distributed.run --standalone --nnodes=1 --nproc_per_node=2 --max_restarts=3 \
        examples/elastic_training.py --checkpoint-dir /tmp/elastic_ckpt

A second run with the same ``--checkpoint-dir`` and more ``--epochs`` resumes too (with any launcher).
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm
from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--algorithm", default="gradient_allreduce")
parser.add_argument("--checkpoint-dir", default="elastic_checkpoints")
args = parser.parse_args()

torch.set_num_threads(1)
bagua.init_process_group()
rank, world = bagua.get_rank(), bagua.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if bagua.get_backend() == "nccl" else torch.device("cpu")

X, y = load_digits(return_X_y=True)
X = torch.tensor(X, dtype=torch.float32, device=device) / 16.0
y = torch.tensor(y, device=device)
X_train, y_train, X_test, y_test = X[:1400], y[:1400], X[1400:], y[1400:]
X_shard, y_shard = X_train[rank::world], y_train[rank::world]  # the shard depends on the world size of this run

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
model = model.with_bagua([optimizer], Algorithm.init(args.algorithm))

start_epoch = load_checkpoint(args.checkpoint_dir, model, optimizer)  # 0 when there is no checkpoint yet
if rank == 0:
    print(f"resumed from epoch {start_epoch}" if start_epoch else "no checkpoint: starting from scratch")

for epoch in range(start_epoch + 1, args.epochs + 1):
    order = torch.randperm(len(X_shard), generator=torch.Generator().manual_seed(epoch)).to(device)
    for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
        idx = order[i:i + args.batch_size]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(X_shard[idx]), y_shard[idx])
        loss.backward()
        optimizer.step()
    save_checkpoint(epoch, args.checkpoint_dir, model, optimizer)
    if rank == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}, checkpoint saved")

with torch.no_grad():
    accuracy = (model(X_test).argmax(1) == y_test).float().mean().item()
if rank == 0:
    print(f"elastic training: finished epoch {max(args.epochs, start_epoch)} on {world} ranks, "
          f"test accuracy {accuracy * 100:.1f}%")
