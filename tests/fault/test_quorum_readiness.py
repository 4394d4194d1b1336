"""Who a quorum waits for, and that the coordinator forgets old rounds: a real coordinator, workers as threads.

- a worker alive but not in the quorum before (a new one, or one restarted under its id: another process) holds no
  one up: the quorum closes at once without it, whatever the deadline, and it joins once its slot is there;
- every round's keys are deleted once every member is past it: the store's keys stay flat over the rounds;
- a member stalled until its quorum's records were deleted is told it was left out: it never closes that quorum
  alone a second time.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from bagua.torch_api.fault.quorum import Excluded, Quorums
from bagua.torch_api.fault.records import Member
from tests.fault.conftest import running_coordinator

ME = Member(round=0, joining=False, samples=1, part=0)
JOINING = dataclasses.replace(ME, joining=True, round=-1)


@pytest.fixture(scope="module")
def coordinator():
    """One coordinator process for this file's tests (each its own job prefix): its ``host:port``."""
    with running_coordinator() as address:
        yield address


def _worker(address, i, workers, prefix, **kw):
    kw = {"heartbeat_s": 0.1, "stale_s": 1.0, "timeout_s": 15.0, "deadline_s": 30.0, **kw}
    return Quorums(address, f"w{i}", workers, prefix=prefix, **kw)


def _round(qs, pool, key):
    closed = list(pool.map(lambda q: q.wait(key, ME), qs))
    assert list(pool.map(lambda q: q.report(closed[0], True), qs)) == [True] * len(qs)
    return closed[0]


def _start(qs, pool):
    closed = list(pool.map(lambda q: q.wait(1, JOINING), qs))
    assert list(pool.map(lambda q: q.report(closed[0], True), qs)) == [True] * len(qs)


def test_a_live_worker_not_in_the_last_quorum_holds_no_one_up(coordinator):
    qs = [_worker(coordinator, i, 2, "new", max_workers=3) for i in range(2)]
    with ThreadPoolExecutor(3) as pool:
        _start(qs, pool)
        new = _worker(coordinator, 2, 2, "new", max_workers=3)  # registered, beating, not there yet
        time.sleep(0.3)
        t0 = time.monotonic()
        assert _round(qs, pool, 2).ids == ["w0", "w1"]
        assert time.monotonic() - t0 < 3.0  # not the 30 s deadline
        arriving = pool.submit(new.wait, 3, JOINING)
        time.sleep(0.5)  # its slot is there before the others arrive: it is in
        closed = list(pool.map(lambda q: q.wait(3, ME), qs))
        assert closed[0].ids == arriving.result(timeout=15).ids == ["w0", "w1", "w2"]
    for q in qs + [new]:
        q.close()


def test_a_restarted_worker_is_not_waited_for_until_it_arrives(coordinator):
    qs = [_worker(coordinator, i, 3, "restarted") for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        _start(qs, pool)
        qs[2].close()  # its process dies ...
        qs[2] = _worker(coordinator, 2, 3, "restarted")  # ... and is restarted at once: the same id beats again
        time.sleep(0.3)
        t0 = time.monotonic()
        assert _round(qs[:2], pool, 2).ids == ["w0", "w1"]
        assert time.monotonic() - t0 < 3.0  # not the 30 s deadline, nor stale_s
        arriving = pool.submit(qs[2].wait, 3, JOINING)
        time.sleep(0.5)
        closed = list(pool.map(lambda q: q.wait(3, ME), qs[:2]))
        joined = arriving.result(timeout=15)
        assert closed[0].ids == joined.ids == ["w0", "w1", "w2"]
        assert joined.members[2].incarnation == qs[2].incarnation
    for q in qs:
        q.close()


def _keys(address):
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=15),
                         wait_for_workers=False)


def test_a_round_s_keys_are_deleted_once_every_member_is_past_it(coordinator):
    qs = [_worker(coordinator, i, 2, "keys") for i in range(2)]
    store = _keys(coordinator)
    counts = {}
    with ThreadPoolExecutor(2) as pool:
        _start(qs, pool)
        for key in range(2, 31):
            _round(qs, pool, key)
            if key in (12, 30):
                time.sleep(0.5)  # the heartbeats delete what they were handed
                counts[key] = store.num_keys()
    assert counts[30] <= counts[12] + 4, counts  # flat: 18 more rounds, no more keys
    assert not store.check(["keys/q/3/closed", "keys/q/3/slot/1", "keys/q/3/done/w0"])
    assert store.check(["keys/q/30/closed"])  # the last rounds' records are still there
    for q in qs:
        q.close()


def test_a_member_stalled_until_its_quorum_was_deleted_is_left_out(coordinator):
    qs = [_worker(coordinator, i, 3, "stalled", deadline_s=0.3) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        _start(qs, pool)
        for key in range(2, 15):  # w2 stalls (it beats, it does not come): the others go on
            _round(qs[:2], pool, key)
        time.sleep(0.5)
        t0 = time.monotonic()
        with pytest.raises(Excluded):
            qs[2].wait(2, ME)  # quorum 2 closed long ago and is gone: not closed again with w2 alone
        assert time.monotonic() - t0 < 12.0  # a follower of a deleted bell looks again every 5 s
    for q in qs:
        q.close()
