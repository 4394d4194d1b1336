"""Fault-tolerant DiLoCo with workers of different speeds (``rounds="time"``), on a real coordinator.

Two workers (threads of the test, each its own ``FaultTolerance`` and ``DiLoCoOptimizer``); the second is padded:
it sleeps 4x the first's step in every step. After the first round it takes fewer inner steps, the new global
weights are the token-weighted mean of the workers' weights (outer SGD with lr 1, momentum 0), written plainly
here from what each worker recorded, and ``python -m bagua.torch_api.fault.top --once`` shows both workers' rows.
A worker that stalls past the deadline in a paced job is left out, heals from the other, and both end with the same
weights, in the same round.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from bagua.torch_api.fault.replica import FaultTolerance
from tests.torch_api.models import batch, make_model, params_of


def _worker(address: str, i: int) -> dict:
    from bagua.torch_api.contrib import DiLoCoOptimizer

    ft = FaultTolerance(address, f"w{i}", workers=2, heartbeat_s=0.1, stale_s=2.0, timeout_s=30.0,
                        exchange_timeout_s=10.0, prefix="unequal")
    model = make_model(i)
    opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=8, rounds="time",
                          outer_lr=1.0, outer_momentum=0.0, fault_tolerance=ft)
    samples, step_s = (3, 0.005) if i == 0 else (5, 0.02)
    rounds, steps, tokens, step = [], 0, 0, 0
    while opt.syncs < 4:
        step += 1
        x, y = batch(i, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.inner.step()
        time.sleep(step_s)
        before, syncs = params_of(model), opt.syncs
        steps, tokens = steps + 1, tokens + samples
        opt.driver.add_samples(samples)
        opt.after_inner_step()
        if opt.syncs > syncs:
            rounds.append((steps, tokens, before, params_of(model)))
            steps = tokens = 0
    records = [(r.workers, r.steps, r.tokens) for r in opt.driver.records]
    return {"rounds": rounds, "records": records, "ft": ft}


def test_a_padded_worker_takes_fewer_steps_and_weighs_by_its_tokens(coordinator):
    with ThreadPoolExecutor(2) as pool:
        fast, slow = pool.map(lambda i: _worker(coordinator, i), [0, 1])
    top = subprocess.run([sys.executable, "-m", "bagua.torch_api.fault.top", "--coordinator", coordinator,
                          "--prefix", "unequal", "--once"], capture_output=True, text=True, timeout=60)
    for r in (fast, slow):
        r["ft"].close()
    assert [r[0] for r in fast["rounds"]] == [8] * 4
    assert slow["rounds"][0][0] == 8 and all(r[0] < 8 for r in slow["rounds"][1:]), slow["rounds"]
    for (n0, w0, x0, g0), (n1, w1, x1, g1) in zip(fast["rounds"], slow["rounds"]):
        assert (w0, w1) == (3 * n0, 5 * n1)
        for a, b, p0, p1 in zip(x0, x1, g0, g1):
            expected = (w0 * a.double() + w1 * b.double()) / (w0 + w1)
            torch.testing.assert_close(p0.double(), expected, rtol=0, atol=1e-6)
            assert torch.equal(p0, p1)
    # the records name the round's members, with each one's steps and tokens
    assert fast["records"] == slow["records"]
    assert fast["records"][1] == (["w0", "w1"], [8, slow["rounds"][1][0]],
                                  [float(fast["rounds"][1][1]), float(slow["rounds"][1][1])])
    # the live table: both workers' latest rows
    assert top.returncode == 0, top.stderr
    lines = top.stdout.splitlines()
    assert lines[0].split()[:3] == ["worker", "round", "sync_every"]
    assert [line.split()[0] for line in lines[1:]] == ["w0", "w1"], top.stdout


def _stalling_worker(address: str, i: int, shared: dict) -> dict:
    """Worker ``w{i}`` of the stalled job. w1 stalls at its step 6 until w0 has run a round without it (w0's lead
    waits ``deadline_s`` for it, then closes alone); w0 then holds before each step until w1, left out, is back at
    the next quorum as a joiner, so the job still has rounds to run when it is."""
    from bagua.torch_api.contrib import DiLoCoOptimizer

    ft = FaultTolerance(address, f"w{i}", workers=2, min_quorum=1, deadline_s=1.0, heartbeat_s=0.1, stale_s=5.0,
                        timeout_s=30.0, exchange_timeout_s=10.0, prefix="unequal-stall")
    model = make_model(i)
    opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=4, rounds="time",
                          outer_lr=1.0, outer_momentum=0.0, fault_tolerance=ft)
    shared[i] = (ft, opt)
    step, until = 0, time.monotonic() + 30.0
    while opt.syncs < 6:
        step += 1
        x, y = batch(i, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.inner.step()
        time.sleep(0.005 if i == 0 else 0.015)
        if i == 1 and step == 6:  # stall past the deadline: the other worker's round closes without this one
            while not any(r.workers == ["w0"] for r in shared[0][1].driver.records):
                assert time.monotonic() < until, "w0 never ran a round without the stalled w1"
                time.sleep(0.01)
        if i == 0 and 1 in shared:
            other = shared[1][0]
            while other.left_out and not other.heals and not _joiner_waits(ft):
                assert time.monotonic() < until, "the left-out w1 never came back"
                time.sleep(0.01)
        opt.after_inner_step()
    out = {"params": params_of(model), "global": [f.global_.clone() for f in opt.fragments],
           "stats": (ft.left_out, ft.heals), "round": opt.driver.pace.round, "records": opt.driver.records}
    return out, ft


def _joiner_waits(ft: FaultTolerance) -> bool:
    """Whether a worker took a slot in the quorum after the last closed one (read on ``ft``'s store)."""
    q = ft.quorums
    return int(q.store.add(f"{q.prefix}/q/{q.latest() + 1}/n", 0)) > 0


def test_a_worker_left_out_of_a_paced_round_heals_and_agrees(coordinator):
    shared: dict = {}
    with ThreadPoolExecutor(2) as pool:
        (a, fa), (b, fb) = pool.map(lambda i: _stalling_worker(coordinator, i, shared), [0, 1])
    fa.close()
    fb.close()
    assert b["stats"][0] >= 1 and b["stats"][1] >= 1, b["stats"]  # left out, then healed from w0
    assert a["stats"] == (0, 0)
    assert all(torch.equal(x, y) for x, y in zip(a["global"], b["global"]))
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert a["round"] == b["round"] == 6  # each round, whatever its steps, counted on both
    # w1's records skip the rounds it missed (one round each, in order, all with both members)
    assert [r.round for r in b["records"]] == sorted({r.round for r in b["records"]})
    assert all(r.workers == ["w0", "w1"] for r in b["records"])
