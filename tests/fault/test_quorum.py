"""Workers that fail alone: 3 DiLoCo workers, each a process of its own, a coordinator, kills and stalls.

Every worker is started as a separate process (no torch world in common), as separate launcher jobs would be. The
checks read what each worker saved at the end:

- without failures, the global weights equal plain ``DiLoCoOptimizer`` in one 3-rank torch world, bit for bit;
- with a worker SIGKILLed during its inner steps, at the start of an exchange (its peers already in the allreduce)
  or while it heals another, and restarted: the survivors finish every round without raising, the restarted worker
  heals from a peer, and after the last synchronization all three hold the same global weights, bit for bit;
- a worker SIGSTOPped past the deadline is left out, then readmitted (it heals) after SIGCONT;
- a coordinator that dies gives every worker a clear error, never a hang;
- the same through ``with_bagua`` and ``DiLoCoAlgorithm(fault_tolerance=...)`` (each worker a one-process Bagua
  job): bit for bit the same weights without failures;
- compressed (uint4, error feedback): one round within the codec's bound of the exact average written plainly in
  this file, residuals within half a step; through ``with_bagua``, a worker killed mid-exchange: the survivors
  retry the round, the restarted worker heals, all agree bit for bit; 2-bit ``nf2``: the round is the mean of
  each pseudo-gradient decoded by the codec's formula written plainly, and the residuals are what it lost;
- workers started with different settings (compression, outer step) stop with a clear error on every worker.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.fault.jobs import Job, free_port, python_module, run_job, tails
from tests.harness import run_workers
from tests.torch_api.models import batch, make_model

WORKERS, STEPS, H = 3, 48, 4
PACED = ["--step-s", "0.25"]  # 12 s of rounds: the job still runs when the test kills its coordinator


def _held(tmp_path: Path) -> list[str]:
    """The survivors wait before the job's second-last round until the restarted worker is back (tests/fault/
    ft_worker.py's ``--hold``): however slowly it restarts, it rejoins a running job and heals."""
    return ["--step-s", "0.02", "--hold", str(tmp_path), "--hold-step", str(STEPS - 2 * H + 1)]


_free_port, _tails = free_port, tails  # the names the other fault tests import


def _spawn(i: int, port: int, out: Path, extra: list[str], log: Path, api: str,
           restarted: bool = False) -> subprocess.Popen:
    return python_module("tests.fault.ft_worker", [
        "--coordinator", f"127.0.0.1:{port}", "--index", str(i), "--workers", str(WORKERS), "--steps", str(STEPS),
        "--sync-every", str(H), "--out", str(out), "--api", api, *extra], log,
        BAGUA_TEST_RESTARTED="1" if restarted else "0")


def _stopped(p: subprocess.Popen) -> bool:
    try:
        return Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _last_round(log: Path) -> int:
    """The last round a worker printed as done (tests/fault/ft_worker.py), 0 before any."""
    return max(map(int, re.findall(r"^round (\d+) done$", log.read_text(), re.M)), default=0)


def _job(tmp_path: Path, extra: dict[int, list[str]], restart: bool = False, stalled: bool = False,
         kill_coordinator: bool = False, timeout_s: float = 150.0,
         api: str = "optimizer", expect_failure: bool = False) -> tuple[list[dict], dict[int, int]]:
    """Run the job; restart a worker that was SIGKILLed (once); with ``stalled``, SIGCONT a stopped worker once
    worker 0 has finished a round past the stopped one's last (one it was left out of, however slowly the machine
    goes), and write ``tmp_path/arrived`` (the others' ``--hold``) once it has found that out and joins again; with
    ``kill_coordinator``, SIGKILL the coordinator once every worker has finished its second round. ``api``:
    ``DiLoCoOptimizer`` (``"optimizer"``) or ``with_bagua`` and ``DiLoCoAlgorithm`` (``"algorithm"``)."""
    continued: set[int] = set()
    killed: list[bool] = []

    def spawn(i: int, port: int, out: Path, log: Path, again: bool) -> subprocess.Popen:
        args = extra.get(i, [])
        if again:  # without its --die
            args = [a for k, a in enumerate(args) if "--die" not in args[max(0, k - 1):k + 1]]
        return _spawn(i, port, out, args, log, api, again)

    def on_poll(job: Job) -> None:
        if kill_coordinator and not killed and all("round 2 done" in log.read_text() for log in job.logs):
            job.coordinator.kill()
            killed.append(True)
        for i, p in job.procs.items():
            if not stalled:
                continue
            if i not in continued and _stopped(p) and _last_round(job.logs[0]) > _last_round(job.logs[i]):
                p.send_signal(signal.SIGCONT)
                continued.add(i)
            if i in continued and "joining again" in job.logs[i].read_text():
                (tmp_path / "arrived").touch()

    results, codes, _ = run_job(tmp_path, WORKERS, spawn, restart=restart, on_poll=on_poll, timeout_s=timeout_s,
                                check=not (kill_coordinator or expect_failure))
    return results, codes


