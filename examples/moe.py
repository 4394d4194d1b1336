"""Mixture of experts with expert parallelism on scikit-learn's digits (the original's MoE example, made small).

Each rank holds ``--num-local-experts`` experts; tokens travel to their expert's rank and back by all-to-all.
The expert parameters are marked ``expert = True``, so gradient allreduce averages only the rest of the model.

    python -m bagua.distributed.launch --nproc_per_node=2 examples/moe.py --num-local-experts 2 --top-k 2
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm
from bagua.torch_api.model_parallel.moe import MoE

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--hidden-size", type=int, default=32)
parser.add_argument("--num-local-experts", type=int, default=2)
parser.add_argument("--top-k", type=int, default=1, choices=[1, 2])
parser.add_argument("--capacity-factor", type=float, default=1.5)
parser.add_argument("--aux-loss-weight", type=float, default=0.01)
parser.add_argument("--algorithm", default="gradient_allreduce")
args = parser.parse_args()

torch.set_num_threads(1)
bagua.init_process_group()
rank, world = bagua.get_rank(), bagua.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if bagua.get_backend() == "nccl" else torch.device("cpu")

X, y = load_digits(return_X_y=True)
X = torch.tensor(X, dtype=torch.float32, device=device) / 16.0
y = torch.tensor(y, device=device)
X_train, y_train, X_test, y_test = X[:1400], y[:1400], X[1400:], y[1400:]
X_shard, y_shard = X_train[rank::world], y_train[rank::world]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        h = args.hidden_size
        self.inp = torch.nn.Linear(64, h)
        expert = torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.ReLU(), torch.nn.Linear(2 * h, h))
        self.moe = MoE(h, expert, num_local_experts=args.num_local_experts, k=args.top_k,
                       capacity_factor=args.capacity_factor, eval_capacity_factor=2 * args.capacity_factor)
        self.out = torch.nn.Linear(h, 10)

    def forward(self, x):
        h = F.relu(self.inp(x))
        moe_out, l_aux, exp_counts = self.moe(h)
        return self.out(h + moe_out), l_aux, exp_counts


torch.manual_seed(0)
net = Net().to(device)
torch.manual_seed(1 + rank)  # experts differ by rank
with torch.no_grad():
    for p in net.moe.parameters():
        if getattr(p, "expert", False):
            p.normal_(0, 0.2)
optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
model = net.with_bagua([optimizer], Algorithm.init(args.algorithm))

steps = len(X_shard) // args.batch_size  # equal on every rank: MoE needs the same token count everywhere
for epoch in range(1, args.epochs + 1):
    order = torch.randperm(len(X_shard), generator=torch.Generator().manual_seed(epoch)).to(device)
    counts = torch.zeros(net.moe.num_experts, dtype=torch.long)
    for step in range(steps):
        idx = order[step * args.batch_size:(step + 1) * args.batch_size]
        optimizer.zero_grad()
        logits, l_aux, exp_counts = model(X_shard[idx])
        loss = F.cross_entropy(logits, y_shard[idx]) + args.aux_loss_weight * l_aux
        loss.backward()
        optimizer.step()
        counts += exp_counts
    if rank == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}, tokens per expert (rank 0) {counts.tolist()}")

model.eval()
n = len(X_test) // world * world  # every rank evaluates the same number of tokens
with torch.no_grad():
    logits = model(X_test[:n])[0]
accuracy = (logits.argmax(1) == y_test[:n]).float().mean().item()
if rank == 0:
    print(f"moe: {net.moe.num_experts} experts on {world} ranks, top-{args.top_k}, test accuracy {accuracy * 100:.1f}%")
