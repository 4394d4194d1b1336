"""The training job each emulated host runs: ``python -m benchmarks.common.workload --system S --model M ...``.

One process per host, described by the usual launcher variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``) plus ``GLOO_SOCKET_IFNAME``. It trains ``--model``
with ``--system`` and writes one JSON file per rank (``<out>.rank<r>.json``) with:

- ``step_times_s``: wall time of every timed step (zero_grad + forward + backward + communication + optimizer
  step), warm-up steps excluded;
- ``tx_bytes``: bytes the host's interface sent during the timed steps (``/proc/net/dev``);
- ``compute_step_s``: median step of an *unwrapped* replica of the model (same data, same optimizer type, no
  communication), measured right after the timed steps on every rank at once: the compute phase;
- ``comm_busy_s``: per timed step, the time during which communication operations were running (the union of
  Bagua bucket executions, or of DDP comm-hook futures; ``None`` for plain DDP, whose C++ allreduce cannot be
  timed from outside);
- ``codec_s``: per step, the estimated compression cost (encode/decode of the gradient-sized tensor with the
  algorithm's codec, timed in-process);
- ``accuracy`` / ``final_loss`` for the digits models.

Models (:data:`MODELS`): ``mlp`` (synthetic, communication-heavy), ``digits`` (small CNN) and ``resnet`` (BatchNorm
ResNet, :mod:`benchmarks.common.resnet`) on scikit-learn's digits, ``gpt`` (byte-level GPT on the standard
library's sources, :mod:`benchmarks.common.gpt`), and ``tiny``, ``resnet_tiny``, ``gpt_tiny`` for tests.

With ``--target T`` the job instead trains until the validation metric reaches ``T`` (or ``--max-steps``) and
adds ``to_target`` to its result (:mod:`benchmarks.to_target.to_target`).

Systems: ``ddp``, ``ddp_fp16`` (``fp16_compress_hook``), ``ddp_powersgd`` (``powerSGD_hook``, rank 1, vanilla
allreduce in the first step as torch requires), ``ddp_post_local_sgd`` (torch's post-local SGD), and every name in Bagua's algorithm registry (``qadam`` gets its
own ``QAdamOptimizer``).

Example::

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
        python -m benchmarks.common.workload --system gradient_allreduce --model tiny --steps 2 --out /tmp/r
"""

from __future__ import annotations
import argparse
import copy
import json
import statistics
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from benchmarks.common.measurements import CODEC_PASSES, _codec_seconds, _evaluate, _median_compute_step, _step
from benchmarks.common.models import MODELS, build_model
from benchmarks.common.models import loss_fn as _loss_fn
from benchmarks.common.models import train_batches as _batches
from benchmarks.common.systems import (
    DDP_SYSTEMS, System, available_systems, load_algorithm_modules, make_system, qadam_warmup_steps, split_system,
    untimed_steps,
)

# systems (systems.py) and measurements (measurements.py) are re-exported here, their original path
__all__ = ["MODELS", "DDP_SYSTEMS", "CODEC_PASSES", "available_systems", "split_system", "build_model", "main",
           "load_algorithm_modules", "System", "untimed_steps", "qadam_warmup_steps", "make_system"]