def _same_global(results: list[dict], steps: int = STEPS) -> None:
    ref = results[0]["global"]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ref, r["global"])), "the workers' global weights differ"
        assert r["syncs"] == results[0]["syncs"] and r["steps"] == steps
    assert all(torch.isfinite(g).all() for g in ref)


def _reference(rank, world_size):
    from bagua.torch_api.contrib.diloco_optimizer import DiLoCoOptimizer

    model = make_model(rank)
    opt = DiLoCoOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), sync_every=H)
    for step in range(1, STEPS + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [f.global_.clone() for f in opt.driver.fragments]


@pytest.mark.parametrize("api", ["optimizer", "algorithm"])
def test_without_failures_equals_diloco_bit_for_bit(tmp_path, api):
    results, _ = _job(tmp_path, {}, api=api)
    reference = run_workers(_reference, WORKERS)
    _same_global(results)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["global"], reference[0]))
    for r in results:
        assert r["stats"]["rounds"] == 1 + STEPS // H and r["stats"]["retries"] == 0
        assert r["stats"]["members"] == ["w0", "w1", "w2"]


@pytest.mark.parametrize("die", ["inner:7", "exchange:2", "serve"])
def test_killed_worker_rejoins_and_all_agree(tmp_path, die, api="optimizer"):
    # "serve": w0 serves the job's first weights to w1 and w2 and dies doing so; w1, w2 retry without it
    victim = 0 if die == "serve" else 2
    extra = {i: _held(tmp_path) + (["--die", die] if i == victim else []) for i in range(WORKERS)}
    results, _ = _job(tmp_path, extra, restart=True, api=api)
    _same_global(results)
    if die != "serve":  # the restarted worker healed from a live peer; "serve" dies at the start, whose copies of
        # w0's first weights are no heals, and w0 restarts in time for the retried start or after it (either way
        # _same_global holds)
        assert results[victim]["stats"]["heals"] >= 1, results[victim]["log"]
    if die != "inner:7":  # a peer died mid-round: the survivors ran it again
        assert any(r["stats"]["retries"] >= 1 for i, r in enumerate(results) if i != victim)


def _exact_first_round(sync_every: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The first synchronization written plainly: every worker starts from worker 0's weights, takes ``sync_every``
    AdamW steps on its own batches; returns the global weights after an outer step of lr 1 on the exact mean of the
    pseudo-gradients, and each worker's pseudo-gradient (all flattened in parameter order)."""
    g0 = torch.cat([p.detach().reshape(-1) for p in make_model(0).parameters()])
    deltas = []
    for i in range(WORKERS):
        model = make_model(0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for step in range(1, sync_every + 1):
            x, y = batch(i, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        deltas.append(g0 - torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return g0 - sum(deltas[1:], deltas[0]) / WORKERS, deltas


def test_compressed_round_is_within_the_codec_bound(tmp_path, codec="uint4", levels=15):
    # one synchronization (H steps), plain averaging (outer lr 1, no momentum): the new global weights are the
    # average. Each worker's pseudo-gradient (one block: the model has 1,540 weights) is quantized once, to a step
    # of range / levels
    results, _ = _job(tmp_path, {i: ["--steps", str(H), "--compression", codec, "--outer", "1,0"]
                                 for i in range(WORKERS)})
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["global"], r["global"])), "the workers differ"
    exact, deltas = _exact_first_round(H)
    got = results[0]["global"][0]
    bound = 1.01 * sum(float(d.max() - d.min()) for d in deltas) / WORKERS / levels + 1e-6
    error = float((got - exact).abs().max())
    assert 0 < error <= bound, (error, bound)
    # error feedback: each worker keeps what its encoding lost, at most half a step per weight
    for i, r in enumerate(results):
        residual = r["residuals"][0]
        assert float(residual.abs().max()) <= 0.51 * float(deltas[i].max() - deltas[i].min()) / levels + 1e-6
        assert float(residual.abs().max()) > 0


def test_nf2_round_is_the_average_of_the_plainly_decoded_pseudo_gradients(tmp_path):
    # the 2-bit nf2 codec in a fault-tolerant round: one block (1,540 weights < 4,096) per worker, coded about its
    # mean and RMS; the new global weights are g0 minus the mean of what the codec's formula, written plainly in
    # tests/torch_api/test_block_codec.py, decodes from each worker's pseudo-gradient
    from tests.torch_api.test_block_codec import _reference_nf2

    results, _ = _job(tmp_path, {i: ["--steps", str(H), "--compression", "nf2", "--outer", "1,0"]
                                 for i in range(WORKERS)})
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["global"], r["global"])), "the workers differ"
    exact, deltas = _exact_first_round(H)
    decoded = [_reference_nf2(d, 4096)[1] for d in deltas]
    expected = exact + sum(deltas) / WORKERS - sum(decoded) / WORKERS  # g0 - mean(decoded)
    got = results[0]["global"][0]
    assert torch.allclose(got, expected, rtol=0, atol=1e-6), float((got - expected).abs().max())
    assert float((got - exact).abs().max()) > 1e-4  # 2 bits are far from exact: the comparison can fail
    for i, r in enumerate(results):  # error feedback keeps exactly what the encoding lost
        assert torch.allclose(r["residuals"][0], deltas[i] - decoded[i], rtol=0, atol=1e-6)


