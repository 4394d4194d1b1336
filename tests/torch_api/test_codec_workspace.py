"""``codecs.workspace``: one factory for both workspaces, one allreduce that dispatches on them, and the interface
the two workspace types share (``device``, ``bytes_sent``, ``state_dict`` / ``load_state_dict``)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.harness import run_workers

CPU = torch.device("cpu")


def test_make_workspace_builds_the_codecs_workspace():
    from bagua.torch_api.codecs.block_allreduce import BlockWorkspace
    from bagua.torch_api.codecs.compressed_allreduce import Workspace
    from bagua.torch_api.codecs.workspace import make_workspace

    chunk = make_workspace("chunk", 1000, 2, CPU, error_feedback=True)
    assert isinstance(chunk, Workspace) and chunk.residual is not None and chunk.device == CPU
    assert make_workspace("chunk", 1000, 2, CPU).residual is None
    block = make_workspace("uint4", 10_000, 2, block_size=64, error_feedback=True)
    assert isinstance(block, BlockWorkspace) and (block.codec, block.block_size, block.keep_previous) == (
        "uint4", 64, True)
    assert block.device is None  # buffers come with the first call
    assert make_workspace("uint8", 10, 2, error_feedback=True, keep_previous=False).keep_previous is False
    assert make_workspace("bf16", 10, 2).keep_previous is False
    with pytest.raises(ValueError, match="device"):
        make_workspace("chunk", 10, 2)
    with pytest.raises(ValueError, match="unknown codec 'int2'"):
        make_workspace("int2", 10, 2)


def test_bytes_sent_counts_both_passes_of_a_full_chunk():
    from bagua.torch_api.codecs import compressed_allreduce
    from bagua.torch_api.codecs.block import wire_numel
    from bagua.torch_api.codecs.workspace import make_workspace

    ws = make_workspace("chunk", 3 * (compressed_allreduce.SEGMENT + 5), 3, CPU)
    assert len(ws.segments) == 2
    assert ws.bytes_sent() == 2 * 2 * (ws.length + 8 * 2)  # every segment carries its chunk's header
    block = make_workspace("uint8", 10_000, 3, block_size=64)
    assert block.bytes_sent() == 2 * 2 * wire_numel(block.chunk, "uint8", 64)


def test_chunk_workspace_state_dict_round_trip():
    from bagua.torch_api.codecs.workspace import make_workspace

    ws = make_workspace("chunk", 10, 2, CPU, error_feedback=True)
    ws.residual.normal_()
    ws.server_residual.normal_()
    other = make_workspace("chunk", 10, 2, CPU, error_feedback=True)
    other.load_state_dict(ws.state_dict())
    assert_close(other.residual, ws.residual, rtol=0, atol=0)
    assert_close(other.server_residual, ws.server_residual, rtol=0, atol=0)
    other.load_state_dict({})
    assert not other.residual.any() and not other.server_residual.any()
    with pytest.raises(ValueError, match="another number of ranks"):
        make_workspace("chunk", 10, 5, CPU, error_feedback=True).load_state_dict(ws.state_dict())
    with pytest.raises(ValueError, match="without error feedback"):
        make_workspace("chunk", 10, 2, CPU).load_state_dict(ws.state_dict())
    assert make_workspace("chunk", 10, 2, CPU).state_dict() == {}


def _worker_dispatch(rank, world_size):
    from bagua.torch_api import communication
    from bagua.torch_api.codecs.block_allreduce import block_allreduce_inplace
    from bagua.torch_api.codecs.compressed_allreduce import low_precision_allreduce_inplace
    from bagua.torch_api.codecs.workspace import compressed_allreduce_inplace, make_workspace

    c = communication._get_default_group().get_global_communicator()
    x = torch.randn(1003, generator=torch.Generator().manual_seed(rank))
    pairs = []
    for codec in ("chunk", "uint4"):
        ws = make_workspace(codec, x.numel(), world_size, CPU, 64, error_feedback=True)
        got, direct = x.clone(), x.clone()
        for _ in range(2):  # twice: the residuals of the first call take part in the second
            compressed_allreduce_inplace(got, ws, c, error_feedback=True, tag=5)
        if codec == "chunk":
            ref = make_workspace(codec, x.numel(), world_size, CPU, error_feedback=True)
            for _ in range(2):
                low_precision_allreduce_inplace(direct, c, workspace=ref, tag=5)
        else:
            ref = None
            for _ in range(2):
                ref = block_allreduce_inplace(direct, c, "uint4", 64, workspace=ref, error_feedback=True, tag=5)
        pairs.append((got, direct))
    # a float16 input goes through a float32 copy for the block codecs
    half = x.half()
    full = half.float()
    compressed_allreduce_inplace(half, make_workspace("uint8", x.numel(), world_size, block_size=64), c)
    block_allreduce_inplace(full, c, "uint8", 64)
    pairs.append((half, full.half()))
    try:
        compressed_allreduce_inplace(x.clone(), make_workspace("chunk", x.numel(), world_size, CPU), c)
        mismatch = None
        compressed_allreduce_inplace(x.clone(), make_workspace("chunk", x.numel(), world_size, CPU), c,
                                     error_feedback=True)
    except ValueError as exc:
        mismatch = str(exc)
    return pairs, mismatch


def test_compressed_allreduce_inplace_equals_the_codecs_own_collective():
    for pairs, mismatch in run_workers(_worker_dispatch, 2):
        for got, direct in pairs:
            assert_close(got, direct, rtol=0, atol=0)
        assert mismatch is not None and "without error feedback" in mismatch
