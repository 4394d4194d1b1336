"""One worker of a fault-tolerant synchronous job: tests/fault/test_sync_workers.py starts, kills and restarts it.

It trains ``make_model(index)`` through ``with_bagua`` and ``GradientAllReduceAlgorithm(fault_tolerance=...)``
(``--algorithm bytegrad``: ``ByteGradAlgorithm(codec="uint8", error_feedback=True, fault_tolerance=...)``), AdamW,
one process per worker (a one-process Bagua job each), on ``batch(index, step)`` at the job's step. ``--die step:S``
SIGKILLs it before its step S, ``--die exchange:N`` at the start of its N-th collective over a round's members (the
peers already in it); ``--hold DIR``: see tests/fault/ft_worker.py. At the end it saves its weights, optimizer
state, counters and statistics to ``--out``.
"""

from __future__ import annotations

import time

import torch

from tests.fault.ft_worker import Hold, _die, add_hold, die_at_average, worker_parser
from tests.torch_api.models import batch, make_model


def main() -> None:
    ap = worker_parser()
    add_hold(ap)
    ap.add_argument("--algorithm", choices=["allreduce", "bytegrad"], default="allreduce")
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args()

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.fault import FaultTolerance

    kind, _, at = args.die.partition(":")
    if kind == "exchange":
        die_at_average(int(at))
    model = make_model(args.index)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    bagua.init_process_group()  # no launcher: a job of one process
    # last: from its first heartbeat, the others wait for this worker (up to their deadline)
    ft = FaultTolerance(args.coordinator, worker=f"w{args.index}", workers=args.workers, min_quorum=1,
                        exchange_timeout_s=5.0, heartbeat_s=0.2, stale_s=1.5, timeout_s=60.0)
    algorithm = (GradientAllReduceAlgorithm(fault_tolerance=ft) if args.algorithm == "allreduce" else
                 ByteGradAlgorithm(codec="uint8", error_feedback=True, fault_tolerance=ft))
    model = model.with_bagua([opt], algorithm)
    steps = model.bagua_ddp.impl.steps
    hold = Hold(args)
    while steps.steps < args.steps:
        step = steps.steps + 1
        if kind == "step" and step == int(at) and not hold.restarted:
            _die()
        hold.before(step)
        x, y = batch(args.index, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        print(f"step {steps.steps} done at {time.time():.2f}", flush=True)
        if args.step_s:
            time.sleep(args.step_s)
    state = opt.state_dict()["state"]
    torch.save({
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [p.grad.detach().clone() for p in model.parameters()],
        "exp_avg": [state[i]["exp_avg"].clone() for i in sorted(state)],
        "adam_step": [float(state[i]["step"]) for i in sorted(state)],
        "steps": steps.steps,
        "stats": {"rounds": ft.rounds, "retries": ft.retries, "heals": ft.heals, "served": ft.served,
                  "members": ft.members, "wait_s": sum(steps.wait_seconds)},
    }, args.out)
    ft.close()


if __name__ == "__main__":
    main()