def test_with_bagua_compressed_round_retried_after_a_death_agrees(tmp_path):
    # with_bagua's DiLoCoAlgorithm, 4-bit pseudo-gradients with error feedback; w2 dies at the start of its second
    # average, the survivors run the round again from their saved pseudo-gradients and residuals; w2 restarts, heals
    extra = {i: _held(tmp_path) + ["--compression", "uint4"] + (["--die", "exchange:2"] if i == 2 else [])
             for i in range(WORKERS)}
    results, _ = _job(tmp_path, extra, restart=True, api="algorithm")
    _same_global(results)
    assert any(r["stats"]["retries"] >= 1 for r in results[:2])
    assert results[2]["stats"]["heals"] >= 1


def test_workers_with_different_settings_stop_with_a_clear_error(tmp_path):
    # w1 another compression, w2 another outer step (w0 and w1 on "auto", resolved to lr 1.0, Nesterov 0.5)
    other = {1: ["--compression", "uint4"], 2: ["--outer", "0.7,0.9"]}
    results, codes = _job(tmp_path, {i: PACED + other.get(i, []) for i in range(WORKERS)}, expect_failure=True,
                          timeout_s=90.0)
    assert all(c != 0 for c in codes.values()), codes
    for r in results:
        assert "needs the same sync_every, fragments, compression and outer step" in r["log"], r["log"][-2000:]
    assert "compression=uint4" in results[0]["log"] and "lr=0.7 momentum=0.9" in results[0]["log"]


def test_stalled_worker_is_left_out_then_readmitted(tmp_path):
    # w2 stops itself before its step 6 (after the round of step 4) and is sent SIGCONT once w0 has closed the round
    # of step 8 without it; w0 and w1 wait before their step 9 until w2 has found out it was left out and joins
    # again, then w2 heals in the round of step 12 and all three average at step 16
    steps = 16
    held = ["--steps", str(steps), "--step-s", "0.02", "--hold", str(tmp_path), "--hold-step", "9"]
    extra = {i: held if i < 2 else ["--steps", str(steps), "--step-s", "0.02", "--stall", "6"] for i in range(WORKERS)}
    results, _ = _job(tmp_path, extra, stalled=True)
    _same_global(results, steps)
    assert results[2]["stats"]["left_out"] >= 1 and results[2]["stats"]["heals"] >= 1, results[2]["log"]
    assert all(r["stats"]["left_out"] == 0 for r in results[:2])


def test_lost_coordinator_gives_a_clear_error(tmp_path):
    extra = {i: PACED for i in range(WORKERS)}
    results, codes = _job(tmp_path, extra, kill_coordinator=True, timeout_s=120.0)
    assert all(c != 0 for c in codes.values()), codes
    for r in results:
        assert "coordinator at 127.0.0.1" in r["log"] and "stopped answering" in r["log"], r["log"][-2000:]
