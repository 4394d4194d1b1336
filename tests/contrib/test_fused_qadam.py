"""Fused QAdam on two ranks: a fused ``QAdamOptimizer`` under ``QAdamAlgorithm`` trains bitwise like the unfused one.

The original's ``tests/contrib/test_fused_optimizer.py::test_qadam`` (fused QAdam, ``warmup_steps=1``,
``hierarchical=False``, ``fuse_step`` and ``step`` in turns) failed here with ``KeyError: 'exp_avg'``: after the
warmup QAdam averages the momenta inside ``step()``, and its communication thread read ``optimizer.state[p]`` while
the fused step had swapped in the fused tensors' state.
"""

from __future__ import annotations

import warnings

import torch

from bagua.torch_api.contrib import fuse_optimizer

STEPS = 6  # step 1 is the warmup (gradients averaged), steps 2-6 average the momenta in 8 bits

# (fuse before with_bagua, with_bagua's do_flatten, fuse_step and step in turns as the original's test does)
CASES = [
    (False, False, True),
    (True, False, False),
    (False, True, False),
]


def _train(rank, fused, fuse_first, bagua_flatten, alternate):
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
    from tests.torch_api.models import batch, make_model

    model = make_model(rank)
    opt = QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=1, weight_decay=0.01)
    if fused and fuse_first:
        fuse_optimizer(opt)
    model = model.with_bagua([opt], QAdamAlgorithm(opt, hierarchical=False), do_flatten=bagua_flatten)
    if fused and not fuse_first:
        fuse_optimizer(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fresh gradients every step; buckets that own the momenta
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if fused and not (alternate and step % 2):
                opt.fuse_step()
            else:
                opt.step()
    momenta = [opt.state[p]["exp_avg"].detach().clone() for p in model.parameters()]
    model.bagua_ddp.close()
    return [p.detach().clone() for p in model.parameters()], momenta


def _worker(rank, world_size, cases):
    return [[_train(rank, fused, *case) for fused in (False, True)] for case in cases]


def test_fused_qadam_matches_unfused_on_two_ranks():
    from tests.harness import run_workers

    results = run_workers(_worker, 2, CASES, timeout=180)
    for c, case in enumerate(CASES):
        for rank in range(2):
            (params, momenta), (fused_params, fused_momenta) = results[rank][c]
            assert all(torch.equal(a, b) for a, b in zip(params, fused_params)), f"rank {rank}, case {case}"
            assert all(torch.equal(a, b) for a, b in zip(momenta, fused_momenta)), f"rank {rank}, case {case}"
        # the momenta are averaged: every rank holds the same weights
        assert all(torch.equal(a, b) for a, b in zip(results[0][c][1][0], results[1][c][1][0])), f"case {case}"
