"""The quorum's rules, each on a real coordinator (its own process) with workers as threads of the test.

Which members a quorum closes with, and when: the first waits for every worker; later ones close as soon as every
live worker arrived, at the deadline without a live straggler, after ``stale_s`` without a dead one, never below
``min_quorum`` and never with joiners alone; a worker that arrives after the close is told it was left out; the
verdict is ``retry`` when one member failed and ``ok`` when the silent one is dead.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bagua.torch_api.fault.quorum import Excluded, Quorums
from bagua.torch_api.fault.records import Member
from bagua.torch_api.fault.replica import FaultTolerance

ME = Member(round=0, joining=False, samples=1, part=0)


def _workers(address, n, workers=3, **kw):
    kw = {"heartbeat_s": 0.1, "stale_s": 1.0, "timeout_s": 20.0, **kw}
    return [Quorums(address, f"w{i}", workers, **kw) for i in range(n)]


def _start(qs, pool):
    """Run the first quorum and an ok verdict on every worker, as a job's start does."""
    closed = list(pool.map(lambda q: q.wait(1, dataclasses.replace(ME, joining=True)), qs))
    assert all(c.first for c in closed)
    assert list(pool.map(lambda q: q.report(closed[0], True), qs)) == [True] * len(qs)


def _ids(quorum):
    return quorum.ids


def test_first_quorum_waits_for_every_worker(coordinator):
    qs = _workers(coordinator, 3)
    with ThreadPoolExecutor(3) as pool:
        early = [pool.submit(q.wait, 1, dataclasses.replace(ME, joining=True)) for q in qs[:2]]
        time.sleep(1.5)  # two of three: the start waits, whatever the deadline
        assert not any(f.done() for f in early)
        last = qs[2].wait(1, dataclasses.replace(ME, joining=True))
        assert _ids(last) == ["w0", "w1", "w2"] == _ids(early[0].result())
    for q in qs:
        q.close()


def test_closes_when_every_live_worker_arrived_or_at_the_deadline(coordinator):
    qs = _workers(coordinator, 3, deadline_s=1.0)
    with ThreadPoolExecutor(3) as pool:
        _start(qs, pool)
        t0 = time.monotonic()
        both = list(pool.map(lambda q: q.wait(2, ME), qs))  # all three live and there: at once
        assert time.monotonic() - t0 < 0.8 and _ids(both[0]) == ["w0", "w1", "w2"]
        assert both[0].epoch == 1  # the same members as the last round: its group serves again
        list(pool.map(lambda q: q.report(both[0], True), qs))
        t0 = time.monotonic()
        two = list(pool.map(lambda q: q.wait(3, ME), qs[:2]))  # w2 beats but does not come: the deadline
        waited = time.monotonic() - t0
        assert 0.9 < waited < 3.0 and _ids(two[0]) == ["w0", "w1"] and two[0].epoch == 3
        with pytest.raises(Excluded):
            qs[2].wait(3, ME)  # it arrives after the close: its state is stale
    for q in qs:
        q.close()


def test_dead_worker_is_not_waited_for_and_verdicts(coordinator):
    qs = _workers(coordinator, 3, deadline_s=30.0)
    with ThreadPoolExecutor(3) as pool:
        _start(qs, pool)
        qs[2].close()  # its heartbeat stops: dead after stale_s, long before the deadline
        t0 = time.monotonic()
        two = list(pool.map(lambda q: q.wait(2, ME), qs[:2]))
        assert time.monotonic() - t0 < 5.0 and _ids(two[0]) == ["w0", "w1"]
        # one member failed: everyone retries, also the one whose exchange went through
        assert list(pool.map(lambda a: a[0].report(two[0], a[1]), zip(qs[:2], [True, False]))) == [False, False]
        three = list(pool.map(lambda q: q.wait(3, ME), qs[:2]))
        assert three[0].epoch == 3  # after a failed round: a new group
        # w1 dies after the exchange, before it reports: w0 still gets ok once w1 is silent
        qs[1].close()
        assert qs[0].report(three[0], True) is True
    for q in qs:
        q.close()


def test_min_quorum_and_joiners_alone_never_close(coordinator):
    qs = _workers(coordinator, 3, min_quorum=2, deadline_s=0.3, timeout_s=2.5)
    with ThreadPoolExecutor(3) as pool:
        _start(qs, pool)
        with pytest.raises(TimeoutError, match="min_quorum"):
            qs[0].wait(2, ME)  # alone, the others beating: past the deadline it still waits for a second
    for q in qs:
        q.close()
    qs = _workers(coordinator, 2, workers=2, prefix="job-b", deadline_s=0.3, timeout_s=2.5)
    with ThreadPoolExecutor(2) as pool:
        _start(qs, pool)
        with pytest.raises(TimeoutError):
            qs[1].wait(2, dataclasses.replace(ME, joining=True))  # a joiner waits for a member to close the round
    for q in qs:
        q.close()


