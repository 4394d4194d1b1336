"""One worker of a fault-tolerant DiLoCo job: tests/fault/test_quorum.py starts, kills, stops and restarts it.

``--die inner:S`` SIGKILLs this process before its inner step S, ``--die exchange:N`` at the start of its N-th
average (the quorum closed, the peers already in the allreduce), ``--die serve`` as it sends the first bucket of a
state to a joiner; ``--stall S`` SIGSTOPs it before step S (the test sends SIGCONT). At the end it saves its
global weights, weights, counters and statistics to ``--out``. ``--api algorithm`` trains through ``with_bagua`` and
``DiLoCoAlgorithm(fault_tolerance=...)`` (a single-process Bagua job per worker) instead of ``DiLoCoOptimizer``.
``--hold DIR``: a restarted worker (``BAGUA_TEST_RESTARTED=1``) writes ``DIR/arrived`` before its first step, the others
wait for it before their step ``--hold-step`` (a loaded machine may take longer to restart a worker than the job to
end). ``--poison nan`` / ``--poison x1e6`` makes every pseudo-gradient it contributes NaN / a million times its own (a
bad worker), ``--poison nan-once`` only its first; the job's secret, if any, comes from the environment (``BAGUA_JOB_SECRET_FILE``).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Optional

import torch

from tests.torch_api.models import batch, make_model


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def worker_parser() -> argparse.ArgumentParser:
    """The arguments every fault-test worker takes (this one's, and tests/fault/ft_sharded_worker.py's)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.0)
    ap.add_argument("--die", default="")
    ap.add_argument("--out", required=True)
    return ap


def add_hold(ap: argparse.ArgumentParser, step: int = 10) -> None:
    """The arguments of :class:`Hold`: ``--hold DIR`` and ``--hold-step S`` (``step`` by default)."""
    ap.add_argument("--hold", default="")
    ap.add_argument("--hold-step", type=int, default=step)


class Hold:
    """``--hold DIR``: a restarted worker says it is back (``DIR/arrived``); the others wait for that before their
    step ``--hold-step``, so a slow restart still finds the job running. ``at_quorum``: it says so as it arrives at
    its first quorum (a DiLoCo worker joins while it is built) rather than at once; ``writes=False``: this process
    only waits (a rank other than its worker's first); ``restarted``: whether this process is the restarted one
    (``BAGUA_TEST_RESTARTED=1`` when not given). ``args`` holds ``hold`` and ``hold_step`` (:func:`add_hold`)."""

    def __init__(self, args: argparse.Namespace, at_quorum: bool = False, writes: bool = True,
                 restarted: Optional[bool] = None) -> None:
        self.restarted = os.environ.get("BAGUA_TEST_RESTARTED") == "1" if restarted is None else restarted
        self.arrived = os.path.join(args.hold, "arrived") if args.hold else ""
        self.step = args.hold_step
        if not (self.arrived and self.restarted and writes):
            return
        if not at_quorum:
            open(self.arrived, "w").close()
            return
        from bagua.torch_api.fault import FaultTolerance

        agree, arrived = FaultTolerance.agree, self.arrived

        def announcing(ft, *a, **k):
            open(arrived, "w").close()
            return agree(ft, *a, **k)

        FaultTolerance.agree = announcing

    def before(self, step: int) -> None:
        """Wait, before ``step``, for the restarted worker if it is due and not back yet."""
        while self.arrived and step >= self.step and not os.path.exists(self.arrived):
            time.sleep(0.05)


def die_at_average(n: int) -> None:
    """SIGKILL this process at the start of its ``n``-th fault-tolerant average (the quorum closed, the peers
    already in the exchange): its ``n``-th collective over a round's members (one per averaging round)."""
    from bagua.torch_api.fault import FaultTolerance

    calls = [0]

    def dying(collective):
        def call(self, *a, **k):
            calls[0] += 1
            if calls[0] == n:
                _die()
            return collective(self, *a, **k)

        return call

    FaultTolerance.allreduce = dying(FaultTolerance.allreduce)
    FaultTolerance.allgather = dying(FaultTolerance.allgather)


