"""The job each host of the islands benchmark runs: the project's GPT sharded with FSDP2 over the ranks of one island,
one system between the islands (``python -m benchmarks.sharded.sharded_gpt``).

The mesh is ``(replicate, shard) = (world // S, S)`` over ranks in order, ``S = --shards`` (2): ranks ``0..S-1``
are one replica, and :class:`~benchmarks.sharded.islands.IslandsCluster` puts them on one island, so FSDP2's all-gathers
and reduce-scatters stay inside an island and only the replicate exchange crosses the slow link. Every block, then
the model, is ``fully_shard``-ed. Systems (:data:`SYSTEMS`):

- ``hsdp``: native HSDP, ``fully_shard`` on the 2-D mesh: FSDP2's own all-reduce over the replicate dimension;
- ``bagua-hsdp``: FSDP2 on ``mesh["shard"]``, Bagua's ``gradient_allreduce`` between the replicas
  (``with_bagua(device_mesh=mesh, replicate_dim="replicate")``, bit-identical to ``hsdp``);
- ``bytegrad-hsdp``: the same with ``bytegrad``, error feedback on (README, "Which algorithm for my link");
- ``diloco-hsdp``: the same with streaming ``diloco`` at the README's 10 and 100 Mbit/s settings for 2 replicas
  (:data:`DILOCO`);
- ``bagua-hsdp-sync``, ``bytegrad-hsdp-sync``: ``bagua-hsdp`` and ``bytegrad-hsdp`` with the replica exchanges run
  inside FSDP2's hook (``overlap=False``, :mod:`bagua.torch_api.sharded.overlap`): what the overlap hides.

Each rank trains on batches of its own (seeded by seed and rank; Adam, the GPT's lr), times every step, evaluates
the validation loss of its own weights (averaged over all ranks) before the first step, every ``--eval-every``
steps and after the last, and stops at ``--max-steps`` or, with ``--target``, once the loss is at or below it. It
writes ``OUT.rank<r>.json`` in :mod:`benchmarks.to_target.to_target`'s layout (its ``summarize`` reads them).

Example::

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29531 \\
        python -m benchmarks.sharded.sharded_gpt --system hsdp --model gpt_tiny --shards 1 --max-steps 2 --out /tmp/r
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["SYSTEMS", "SYNC", "DILOCO", "BYTEGRAD", "build_mesh", "shard_model", "make_system", "parse_args", "train",
           "main"]

#: streaming DiLoCo as the README picks it at 10 and 100 Mbit/s for 2 replicas (2 hosts)
DILOCO: dict[str, Any] = {"sync_every": 10, "outer_lr": 1.0, "outer_momentum": 0.0, "compression": "uint4",
                          "fragments": 2, "overlap_steps": 3}
#: ByteGrad as the README recommends it
BYTEGRAD: dict[str, Any] = {"error_feedback": True}
#: system -> (Bagua algorithm, its arguments); ``None``: native HSDP, no Bagua
SYSTEMS: dict[str, Optional[tuple[str, dict[str, Any]]]] = {
    "hsdp": None,
    "bagua-hsdp": ("gradient_allreduce", {}),
    "bytegrad-hsdp": ("bytegrad", BYTEGRAD),
    "diloco-hsdp": ("diloco", DILOCO),
    "bagua-hsdp-sync": ("gradient_allreduce", {}),
    "bytegrad-hsdp-sync": ("bytegrad", BYTEGRAD),
}
#: the systems whose replica exchanges run synchronously inside FSDP2's hook (``overlap=False``)
SYNC = ("bagua-hsdp-sync", "bytegrad-hsdp-sync")


def build_mesh(world: int, shards: int) -> Any:
    """The ``(replicate, shard)`` CPU mesh: consecutive ranks form one replica (one island)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world % shards:
        raise ValueError(f"--shards={shards} does not divide the {world} ranks")
    return init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("replicate", "shard"))


