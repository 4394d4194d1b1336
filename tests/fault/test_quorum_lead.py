"""The lead of a quorum, on a real coordinator (its own process) with workers as threads of the test.

One member (the lead) reads the slots and heartbeats and closes the quorum; the others wait on one key. A lead that
dies is replaced: after it took the lead and its slot, before closing (the followers' heartbeat threads ring its
bell after ``stale_s``; one of them takes over and the round closes and ends ``ok``); before it reports (another
member judges the verdict); and at once when the dead lead's restarted process (same id) arrives, although its
heartbeat moves again. Each worker makes a few store calls per round, whatever the number of workers.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bagua.torch_api.fault.quorum import Quorums
from bagua.torch_api.fault.records import Member
from tests.fault.conftest import running_coordinator

ME = Member(round=0, joining=False, samples=1, part=0)
SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def coordinator():
    """One coordinator process for this file's tests (each uses its own job prefix): its ``host:port``."""
    with running_coordinator() as address:
        yield address


def _workers(address, n, prefix, **kw):
    kw = {"heartbeat_s": 0.1, "stale_s": 1.0, "timeout_s": 20.0, "deadline_s": 30.0, "secret": SECRET,
          "prefix": prefix, **kw}
    return [Quorums(address, f"w{i}", n, **kw) for i in range(n)]


def _start(qs, pool):
    closed = list(pool.map(lambda q: q.wait(1, dataclasses.replace(ME, joining=True)), qs))
    assert list(pool.map(lambda q: q.report(closed[0], True), qs)) == [True] * len(qs)


def _lead_then_die(q, key):
    """``q`` arrives in quorum ``key``, takes its lead, and dies before closing it (its heartbeat stops)."""
    slot = q.store.add(q._k(f"q/{key}/n"), 1)
    me = dataclasses.replace(ME, id=q.worker, incarnation=q.incarnation)
    q._set(f"q/{key}/slot/{slot}", me.to_json())
    assert q._mine(q._take_lead(key))
    q.close()


def test_a_lead_dead_before_closing_is_taken_over_and_the_round_closes(coordinator):
    qs = _workers(coordinator, 3, "dead-lead")
    with ThreadPoolExecutor(3) as pool:
        _start(qs, pool)
        _lead_then_die(qs[0], 2)
        t0 = time.monotonic()
        closed = list(pool.map(lambda q: q.wait(2, ME), qs[1:]))
        assert closed[0].ids == ["w0", "w1", "w2"] == closed[1].ids  # w0 arrived before it died
        lead = qs[1]._read_lead(2)
        assert lead.id in ("w1", "w2")  # a follower took the lead over
        # w0 never reports: the new lead judges it dead, and the round is ok for the survivors
        assert list(pool.map(lambda q: q.report(closed[0], True), qs[1:])) == [True, True]
        assert time.monotonic() - t0 < 8.0
        again = list(pool.map(lambda q: q.wait(3, ME), qs[1:]))  # the next round goes on without w0
        assert again[0].ids == ["w1", "w2"]
    for q in qs:
        q.close()


def test_a_lead_dead_before_the_verdict_is_judged_by_another_member(coordinator):
    qs = _workers(coordinator, 3, "dead-judge")
    with ThreadPoolExecutor(3) as pool:
        _start(qs, pool)
        closed = list(pool.map(lambda q: q.wait(2, ME), qs))
        lead = qs[0]._read_lead(2)
        dead = next(q for q in qs if q.worker == lead.id)
        dead.close()  # it dies after the exchange, before it reports
        others = [q for q in qs if q is not dead]
        t0 = time.monotonic()
        assert list(pool.map(lambda q: q.report(closed[0], True), others)) == [True, True]
        assert time.monotonic() - t0 < 8.0
        assert qs[0]._read_lead(2).id != lead.id
    for q in qs:
        q.close()


def test_a_restarted_lead_frees_its_quorum_at_once(coordinator):
    # stale_s is long: only the restarted process's own word can end the dead lead's wait this early
    qs = _workers(coordinator, 3, "restarted-lead", stale_s=6.0)
    with ThreadPoolExecutor(3) as pool:
        _start(qs, pool)
        _lead_then_die(qs[0], 2)
        t0 = time.monotonic()
        followers = [pool.submit(q.wait, 2, ME) for q in qs[1:]]
        time.sleep(0.3)
        qs[0] = Quorums(coordinator, "w0", 3, heartbeat_s=0.1, stale_s=6.0, timeout_s=20.0, deadline_s=30.0,
                        secret=SECRET, prefix="restarted-lead")
        joined = qs[0].wait(2, dataclasses.replace(ME, joining=True, round=-1))
        closed = [f.result(timeout=20) for f in followers]
        assert time.monotonic() - t0 < 4.0
        assert joined.ids == closed[0].ids == ["w0", "w1", "w2"]
        assert joined.members[0].incarnation == qs[0].incarnation  # the new process's slot, not the dead one's
    for q in qs:
        q.close()


def test_store_calls_per_worker_and_round_do_not_grow_with_the_workers(coordinator):
    calls = {}
    for n in (2, 8):
        qs = _workers(coordinator, n, f"calls-{n}")
        counted = [0]

        class Counting:
            def __init__(self, store):
                self.store = store

            def __getattr__(self, name):
                counted[0] += 1
                return getattr(self.store, name)

        with ThreadPoolExecutor(n) as pool:
            _start(qs, pool)
            for q in qs:
                q.store = Counting(q.store)
            for key in (2, 3, 4):
                closed = list(pool.map(lambda q: q.wait(key, ME), qs))
                assert list(pool.map(lambda q: q.report(closed[0], True), qs)) == [True] * n
        calls[n] = counted[0] / (3 * n)
        for q in qs:
            q.close()
    # the old protocol: every waiting member read every slot and heartbeat, tens of calls per worker at 8 workers
    assert calls[8] < 20 and calls[8] < 1.5 * calls[2], calls
