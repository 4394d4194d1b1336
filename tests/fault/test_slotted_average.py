"""One allreduce carries a round's contributions and the screen's norms (``screen.slotted_average``), on 2 gloo ranks.

The references are plain maths written here on the two ranks' tensors (a mean, a weighted sum, the one finite
tensor), and the norms are ``torch.linalg.vector_norm`` of each tensor: nothing of the slots is shared with them.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from tests.harness import run_workers

TIMEOUT = datetime.timedelta(seconds=60)


def _contribution(rank: int, case: str) -> torch.Tensor:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(11 + rank))
    if case == "nan" and rank == 1:
        x[3] = float("nan")
    return x


CASES = {"equal": ("finite", [1, 1]), "weighted": ("finite", [3, 1]), "nan": ("nan", [1, 1])}


def _worker(rank, world_size):
    import torch.distributed as dist

    from bagua.torch_api.fault.screen import slotted_average

    group = dist.new_group(backend="gloo")
    out = {}
    for name, (case, weights) in CASES.items():
        n = len(weights)
        buf = torch.empty(1000 + n)
        refills = [0]

        def refill(data, case=case, refills=refills):
            refills[0] += 1
            data.copy_(_contribution(rank, case))

        buf[:-n] = _contribution(rank, case)
        buf[-n:] = 123.0  # junk in the slots: they are this function's to write
        kept, why = slotted_average(group, buf, rank, weights, 10.0, TIMEOUT, refill)
        out[name] = (buf[:-n].clone(), buf[-n:].clone(), kept, why, refills[0])
    return out


@pytest.fixture(scope="module")
def ranks():
    """Every case's outcome on both ranks (one spawn of two processes for the file)."""
    return run_workers(_worker, 2, timeout=120)


def _run(ranks, name):
    return ranks[0][name], ranks[1][name]


def test_equal_weights_are_the_mean_and_carry_every_norm(ranks):
    (out0, slots0, kept, why, refills), (out1, slots1, _, _, _) = _run(ranks, "equal")
    a, b = _contribution(0, "finite"), _contribution(1, "finite")
    assert torch.equal(out0, out1) and torch.equal(out0, (a + b) / 2)
    norms = [float(torch.linalg.vector_norm(t, dtype=torch.float64)) for t in (a, b)]
    assert torch.allclose(slots0.double(), torch.tensor(norms, dtype=torch.float64), rtol=1e-6)
    assert torch.equal(slots0, slots1)
    assert kept == [1, 1] and why == {} and refills == 0  # one allreduce


def test_unequal_weights_are_the_weighted_average(ranks):
    (out0, _, kept, _, refills), (out1, _, _, _, _) = _run(ranks, "weighted")
    a, b = _contribution(0, "finite"), _contribution(1, "finite")
    assert torch.equal(out0, out1)
    torch.testing.assert_close(out0, 0.75 * a + 0.25 * b, rtol=0, atol=1e-6)
    assert kept == [3, 1] and refills == 0


def test_a_nan_contribution_is_left_out_and_the_other_kept(ranks):
    (out0, _, kept, why, refills), (out1, _, _, _, _) = _run(ranks, "nan")
    assert torch.equal(out0, out1) and torch.equal(out0, _contribution(0, "nan"))
    assert kept == [1, 0] and list(why) == [1] and "NaN" in why[1]
    assert refills == 1  # the average ran again, without it
