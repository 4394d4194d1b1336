"""Run by tests/test_clean_exit.py: one rank of a job that rendezvouses through a ``FileStore`` (no ports), trains a
few steps of ALGORITHM (or only initializes: ``none``; or trains torch's own DDP model: ``torch_ddp``) and exits,
then reports how it exited.

Usage: exit_checked.py ALGORITHM RANK NPROC FOLDER [--no-shutdown]

The last exit handler to run (registered first) writes ``FOLDER/exit-RANK.json``: whether ``torch.distributed``
was still initialized, and the process's native threads then against those before ``init_process_group``. A
process group left to the interpreter's final teardown keeps gloo's threads alive there, and one of them finishing
a collective while the interpreter is finalizing aborts the process ("terminate called without an active
exception") in a third to a half of the runs: Bagua's exit handler must have destroyed every group and joined
their threads before that point, which this report shows in every run. ``--no-shutdown`` unregisters Bagua's exit
handler, to see the report (and the aborts) without it.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

import torch
import torch.distributed as dist

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm
from bagua.torch_api.comm import lifecycle


def _threads() -> list[str]:
    """The names of this process's native threads (Linux)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


name, rank, nproc, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
baseline = _threads()


@atexit.register  # registered first, so it runs last: after Bagua's handler
def _report() -> None:
    with open(os.path.join(folder, f"exit-{rank}.json"), "w") as f:
        json.dump({"initialized": dist.is_initialized(), "baseline": baseline, "threads": _threads()}, f)


torch.set_num_threads(1)
store = dist.FileStore(os.path.join(folder, "store"), nproc)
bagua.init_process_group(store=store, rank=rank, world_size=nproc, local_world_size=nproc)
if "--no-shutdown" in sys.argv[5:]:
    atexit.unregister(lifecycle._shutdown)
if name != "none":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if name == "torch_ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)  # torch's own, in a Bagua job
    else:
        kwargs = {"async": {"sync_interval_ms": 5}}.get(name, {})
        model = model.with_bagua([opt], Algorithm.init(name, **kwargs))
    for step in range(10):
        opt.zero_grad()
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
    if name == "async":
        # every rank that stops training calls abort (documented): a peer that disappears without it is a dead
        # peer to the others, whose next forward raises
        model.bagua_algorithm.abort(model)
with open(os.path.join(folder, f"done-{rank}"), "w") as f:
    f.write("done")
