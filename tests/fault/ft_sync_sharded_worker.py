"""One rank of a replica of a fault-tolerant synchronous job whose model is sharded with FSDP2 over 2 ranks.

tests/fault/test_sync_sharded.py starts both ranks of each replica (a job of its own: ``--store`` is the replica's
``FileStore``), kills and restarts them. Each rank trains ``model(index)`` (tests/fault/ft_sharded_worker.py),
``fully_shard``-ed over its replica's ranks, through ``with_bagua(..., device_mesh=(1, 2))`` and
``GradientAllReduceAlgorithm(fault_tolerance=...)`` (``--algorithm bytegrad``: ``ByteGradAlgorithm(codec="uint8",
error_feedback=True, ...)``), AdamW, on ``batch(2 * index + rank, step)`` at the job's step. ``--die exchange:N``
SIGKILLs rank 1 at the start of its N-th collective over a round's members (``BAGUA_TEST_RESTARTED`` unset).
``--hold DIR`` (tests/fault/ft_worker.py's ``Hold``): a restarted replica's first rank writes ``DIR/arrived``
before its first step, and the others wait for it before their step ``--hold-step`` (8 by default; a restart may
take longer than the job on a loaded machine). At the end each rank saves the full weights, its AdamW state
shards, counters and statistics to ``--out``/``rank<r>.pt``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.fault.ft_sharded_worker import model
from tests.fault.ft_worker import Hold, add_hold, die_at_average, worker_parser
from tests.sharded.common import batch


def main() -> None:
    ap = worker_parser()
    ap.add_argument("--algorithm", choices=["allreduce", "bytegrad"], default="allreduce")
    ap.add_argument("--store", required=True, help="the replica's FileStore (its ranks' rendezvous)")
    add_hold(ap, step=8)
    args = ap.parse_args()

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.fault import FaultTolerance
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks of a job that hangs
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restarted = os.environ.get("BAGUA_TEST_RESTARTED") == "1"
    kind, _, at = args.die.partition(":")
    if kind == "exchange" and rank == 1 and not restarted:
        die_at_average(int(at))
    bagua.init_process_group(store=dist.FileStore(args.store, world), rank=rank, world_size=world,
                             local_world_size=world)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    net = model(args.index)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    # a live replica is waited for (deadline_s) however loaded the machine: only a dead one is left out, once its
    # heartbeat stops (stale_s)
    ft = FaultTolerance(args.coordinator, worker=f"w{args.index}", workers=args.workers, min_quorum=1,
                        deadline_s=30.0, exchange_timeout_s=5.0, heartbeat_s=0.2, stale_s=6.0, timeout_s=60.0)
    algorithm = (GradientAllReduceAlgorithm(fault_tolerance=ft) if args.algorithm == "allreduce" else
                 ByteGradAlgorithm(codec="uint8", error_feedback=True, fault_tolerance=ft))
    net = net.with_bagua([opt], algorithm, device_mesh=mesh, replicate_dim="replicate")
    steps = net.bagua_sharded.sync.steps
    hold = Hold(args, writes=rank == 0, restarted=restarted)
    while steps.steps < args.steps:
        step = steps.steps + 1
        hold.before(step)
        x, y = batch(2 * args.index + rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if args.step_s:
            time.sleep(args.step_s)
    state = opt.state_dict()["state"]
    full = [p.full_tensor().detach().clone() for p in net.parameters()]  # collective over the replica's ranks
    torch.save({
        "full": full,
        "exp_avg": [state[i]["exp_avg"].to_local().clone() for i in sorted(state)],
        "adam_step": [float(state[i]["step"]) for i in sorted(state)],
        "steps": steps.steps,
        "stats": {"rounds": ft.rounds, "retries": ft.retries, "heals": ft.heals, "served": ft.served,
                  "members": ft.members, "restarted": restarted},
    }, Path(args.out) / f"rank{rank}.pt")
    dist.barrier()  # FSDP2's gloo teardown: every rank done before the groups go
    ft.close()


if __name__ == "__main__":
    main()
