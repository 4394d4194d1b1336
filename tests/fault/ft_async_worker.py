"""One worker of an asynchronous fault-tolerant DiLoCo job: tests/fault/test_async_ft.py starts, kills and restarts it.

Worker ``i`` pads each inner step by ``--step-s * (i + 1)`` seconds (unequal speeds), trains through
``DiLoCoOptimizer(asynchronous=True, fault_tolerance=ft)``, and at the end saves its global weights, the log of
arrivals it applied, its statistics and the state it started from to ``--out``. ``--die inner:S`` SIGKILLs it
before its inner step S; ``--hold PATH`` waits for that file before ``close()``.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from tests.fault.ft_worker import worker_parser
from tests.torch_api.models import batch, make_model


def main() -> None:
    ap = worker_parser()
    ap.add_argument("--outer", default="0.8,0.5,2", help="LR,MOMENTUM,WARMUP")
    ap.add_argument("--hold", default="", help="before close(), wait until this file exists")
    args = ap.parse_args()
    lr, momentum, warmup = args.outer.split(",")
    from bagua.torch_api.contrib.diloco_optimizer import DiLoCoOptimizer
    from bagua.torch_api.fault import FaultTolerance

    ft = FaultTolerance(args.coordinator, worker=f"w{args.index}", workers=args.workers, heartbeat_s=0.2,
                        stale_s=1.5, timeout_s=60.0, prefix="async")
    model = make_model(args.index)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt = DiLoCoOptimizer(inner, sync_every=args.sync_every, asynchronous=True, fault_tolerance=ft,
                          outer_lr=float(lr), outer_momentum=float(momentum), outer_lr_warmup=int(warmup))
    d, run = opt.driver, opt.driver.asynchronous
    initial = {"global": d.fragments[0].global_.clone(), "cursor": run.cursor, "steps": d.steps}
    kind, _, at = args.die.partition(":")
    while d.steps < args.steps:
        step = d.steps + 1
        if kind == "inner" and step == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(args.index, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        time.sleep(args.step_s * (args.index + 1))
        opt.step()
    while args.hold and not os.path.exists(args.hold):
        time.sleep(0.05)
    opt.close()
    torch.save({
        "global": d.fragments[0].global_.clone(), "params": [p.detach().clone() for p in model.parameters()],
        "steps": d.steps, "initial": initial,
        "arrivals": [(a.seq, a.worker, a.arrival.tokens, a.arrival.base, a.arrival.version) for a in run.arrivals],
        "stats": {"heals": run.heals, "served": run.served, "ignored": run.ignored, "exchanges": run.exchanges,
                  "cursor": run.cursor, "refused": ft.quorums.records.refused},
    }, args.out)
    ft.close()


if __name__ == "__main__":
    main()
