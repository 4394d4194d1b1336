"""Synchronous jobs on FSDP2-sharded replicas that outlive a dead replica (real FSDP2, gloo, CPU, real coordinator).

Each replica is a job of 2 ranks of its own (tests/fault/ft_sync_sharded_worker.py; its ranks rendezvous through a
``FileStore`` of the replica's), the model ``fully_shard``-ed over them, ``GradientAllReduceAlgorithm`` or
``ByteGradAlgorithm`` with ``fault_tolerance=`` through ``with_bagua(..., device_mesh=(1, 2))``. The checks:

- without failures, 2 replicas x 2 shards end with the weights of plain HSDP maths written here on whole tensors
  (replica 0's initial weights, each step the mean of the 4 ranks' gradients, AdamW), within 1e-5 (FSDP2's
  reduce-scatter and the allreduce sum in another order than ``torch.stack(...).mean``);
- with gradient allreduce, and with ``ByteGradAlgorithm(codec="uint8", error_feedback=True)``, rank 1 of one of 2
  replicas SIGKILLed at the start of a step's exchange (rank 0 may have finished its shard's): the test kills the
  replica's other rank and restarts both, as a launcher does; the survivor never raises (it runs the step again
  alone, for every shard), the restarted replica heals shard by shard (weights, step and AdamW's state) from the
  live one and joins at a step boundary, and both end with bit-identical weights and moments.

Each job is about 12 s of training; on a loaded machine starting its 7 processes (torch imports) takes longer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bagua.torch_api.fault.coordinator import start_coordinator
from tests.fault.ft_sharded_worker import model
from tests.fault.test_quorum import _free_port, _tails
from tests.sharded.common import batch

ROOT = Path(__file__).resolve().parents[2]
SHARDS = 2


def _spawn(i: int, attempt: int, port: int, workers: int, steps: int, tmp_path: Path, extra: list[str],
           log: Path) -> list[subprocess.Popen]:
    """Start replica ``i``'s ranks (a job of its own, rendezvousing through a fresh ``FileStore``)."""
    cmd = [sys.executable, "-m", "tests.fault.ft_sync_sharded_worker", "--coordinator", f"127.0.0.1:{port}",
           "--index", str(i), "--workers", str(workers), "--steps", str(steps), "--out", str(tmp_path / f"w{i}"),
           "--store", str(tmp_path / f"store{i}.{attempt}"), *extra]
    procs = []
    for r in range(SHARDS):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(SHARDS), LOCAL_WORLD_SIZE=str(SHARDS),
                   BAGUA_TEST_RESTARTED="1" if attempt else "0")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT))
    return procs


def _job(tmp_path: Path, workers: int, steps: int, extra: dict[int, list[str]], common: list[str],
         timeout_s: float = 300.0) -> list[list[dict]]:
    """Run ``workers`` replicas to the end; when a rank of one is SIGKILLed, kill its other rank and restart the
    replica once, without its ``--die``; return what each rank of each replica saved."""
    port = _free_port()
    coordinator = start_coordinator("127.0.0.1", port)
    logs = [tmp_path / f"w{i}.log" for i in range(workers)]
    for i in range(workers):
        (tmp_path / f"w{i}").mkdir()
    replicas = {i: _spawn(i, 0, port, workers, steps, tmp_path, common + extra.get(i, []), logs[i])
                for i in range(workers)}
    restarted: set[int] = set()
    start = time.monotonic()
    try:
        while any(p.poll() is None for procs in replicas.values() for p in procs):
            for i, procs in replicas.items():
                if i not in restarted and any(p.poll() == -signal.SIGKILL for p in procs):
                    restarted.add(i)
                    for p in procs:
                        p.kill()
                        p.wait()
                    replicas[i] = _spawn(i, 1, port, workers, steps, tmp_path, common, logs[i])
            if time.monotonic() - start > timeout_s:
                for p in (p for procs in replicas.values() for p in procs if p.poll() is None):
                    p.send_signal(signal.SIGUSR1)  # each rank writes its threads' stacks to its log
                time.sleep(1.0)
                raise AssertionError(f"the job did not end within {timeout_s} s: " + _tails(logs))
            time.sleep(0.05)
    finally:
        for procs in replicas.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        coordinator.kill()
        coordinator.wait()
    codes = {i: [p.returncode for p in procs] for i, procs in replicas.items()}
    assert all(c == 0 for cs in codes.values() for c in cs), f"exit codes {codes}: " + _tails(logs)
    return [[dict(torch.load(tmp_path / f"w{i}" / f"rank{r}.pt", weights_only=True), log=logs[i].read_text())
             for r in range(SHARDS)] for i in range(workers)]


def _plain_hsdp(replicas: int, steps: int, lr: float = 0.01) -> list[torch.Tensor]:
    """The job without faults on whole tensors, no Bagua, no FSDP2: replica 0's initial weights, each step the mean
    of every rank's gradient on its own batch, AdamW."""
    net = model(0)
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    for step in range(1, steps + 1):
        grads = []
        for k in range(replicas * SHARDS):  # replica i's rank r trains on batch 2 * i + r
            net.zero_grad()
            x, y = batch(k, step)
            torch.nn.functional.mse_loss(net(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for j, p in enumerate(net.parameters()):
            p.grad = torch.stack([g[j] for g in grads]).mean(0)
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _identical(results: list[list[dict]], steps: int) -> None:
    ref = results[0]
    for replica in results:
        for r, got in enumerate(replica):
            assert got["steps"] == steps
            assert all(torch.equal(a, b) for a, b in zip(ref[0]["full"], got["full"])), "the weights differ"
            assert all(torch.equal(a, b) for a, b in zip(ref[r]["exp_avg"], got["exp_avg"])), "AdamW's moments differ"
            assert got["adam_step"] == ref[r]["adam_step"]
    assert all(torch.isfinite(p).all() for p in ref[0]["full"])


def test_sharded_allreduce_without_failures_equals_plain_hsdp(tmp_path):
    steps = 6
    results = _job(tmp_path, 2, steps, {}, [])
    _identical(results, steps)
    for got, want in zip(results[0][0]["full"], _plain_hsdp(2, steps)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for replica in results:
        for r in replica:
            assert r["stats"]["retries"] == 0 and r["stats"]["members"] == ["w0", "w1"], r["stats"]
            assert r["stats"]["rounds"] == 1 + steps  # the job's start, then one round per step


@pytest.mark.parametrize("algorithm", ["allreduce", "bytegrad"])
def test_sharded_replica_killed_mid_exchange_and_restarted(tmp_path, algorithm):
    steps, victim = 12, 1
    results = _job(tmp_path, 2, steps, {victim: ["--die", "exchange:3"]},
                   ["--algorithm", algorithm, "--step-s", "0.05", "--hold", str(tmp_path)])
    _identical(results, steps)
    survivor = results[1 - victim]
    assert all(not r["stats"]["restarted"] and r["stats"]["retries"] >= 1 for r in survivor), \
        [r["stats"] for r in survivor]
    assert all(r["stats"]["restarted"] and r["stats"]["heals"] >= 1 for r in results[victim]), \
        [r["stats"] for r in results[victim]]
    assert all(r["stats"]["members"] == ["w0", "w1"] for replica in results for r in replica)