def test_adaptive_deadline_and_constant_batch(coordinator):
    q = _workers(coordinator, 1, workers=1)[0]
    assert q.deadline() == q.min_deadline_s
    q._arrivals = [0.0, 10.0, 20.0, 30.0]  # rounds every 10 s: half of it
    assert q.deadline() == pytest.approx(5.0)
    q.close()
    ft = FaultTolerance(coordinator, "w9", workers=4, constant_batch=True, prefix="job-c")
    assert ft.accumulation(3) == 3  # before the first round
    ft.members = ["w0", "w9"]
    assert ft.accumulation(3) == 6  # 2 of 4 workers: twice the micro-batches
    ft.members = ["w0", "w1", "w9"]
    assert ft.accumulation(3) == 4
    ft.close()


@pytest.mark.parametrize("kwargs, name", [({"overlap_steps": 2}, "overlap_steps"),
                                          ({"warmup_steps": 5}, "warmup_steps")])
def test_what_fault_tolerance_refuses(coordinator, kwargs, name):
    import torch

    from bagua.torch_api.contrib.diloco_optimizer import DiLoCoOptimizer

    ft = FaultTolerance(coordinator, "w0", workers=1, prefix=f"refuse-{name}")
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"fault_tolerance=...\\) needs {name}="):
        DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), fault_tolerance=ft, **kwargs)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing touched
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    with pytest.raises(ValueError, match=f"DiLoCoAlgorithm\\(fault_tolerance=...\\) needs {name}="):
        DiLoCoAlgorithm(sync_every=10, fault_tolerance=ft, **kwargs)
    ft.close()


def test_a_worker_restarted_at_once_gets_a_new_group(coordinator):
    # w1 dies and its restart (same id, a new process) arrives in the very next round: the members' ids are the
    # last round's, but the last round's group does not hold the new process, so the round needs a new one
    qs = _workers(coordinator, 3, deadline_s=5.0)
    with ThreadPoolExecutor(3) as pool:
        _start(qs, pool)
        qs[1].close()
        qs[1] = Quorums(coordinator, "w1", 3, heartbeat_s=0.1, stale_s=1.0, timeout_s=20.0)
        moods = [ME, dataclasses.replace(ME, joining=True, round=-1), ME]
        closed = list(pool.map(lambda a: a[0].wait(2, a[1]), zip(qs, moods)))
        assert _ids(closed[0]) == ["w0", "w1", "w2"] and closed[0].epoch == 2
    for q in qs:
        q.close()


def test_fault_tolerant_residuals_are_in_the_checkpoint(coordinator):
    # one worker, uint4 pseudo-gradients with error feedback, plain averaging (lr 1, no momentum): after one round
    # its residual is what the encoding lost, delta - average, with delta = g0 - x from plain AdamW steps here and
    # the average g0 - g1 read off the global weights; the checkpoint holds it, and loading it restores it
    import torch

    from bagua.torch_api.contrib.diloco_optimizer import DiLoCoOptimizer
    from tests.torch_api.models import batch, make_model

    ft = FaultTolerance(coordinator, "w0", workers=1, prefix="residuals")
    model, plain = make_model(0), make_model(0)
    opt = DiLoCoOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), sync_every=2, compression="uint4",
                          outer_lr=1.0, outer_momentum=0.0, fault_tolerance=ft)
    reference = torch.optim.AdamW(plain.parameters(), lr=0.01)
    g0 = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    for step in (1, 2):
        for m, o in ((model, opt), (plain, reference)):
            x, y = batch(0, step)
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    delta = g0 - torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    g1 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    saved = opt.state_dict()["diloco"]
    assert "0.codec.residual" in saved, sorted(saved)
    torch.testing.assert_close(saved["0.codec.residual"], delta - (g0 - g1), rtol=0, atol=1e-6)
    assert float(saved["0.codec.residual"].abs().max()) > 0
    opt.driver.fragments[0].workspace = None  # as a restarted process: no residual
    opt.load_state_dict(dict(opt.inner.state_dict(), diloco=saved))
    assert torch.equal(opt.driver.fragments[0].workspace.residual, saved["0.codec.residual"])
    ft.close()
