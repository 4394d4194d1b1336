"""What Bagua adds per rank on sharded replicas, against the same algorithm on unsharded replicas.

Goal (issue 50): Bagua's added state per rank within 1.15x of (unsharded amount / S) when FSDP2 shards each
replica over S ranks. The model is a 100.7 M-parameter MLP (6 x Linear(4096, 4096), Tanh between: 403 MB of
float32 weights). For each algorithm (DiLoCo: global weights, outer momentum, the pseudo-gradient buffer;
ByteGrad: error-feedback residuals and the codec's buffers), two runs of 3 training steps:

- sharded: 4 processes as 2 replicas x S=2 shards (``fully_shard`` per layer over ``mesh["shard"]``,
  ``with_bagua(..., device_mesh=mesh, replicate_dim="replicate")``), so the exchange really runs between replicas;
- unsharded: 2 processes, the same algorithm between the same 2 replicas, each holding the whole model.

"Added state" is measured by summing the bytes of the distinct tensor storages reachable from the object Bagua
attaches to the model (``model.bagua_sharded`` or ``model.bagua_ddp``), walking Bagua's own objects, containers and
outer optimizers, minus the storages of the model's parameters, their gradients and the inner optimizer's state
(gradient buckets that are views of the gradients are the gradients, not an addition). Peak RSS per rank is
printed too, for context only: it includes torch, the model, FSDP2's buffers and the allocator's slack.

Run from the repository root (about 1-2 minutes and 6 GB of memory on 2 cores)::

    python -m benchmarks.sharded.sharded_memory
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import tempfile
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WIDTH", "LAYERS", "S", "held_bytes", "main"]

WIDTH, LAYERS = 4096, 6
S = 2  # shards per replica
REPLICAS = 2
STEPS = 3
GOAL = 1.15
ALGORITHMS = {
    "diloco": {"sync_every": 1, "outer_lr": 0.7, "outer_momentum": 0.9},
    "bytegrad": {"hierarchical": False, "error_feedback": True},
}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: its local shard
    s = local.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _walk(obj: Any, skip: set[int], seen: set[int], visited: set[int], depth: int = 0) -> int:
    """The bytes of the tensor storages reachable from ``obj`` and in neither ``skip`` nor ``seen`` (both by data
    pointer); descends into containers, Bagua's objects and optimizers other than those in ``visited``."""
    if id(obj) in visited or depth > 16 or isinstance(obj, torch.nn.Module):
        return 0
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        ptr, nbytes = _storage(obj)
        if ptr in skip or ptr in seen or nbytes == 0:
            return 0
        seen.add(ptr)
        return nbytes
    if isinstance(obj, dict):
        children: list[Any] = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif isinstance(obj, torch.optim.Optimizer):
        children = [obj.state, obj.param_groups]
    elif type(obj).__module__.startswith("bagua."):
        children = list(getattr(obj, "__dict__", {}).values())
        children += [getattr(obj, n, None) for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
    else:
        return 0  # process groups, threads, functions: no tensors of Bagua's own
    return sum(_walk(c, skip, seen, visited, depth + 1) for c in children)


def held_bytes(root: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Sum the bytes Bagua's object ``root`` holds beyond the model's parameters, gradients and ``optimizer``'s
    state, by attribute of ``root``."""
    skip = {_storage(p)[0] for p in model.parameters()}
    skip |= {_storage(p.grad)[0] for p in model.parameters() if p.grad is not None}
    skip |= {_storage(t)[0] for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)}
    seen: set[int] = set()
    visited = {id(optimizer)}
    return {name: b for name, value in vars(root).items() if (b := _walk(value, skip, seen, visited))}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())))


def _worker(rank: int, world: int, sharded: bool, name: str, store_path: str, results: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    torch.set_num_threads(1)
    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms import Algorithm

    bagua.init_process_group(store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                             local_world_size=1)
    model = _mlp()
    kwargs = dict(ALGORITHMS[name])
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (REPLICAS, S), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        extra: dict[str, Any] = {"device_mesh": mesh, "replicate_dim": "replicate"}
    else:
        kwargs.setdefault("hierarchical", False)
        extra = {}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model.with_bagua([optimizer], Algorithm.init(name, **kwargs), **extra)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        optimizer.zero_grad()
        x, y = torch.randn(2, WIDTH, generator=g), torch.randn(2, WIDTH, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    root = model.bagua_sharded if sharded else model.bagua_ddp
    held = held_bytes(root, model, optimizer)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.barrier()  # every rank done before the groups go (FSDP2's gloo teardown)
    results.put((rank, held, rss))
    dist.destroy_process_group()


def _run(sharded: bool, name: str) -> list[tuple[dict[str, int], int]]:
    world = REPLICAS * S if sharded else REPLICAS
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bagua-memory-") as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, sharded, name, os.path.join(tmp, "store"), results))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = {}
        for _ in range(world):
            rank, held, rss = results.get(timeout=900)
            got[rank] = (held, rss)
        for p in procs:
            p.join(timeout=60)
    return [got[r] for r in range(world)]


def main() -> None:
    """Measure each algorithm sharded and unsharded; print the per-rank bytes and the ratio to the goal."""
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    print(f"model: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB float32); "
          f"sharded: {REPLICAS} replicas x S={S} shards; unsharded: {REPLICAS} replicas")
    for name in ALGORITHMS:
        sharded, unsharded = _run(True, name), _run(False, name)
        mine = max(sum(h.values()) for h, _ in sharded)
        full = max(sum(h.values()) for h, _ in unsharded)
        ratio = mine / (full / S)
        parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in max(sharded, key=lambda x: sum(x[0].values()))[0].items())
        print(f"{name}: unsharded {full / 2**20:.1f} MiB/rank; sharded {mine / 2**20:.1f} MiB/rank ({parts}); "
              f"sharded / (unsharded / S) = {ratio:.3f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'}); "
              f"peak RSS/rank sharded {max(r for _, r in sharded) / 2**20:.0f} MiB, "
              f"unsharded {max(r for _, r in unsharded) / 2**20:.0f} MiB")


if __name__ == "__main__":  # spawned ranks import this module; only the parent measures
    main()
