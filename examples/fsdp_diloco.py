"""DiLoCo between FSDP2-sharded replicas: a Hugging Face GPT-2, each replica sharded block by block over its ranks.

The ranks form a 2-D mesh (replicas x shards). FSDP2 (``fully_shard``) shards every transformer block, and the
model, over ``mesh["shard"]``: the fast links inside a replica. Bagua's DiLoCo runs over ``mesh["replicate"]``:
the slow links between replicas, which exchange each shard's pseudo-gradient once every ``--sync-every`` steps.
The model is a small ``GPT2LMHeadModel`` built from a ``GPT2Config`` in code (nothing is downloaded); the data
are synthetic token sequences with a learnable rule (each token a fixed affine function of the previous one,
modulo the vocabulary), a different stream on every rank.

Run on 4 local CPU processes, 2 replicas x 2 shards (see docs/fsdp.md)::

    torchrun --nproc_per_node=4 examples/fsdp_diloco.py
    python -m bagua.distributed.launch --nproc_per_node=4 examples/fsdp_diloco.py --shards 2
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

parser = argparse.ArgumentParser()
parser.add_argument("--shards", type=int, default=2, help="ranks per replica (FSDP2); the rest are replicas")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--sync-every", type=int, default=10, help="DiLoCo's H: inner steps between synchronizations")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-embd", type=int, default=64)
parser.add_argument("--log-interval", type=int, default=10)
args = parser.parse_args()

torch.set_num_threads(1)
bagua.init_process_group()
rank, world = bagua.get_rank(), bagua.get_world_size()
if world % args.shards:
    raise SystemExit(f"--shards {args.shards} must divide the {world} ranks")
replicas = world // args.shards
mesh = init_device_mesh("cpu", (replicas, args.shards), mesh_dim_names=("replicate", "shard"))

# the model: the same initial weights on every rank (Bagua broadcasts the first replica's shards anyway)
torch.manual_seed(0)
config = GPT2Config(vocab_size=128, n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer, n_head=4,
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
model.loss_type = "ForCausalLM"  # name the loss: transformers warns when it has to guess
for block in model.transformer.h:
    fully_shard(block, mesh=mesh["shard"])
fully_shard(model, mesh=mesh["shard"])  # embeddings, final LayerNorm and the tied output projection

optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
model.with_bagua([optimizer], DiLoCoAlgorithm(sync_every=args.sync_every, outer_lr=0.7, outer_momentum=0.9),
                 device_mesh=mesh, replicate_dim="replicate")

# data: x[t] = (5 x[t-1] + 3) mod V from a random first token, a stream per rank
generator = torch.Generator().manual_seed(1000 + rank)


def batch() -> torch.Tensor:
    tokens = torch.empty(args.batch_size, args.seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, config.vocab_size, (args.batch_size,), generator=generator)
    for t in range(1, args.seq_len):
        tokens[:, t] = (5 * tokens[:, t - 1] + 3) % config.vocab_size
    return tokens


model.train()
first = None
for step in range(1, args.steps + 1):
    tokens = batch()
    optimizer.zero_grad()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    # the mean loss over all ranks, for the log only
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean = mean.item() / world
    first = mean if first is None else first
    if rank == 0 and (step % args.log_interval == 0 or step == 1):
        print(f"step {step}: loss {mean:.4f}", flush=True)

syncs = model.bagua_sharded.driver.syncs
if rank == 0:
    params = sum(p.numel() for p in model.parameters())
    print(f"fsdp_diloco: {replicas} replicas x {args.shards} shards, GPT-2 of {params / 1e6:.2f} M parameters, "
          f"{args.steps} steps, {syncs} DiLoCo synchronizations, loss {first:.4f} -> {mean:.4f}")
dist.barrier()  # every rank done before the process groups go (FSDP2 on gloo)
