"""What a robust average costs against the plain one, and what the screen for bad contributions costs.

Members of a fault-tolerant round (``FaultTolerance``, each a thread of this process, on loopback gloo, one
coordinator process) average ``--numel`` float32 values ``--rounds`` times with each aggregation: the plain
weighted average (a ring allreduce), ``robust="trimmed_mean"`` and ``robust="median"`` (an all-gather, then the
coordinate-wise statistic on every member). It prints, per aggregation, the bytes one member sends (formulas of
bagua.torch_api.ops.diloco_exchange and bagua.torch_api.fault.robust) and the median time of an ``allreduce``
(which includes the screen's all-gather of one norm per member), and the median time of the screen alone.

    .venv/bin/python benchmarks/fault/robust_cost.py --members 3 --numel 1000000 --rounds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--numel", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)

    import logging

    import torch

    from bagua.torch_api.fault import FaultTolerance
    from bagua.torch_api.fault.coordinator import start_coordinator
    from bagua.torch_api.fault.robust import robust_allgather_bytes
    from bagua.torch_api.ops.diloco_exchange import float32_allreduce_bytes

    logging.disable(logging.WARNING)  # the open-job warning, once per member
    torch.set_num_threads(1)
    port = 29000 + os.getpid() % 2000
    coordinator = start_coordinator("127.0.0.1", port)
    n = args.members

    def member(i: int, robust) -> tuple[list[float], list[float]]:
        ft = FaultTolerance(f"127.0.0.1:{port}", f"w{i}", workers=n, heartbeat_s=0.2, stale_s=2.0, timeout_s=60.0,
                            exchange_timeout_s=60.0, prefix=f"cost-{robust}", robust=robust)
        ft.register(dict, lambda s: None, settings="cost")
        ft.start_round(-1, -1)
        ft.should_commit()
        times, screens = [], []
        x = torch.randn(args.numel, generator=torch.Generator().manual_seed(i))
        for r in range(args.rounds):
            ft.count_step(1)
            ft.start_round(r, 0)
            t0 = time.perf_counter()
            ft.screen(x)
            screens.append(time.perf_counter() - t0)
            y = x.clone()
            t0 = time.perf_counter()
            ft.allreduce(y)
            times.append(time.perf_counter() - t0)
            ft.should_commit()
        ft.close()
        return times, screens

    try:
        print(f"{n} members, {args.numel} float32 values, {args.rounds} rounds, loopback")
        print(f"{'aggregation':>14} {'bytes sent/member':>18} {'allreduce ms':>13} {'screen ms':>10}")
        for robust in (None, "trimmed_mean", "median"):
            with ThreadPoolExecutor(n) as pool:
                results = list(pool.map(lambda i: member(i, robust), range(n)))
            sent = (float32_allreduce_bytes(args.numel, n) if robust is None
                    else robust_allgather_bytes(args.numel, n))
            ms = 1e3 * statistics.median(results[0][0])
            screen_ms = 1e3 * statistics.median(results[0][1])
            print(f"{robust or 'plain average':>14} {sent:>18,} {ms:>13.1f} {screen_ms:>10.2f}")
    finally:
        coordinator.kill()
        coordinator.wait()


if __name__ == "__main__":
    main()
