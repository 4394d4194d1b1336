"""ShardedReplicas asks the algorithm how it runs (its ``replica_hook``), never its class name.

On 2 replicas x 2 shards (CPU/gloo): a user's subclass of ``DiLoCoAlgorithm`` trains exactly as the class it
extends (bit for bit), a subclass of ``GradientAllReduceAlgorithm`` exactly as native HSDP's averaging does through
the built-in one, and ``DiLoCoAlgorithm(hierarchical=True)``, which sharded replicas used to ignore silently, is
refused on every rank with a message naming the fix. A subclass's checkpoint holds its codec residuals as its
base's does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness import run_workers
from tests.sharded.test_sharded_replicas import STEPS, _full, _mesh, _shard, _train
from tests.sharded.common import model as _model


def _run(algorithm, rank, saved_keys=False):
    from bagua.torch_api.sharded.checkpoint import sharded_state_dict

    mesh = _mesh()
    model = _shard(_model(), mesh["shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([optimizer], algorithm, device_mesh=mesh, replicate_dim="replicate")
    _train(model, optimizer, rank, STEPS)
    out = _full(model), model.bagua_sharded.hook
    if saved_keys:  # what a checkpoint of it holds: the codec residuals are asked of the hook, not the class name
        out += (sorted(sharded_state_dict(model.bagua_sharded)),)
    model.bagua_sharded.close()
    return out


def _worker(rank, world):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    class MyDiLoCo(DiLoCoAlgorithm):
        """A user's subclass: another name, the same maths."""

    class MyAllReduce(GradientAllReduceAlgorithm):
        pass

    settings = dict(sync_every=2, fragments=2, outer_lr=0.7, outer_momentum=0.9)
    out = {"diloco": _run(DiLoCoAlgorithm(**settings), rank), "mine": _run(MyDiLoCo(**settings), rank),
           "allreduce": _run(GradientAllReduceAlgorithm(), rank), "my_allreduce": _run(MyAllReduce(), rank)}
    out["uint4"] = _run(DiLoCoAlgorithm(compression="uint4", **settings), rank, saved_keys=True)
    out["my_uint4"] = _run(MyDiLoCo(compression="uint4", **settings), rank, saved_keys=True)
    try:
        _run(DiLoCoAlgorithm(hierarchical=True, **settings), rank)
        out["hierarchical"] = None
    except ValueError as exc:
        out["hierarchical"] = str(exc)
    dist.barrier()  # FSDP2's gloo teardown: every rank done before the groups go
    return out


def test_subclasses_run_as_their_base_and_hierarchical_is_refused():
    results = run_workers(_worker, 4, timeout=240)
    for r in results:
        assert r["mine"][1] == r["diloco"][1] == "diloco" and r["my_allreduce"][1] == r["allreduce"][1] == "allreduce"
        for a, b in zip(r["mine"][0], r["diloco"][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(r["my_allreduce"][0], r["allreduce"][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert r["my_uint4"][2] == r["uint4"][2] and any(k.startswith("ranks.replica") for k in r["uint4"][2])
        for a, b in zip(r["my_uint4"][0], r["uint4"][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert r["hierarchical"] is not None and "hierarchical=False" in r["hierarchical"], r["hierarchical"]
    assert not torch.equal(results[0]["diloco"][0][0], results[0]["allreduce"][0][0])  # the runs differ
