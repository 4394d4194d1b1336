"""Workers that fail alone, each a job of 2 ranks holding the model sharded with FSDP2 (real FSDP2, gloo, CPU).

Each worker is started by ``bagua.distributed.run --nproc_per_node=2 --max_restarts=1`` (tests/fault/
ft_sharded_worker.py), its first rank in the quorums, each rank exchanging its shard with the same shard's ranks of
the other workers. The checks:

- without failures, 2 workers end with the weights of DiLoCo written plainly in this file on whole tensors (every
  worker starts from worker 0's weights, AdamW inner steps on the batches of both of its ranks, every ``H`` steps
  torch's Nesterov SGD on the global weights with the mean pseudo-gradient): FSDP2's reduce-scatter sums the two
  ranks' halves in another order than one backward over 8 samples, hence the tolerance;
- with a rank of one of 3 workers SIGKILLed during its inner steps or at the start of its shard's average (the other
  shard's exchange may have finished), its launcher restarts both ranks, they heal shard by shard from a live peer
  (with its Adam moments, which are DTensors there), the survivors never raise (the round is retried for every
  shard when one failed), and after the last synchronization all 3 workers hold the same weights, bit for bit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bagua.torch_api.fault.coordinator import start_coordinator
from tests.fault.ft_sharded_worker import model
from tests.sharded.common import batch

ROOT = Path(__file__).resolve().parents[2]
H, LR, MOMENTUM = 4, 0.7, 0.9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp_path: Path, workers: int, steps: int, extra: dict[int, list[str]],
         timeout_s: float = 150.0) -> list[list[dict]]:
    """Run ``workers`` jobs of 2 ranks to the end; return what each rank of each saved."""
    port = _free_port()
    coordinator = start_coordinator("127.0.0.1", port)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs, logs = [], []
    try:
        for i in range(workers):
            (tmp_path / f"w{i}").mkdir()
            logs.append(tmp_path / f"w{i}.log")
            cmd = [sys.executable, "-m", "bagua.distributed.run", "--standalone", "--nproc_per_node=2",
                   "--max_restarts=1", "--monitor_interval=0.1", "-m", "tests.fault.ft_sharded_worker",
                   "--coordinator", f"127.0.0.1:{port}", "--index", str(i), "--workers", str(workers),
                   "--steps", str(steps), "--sync-every", str(H), "--outer", f"{LR},{MOMENTUM}",
                   "--out", str(tmp_path / f"w{i}"), *extra.get(i, [])]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[-1].open("w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
        start = time.monotonic()
        while any(p.poll() is None for p in procs):
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"the job did not end within {timeout_s} s: " + _tails(logs))
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        coordinator.kill()
        coordinator.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0] * workers, f"exit codes {codes}: " + _tails(logs)
    return [[dict(torch.load(tmp_path / f"w{i}" / f"rank{r}.pt", weights_only=True), log=logs[i].read_text())
             for r in range(2)] for i in range(workers)]


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-25:]) for p in logs if p.exists())


def _plain_diloco(workers: int, steps: int) -> list[torch.Tensor]:
    """DiLoCo on whole tensors, no Bagua: the global weights after ``steps`` inner steps of every worker."""
    nets = [model(0) for _ in range(workers)]
    inners = [torch.optim.AdamW(n.parameters(), lr=0.01) for n in nets]
    global_ = [p.detach().clone() for p in nets[0].parameters()]
    outer = torch.optim.SGD(global_, lr=LR, momentum=MOMENTUM, nesterov=True)
    for step in range(1, steps + 1):
        for w, (net, inner) in enumerate(zip(nets, inners)):
            xs, ys = zip(*(batch(2 * w + r, step) for r in range(2)))
            inner.zero_grad()
            torch.nn.functional.mse_loss(net(torch.cat(xs)), torch.cat(ys)).backward()
            inner.step()
        if step % H == 0:
            with torch.no_grad():
                for k, g in enumerate(global_):
                    g.grad = sum(g - list(n.parameters())[k] for n in nets) / workers
                outer.step()
                for net in nets:
                    for p, g in zip(net.parameters(), global_):
                        p.copy_(g)
    return global_


def test_sharded_workers_without_failures_equal_plain_diloco(tmp_path):
    steps = 12
    results = _job(tmp_path, 2, steps, {})
    reference = _plain_diloco(2, steps)
    for worker in results:
        for r in worker:
            assert r["steps"] == steps and r["syncs"] == steps // H
            assert r["stats"]["rounds"] == 1 + steps // H and r["stats"]["retries"] == 0
            assert r["stats"]["members"] == ["w0", "w1"]
            for a, b in zip(r["full"], reference):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][0]["full"], results[1][0]["full"]):  # the workers agree exactly
        assert torch.equal(a, b)


@pytest.mark.parametrize("die", ["inner:7", "exchange:2"])
def test_killed_rank_restarts_its_worker_which_heals_shard_by_shard(tmp_path, die):
    steps, victim = 48, 2
    # the survivors wait before the second-last round until the restarted worker arrives at its first quorum: a
    # restart can take longer than the survivors' remaining steps on a loaded machine, and one that finds the job
    # ended raises
    held = ["--step-s", "0.02", "--inner-state", "--hold", str(tmp_path), "--hold-step", str(steps - 2 * H + 1)]
    results = _job(tmp_path, 3, steps, {i: held + (["--die", die] if i == victim else []) for i in range(3)})
    for worker in results:
        for r in worker:
            assert r["steps"] == steps and r["syncs"] == results[0][0]["syncs"]
        for a, b in zip(worker[0]["full"], results[0][0]["full"]):
            assert torch.equal(a, b), "the workers' weights differ after the last synchronization"
        assert all(torch.isfinite(a).all() for a in worker[0]["full"])
    for r in results[victim]:
        assert r["stats"]["restart"] == 1 and r["stats"]["heals"] >= 1, r["log"][-3000:]
    survivors = [r for i in range(3) if i != victim for r in results[i]]
    assert all(r["stats"]["restart"] == 0 for r in survivors)
    if die.startswith("exchange"):  # a shard's exchange failed: the survivors ran the round again, every shard
        assert all(r["stats"]["retries"] >= 1 for r in survivors), [r["stats"] for r in survivors]
    assert all(r["stats"]["members"] == ["w0", "w1", "w2"] for w in results for r in w)
