"""Sharded replicas' overlapped exchanges give the synchronous exchanges' numbers, bit for bit.

On 2 replicas x 2 shards (CPU/gloo): gradient allreduce and ByteGrad (uint8 with error feedback, and the chunk
code) train with the replica exchanges left in flight during the backward (several at once) and with them run
inside FSDP2's hook (``overlap=False``); the gradients read after every ``backward()`` and the final weights are the
same bytes, and gradient allreduce's equal native HSDP's (the reference: FSDP2's own all-reduce). With gradient
accumulation (two backwards per step) the second backward's units, whose gradients FSDP2 accumulates into a copy,
fall back to the synchronous exchange, and the weights still equal HSDP's accumulated run. A unit whose parameter
has a post-accumulate-grad hook (it reads the gradient inside the backward) exchanges synchronously, after the
exchanges in flight, while the other units overlap: the hook sees the averaged gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness import run_workers
from tests.sharded.common import batch as _batch
from tests.sharded.common import model as _model
from tests.sharded.test_sharded_replicas import STEPS, _algorithm, _full, _mesh, _shard

CASES = {
    "allreduce": ("gradient_allreduce", {}),
    "uint8": ("bytegrad", {"codec": "uint8", "error_feedback": True, "hierarchical": False}),
    "chunk": ("bytegrad", {"codec": "chunk", "hierarchical": False}),
}


def _run(rank, name, kwargs, mode, micro=1, hooked=False):
    """``mode``: "overlap", "sync" (Bagua between replicas, exchanges in flight or in the hook) or "hsdp"."""
    mesh = _mesh()
    model = _shard(_model(), mesh if mode == "hsdp" else mesh["shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode != "hsdp":
        model = model.with_bagua([optimizer], _algorithm(name, **kwargs), device_mesh=mesh,
                                 replicate_dim="replicate")
        model.bagua_sharded.overlap = mode == "overlap"
    grads, seen = [], []
    if hooked:  # the third layer's weight: its unit is exchanged second in the backward
        model[4].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.to_local().clone()))
    for step in range(STEPS):
        optimizer.zero_grad()
        for m in range(micro):
            x, y = _batch(rank, micro * step + m)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.to_local().clone() for p in model.parameters()])  # read before the step
        optimizer.step()
    out = {"full": _full(model), "grads": grads, "seen": seen}
    if mode != "hsdp":
        exchanges = model.bagua_sharded._exchanges
        out["started"], out["most_in_flight"] = exchanges.started, exchanges.most_in_flight
        model.bagua_sharded.close()
    return out


def _worker(rank, world, cases, micro, hooked=False):
    out = {}
    for case in cases:
        name, kwargs = CASES[case]
        for mode in ("overlap", "sync"):
            out[case, mode] = _run(rank, name, kwargs, mode, micro, hooked)
    if "allreduce" in cases:
        out["hsdp"] = _run(rank, "", {}, "hsdp", micro)
    dist.barrier()  # FSDP2's gloo teardown: every rank done before the groups go
    return out


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_overlapped_exchanges_equal_synchronous_ones_and_native_hsdp_bitwise():
    results = run_workers(_worker, 4, list(CASES), 1, timeout=240)
    for r in results:
        for case in CASES:
            overlap, sync = r[case, "overlap"], r[case, "sync"]
            # 4 units x 6 steps left in flight, several at once; none with overlap=False
            assert overlap["started"] == 4 * STEPS and overlap["most_in_flight"] >= 2, overlap["started"]
            assert sync["started"] == 0
            _same(overlap["full"], sync["full"])
            for a, b in zip(overlap["grads"], sync["grads"]):
                _same(a, b)
        _same(r["allreduce", "overlap"]["full"], r["hsdp"]["full"])
        for a, b in zip(r["allreduce", "overlap"]["grads"], r["hsdp"]["grads"]):
            _same(a, b)
    assert not torch.equal(results[0]["uint8", "overlap"]["full"][0], results[0]["hsdp"]["full"][0])
    for shard in range(2):  # ByteGrad's replicas of a shard hold the same bytes
        _same(results[shard]["uint8", "overlap"]["full"], results[2 + shard]["uint8", "overlap"]["full"])


def test_accumulated_gradients_fall_back_to_the_synchronous_exchange():
    results = run_workers(_worker, 4, ["allreduce"], 2, timeout=240)
    for r in results:
        overlap = r["allreduce", "overlap"]
        # the first backward of each step overlaps; the second accumulates into the gradients: synchronous
        assert overlap["started"] == 4 * STEPS, overlap["started"]
        _same(overlap["full"], r["allreduce", "sync"]["full"])
        _same(overlap["full"], r["hsdp"]["full"])
        for a, b in zip(overlap["grads"], r["hsdp"]["grads"]):
            _same(a, b)


def test_a_unit_read_inside_the_backward_is_exchanged_synchronously_in_order():
    results = run_workers(_worker, 4, ["uint8"], 1, True, timeout=240)
    for r in results:
        overlap, sync = r["uint8", "overlap"], r["uint8", "sync"]
        assert overlap["started"] == 3 * STEPS, overlap["started"]  # the hooked unit: synchronous
        assert len(overlap["seen"]) == STEPS
        for a, b in zip(overlap["seen"], sync["seen"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        _same(overlap["full"], sync["full"])
        for a, b in zip(overlap["grads"], sync["grads"]):
            _same(a, b)
