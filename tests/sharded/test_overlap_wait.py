"""``PendingExchanges.wait_s`` counts the seconds a wait blocked on exchanges still running, and nothing else."""

from __future__ import annotations

import threading
import time

from bagua.torch_api.sharded.overlap import PendingExchanges


def test_wait_s_counts_only_the_time_blocked_on_exchanges_in_flight():
    exchanges = PendingExchanges(None, "wait test")  # type: ignore[arg-type]  # submit() never uses it
    try:
        release = threading.Event()
        exchanges.wait()  # nothing in flight: nothing counted
        assert exchanges.wait_s == 0.0
        # outside a backward, submit() waits at once: what it blocked is counted, no more than the call took
        threading.Timer(0.5, release.set).start()
        start = time.perf_counter()
        exchanges.submit(lambda: release.wait(5.0), "a job that waits 0.5 s", cuda=False)
        took = time.perf_counter() - start
        assert 0.25 <= exchanges.wait_s <= took and len(exchanges) == 0
        before = exchanges.wait_s
        exchanges.submit(lambda: None, "a no-op", cuda=False)
        assert exchanges.wait_s - before < 0.1
        assert exchanges.started == 2
    finally:
        exchanges.close()
