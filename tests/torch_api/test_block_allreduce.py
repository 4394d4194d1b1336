"""The block-wise compressed allreduce against the same maths computed plainly on tensors, bit for bit.

Every worker returns its inputs and results; the test then simulates the collective in-process on the gathered
inputs: each rank's chunks through the plain codec formula of ``test_block_codec._reference`` (no code shared with
the module), the decoded copies of each chunk added in rank order in float32, divided by ``n``, quantized again;
with error feedback the rank and server residuals of the module docstring, over several calls. Same float32
operations in the same order, so the comparison is exact.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.test_block_codec import _reference

CODECS = ("uint4", "uint8", "bf16", "nf2", "sign1")


def _dq(x: torch.Tensor, codec: str, block: int) -> torch.Tensor:
    """D(Q(x)) by the plain formulas."""
    if x.numel() == 0:
        return x.clone()
    if codec == "bf16":
        return x.to(torch.bfloat16).float()
    if codec == "topk":
        from tests.torch_api.test_sparse_codec import _reference as topk_reference

        return topk_reference(x, block)
    return _reference(x, codec, block)[1]


def _chunks(numel: int, n: int, block: int) -> list[tuple[int, int]]:
    blocks = -(-numel // block)
    length = -(-blocks // n) * block if blocks >= n else -(-numel // n)
    return [(min(j * length, numel), min((j + 1) * length, numel)) for j in range(n)], length


def _simulate(inputs: list[list[torch.Tensor]], codec: str, block: int, average: bool, ef: bool):
    """Per call, the result every rank should hold; and the residuals after the last call."""
    n, numel = len(inputs), inputs[0][0].numel()
    bounds, length = _chunks(numel, n, block)
    e = [torch.zeros(numel) for _ in range(n)]
    s = [torch.zeros(length) for _ in range(n)]
    results = []
    for call in range(len(inputs[0])):
        x = [inputs[i][call] + e[i] if ef else inputs[i][call] for i in range(n)]
        dq = [torch.cat([_dq(x[i][a:b], codec, block) for a, b in bounds]) for i in range(n)]
        if ef:
            e = [x[i] - dq[i] for i in range(n)]
        out = torch.empty(numel)
        for j, (a, b) in enumerate(bounds):
            y = dq[0][a:b]
            for i in range(1, n):
                y = y + dq[i][a:b]
            if average:
                y = y / torch.tensor([float(n)])
            if ef:
                y = y + s[j][: b - a]
            out[a:b] = _dq(y, codec, block)
            if ef:
                s[j][: b - a] = y - out[a:b]
        results.append(out)
    return results, e, s


def _run(c, x_by_call, codec, block, average, ef, reload_before_last=False):
    from bagua.torch_api.codecs.block_allreduce import BlockWorkspace, block_allreduce_inplace

    ws, outs = None, []
    for call, x in enumerate(x_by_call):
        if reload_before_last and call == len(x_by_call) - 1:  # a checkpoint round trip into a new workspace
            state = ws.state_dict()
            ws = BlockWorkspace(x.numel(), c.nranks(), codec, block)
            ws.load_state_dict(state)
        flat = x.clone()
        ws = block_allreduce_inplace(flat, c, codec, block, average=average, workspace=ws, error_feedback=ef, tag=3)
        outs.append(flat)
    return outs, ws.state_dict()


def _cases(world_size):
    # (codec, numel, block, average, error feedback): several blocks with a short last chunk, chunks of whole
    # default blocks, tiny tensors (fewer blocks than ranks, an empty chunk)
    cases = [(codec, 64 * 5 * world_size + 17, 64, True, ef) for codec in CODECS for ef in (False, True)]
    cases += [("uint4", 3 * 4096 + 5, 4096, False, True), ("uint8", 5, 4096, True, True), ("uint4", 1, 64, True, False)]
    return cases


def _worker(rank, world_size):
    from bagua.torch_api import communication
    from bagua.torch_api.codecs import block_allreduce
    from bagua.torch_api.codecs.block_allreduce import block_allreduce_inplace

    c = communication._get_default_group().get_global_communicator()
    parity = []
    for k, (codec, numel, block, average, ef) in enumerate(_cases(world_size)):
        gen = torch.Generator().manual_seed(1000 * k + rank)
        xs = [torch.randn(numel, generator=gen) * (1 + rank) for _ in range(3)]
        results, state = _run(c, xs, codec, block, average, ef, reload_before_last=ef)
        parity.append((xs, results, state))
    # the NCCL order (each rank's sends and receives in one batch_isend_irecv), which gloo runs too
    block_allreduce._post_receives_first = lambda group: False
    grouped = [_run(c, xs, codec, block, average, ef)[0] for (xs, _, _), (codec, _, block, average, ef)
               in zip(parity, _cases(world_size))]
    # a communicator the last rank is outside of, and one-rank communicators
    pair = communication.new_group([0, 1]).get_global_communicator()
    solo = [communication.new_group([i]).get_global_communicator() for i in range(world_size)][rank]
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    outside, single = x.clone(), x.clone()
    block_allreduce_inplace(outside, pair, "uint4", 64, error_feedback=True)
    block_allreduce_inplace(single, solo, "uint4", 64, error_feedback=True)
    block_allreduce_inplace(torch.empty(0), c, "uint4", 64, error_feedback=True)
    return parity, (x, outside, single), grouped


@pytest.fixture(scope="module")
def runs():
    """Every worker's results, at 2 and 3 ranks (one spawn each: starting processes is the slow part)."""
    return {n: run_workers(_worker, n) for n in (2, 3)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_equals_the_plain_simulation_bit_for_bit(runs, world_size):
    per_rank = [parity for parity, _, _ in runs[world_size]]
    for k, (codec, numel, block, average, ef) in enumerate(_cases(world_size)):
        inputs = [per_rank[i][k][0] for i in range(world_size)]
        expected, e, s = _simulate(inputs, codec, block, average, ef)
        for i in range(world_size):
            _, results, state = per_rank[i][k]
            for got, want in zip(results, expected):
                assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"case {k} rank {i}: {m}")
                assert torch.equal(got, want)  # every rank holds the same bits (signed zeros included)
            if ef:
                assert_close(state["residual"], e[i], rtol=0, atol=0)
                assert_close(state["server_residual"], s[i], rtol=0, atol=0)
            else:
                assert state == {}


