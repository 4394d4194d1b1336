"""FaultTolerance as a communicator any algorithm can use: no DiLoCo here, only state callbacks and tensors.

Two workers (threads of the test, each its own FaultTolerance) on a real coordinator: the first round heals the
second from the first through the callbacks they registered (the first worker's state, bit for bit); the next
round averages a tensor weighted by the samples each counted, against the weighted mean written plainly, and both
commit.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from bagua.torch_api.fault.replica import FaultTolerance


class _Algorithm:
    """A toy algorithm's state: one tensor and a counter, healed through the callbacks."""

    def __init__(self, seed: int) -> None:
        self.x = torch.randn(5, generator=torch.Generator().manual_seed(seed))
        self.rounds = seed

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"x": self.x.clone(), "rounds": torch.tensor(self.rounds)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.x.copy_(state["x"])
        self.rounds = int(state["rounds"])


def _ft(address: str, i: int, timeout_s: float = 30.0, prefix: str = "ending") -> FaultTolerance:
    """Worker ``w<i>`` of a job of two, with quick heartbeats."""
    return FaultTolerance(address, f"w{i}", workers=2, heartbeat_s=0.1, stale_s=1.0, timeout_s=timeout_s,
                          exchange_timeout_s=10.0, prefix=prefix)


def _worker(address: str, i: int, samples: int) -> dict:
    ft = _ft(address, i, prefix="communicator")
    algo = _Algorithm(seed=10 + i)
    ft.register(algo.state_dict, algo.load_state_dict, settings="toy", needs="the same toy")
    join = ft.start_round(algo.rounds, -1)  # every worker joins first: the job's first round
    joined = (join.quorum.first, join.healed, ft.should_commit(), algo.x.clone(), algo.rounds)
    ft.add_samples(samples)
    ft.count_step(1)
    y = torch.arange(5, dtype=torch.float32) * (i + 1)
    rnd = ft.start_round(algo.rounds, 0)
    ft.allreduce(y)
    out = {"joined": joined, "weights": rnd.weights, "healed": rnd.healed, "ok": ft.should_commit(), "y": y,
           "stats": (ft.rounds, ft.heals, ft.served, ft.members)}
    ft.close()
    return out


def test_heal_through_callbacks_and_weighted_average(coordinator):
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda args: _worker(coordinator, *args), [(0, 3), (1, 1)])
    first = _Algorithm(seed=10)
    # round 1: w1 took w0's state through its load callback; w0 kept its own
    assert a["joined"][:3] == (True, False, True) and b["joined"][:3] == (True, True, True)
    assert torch.equal(a["joined"][3], first.x) and torch.equal(b["joined"][3], first.x)
    assert a["joined"][4] == b["joined"][4] == 10
    # round 2: weighted by the samples counted (3 and 1), nobody heals
    assert a["weights"] == b["weights"] == (3, 1) and not a["healed"] and not b["healed"] and a["ok"] and b["ok"]
    expected = (3 * torch.arange(5.0) + 1 * 2 * torch.arange(5.0)) / 4
    for r in (a, b):
        torch.testing.assert_close(r["y"], expected, rtol=0, atol=1e-6)
    # the start-up copy is no heal (it was counted as one on every worker but the first)
    assert a["stats"] == (2, 0, 1, ["w0", "w1"]) and b["stats"] == (2, 0, 0, ["w0", "w1"])


# -- how a job ends: a worker that joins after every other one finished is told so at once -----------------------


def _finished_job(address: str) -> None:
    """Two workers take the job's start and one round, then both close: the job is over."""
    def run(i: int) -> None:
        ft = _ft(address, i)
        algo = _Algorithm(seed=10 + i)
        ft.register(algo.state_dict, algo.load_state_dict, settings="toy", needs="the same toy")
        ft.start_round(algo.rounds, -1)
        ft.should_commit()
        ft.count_step(1)
        ft.start_round(algo.rounds, 0)
        ft.allreduce(torch.ones(3))
        assert ft.should_commit()
        ft.close()

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, [0, 1]))


def test_a_worker_restarted_after_the_job_ended_is_told_at_once(coordinator):
    from bagua.torch_api.fault import JobEnded

    _finished_job(coordinator)
    late = _ft(coordinator, 1)  # w1 restarted after the last round
    algo = _Algorithm(seed=0)
    late.register(algo.state_dict, algo.load_state_dict, settings="toy", needs="the same toy")
    start = time.monotonic()
    with pytest.raises(JobEnded, match=r"the job has ended: every other worker \(w0\) finished .* nothing to join"):
        late.start_round(0, 0)
    assert time.monotonic() - start < 10.0  # told within a few polls, not after timeout_s (30 s)
    late.close()


def test_a_joiner_waits_while_another_worker_has_not_finished(coordinator):
    from bagua.torch_api.fault import JobEnded

    _finished_job(coordinator)
    alive = _ft(coordinator, 0)  # w0 restarted too and has not finished: the joiner keeps waiting for a round
    late = _ft(coordinator, 1, timeout_s=4.0)
    algo = _Algorithm(seed=0)
    late.register(algo.state_dict, algo.load_state_dict, settings="toy", needs="the same toy")
    with pytest.raises(TimeoutError) as error:
        late.start_round(0, 0)
    assert not isinstance(error.value, JobEnded)
    assert "to join the job at quorum" in str(error.value) and "never closes a round" in str(error.value)
    late.close()
    alive.close()
