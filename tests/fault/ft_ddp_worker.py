"""One worker of a fault-tolerant job on torch DDP: tests/fault/test_sync_ddp_hook.py runs, kills and restarts it.

:func:`train` trains ``make_model(index)`` wrapped in ``torch.nn.parallel.DistributedDataParallel`` over a torch
world of this process alone (buckets small enough that a step has several), with
:func:`~bagua.torch_api.contrib.ddp_fault.fault_tolerant_hook` (``"bytegrad"``: ``codec="uint8",
error_feedback=True``), AdamW, on ``batch(index, step)`` at the job's step, and returns its weights, optimizer state,
counters and statistics. As a command (``python -m``, or :func:`forked`; ``--die`` and ``--hold`` as in
tests/fault/ft_sync_worker.py) it saves them to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from tests.fault.ft_worker import Hold, _die, add_hold, die_at_average, worker_parser
from tests.torch_api.models import batch, make_model


def train(index: int, coordinator: str, workers: int, steps: int, algorithm: str = "allreduce",
          step_s: float = 0.0, die_step: int = 0, hold: str = "", hold_step: int = 10,
          restarted: bool = False) -> dict:
    """Run this worker's part of the job; return what it ends with. ``hold``, ``hold_step``: the ``--hold`` and
    ``--hold-step`` of tests/fault/ft_worker.py's :class:`~tests.fault.ft_worker.Hold`."""
    from bagua.torch_api.contrib.ddp_fault import FaultTolerantHookState, fault_tolerant_hook
    from bagua.torch_api.fault import FaultTolerance

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # this worker alone
    model = torch.nn.parallel.DistributedDataParallel(make_model(index), bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ft = FaultTolerance(coordinator, worker=f"w{index}", workers=workers, min_quorum=1, exchange_timeout_s=5.0,
                        heartbeat_s=0.2, stale_s=1.5, timeout_s=60.0)
    state = (FaultTolerantHookState(ft, model, opt) if algorithm == "allreduce" else
             FaultTolerantHookState(ft, model, opt, codec="uint8", error_feedback=True))
    model.register_comm_hook(state, fault_tolerant_hook)
    held = Hold(argparse.Namespace(hold=hold, hold_step=hold_step), restarted=restarted)
    while state.steps.steps < steps:
        step = state.steps.steps + 1
        if step == die_step and not restarted:
            _die()
        held.before(step)
        x, y = batch(index, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        print(f"step {state.steps.steps} done at {time.time():.2f}", flush=True)
        if step_s:
            time.sleep(step_s)
    opt_state = opt.state_dict()["state"]
    out = {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [p.grad.detach().clone() for p in model.parameters()],
        "exp_avg": [opt_state[i]["exp_avg"].clone() for i in sorted(opt_state)],
        "adam_step": [float(opt_state[i]["step"]) for i in sorted(opt_state)],
        "steps": state.steps.steps,
        "stats": {"rounds": ft.rounds, "retries": ft.retries, "heals": ft.heals, "served": ft.served,
                  "members": ft.members, "iter": state.iter, "buckets": state.buckets},
    }
    state.close()
    ft.close()
    dist.destroy_process_group()
    return out


def main(argv: Optional[list[str]] = None) -> None:
    ap = worker_parser()
    add_hold(ap)
    ap.add_argument("--algorithm", choices=["allreduce", "bytegrad"], default="allreduce")
    args = ap.parse_args(argv)
    kind, _, at = args.die.partition(":")
    if kind == "exchange":
        die_at_average(int(at))
    out = train(args.index, args.coordinator, args.workers, args.steps, args.algorithm, args.step_s,
                int(at) if kind == "step" else 0, args.hold, args.hold_step,
                os.environ.get("BAGUA_TEST_RESTARTED") == "1")
    torch.save(out, args.out)


def forked(argv: list[str], log: str, restarted: bool) -> None:
    """:func:`main` in a process of the test harness's forkserver (torch already imported), output to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(fd, "w", buffering=1)
    os.environ["BAGUA_TEST_RESTARTED"] = "1" if restarted else "0"
    torch.set_num_threads(1)
    main(argv)


if __name__ == "__main__":
    main()
