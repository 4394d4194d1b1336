"""A synchronous job counts a step's samples when its agreement starts: samples added later are refused.

One worker's :class:`~bagua.torch_api.fault.synchronous.SyncSteps` on a real coordinator: ``add_samples`` before a
step's first forward counts; after it (a second micro-batch's samples, or a loop that counts after its forward)
it raises at once with what to do, rather than count silently towards the next step; after the backward the next
step counts again.
"""

from __future__ import annotations

import pytest
import torch

from bagua.torch_api.fault.replica import FaultTolerance
from bagua.torch_api.fault.synchronous import SyncSteps


def test_samples_added_after_a_steps_first_forward_are_refused(coordinator):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    ft = FaultTolerance(coordinator, "w0", workers=1, timeout_s=30.0, prefix="samples")
    try:
        steps = SyncSteps(ft, list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(3):
            ft.add_samples(4)
            steps.before_forward()
            with pytest.raises(ValueError, match=r"add_samples\(4\) after this step's first forward.* before"):
                ft.add_samples(4)
            model(torch.randn(4, 3)).sum().backward()
            steps.after_backward()
            assert steps.steps == step + 1
        ft.add_samples(4)  # the next step counts again
    finally:
        ft.close()