@pytest.mark.parametrize("world_size", [2, 3])
def test_grouped_sends_give_the_same_result(runs, world_size):
    for parity, _, grouped in runs[world_size]:
        for (_, results, _), again in zip(parity, grouped):
            assert all(torch.equal(a, b) for a, b in zip(results, again))


def test_non_member_and_one_rank_leave_flat_unchanged(runs):
    for rank, (_, (x, outside, single), _) in enumerate(runs[3]):
        assert torch.equal(single, x)
        assert torch.equal(outside, x) == (rank == 2)


def test_workspace_checks_and_state_dict():
    from bagua.torch_api.codecs.block_allreduce import BlockWorkspace, block_allreduce_inplace, chunk_length
    from bagua.torch_api.comm.process_group import BaguaCommunicator

    ws = BlockWorkspace(10_000, 2, "uint4", 4096)
    assert ws.chunk == chunk_length(10_000, 2, 4096) == 8192 and ws.bounds(1) == (8192, 10_000)
    outside = BaguaCommunicator(None, [0, 1])  # no process group needed: nothing is sent
    with pytest.raises(ValueError, match="not 10001 on 2"):
        block_allreduce_inplace(torch.zeros(10_001), outside, "uint4", workspace=ws)
    with pytest.raises(ValueError, match="uint8"):
        block_allreduce_inplace(torch.zeros(10_000), outside, "uint8", workspace=ws)
    with pytest.raises(ValueError, match="on 3 ranks"):
        BlockWorkspace(10_000, 3, "uint4").check(10_000, 2, "uint4", 4096)
    with pytest.raises(ValueError, match="1-D float32"):
        block_allreduce_inplace(torch.zeros(4, dtype=torch.float64), outside, "uint4")
    assert ws.state_dict() == {}
    state = {"residual": torch.randn(10_000), "server_residual": torch.randn(8192)}
    ws.load_state_dict(state)
    back = ws.state_dict()
    assert all(torch.equal(back[key], state[key]) for key in state)
    with pytest.raises(ValueError, match="server_residual: expected shape"):
        BlockWorkspace(10_000, 3, "uint4").load_state_dict(state)
    ws.load_state_dict({})
    assert ws.state_dict() == {}
