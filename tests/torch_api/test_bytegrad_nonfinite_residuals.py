"""ByteGrad with error feedback: one rank's NaN gradient leaves no trace in the residuals (issue 20).

One rank's gradient holds NaN at step BAD. Every rank skips that step (the user checks the gradients, as with the
default ``nonfinite="propagate"``, or ByteGrad drops them with ``nonfinite="skip"``), and the error-feedback
residuals get their values from before the step back. The run then equals, bit for bit, the same run in which
step BAD's batch was never seen: same gradients, same residuals, same 8-bit codes afterwards.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of

STEPS, BAD = 6, 2


def _worker(rank, world_size, nonfinite, inject):
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.with_bagua([opt], ByteGradAlgorithm(hierarchical=False, error_feedback=True, nonfinite=nonfinite))
    skipped = []
    for step in range(STEPS):
        if step == BAD and not inject:
            continue  # the reference: this batch is never seen
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == BAD and rank == 1:
            loss = loss * float("nan")  # one rank's gradient is NaN
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads and all(torch.isfinite(g).all() for g in grads):
            opt.step()
        else:
            skipped.append(step)  # what a user (or GradScaler) does with a non-finite gradient
    return params_of(model), skipped


@pytest.mark.parametrize("nonfinite", ["propagate", "skip"])
def test_nan_step_leaves_the_error_feedback_residuals_untouched(nonfinite):
    with_nan = run_workers(_worker, 2, nonfinite, True, timeout=90)
    without = run_workers(_worker, 2, nonfinite, False, timeout=90)
    for rank in range(2):
        weights, skipped = with_nan[rank]
        assert skipped == [BAD], (rank, skipped)  # every rank saw the NaN (or no gradient) and skipped that step
        for i, (got, want) in enumerate(zip(weights, without[rank][0])):
            assert torch.isfinite(got).all()
            assert torch.equal(got, want), f"rank {rank} parameter {i} differs from the run without step {BAD}"
    assert all(torch.equal(a, b) for a, b in zip(with_nan[0][0], with_nan[1][0]))
