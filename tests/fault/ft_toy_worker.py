"""One worker of a fault-tolerant job without DiLoCo: FaultTolerance as a communicator averaging known tensors.

tests/fault/test_bad_workers.py starts three. Worker ``i`` contributes ``y(i, r) = arange(6) * (i + 1) + r`` in
round ``r``; with ``--bad``, worker 2 contributes NaN in round 1, ``y * 1e6`` in round 2, its honest ``y`` in
round 3, claims 10**9 samples (the others 2) in round 4, and NaN again in round 5, whose average goes through
DiLoCo's compressed all-gather path (``OverMembers.compressed_average``, codec ``bf16``). Every round's result,
weights and the contributions left out are saved to ``--out``. With ``--robust HOW`` (a robust aggregation):
two rounds, worker 2 sending ``-2 * y`` (a lie within the norm bound) in round 1 and NaN in round 2.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch


def y(i: int, r: int) -> torch.Tensor:
    """What worker ``i`` contributes in round ``r`` when honest."""
    return torch.arange(6, dtype=torch.float32) * (i + 1) + r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--bad", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--robust", default=None)
    args = ap.parse_args()

    from bagua.torch_api.fault import FaultTolerance
    from bagua.torch_api.ops.diloco_exchange import OverMembers

    i, bad = args.index, args.bad and args.index == 2
    ft = FaultTolerance(args.coordinator, f"w{i}", workers=args.workers, heartbeat_s=0.1, stale_s=1.0,
                        timeout_s=60.0, exchange_timeout_s=20.0, prefix="toy", robust=args.robust)
    state = {"x": torch.zeros(1)}
    ft.register(lambda: dict(state), lambda s: state.update(s), settings="toy")
    ft.start_round(-1, -1)
    assert ft.should_commit()
    out = {}
    for r in range(1, 3 if args.robust else 6):
        if r == 4:
            ft.add_samples(10**9 if bad else 2)
        ft.count_step(1)
        t = y(i, r)
        if bad and args.robust:
            t.mul_(-2.0) if r == 1 else t.fill_(float("nan"))
        elif bad and r in (1, 5):
            t.fill_(float("nan"))
        elif bad and r == 2:
            t.mul_(1e6)
        rnd = ft.start_round(r, 0)
        if r == 5:
            OverMembers(ft, rnd).compressed_average(SimpleNamespace(delta=t, workspace=None, index=0), "bf16", 64,
                                                    error_feedback=False)
        else:
            ft.allreduce(t)
        out[r] = {"y": t, "weights": rnd.weights, "ok": ft.should_commit()}
    out["dropped"] = ft.dropped
    torch.save(out, args.out)
    ft.close()


if __name__ == "__main__":
    main()