def poison(kind: str) -> None:
    """Make every pseudo-gradient this worker contributes NaN (``"nan"``) or a million times its own
    (``"x1e6"``); ``"nan-once"``: only the first NaN."""
    from bagua.torch_api.ops.diloco import Fragment

    honest = Fragment.pseudo_gradient
    calls = [0]

    def bad(self):
        delta = honest(self)
        calls[0] += 1
        if kind == "nan-once":
            return delta.fill_(float("nan")) if calls[0] == 1 else delta
        return delta.fill_(float("nan")) if kind == "nan" else delta.mul_(1e6)

    Fragment.pseudo_gradient = bad


def main() -> None:
    ap = worker_parser()
    add_hold(ap)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--min-quorum", type=int, default=1)
    ap.add_argument("--stall", type=int, default=0)
    ap.add_argument("--api", choices=["optimizer", "algorithm"], default="optimizer")
    ap.add_argument("--compression", default="none")
    ap.add_argument("--outer", default="auto", help='"auto", or "LR,MOMENTUM" (no warm-up)')
    ap.add_argument("--poison", choices=["", "nan", "nan-once", "x1e6"], default="")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    if args.poison:
        poison(args.poison)
    outer = {} if args.outer == "auto" else dict(zip(("outer_lr", "outer_momentum"), map(float, args.outer.split(","))))

    from bagua.torch_api.contrib.diloco_optimizer import DiLoCoOptimizer
    from bagua.torch_api.fault import FaultTolerance, transfer

    kind, _, at = args.die.partition(":")
    if kind == "exchange":
        die_at_average(int(at))
    elif kind == "serve":
        transfer._before_bucket_send = lambda k, bucket: _die()

    if args.api == "algorithm":
        import bagua.torch_api as bagua

        bagua.init_process_group()  # no launcher: a job of one process
    ft = FaultTolerance(args.coordinator, worker=f"w{args.index}", workers=args.workers,
                        min_quorum=args.min_quorum, deadline_s=None, exchange_timeout_s=5.0, heartbeat_s=0.2,
                        stale_s=1.5, timeout_s=args.timeout_s)
    hold = Hold(args, at_quorum=True)
    model = make_model(args.index)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    if args.api == "algorithm":
        from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

        model = model.with_bagua([inner], DiLoCoAlgorithm(sync_every=args.sync_every, fragments=args.fragments,
                                                          compression=args.compression, fault_tolerance=ft,
                                                          **outer))
        opt, d = inner, model.bagua_ddp.impl.driver
    else:
        opt = DiLoCoOptimizer(inner, sync_every=args.sync_every, fragments=args.fragments,
                              compression=args.compression, fault_tolerance=ft, **outer)
        d = opt.driver
    while d.steps < args.steps:
        step = d.steps + 1
        if kind == "inner" and step == int(at) and not hold.restarted:
            _die()
        hold.before(step)
        if args.stall and step == args.stall:
            os.kill(os.getpid(), signal.SIGSTOP)
        x, y = batch(args.index, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        rounds = ft.rounds
        opt.step()
        if ft.rounds != rounds:
            print(f"round {ft.rounds} done", flush=True)
        if args.step_s:
            time.sleep(args.step_s)
    torch.save({
        "global": [f.global_.clone() for f in d.fragments],
        "params": [p.detach().clone() for p in model.parameters()],
        "steps": d.steps, "syncs": d.syncs,
        "residuals": {f.index: f.workspace.residual.clone() for f in d.fragments
                      if getattr(f.workspace, "residual", None) is not None},
        "stats": {"rounds": ft.rounds, "retries": ft.retries, "heals": ft.heals, "served": ft.served,
                  "left_out": ft.left_out, "members": ft.members, "dropped": ft.dropped,
                  "refused": ft.quorums.records.refused},
    }, args.out)
    ft.close()


if __name__ == "__main__":
    main()