def shard_model(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``fully_shard`` every transformer block, then the model (embeddings, final norm, tied head), on ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_system(system: str, model: torch.nn.Module, mesh: Any, lr: float) -> tuple[torch.nn.Module,
                                                                                    torch.optim.Optimizer]:
    """Shard ``model`` for ``system`` and put Bagua between the replicas; return it and its Adam optimizer."""
    from bagua.torch_api.algorithms import Algorithm

    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; available: {', '.join(SYSTEMS)}")
    bagua = SYSTEMS[system]
    model = shard_model(model, mesh if bagua is None else mesh["shard"])
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    if bagua is not None:
        name, kwargs = bagua
        model = model.with_bagua([optimizer], Algorithm.init(name, **kwargs), device_mesh=mesh,
                                 replicate_dim="replicate")
        if system in SYNC:
            model.bagua_sharded.overlap = False
    return model, optimizer


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the job's arguments."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.sharded.sharded_gpt", description=__doc__.splitlines()[0])
    p.add_argument("--system", required=True, choices=sorted(SYSTEMS))
    p.add_argument("--model", default="gpt", choices=("gpt", "gpt_tiny"))
    p.add_argument("--shards", type=int, default=2, help="ranks per replica (per island)")
    p.add_argument("--max-steps", type=int, default=10, help="steps to run (with --target: at most)")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the median step time")
    p.add_argument("--target", type=float, default=None, help="stop once the validation loss is at or below it")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: first and last only)")
    p.add_argument("--eval-samples", type=int, default=64, help="validation windows")
    p.add_argument("--batch-size", type=int, default=None, help="per-rank sequences (default: the model's)")
    p.add_argument("--lr", type=float, default=None, help="default: the model's (Adam, 0.001)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iface", default="lo", help="interface whose tx bytes are counted")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", required=True, help="results go to OUT.rank<r>.json")
    args = p.parse_args(argv)
    for key in ("max_steps", "shards", "eval_samples", "threads"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    return args


def train(args: argparse.Namespace, rank: int, world: int) -> dict:
    """Train the sharded GPT with ``args.system``; return this rank's result (to_target's layout)."""
    from benchmarks.common.gpt import lm_loss
    from benchmarks.common.measurements import _step
    from benchmarks.common.models import MODELS, build_model
    from benchmarks.common.netns import read_tx_bytes
    from benchmarks.to_target.to_target import _mean_over_ranks, _text_stream

    spec = MODELS[args.model]
    args.batch_size = args.batch_size or spec.batch_size
    batch, (vx, vy) = _text_stream(args, rank, spec.in_shape[0])
    model = build_model(args.model, args.seed)
    numel = sum(p.numel() for p in model.parameters())
    model, optimizer = make_system(args.system, model, build_mesh(world, args.shards), args.lr or spec.lr)

    def evaluate() -> float:
        with torch.no_grad():  # this rank's own weights: DiLoCo's replicas differ between synchronizations
            return _mean_over_ranks(float(lm_loss(model(vx), vy)), world)

    dist.barrier()
    tx_start, start = read_tx_bytes(args.iface), time.perf_counter()
    metric = evaluate()
    eval_s = time.perf_counter() - start
    curve, times, losses, waits = [[0, 0.0, eval_s, metric]], [], [], []
    exchanges = getattr(getattr(model, "bagua_sharded", None), "_exchanges", None)
    hit = args.target is not None and metric <= args.target
    while not hit and len(times) < args.max_steps:
        x, y = batch(len(times))
        t0, w0 = time.perf_counter(), exchanges.wait_s if exchanges is not None else 0.0
        losses.append(_step(model, optimizer, lm_loss, x, y))
        times.append(time.perf_counter() - t0)
        waits.append(exchanges.wait_s - w0 if exchanges is not None else 0.0)
        step = len(times)
        if (args.eval_every and step % args.eval_every == 0) or step == args.max_steps:
            e0 = time.perf_counter()
            metric = evaluate()
            now = time.perf_counter()
            eval_s += now - e0
            curve.append([step, now - start - eval_s, now - start, metric])
            hit = args.target is not None and metric <= args.target
    tx_bytes = read_tx_bytes(args.iface) - tx_start
    sharded = getattr(model, "bagua_sharded", None)
    if sharded is not None:
        sharded.close()
    timed = times[args.warmup:] or times
    steps_run, train_s, wall_s = curve[-1][0], curve[-1][1], curve[-1][2]
    return {
        "rank": rank, "world_size": world, "system": args.system, "model": args.model, "params": numel,
        "batch_size": args.batch_size, "warmup": args.warmup, "timed_steps": len(timed), "step_times_s": times,
        "median_step_s": statistics.median(timed), "exchange_wait_s": waits,
        "exchanges_started": exchanges.started if exchanges is not None else 0, "tx_bytes": tx_bytes,
        "iface": args.iface,
        "final_loss": statistics.mean(losses[-5:]), "settings": SYSTEMS[args.system],
        "to_target": {
            "metric": "val_loss", "higher_is_better": False, "target": args.target, "reached": hit,
            "steps_to_target": steps_run if hit else None, "time_to_target_s": train_s if hit else None,
            "wall_to_target_s": wall_s if hit else None, "final_metric": metric, "steps_run": steps_run,
            "step_budget": args.max_steps, "eval_every": args.eval_every, "eval_s": eval_s, "train_s": train_s,
            "wall_s": wall_s, "curve": curve,
        },
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the job on this host; write and return this rank's result."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import bagua.torch_api as bagua
    from benchmarks.common.workload import _write

    bagua.init_process_group()
    result = train(args, dist.get_rank(), dist.get_world_size())
    dist.barrier()  # FSDP2's gloo teardown: every rank done before the groups go
    return _write(args, result)


if __name__ == "__main__":
    main()
