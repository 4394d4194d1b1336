"""Synchronous jobs that outlive a dead replica: gradient allreduce and ByteGrad with ``fault_tolerance=``.

Every worker is a process of its own (a one-process Bagua job, ``with_bagua``), with a real coordinator:

- without failures, 2 workers of ``GradientAllReduceAlgorithm(fault_tolerance=...)`` end with the weights of
  plain maths written here (the first worker's initial weights, each step the mean of the two workers' gradients,
  AdamW), within 1e-5 (the allreduce sums in another order than ``torch.stack(...).mean``); ByteGrad (``uint8``,
  error feedback) averages one step within the codec's bound of the plain mean;
- a worker SIGKILLed at the start of an exchange (its peers already in it), then restarted: the survivors never
  raise (they run the step again without it), the restarted worker heals from a peer (weights, step, AdamW's
  state) and joins at a step boundary, and all three end with bit-identical weights and optimizer state.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.fault.jobs import python_module, run_job
from tests.torch_api.models import batch, make_model


def _spawn(i: int, port: int, workers: int, steps: int, out: Path, extra: list[str], log: Path,
           restarted: bool = False) -> subprocess.Popen:
    return python_module("tests.fault.ft_sync_worker", [
        "--coordinator", f"127.0.0.1:{port}", "--index", str(i), "--workers", str(workers), "--steps", str(steps),
        "--out", str(out), *extra], log, BAGUA_TEST_RESTARTED="1" if restarted else "0")


def _job(tmp_path: Path, workers: int, steps: int, extra: dict[int, list[str]], common: list[str],
         timeout_s: float = 240.0) -> list[dict]:
    """Run the job; restart (once, without its ``--die``) a worker that was SIGKILLed; return what each saved."""
    def spawn(i: int, port: int, out: Path, log: Path, again: bool) -> subprocess.Popen:
        return _spawn(i, port, workers, steps, out, common + ([] if again else extra.get(i, [])), log, again)

    return run_job(tmp_path, workers, spawn, timeout_s=timeout_s)[0]


def _plain_grads(model: torch.nn.Module, workers: int, step: int) -> list[list[torch.Tensor]]:
    """Each worker's gradients at ``model``'s weights on its own batch of ``step``."""
    out = []
    for i in range(workers):
        model.zero_grad()
        x, y = batch(i, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _plain_training(workers: int, steps: int, lr: float = 0.01) -> list[torch.Tensor]:
    """The job without faults, in plain maths: worker 0's initial weights, the mean gradient, AdamW."""
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(1, steps + 1):
        grads = _plain_grads(model, workers, step)
        for k, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[k] for g in grads]).mean(0)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _within_uint8_bound(got: list[torch.Tensor], workers: int) -> None:
    """Check one ByteGrad step's averaged gradients ``got`` (``uint8``, error feedback, from ``make_model(0)``)
    against the plain mean of ``workers`` workers' gradients: within the codec's bound, not equal to it."""
    grads = _plain_grads(make_model(0), workers, 1)
    flat = [torch.cat([g.reshape(-1) for g in w]) for w in grads]  # one block: the model has < 4096 values
    mean = torch.stack(flat).mean(0)
    bound = sum((f.max() - f.min()) / (2 * 255) for f in flat) / workers + 1e-5  # half a level per worker, averaged
    flat_got = torch.cat([g.reshape(-1) for g in got])
    assert (flat_got - mean).abs().max() <= bound
    assert not torch.equal(flat_got, mean)  # it did travel in 8 bits


def _identical(results: list[dict], steps: int) -> None:
    ref = results[0]
    for r in results[1:]:
        assert r["steps"] == steps
        assert all(torch.equal(a, b) for a, b in zip(ref["params"], r["params"])), "the workers' weights differ"
        assert all(torch.equal(a, b) for a, b in zip(ref["exp_avg"], r["exp_avg"])), "AdamW's moments differ"
        assert r["adam_step"] == ref["adam_step"]
    assert all(torch.isfinite(p).all() for p in ref["params"])


def test_allreduce_without_failures_equals_plain_maths(tmp_path):
    steps = 8
    results = _job(tmp_path, 2, steps, {}, [])
    _identical(results, steps)
    reference = _plain_training(2, steps)
    for got, want in zip(results[0]["params"], reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert all(r["stats"]["retries"] == 0 for r in results)


def test_bytegrad_step_within_the_codec_bound(tmp_path):
    results = _job(tmp_path, 2, 1, {}, ["--algorithm", "bytegrad"])
    _identical(results, 1)
    _within_uint8_bound(results[0]["grads"], 2)


@pytest.mark.parametrize("algorithm", ["allreduce", "bytegrad"])
def test_replica_killed_mid_exchange_and_restarted(tmp_path, algorithm):
    steps = 24
    results = _job(tmp_path, 3, steps, {1: ["--die", "exchange:6"]},
                   ["--step-s", "0.1", "--algorithm", algorithm, "--hold", str(tmp_path)])
    _identical(results, steps)
    survivors = [results[0], results[2]]
    assert all(r["stats"]["retries"] >= 1 for r in survivors), [r["stats"] for r in results]
    assert results[1]["stats"]["heals"] >= 1, results[1]["stats"]
    assert all(r["stats"]["members"] == ["w0", "w1", "w2"] for r in results), [r["stats"] for r in results]