# -- main ----------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the workload's arguments."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.common.workload", description=__doc__.splitlines()[0])
    p.add_argument("--system", required=True, help="ddp, ddp_fp16, ddp_powersgd or a Bagua algorithm name")
    p.add_argument("--model", default="mlp", choices=sorted(MODELS))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=5, help="timed steps (synthetic models)")
    p.add_argument("--epochs", type=int, default=6, help="epochs (digits); every step after --warmup is timed")
    p.add_argument("--batch-size", type=int, default=None, help="per-rank batch size (default: the model's, "
                                                                  "32; gpt: 8 sequences)")
    p.add_argument("--lr", type=float, default=None, help="default: 0.01 (SGD), 0.002 (Adam, digits), "
                                                          "0.001 (Adam, gpt)")
    p.add_argument("--target", type=float, default=None, help="train to this validation metric instead of timing "
                                                              "steps (benchmarks.to_target.to_target)")
    p.add_argument("--eval-every", type=int, default=None, help="with --target: steps between evaluations "
                                                                 "(default: the model's, to_target.DEFAULTS)")
    p.add_argument("--eval-samples", type=int, default=None, help="with --target: validation windows (gpt) or "
                                                                   "test images (0: all 360) evaluated")
    p.add_argument("--max-steps", type=int, default=None, help="with --target: give up after this many steps")
    p.add_argument("--qadam-warmup", type=int, default=None, help="with --target: QAdam's warmup steps")
    p.add_argument("--compute-steps", type=int, default=3, help="replica steps for the compute phase (0: skip)")
    p.add_argument("--iface", default="lo", help="interface whose tx bytes are counted")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--go-file", default=None, help="after the warm-up, write GO_FILE.ready<rank> and wait for "
                                                   "GO_FILE to exist before the timed steps (a driver reshapes "
                                                   "the link in between: benchmarks.to_target.one_megabit)")
    p.add_argument("--out", required=True, help="results go to OUT.rank<r>.json")
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = MODELS[args.model].batch_size
    for key in ("warmup", "steps", "epochs", "batch_size", "threads", "eval_every", "max_steps"):
        if getattr(args, key) is not None and getattr(args, key) < (0 if key == "warmup" else 1):
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the job on this host; write and return this rank's result."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import bagua.torch_api as bagua
    from benchmarks.common.netns import read_tx_bytes

    bagua.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.target is not None:
        from benchmarks.to_target import to_target
        return _write(args, to_target.train(args, rank, world))
    spec = MODELS[args.model]
    optimizer_kind = split_system(args.system)[1].get("inner", spec.optimizer)  # what the compute step uses
    lr = args.lr if args.lr is not None else spec.lr
    qadam_warmup = qadam_warmup_steps(len(_batches(args, rank, world)[0]) if spec.data == "digits" else None,
                                      args.steps)
    args.warmup = untimed_steps(args.system, args.warmup, qadam_warmup)
    batches, test = _batches(args, rank, world)
    if len(batches) <= args.warmup:
        raise ValueError(f"{len(batches)} steps in total but --warmup={args.warmup}: add epochs or steps")
    model = build_model(args.model, args.seed)
    replica = copy.deepcopy(model) if args.compute_steps else None
    numel = sum(p.numel() for p in model.parameters())
    system = make_system(args.system, model, optimizer_kind, lr, qadam_warmup)
    loss_fn = _loss_fn(spec)

    times, losses, tx_start, comm_busy = [], [], 0, 0.0
    train_start = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        if i == args.warmup:
            if args.go_file:
                _wait_for_go(args.go_file, rank)
            dist.barrier()
            tx_start = read_tx_bytes(args.iface)
            if system.timer is not None:
                system.timer.take()
        system.before_step()
        start = time.perf_counter()
        losses.append(_step(system.model, system.optimizer, loss_fn, x, y))
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    tx_bytes = read_tx_bytes(args.iface) - tx_start
    if system.timer is not None:
        comm_busy = system.timer.take()
    train_time = time.perf_counter() - train_start
    system.close()
    accuracy = _evaluate(system.model, test) if test is not None else None

    dist.barrier()  # every rank measures compute and the codec at the same time, as in training
    compute = (_median_compute_step(replica, optimizer_kind, lr, loss_fn, batches, args.compute_steps)
               if replica is not None else None)
    codec = _codec_seconds(split_system(args.system)[0], numel, world)
    result = {
        "rank": rank, "world_size": world, "system": args.system, "model": args.model, "params": numel,
        "batch_size": args.batch_size, "warmup": args.warmup, "timed_steps": len(times),
        "step_times_s": times, "median_step_s": statistics.median(times), "tx_bytes": tx_bytes,
        "iface": args.iface, "compute_step_s": compute, "codec_s": codec,
        "comm_busy_s": comm_busy / len(times) if system.timer is not None else None,
        "accuracy": accuracy, "final_loss": statistics.mean(losses[-5:]), "train_time_s": train_time,
        "notes": system.notes,
    }
    return _write(args, result)


def _wait_for_go(go_file: str, rank: int, timeout_s: float = 900.0) -> None:
    """Say this rank finished its warm-up (``go_file.ready<rank>``), then wait until ``go_file`` exists."""
    import os
    with open(f"{go_file}.ready{rank}", "w"):
        pass
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(go_file):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{go_file} did not appear within {timeout_s:.0f} s; the driver that reshapes "
                               "the link must create it once every rank is ready")
        time.sleep(0.05)


def _write(args: argparse.Namespace, result: dict) -> dict:
    """Write this rank's result, wait for every rank, leave the process group; return the result."""
    with open(f"{args.out}.rank{result['rank']}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
