"""One worker of a fault-tolerant DiLoCo job whose model is sharded with FSDP2 over the worker's 2 ranks.

tests/fault/test_sharded_workers.py starts it as a job of its own under ``bagua.distributed.run --nproc_per_node=2``
(which restarts both ranks when one dies). Each rank trains on the batches of sample stream ``2 * index + rank``;
the worker's initial weights come from seed ``index`` (the job's first round gives every worker worker 0's).
``--die inner:S`` SIGKILLs rank 1 before its inner step S, ``--die exchange:N`` at the start of its N-th average
(rank 0 may have finished its own shard's), only in the launcher's first attempt. ``--hold DIR``: tests/fault/
ft_worker.py's ``Hold`` (a restarted worker's first rank says it is back as it arrives at its first quorum; every
rank of the others waits for that before its step ``--hold-step``). At the end each rank saves the full weights,
its shard's global weights, counters and statistics to ``--out``/``rank<r>.pt``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.fault.ft_worker import Hold, add_hold, die_at_average, worker_parser
from tests.sharded.common import batch

ROUNDS_LOG = "round {} done"


def model(seed: int) -> torch.nn.Module:
    """Two tanh layers of 16; the seed sets the initial weights."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh())


def main() -> None:
    ap = worker_parser()
    ap.add_argument("--outer", default="0.7,0.9", help="LR,MOMENTUM of the outer Nesterov SGD")
    ap.add_argument("--inner-state", action="store_true")
    add_hold(ap)
    args = ap.parse_args()

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm
    from bagua.torch_api.fault import FaultTolerance
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    bagua.init_process_group()
    rank = dist.get_rank()
    kind, _, at = args.die.partition(":")
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    dies = rank == 1 and kind and not restarted
    if dies and kind == "exchange":
        die_at_average(int(at))
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
    net = model(args.index)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    inner = torch.optim.AdamW(net.parameters(), lr=0.01)
    lr, momentum = map(float, args.outer.split(","))
    ft = FaultTolerance(args.coordinator, worker=f"w{args.index}", workers=args.workers, deadline_s=None,
                        exchange_timeout_s=5.0, heartbeat_s=0.2, stale_s=1.5, timeout_s=60.0,
                        inner_state=args.inner_state)
    hold = Hold(args, at_quorum=True, writes=rank == 0, restarted=restarted)
    net = net.with_bagua([inner], DiLoCoAlgorithm(sync_every=args.sync_every, outer_lr=lr, outer_momentum=momentum,
                                                  fault_tolerance=ft),
                         device_mesh=mesh, replicate_dim="replicate")
    d = net.bagua_sharded.driver
    while d.steps < args.steps:
        step = d.steps + 1
        hold.before(step)
        if dies and kind == "inner" and step == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(2 * args.index + rank, step)
        inner.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        rounds = ft.rounds
        inner.step()
        if ft.rounds != rounds and rank == 0:
            print(ROUNDS_LOG.format(ft.rounds), flush=True)
        if args.step_s:
            time.sleep(args.step_s)
    full = [p.full_tensor().detach().clone() for p in net.parameters()]  # collective over the worker's ranks
    torch.save({
        "full": full, "global": [f.global_.clone() for f in d.fragments], "steps": d.steps, "syncs": d.syncs,
        "stats": {"rounds": ft.rounds, "retries": ft.retries, "heals": ft.heals, "served": ft.served,
                  "members": ft.members, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))},
    }, Path(args.out) / f"rank{rank}.pt")
    dist.barrier()  # FSDP2's gloo teardown: every rank done before the groups go
    ft.close()


if __name__ == "__main__":
    main()
