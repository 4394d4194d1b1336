"""A tiny training script run by the launcher tests under `python -m bagua.distributed.launch/run`.

Usage: train_tiny.py OUT_DIR STEPS [--crash-at STEP] [--kill-at STEP] [--algorithm NAME] [--local_rank N]
Saves a checkpoint after every step, resumes from the latest one, and writes each rank's final weights.
With --crash-at, rank 1 exits abruptly at that step on the first attempt (TORCHELASTIC_RESTART_COUNT == 0); with
--kill-at, it kills itself with SIGKILL. With an --algorithm whose ranks diverge (decentralized), the checkpoint is
loaded after with_bagua, so that every rank gets its own state back.
"""

import argparse
import os
import signal

import torch

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("steps", type=int)
parser.add_argument("--crash-at", type=int, default=-1)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--algorithm", default="gradient_allreduce")
parser.add_argument("--local_rank", type=int, default=None)  # only the original's spelling, as old scripts have
args = parser.parse_args()

bagua.init_process_group()
rank = bagua.get_rank()
torch.manual_seed(rank)  # different initial weights: the wrap-time broadcast must fix them
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
ckpt = os.path.join(args.out, "ckpt")
if args.algorithm == "gradient_allreduce":
    start = load_checkpoint(ckpt, model, optimizer)  # before wrapping: the original's order, identical ranks
    model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())
else:
    kwargs = {"peer_selection_mode": "shift_one"} if args.algorithm == "decentralized" else {}
    model = model.with_bagua([optimizer], Algorithm.init(args.algorithm, hierarchical=False, **kwargs))
    start = load_checkpoint(ckpt, model, optimizer)  # after wrapping: each rank's own state
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
for step in range(start, args.steps):
    if rank == 1 and step == args.crash_at and attempt == 0:
        os._exit(17)  # a rank dies mid-run
    if rank == 1 and step == args.kill_at and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(step * 10 + rank)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    save_checkpoint(step + 1, ckpt, model, optimizer)
torch.save(
    {"params": [p.detach() for p in model.parameters()], "local_rank_arg": args.local_rank, "attempt": attempt,
     "start": start, "mark": os.environ.get("BAGUA_TEST_MARK")},
    os.path.join(args.out, f"final_rank{rank}.pt"),
)
print(f"rank {rank} trained {args.steps - start} steps", flush=True)
