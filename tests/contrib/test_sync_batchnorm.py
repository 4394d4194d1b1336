"""SyncBatchNorm at 2 ranks equals one BatchNorm over the concatenated global batch.

Compared per case: outputs and input gradients (each rank's slice), weight/bias gradients summed over ranks (what
data-parallel training reduces), running mean/var after two steps, and the eval-mode output. Tolerance: float32,
rtol = atol = 1e-5 (the synchronized statistics are merged from per-rank moments, a different summation order).
"""

from __future__ import annotations

import pytest
import torch

from bagua.torch_api.contrib import SyncBatchNorm, convert_sync_batchnorm
from tests.harness import run_workers

TOL = dict(rtol=1e-5, atol=1e-5)

# (name, per-rank batch sizes, trailing shape after (N, C), momentum, affine, track_running_stats)
CASES = [
    ("4d_uneven", (3, 5), (4, 4), 0.1, True, True),
    ("2d_cumulative", (4, 4), (), None, True, True),
    ("3d_no_running_stats", (2, 6), (7,), 0.1, True, False),
    ("4d_no_affine_tiny_rank", (1, 3), (3, 2), 0.3, False, True),
]
C = 3


def _data(case, step):
    """The global batch and output-gradient weights of ``step`` (same on every process)."""
    _, sizes, tail, *_ = case
    g = torch.Generator().manual_seed(1000 * step + len(tail))
    x = torch.randn((sum(sizes), C) + tail, generator=g) * 2.0 + 0.5
    w = torch.randn(x.shape, generator=g)
    return x, w


def _run(bn, case, rank, steps=2):
    """Train ``steps`` steps on the rank's slice (rank=None: the whole batch); return what the test compares."""
    sizes = case[1]
    out = {}
    for step in range(steps):
        x, w = _data(case, step)
        if rank is not None:
            lo = sum(sizes[:rank])
            x, w = x[lo:lo + sizes[rank]], w[lo:lo + sizes[rank]]
        x = x.clone().requires_grad_()
        bn.zero_grad()
        y = bn(x)
        (y * w).sum().backward()
        out = {"y": y.detach(), "dx": x.grad}
        if bn.affine:
            out.update(dw=bn.weight.grad.clone(), db=bn.bias.grad.clone())
    if bn.track_running_stats:
        out.update(mean=bn.running_mean.clone(), var=bn.running_var.clone(), n=bn.num_batches_tracked.clone())
    bn.eval()
    x, _ = _data(case, 7)
    if rank is not None:
        lo = sum(sizes[:rank])
        x = x[lo:lo + sizes[rank]]
    out["eval"] = bn(x).detach()
    return out


def _make(cls, case):
    _, _, _, momentum, affine, track = case
    torch.manual_seed(0)
    bn = cls(C, momentum=momentum, affine=affine, track_running_stats=track)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return bn


def _worker(rank, world_size):
    return [_run(_make(SyncBatchNorm, case), case, rank) for case in CASES]


def test_sync_batchnorm_equals_batchnorm_on_the_global_batch():
    results = run_workers(_worker, 2, timeout=90)
    for i, case in enumerate(CASES):
        ref = _run(_make(torch.nn.BatchNorm2d if len(case[2]) == 2 else torch.nn.BatchNorm1d, case), case, None)
        sizes = case[1]
        for key in ("y", "dx", "eval"):
            got = torch.cat([results[r][i][key] for r in range(2)])
            torch.testing.assert_close(got, ref[key], **TOL, msg=lambda m: f"{case[0]} {key}: {m}")
        for key in ("dw", "db"):
            if key in ref:
                got = results[0][i][key] + results[1][i][key]
                torch.testing.assert_close(got, ref[key], **TOL, msg=lambda m: f"{case[0]} {key}: {m}")
        for key in ("mean", "var", "n"):
            if key in ref:
                for r in range(2):
                    torch.testing.assert_close(results[r][i][key], ref[key], **TOL,
                                               msg=lambda m: f"{case[0]} rank {r} {key}: {m}")
        assert results[0][i]["y"].shape[0] == sizes[0]


def test_single_process_is_a_plain_batchnorm_and_convert_shares_parameters():
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
                              torch.nn.Sequential(torch.nn.Flatten(), torch.nn.BatchNorm1d(12, momentum=None)))
    ref = torch.nn.Sequential(*[m for m in net])  # same modules, before conversion
    x = torch.randn(5, 2, 2, 2)
    want = ref(x)
    with torch.no_grad():
        for m in (net[1], net[3][1]):
            m.running_mean.zero_()
            m.running_var.fill_(1.0)
            m.num_batches_tracked.zero_()
    weight = net[1].weight
    converted = convert_sync_batchnorm(net)
    assert type(converted[1]) is SyncBatchNorm and type(converted[3][1]) is SyncBatchNorm
    assert converted[1].weight is weight and converted[3][1].momentum is None
    torch.testing.assert_close(converted(x), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"\(N, C, \*\)"):
        SyncBatchNorm(3)(torch.randn(3))
    with pytest.raises(ValueError, match="channels"):
        SyncBatchNorm(3)(torch.randn(4, 5))
