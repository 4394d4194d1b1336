"""Checkpoints of sharded replicas with torch.distributed.checkpoint: 4 processes as 2 replicas x 2 shards.

A run trains ``SAVED`` steps, saves the model, the optimizer and ``model.bagua_sharded`` with DCP, and trains
``MORE`` steps; a fresh run loads the checkpoint and trains the same ``MORE`` steps. Their full weights must be the
same bytes. Loading at another number of shards per replica reshards what DCP can reshard, and refuses residuals.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_workers
from tests.sharded.common import batch as _batch
from tests.sharded.common import model as _model

SAVED, MORE = 3, 4


def _setup(name: str, kwargs: dict, shape: tuple[int, int]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bagua.torch_api.algorithms import Algorithm

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = model.with_bagua([optimizer], Algorithm.init(name, **kwargs), device_mesh=mesh,
                             replicate_dim="replicate")
    return model, optimizer


def _state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
            "bagua": model.bagua_sharded}


def _train(model, optimizer, batches: list[int], steps: range) -> None:
    for step in steps:
        xs, ys = zip(*(_batch(b, step) for b in batches))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        optimizer.step()


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _worker_save(rank, world, name, kwargs, path):
    import torch.distributed.checkpoint as dcp

    model, optimizer = _setup(name, kwargs, (2, 2))
    _train(model, optimizer, [rank], range(SAVED))
    dcp.save(_state(model, optimizer), checkpoint_id=path)
    saved = _full(model)
    _train(model, optimizer, [rank], range(SAVED, SAVED + MORE))
    out = {"saved": saved, "full": _full(model)}
    dist.barrier()  # FSDP2's gloo teardown: every rank done before the groups go
    return out


def _worker_load(rank, world, name, kwargs, path, shape=(2, 2)):
    """Load at ``shape``; at one shard per replica, rank r is fed the batches of replica r's two shard ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, optimizer = _setup(name, kwargs, shape)
    state = _state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=path)
    except ValueError as e:
        dist.barrier()
        return {"error": str(e)}
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    loaded = _full(model)
    batches = [rank] if shape[1] == 2 else [2 * rank, 2 * rank + 1]
    _train(model, optimizer, batches, range(SAVED, SAVED + MORE))
    out = {"loaded": loaded, "full": _full(model)}
    dist.barrier()
    return out


CASES = {
    "diloco": ("diloco", {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}),
    # saved after the warm-up, fragment 0's residuals set (exchanged at inner step 1) and fragment 1's exchange in
    # flight (started at inner step 2, its outer step at 3)
    "streaming-uint8": ("diloco", {"sync_every": 2, "fragments": 2, "compression": "uint8", "error_feedback": True,
                                   "overlap_steps": 1, "warmup_steps": 1, "outer_lr": 0.7, "outer_momentum": 0.9}),
    "bytegrad": ("bytegrad", {"codec": "uint8", "error_feedback": True, "hierarchical": False}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(case) -> (checkpoint path, the uninterrupted run)``: each case's run is spawned once for the tests
    that load its checkpoint (loading only reads it)."""
    runs: dict[str, tuple[str, list]] = {}

    def run(case: str) -> tuple[str, list]:
        if case not in runs:
            name, kwargs = CASES[case]
            path = str(tmp_path_factory.mktemp(case) / "ckpt")
            runs[case] = (path, run_workers(_worker_save, 4, name, kwargs, path, timeout=180))
        return runs[case]

    return run


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_training_equals_uninterrupted_bitwise(case, saved):
    name, kwargs = CASES[case]
    path, uninterrupted = saved(case)
    resumed = run_workers(_worker_load, 4, name, kwargs, path, timeout=180)
    for r in range(4):
        for a, b in zip(resumed[r]["loaded"], uninterrupted[r]["saved"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(resumed[r]["full"], uninterrupted[r]["full"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["diloco", "bytegrad"])
def test_loading_at_one_shard_per_replica(case, saved):
    """DCP reshards the model, the optimizer and DiLoCo's outer state; ByteGrad's residuals are refused."""
    name, kwargs = CASES[case]
    path, uninterrupted = saved(case)
    resumed = run_workers(_worker_load, 2, name, kwargs, path, (2, 1), timeout=180)
    for r in range(2):  # replica r: ranks 2r and 2r + 1 at (2, 2), rank r at (2, 1)
        if case == "bytegrad":
            assert "cannot reshard the error-feedback residuals" in resumed[r]["error"]
            assert "(2, 2), loading at (2, 1)" in resumed[r]["error"]
            continue
        for a, b in zip(resumed[r]["loaded"], uninterrupted[2 * r]["saved"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(resumed[r]["full"], uninterrupted[2 * r]["full"]):
            # one rank's batch of 8 instead of a reduce-scatter of two batches of 4: rounding
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
