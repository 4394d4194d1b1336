"""Fault injection on the training engine: what survives and what the user sees.

(Cache-store faults — Redis stopped mid-epoch, corrupt entries, a full LMDB — are in tests/contrib.)
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.harness import run_workers


def _worker_raise_in_forward(rank, world_size):
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    x = torch.randn(2, 4)
    for step in range(3):
        opt.zero_grad()
        if rank == 1 and step == 1:
            os._exit(3)  # the user's forward raised and the process died
        start = time.monotonic()
        try:
            model(x).sum().backward()
        except RuntimeError as exc:
            return f"step {step} after {time.monotonic() - start:.1f}s: {exc}"
        opt.step()
    return "finished"


def _worker_report_only_survivor(rank, world_size, out_dir):
    message = _worker_raise_in_forward(rank, world_size)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(message)
    return message


def test_survivor_sees_bucket_rank_and_timeout_hint(tmp_path):
    from tests.harness import WorkerError

    with pytest.raises(WorkerError, match="rank 1 exited with code 3"):
        run_workers(_worker_report_only_survivor, 2, str(tmp_path), env={"BAGUA_COMM_TIMEOUT_S": "20"}, timeout=90)
    for _ in range(100):  # rank 0 writes its message once its backward has failed
        if (tmp_path / "rank0.txt").exists():
            break
        time.sleep(0.2)
    message = (tmp_path / "rank0.txt").read_text()
    assert message.startswith("step 1"), message
    assert "rank 0" in message and "bucket '0'" in message and "BAGUA_COMM_TIMEOUT_S" in message, message
