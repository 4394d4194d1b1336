"""The sparse ``topk`` codec against its formulas written plainly here, and its all-gather exchange over 2 ranks.

The reference keeps, per block of ``m`` values, the ``ceil(m / 32)`` largest in magnitude, scales them by the
largest kept magnitude ``s`` and rounds ``v / s * 7`` half to even; decoding is ``q * (s / 7)`` at the kept places
and 0 elsewhere. The exchange is checked against the plain sum of the ranks' decoded encodings in rank order,
with the error-feedback residual ``x - D(Q(x))`` carried over three calls.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness import run_workers


def _reference(x: torch.Tensor, block: int) -> torch.Tensor:
    """D(Q(x)) by the plain formula, block by block (no code shared with bagua.torch_api.codecs.sparse)."""
    out = torch.zeros_like(x)
    for a in range(0, x.numel(), block):
        part = x[a : a + block]
        k = max(1, math.ceil(part.numel() / 32))
        order = sorted(range(part.numel()), key=lambda i: -abs(float(part[i])))[:k]
        s = max(abs(float(part[i])) for i in order)
        for i in order:
            q = round(float(part[i]) / s * 7) if s > 0 else 0  # Python's round: half to even, like torch.round
            out[a + i] = torch.tensor(q, dtype=torch.float32) * (torch.tensor(s, dtype=torch.float32) / 7)
    return out


@pytest.mark.parametrize("numel,block", [(1000, 256), (4096 * 2 + 7, 4096), (5, 256), (257, 256), (64, 64)])
def test_topk_matches_the_plain_formula(numel: int, block: int) -> None:
    from bagua.torch_api.codecs import block as bc

    # distinct magnitudes, so the top-k set is the same whatever order ties would take
    x = torch.randperm(numel).float().add_(1.0).mul_(torch.randn(numel).sign()) / numel
    wire = bc.encode(x, "topk", block)
    assert wire.numel() == bc.wire_numel(numel, "topk", block)
    y = bc.decode(wire, numel, "topk", block)
    assert torch.equal(y, _reference(x, block))
    assert bool(((x - y).abs() <= bc.error_bound(x, "topk", block)).all())
    acc = torch.full((numel,), 0.25)
    bc.decode(wire, numel, "topk", block, out=acc, accumulate=True)
    assert torch.equal(acc, torch.full((numel,), 0.25) + y)


def test_topk_wire_size_and_non_finite_blocks() -> None:
    from bagua.torch_api.codecs import block as bc

    # per block of 256: a 4-byte scale, 8 one-byte positions, 8 codes of 4 bits; of 4096: 128 two-byte positions
    assert bc.wire_numel(256 * 10, "topk", 256) == 10 * (4 + 8 + 4)
    assert bc.wire_numel(4096, "topk", 4096) == 4 + 128 * 2 + 64
    x = torch.randn(512)
    x[300] = float("nan")
    y = bc.decode(bc.encode(x, "topk", 256), 512, "topk", 256)
    assert torch.isnan(y[256:]).all() and torch.isfinite(y[:256]).all()
    zero = bc.decode(bc.encode(torch.zeros(300), "topk", 256), 300, "topk", 256)
    assert torch.equal(zero, torch.zeros(300))
    with pytest.raises(ValueError, match="65536"):
        bc.wire_numel(10, "topk", 1 << 17)


def test_topk_is_a_registered_pseudo_gradient_codec() -> None:
    from bagua.torch_api.codecs.registry import GlobalCodecRegistry
    from bagua.torch_api.codecs.workspace import allgather_average

    assert GlobalCodecRegistry.get("topk").block_codec == "topk"
    assert "topk" not in GlobalCodecRegistry.available(for_gradients=True)
    x = torch.randn(600)
    other = torch.randn(600)
    from bagua.torch_api.codecs import block as bc

    wires = [bc.encode(x, "topk", 256), bc.encode(other, "topk", 256)]
    avg, mine = allgather_average(x, "topk", lambda w: wires, 256)
    assert torch.equal(mine, wires[0])
    assert torch.equal(avg, (_reference(x, 256) + _reference(other, 256)) / 2)


def _worker(rank: int, world_size: int):
    from bagua.torch_api import communication
    from bagua.torch_api.codecs.block_allreduce import block_allreduce_inplace

    c = communication._get_default_group().get_global_communicator()
    gen = torch.Generator().manual_seed(7 + rank)
    xs = [torch.randn(1000, generator=gen) * (1 + rank) for _ in range(3)]
    ws, outs = None, []
    for x in xs:
        flat = x.clone()
        ws = block_allreduce_inplace(flat, c, "topk", 256, average=True, workspace=ws, error_feedback=True)
        outs.append(flat)
    return xs, outs, ws.residual.clone(), ws.bytes_sent()


def test_topk_allreduce_is_the_plain_average_with_error_feedback() -> None:
    results = run_workers(_worker, 2)
    inputs = [r[0] for r in results]
    e = [torch.zeros(1000) for _ in range(2)]
    for call in range(3):
        x = [inputs[i][call] + e[i] for i in range(2)]
        dq = [_reference(x[i], 256) for i in range(2)]
        e = [x[i] - dq[i] for i in range(2)]
        expected = (torch.zeros(1000) + dq[0] + dq[1]) / 2
        for rank in range(2):
            assert torch.equal(results[rank][1][call], expected), (call, rank)
    for rank in range(2):
        assert torch.equal(results[rank][2], e[rank])
        assert results[rank][3] == 4 * (4 + 8 + 4)  # 1000 = 3 blocks of 256 + 232 (k = 8 too): one wire, one peer


def _worker_diloco(rank: int, world_size: int):
    from bagua.torch_api.contrib import DiLoCoOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(40, 20)
    g = [p.detach().clone() for p in model.parameters()]
    lr = 0.1
    opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=lr), sync_every=1, compression="topk",
                          block_size=256, outer_lr=1.0, outer_momentum=0.0, outer_lr_warmup=0)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 40, generator=gen), torch.randn(16, 20, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    return g, grads, [p.detach().clone() for p in model.parameters()]


def test_diloco_with_topk_takes_the_outer_step_on_the_plain_sparse_average() -> None:
    results = run_workers(_worker_diloco, 2)
    g = torch.cat([t.reshape(-1) for t in results[0][0]])
    deltas = []
    for _, grads, _ in results:  # x = g - lr * grad (SGD), delta = g - x, the same float32 operations
        x = torch.cat([(t.add(gr, alpha=-0.1)).reshape(-1) for t, gr in zip(results[0][0], grads)])
        deltas.append(g - x)
    average = (torch.zeros_like(g) + _reference(deltas[0], 256) + _reference(deltas[1], 256)) / 2
    expected = g - average  # outer SGD, lr 1, no momentum
    for _, _, params in results:
        torch.testing.assert_close(torch.cat([p.reshape(-1) for p in params]), expected, rtol=0, atol=1e-7)


def test_topk_decode_overwrites_and_accumulates_only_the_kept_places() -> None:
    from bagua.torch_api.codecs import block as bc

    x = torch.randperm(700).float().add_(1.0).mul_(torch.randn(700).sign()) / 700
    x[600] = float("inf")  # the third block (512..699) decodes to NaN
    wire = bc.encode(x, "topk", 256)
    ref = _reference(x[:512], 256)
    out = bc.decode(wire, 700, "topk", 256, out=torch.randn(700))  # what out held before is overwritten
    assert torch.equal(out[:512], ref) and torch.isnan(out[512:]).all()
    base = torch.randn(700)
    acc = bc.decode(wire, 700, "topk", 256, out=base.clone(), accumulate=True)
    assert torch.equal(acc[:512], base[:512] + ref) and torch.isnan(acc[512:]).all()
