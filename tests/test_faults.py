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


# -- async model averaging: a peer killed with SIGKILL makes the survivor raise, naming it ---------------------


def _worker_async_peer_dies(rank, world_size, out_dir, how):
    import json
    import signal

    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.with_bagua([opt], AsyncModelAverageAlgorithm(sync_interval_ms=10))
    x = torch.randn(2, 4)
    started = None
    step = 0
    while started is None or time.monotonic() - started < 30.0:
        if step == 20:
            if rank == 1:
                with open(os.path.join(out_dir, "rank1.json"), "w") as f:
                    json.dump({"pid": os.getpid(), "killed_at": time.time()}, f)
                os.kill(os.getpid(), getattr(signal, how))  # dead (SIGKILL) or stuck for good (SIGSTOP)
            started = time.monotonic()
        try:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        except RuntimeError as exc:
            message = f"raised: {exc}"
            break
        time.sleep(0.005)
        step += 1
    else:
        message = "finished: trained alone for 30 s after the peer died"
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump({"at": time.time(), "message": message}, f)
    if how == "SIGSTOP":  # end the stuck peer, so the harness sees it gone
        with open(os.path.join(out_dir, "rank1.json")) as f:
            os.kill(json.load(f)["pid"], signal.SIGKILL)
    return message


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_async_survivor_raises_naming_the_dead_peer(tmp_path, how):
    import json

    from tests.harness import WorkerError

    # the harness gives up on rank 1 (killed, or stopped and then killed by rank 0); rank 0 reports through a file
    with pytest.raises(WorkerError, match="rank 1 exited with code -9"):
        run_workers(_worker_async_peer_dies, 2, str(tmp_path), how, env={"BAGUA_COMM_TIMEOUT_S": "5"}, timeout=120)
    for _ in range(100):  # rank 0 writes its message once its training forward has raised
        if (tmp_path / "rank0.json").exists():
            break
        time.sleep(0.2)
    report = json.loads((tmp_path / "rank0.json").read_text())
    message = report["message"]
    assert message.startswith("raised"), message
    assert "rank 0: async model averaging with peer rank(s) [1] failed" in message, message
    # within the communication timeout (5 s), plus a round and a step on a loaded 2-core machine (5 s)
    seconds = report["at"] - json.loads((tmp_path / "rank1.json").read_text())["killed_at"]
    assert seconds < 10.0, (seconds, message)
