"""Torch DDP that outlives a dead replica: ``FaultTolerantHookState`` and ``fault_tolerant_hook``.

Every worker is a process of its own whose DDP world has size 1 (tests/fault/ft_ddp_worker.py, with DDP buckets
small enough that a step has several), started from the test harness's forkserver (torch imported once: quick to
start), with a real coordinator:

- without failures, 3 workers of the float32 hook end with the weights of plain maths written in
  tests/fault/test_sync_workers.py (the first worker's initial weights, each step the mean of the workers'
  gradients, AdamW), within 1e-5; the ByteGrad hook (``uint8``, error feedback) averages one step within the
  codec's bound of the plain mean;
- a worker SIGKILLed at the start of an exchange (its peers already in it), then restarted: the survivors never
  raise (they run the step again without it), the restarted worker heals from a peer (weights, step, AdamW's
  state) and joins at a step boundary, and all three end with bit-identical weights and optimizer state;
- what the state refuses, before anything is built, and what the message says to do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from bagua.torch_api.contrib.ddp_fault import FaultTolerantHookState
from bagua.torch_api.fault import FaultTolerance
from tests.fault.jobs import run_job
from tests.fault.test_sync_workers import _identical, _plain_training, _within_uint8_bound
from tests.harness import _CTX, run_workers
from tests.torch_api.models import make_model


class _Forked:
    """A worker process of the test harness's forkserver (torch already imported: quick to start, also when
    restarted), seen as the ``subprocess.Popen`` that :func:`~tests.fault.jobs.run_job` polls."""

    def __init__(self, argv: list[str], log: Path, restarted: bool) -> None:
        from tests.fault.ft_ddp_worker import forked

        self.proc = _CTX.Process(target=forked, args=(argv, str(log), restarted), daemon=True)
        self.proc.start()

    def poll(self) -> Optional[int]:
        return self.proc.exitcode

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.proc.pid is not None and self.proc.exitcode is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.proc.kill()


def _job(tmp_path: Path, steps: int, common: list[str], extra: dict[int, list[str]]) -> list[dict]:
    """Run 3 DDP workers; restart (once, without its ``--die``) a worker that was SIGKILLed."""
    def spawn(i: int, port: int, out: Path, log: Path, again: bool) -> Any:
        argv = ["--coordinator", f"127.0.0.1:{port}", "--index", str(i), "--workers", "3", "--steps", str(steps),
                "--out", str(out), *common, *([] if again else extra.get(i, []))]
        return _Forked(argv, log, again)

    return run_job(tmp_path, 3, spawn, timeout_s=120.0)[0]


def _train(rank: int, world: int, coordinator: str, steps: int, algorithm: str) -> dict:
    from tests.fault.ft_ddp_worker import train

    return train(rank, coordinator, world, steps, algorithm)


def _no_failures(coordinator: str, steps: int, algorithm: str) -> list[dict]:
    """3 workers as processes of the test harness (torch already imported: quick to start), each a torch world of
    its own (``init_bagua=False``)."""
    return run_workers(_train, 3, coordinator, steps, algorithm, init_bagua=False, timeout=120)


def test_allreduce_hook_without_failures_equals_plain_maths(coordinator):
    steps = 4
    results = _no_failures(coordinator, steps, "allreduce")
    _identical(results, steps)
    reference = _plain_training(3, steps)
    for got, want in zip(results[0]["params"], reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert all(r["stats"]["retries"] == 0 and r["stats"]["iter"] == steps for r in results)
    assert all(r["stats"]["buckets"] > steps for r in results)  # DDP handed over several buckets a step


def test_bytegrad_hook_step_within_the_codec_bound(coordinator):
    results = _no_failures(coordinator, 1, "bytegrad")
    _identical(results, 1)
    _within_uint8_bound(results[0]["grads"], 3)


def test_replica_killed_mid_exchange_and_restarted(tmp_path):
    steps = 12
    results = _job(tmp_path, steps, ["--step-s", "0.05", "--hold", str(tmp_path), "--hold-step", "6"],
                   {1: ["--die", "exchange:4"]})
    _identical(results, steps)
    survivors = [results[0], results[2]]
    assert all(r["stats"]["retries"] >= 1 for r in survivors), [r["stats"] for r in results]
    assert results[1]["stats"]["heals"] >= 1, results[1]["stats"]
    assert all(r["stats"]["members"] == ["w0", "w1", "w2"] for r in results), [r["stats"] for r in results]


def _refusals(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    ft = object.__new__(FaultTolerance)  # only its type is checked: no coordinator
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alone = [dist.new_group([r]) for r in range(world)][rank]
    messages = []
    for ddp, kwargs in [(model, {}),
                        (torch.nn.parallel.DistributedDataParallel(make_model(0)), {}),
                        (torch.nn.parallel.DistributedDataParallel(model, process_group=alone), {"codec": "chunk"}),
                        (torch.nn.parallel.DistributedDataParallel(model, process_group=alone),
                         {"error_feedback": True})]:
        try:
            FaultTolerantHookState(ft, ddp, opt, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_state_says_what_to_use():
    with pytest.raises(ValueError, match="takes a bagua.torch_api.fault.FaultTolerance"):
        FaultTolerantHookState("127.0.0.1:29600", None, None)  # type: ignore[arg-type]
    for messages in run_workers(_refusals, 2, timeout=120):
        assert len(messages) == 4, messages
        assert "DistributedDataParallel module" in messages[0]
        assert "has 2 ranks" in messages[1] and "world_size=1" in messages[1]
        assert "codec='uint8'" in messages[2]
        assert "error_feedback=False" in messages[3]
