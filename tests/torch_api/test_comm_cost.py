"""The ring allreduce's cost (bagua.torch_api.comm.cost) against a step-by-step simulation of the ring."""

from __future__ import annotations

import doctest

import pytest

from bagua.torch_api.comm import cost


def _simulate_ring(values: list[list[float]]) -> tuple[list[list[float]], list[int], int]:
    """Run a ring allreduce on ``values[rank]`` (equal lengths, divisible by the rank count) one send at a time;
    return every rank's result, the elements each rank sent and the number of steps."""
    n, size = len(values), len(values[0])
    chunk = size // n
    data = [list(v) for v in values]
    sent = [0] * n
    steps = 0
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            steps += 1
            messages = []
            for rank in range(n):  # rank sends one chunk to rank + 1
                index = (rank - step + (0 if phase == "reduce-scatter" else 1)) % n
                messages.append((rank, index, data[rank][index * chunk:(index + 1) * chunk]))
                sent[rank] += chunk
            for rank, index, payload in messages:
                receiver = data[(rank + 1) % n]
                for k, x in enumerate(payload):
                    j = index * chunk + k
                    receiver[j] = receiver[j] + x if phase == "reduce-scatter" else x
    return data, sent, steps


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_bytes_and_steps_match_a_simulated_ring(n):
    size = 6 * n
    values = [[float(r * 100 + i) for i in range(size)] for r in range(n)]
    result, sent, steps = _simulate_ring(values)
    expected = [sum(values[r][i] for r in range(n)) for i in range(size)]
    assert all(row == expected for row in result)  # the simulation is a real allreduce
    element_bytes = 4
    assert all(cost.ring_allreduce_bytes(size * element_bytes, n) == s * element_bytes for s in sent)
    assert cost.ring_allreduce_steps(n) == steps


def test_one_rank_sends_nothing():
    assert cost.ring_allreduce_bytes(1e9, 1) == 0.0 and cost.ring_allreduce_steps(1) == 0


def test_docstring_examples_run():
    assert doctest.testmod(cost).failed == 0
