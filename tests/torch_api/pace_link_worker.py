"""One rank of tests/torch_api/test_diloco_pace.py's shaped-link test, started on an emulated host.

Trains a 1 MB model with ``DiLoCoOptimizer(sync_every=4, sync_every_max=16)`` (each inner step padded to about
30 ms of compute) for ``--rounds`` outer steps; rank 0 writes the outer steps taken to ``--progress`` after each
(the test shapes the link from it), and every rank saves its round records' ``sync_every`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import bagua.torch_api as bagua
    from bagua.torch_api.contrib import DiLoCoOptimizer

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Linear(500, 500)  # 250,500 parameters: 1 MB per exchange
    opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), sync_every=4, sync_every_max=16,
                          max_exchange_share=0.3)
    step = 0
    while opt.syncs < args.rounds:
        step += 1
        x = torch.randn(8, 500, generator=torch.Generator().manual_seed(rank * 1000 + step))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        time.sleep(0.03)
        syncs = opt.syncs
        opt.step()
        if rank == 0 and opt.syncs > syncs:
            with open(args.progress + ".tmp", "w") as f:
                f.write(str(opt.syncs))
            os.replace(args.progress + ".tmp", args.progress)
    records = [(r.sync_every, r.exchange_s) for r in opt.driver.records]
    opt.close()
    with open(args.out, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main()
