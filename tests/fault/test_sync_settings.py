"""What fault-tolerant synchronous training refuses, before anything is built, and what the message says to do."""

from __future__ import annotations

import pytest
import torch

from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua.torch_api.contrib.ddp_hooks import ByteGradState
from bagua.torch_api.fault import FaultTolerance
from tests.harness import run_workers


@pytest.fixture()
def ft():
    return object.__new__(FaultTolerance)  # only its type is checked here: no coordinator


def test_allreduce_takes_a_fault_tolerance_and_averages(ft):
    with pytest.raises(ValueError, match="takes a bagua.torch_api.fault.FaultTolerance"):
        GradientAllReduceAlgorithm(fault_tolerance="127.0.0.1:29600")
    with pytest.raises(ValueError, match="use average=True"):
        GradientAllReduceAlgorithm(fault_tolerance=ft, average=False)
    assert GradientAllReduceAlgorithm(fault_tolerance=ft).fault_tolerance is ft


def test_bytegrad_needs_a_block_codec(ft):
    with pytest.raises(ValueError, match="codec='uint8'"):
        ByteGradAlgorithm(fault_tolerance=ft)  # the default, "chunk", is a scatter-reduce over a fixed group
    assert ByteGradAlgorithm(fault_tolerance=ft, codec="uint4").codec == "uint4"
    with pytest.raises(ValueError, match="left out of the step's round"):
        ByteGradAlgorithm(fault_tolerance=ft, codec="uint8", nonfinite="raise")


def test_ddp_hook_says_what_to_use(ft):
    with pytest.raises(ValueError, match="FaultTolerantHookState"):
        ByteGradState(fault_tolerance=ft)


def _sharded_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from tests.sharded.common import model as _model
    from tests.sharded.test_sharded_replicas import _shard

    # replicas in one torch world: a dead one would take the others down (tests/fault/test_sync_sharded.py runs
    # each replica as a job of its own)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh["shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = GradientAllReduceAlgorithm(fault_tolerance=object.__new__(FaultTolerance))
    try:
        model.with_bagua([optimizer], algorithm, device_mesh=mesh, replicate_dim="replicate")
    except ValueError as exc:
        return str(exc)
    return None


def test_sharded_replicas_in_one_world_say_what_to_use():
    for message in run_workers(_sharded_worker, 2, timeout=120):
        assert message is not None and "GradientAllReduceAlgorithm(fault_tolerance=...)" in message, message
        assert "build the mesh as (1, shards)" in message, message
