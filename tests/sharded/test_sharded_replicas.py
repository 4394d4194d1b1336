"""Bagua between FSDP2-sharded replicas, on CPU/gloo: 4 processes as 2 replicas x 2 shards.

References share no code with Bagua's sharded path: native HSDP (FSDP2 on the 2-D mesh) for gradient allreduce,
the maths of the codec's bound for ByteGrad, and Bagua's unsharded DiLoCo at 2 full replicas (each fed the batches
of its replica's two shard ranks) for DiLoCo.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_workers
from tests.sharded.common import batch as _batch
from tests.sharded.common import model as _model

STEPS = 6


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _algorithm(name: str, **kwargs):
    from bagua.torch_api.algorithms import Algorithm

    return Algorithm.init(name, **kwargs)


def _train(model, optimizer, rank: int, steps: int, grads: list | None = None) -> None:
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if grads is not None:
            grads.append([p.grad.to_local().clone() for p in model.parameters()])
        optimizer.step()


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _worker_sharded(rank, world, name, kwargs, mode="bagua"):
    """``mode``: "bagua" (FSDP2 on the shard dimension, Bagua between replicas), "hsdp" (native HSDP) or "replica"
    (FSDP2 on the shard dimension and nothing between replicas: each replica's own gradients)."""
    mesh = _mesh()
    model = _shard(_model(), mesh if mode == "hsdp" else mesh["shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "bagua":
        model = model.with_bagua([optimizer], _algorithm(name, **kwargs), device_mesh=mesh,
                                 replicate_dim="replicate")
    grads: list = []
    _train(model, optimizer, rank, STEPS, grads)
    out = {"full": _full(model), "grads": grads}
    dist.barrier()  # FSDP2's gloo teardown: every rank done before the groups go
    return out


def _worker_unsharded_diloco(rank, world, kwargs):
    """The reference: unsharded DiLoCo, rank r fed the batches of replica r's two shard ranks."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([optimizer], _algorithm("diloco", hierarchical=False, **kwargs))
    for step in range(STEPS):
        xs, ys = zip(*(_batch(2 * rank + s, step) for s in range(2)))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def hsdp() -> list:
    """Native HSDP's run, the same for every test that compares with it: spawned once."""
    return run_workers(_worker_sharded, 4, "gradient_allreduce", {}, "hsdp", timeout=180)


@pytest.fixture(scope="module")
def alone() -> list:
    """Each replica's own gradients (nothing between replicas), the same for every codec: spawned once."""
    return run_workers(_worker_sharded, 4, "gradient_allreduce", {}, "replica", timeout=180)


def test_gradient_allreduce_equals_native_hsdp_bitwise(hsdp):
    bagua = run_workers(_worker_sharded, 4, "gradient_allreduce", {}, timeout=180)
    for r in range(4):
        for a, b in zip(bagua[r]["full"], hsdp[r]["full"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("codec", ["uint8", "chunk"])
def test_bytegrad_gradients_within_the_codec_bound_of_hsdp(codec, hsdp, alone):
    kwargs = {"codec": codec, "error_feedback": True, "hierarchical": False}
    bagua = run_workers(_worker_sharded, 4, "bytegrad", kwargs, timeout=180)
    # The first step's gradients (the same weights: only the codec differs). Each replica's shard is quantized at
    # its rank, then the average at the chunk's owner, each within half a level of 255 over the range of what it
    # codes (a chunk or block, inside this rank's whole shard): |error| <= (max_r range(g_r) + range(avg)) / 510.
    def span(ts):
        flat = torch.cat([t.flatten() for t in ts])
        return float(flat.max() - flat.min())

    for r in range(4):
        replicas = [alone[s_]["grads"][0] for s_ in (r % 2, 2 + r % 2)]
        bound = (max(span(g) for g in replicas) + span(hsdp[r]["grads"][0])) / 510 + 1e-7
        error = max(float((g - ref).abs().max()) for g, ref in zip(bagua[r]["grads"][0], hsdp[r]["grads"][0])
                    if ref.numel())
        assert 0 < error <= bound, (error, bound)
    for shard in range(2):  # the replicas of a shard hold the same bytes
        for a, b in zip(bagua[shard]["full"], bagua[2 + shard]["full"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [
    {"sync_every": 2},
    {"sync_every": 2, "warmup_steps": 1, "fragments": 2},
    {"sync_every": 2, "fragments": 2, "overlap_steps": 1},
], ids=["plain", "streaming-warmup", "streaming-overlap"])
def test_diloco_equals_unsharded_diloco_at_two_replicas(kwargs):
    kwargs = dict(kwargs, outer_lr=0.7, outer_momentum=0.9)
    sharded = run_workers(_worker_sharded, 4, "diloco", kwargs, timeout=180)
    reference = run_workers(_worker_unsharded_diloco, 2, kwargs, timeout=180)
    for r in range(4):
        for a, b in zip(sharded[r]["full"], reference[r // 2]):
            # the replica's gradient is reduce-scattered (a sum of two halves) instead of one batch of 8: rounding
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if "fragments" not in kwargs:  # plain DiLoCo: the replicas agree after the last synchronization (step 6)
        for a, b in zip(sharded[0]["full"], sharded[2]["full"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _worker_errors(rank, world):
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.decentralized import DecentralizedAlgorithm
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    mesh = _mesh()
    messages = []
    hsdp = _shard(_model(), mesh)  # native HSDP: FSDP2 already does the replicate dimension
    sharded = _shard(_model(), mesh["shard"])
    cases = [
        (sharded, DecentralizedAlgorithm(), {"device_mesh": mesh, "replicate_dim": "replicate"}),
        (sharded, GradientAllReduceAlgorithm(), {"device_mesh": mesh, "replicate_dim": "replica"}),
        (sharded, GradientAllReduceAlgorithm(), {}),
        (sharded, ByteGradAlgorithm(nonfinite="skip"), {"device_mesh": mesh, "replicate_dim": "replicate"}),
        (hsdp, GradientAllReduceAlgorithm(), {"device_mesh": mesh, "replicate_dim": "replicate"}),
    ]
    # a fault-tolerant worker is one replica: its mesh must be (1, shards)
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm
    from bagua.torch_api.fault import FaultTolerance
    from bagua.torch_api.fault.coordinator import start_coordinator

    port = torch.tensor([0])
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
        coordinator = start_coordinator("127.0.0.1", int(port))
    dist.broadcast(port, 0)
    ft = FaultTolerance(f"127.0.0.1:{int(port)}", worker=f"w{rank}", workers=4, timeout_s=30.0)
    cases.append((sharded, DiLoCoAlgorithm(fault_tolerance=ft), {"device_mesh": mesh, "replicate_dim": "replicate"}))
    for model, algorithm, kwargs in cases:
        try:
            model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], algorithm, **kwargs)
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    ft.close()
    dist.barrier()
    if rank == 0:
        coordinator.kill()
        coordinator.wait()
    return messages


def test_unsupported_settings_raise_on_every_rank_saying_what_to_do():
    results = run_workers(_worker_errors, 4, timeout=180)
    for messages in results:
        assert messages[0] is not None and "DecentralizedAlgorithm does not run on sharded replicas" in messages[0]
        assert "DiLoCoAlgorithm" in messages[0]
        assert messages[1] is not None and "['replicate', 'shard']" in messages[1]
        assert messages[2] is not None and "device_mesh=mesh" in messages[2]
        assert messages[3] is not None and "nonfinite=" in messages[3]
        assert messages[4] is not None and "native HSDP" in messages[4]
        assert messages[5] is not None and "build the mesh as (1, shards)" in messages[5]

