"""Sharded replicas (FSDP2 inside a replica, Bagua between replicas) on CUDA, against the same job on CPU.

- one rank on NCCL, a 1 x 1 mesh: FSDP2's CUDA path (its streams and events) and Bagua's hooks on CUDA tensors;
- two ranks on the one GPU through gloo, a 2 x 1 mesh (2 replicas of 1 shard): the replicate exchange of CUDA
  tensors (gloo reduces CUDA tensors in ``all_reduce`` and ``broadcast``). ByteGrad's scatter-reduce is
  point-to-point, which gloo cannot do with CUDA tensors: not run there.

Tolerance, CUDA against CPU (TF32 off): ``rtol=1e-5, atol=1e-5`` (matmuls sum in another order; DiLoCo's outer
Nesterov step scales the rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.gpu.cuda_jobs import init_gloo
from tests.harness import run_workers

pytestmark = pytest.mark.gpu

CASES = {
    "gradient_allreduce": {},
    "diloco": {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9},
    "bytegrad": {"codec": "uint8", "error_feedback": True, "hierarchical": False},
}


def _train(device: str, replicas: int, name: str, kwargs: dict, rank: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bagua.torch_api.algorithms import Algorithm

    torch.backends.cuda.matmul.allow_tf32 = False
    mesh = init_device_mesh(device, (replicas, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(device)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh["shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([optimizer], Algorithm.init(name, **kwargs), device_mesh=mesh, replicate_dim="replicate")
    for step in range(4):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    weights = [p.full_tensor().detach().cpu() for p in model.parameters()]
    model.bagua_sharded.close()
    dist.barrier()
    return weights


def _worker_one_rank_nccl(rank, world_size, name, kwargs):
    return _train("cuda", 1, name, kwargs, rank)


def _worker_one_rank_cpu(rank, world_size, name, kwargs):
    return _train("cpu", 1, name, kwargs, rank)


@pytest.mark.parametrize("name", list(CASES))
def test_one_rank_on_nccl_matches_cpu(name):
    cuda = run_workers(_worker_one_rank_nccl, 1, name, CASES[name], timeout=300)[0]
    cpu = run_workers(_worker_one_rank_cpu, 1, name, CASES[name], env={"CUDA_VISIBLE_DEVICES": ""}, timeout=300)[0]
    for a, b in zip(cuda, cpu):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _worker_two_ranks_gloo(rank, world_size, name, kwargs, store_path):
    init_gloo(rank, world_size, store_path)
    return _train("cpu", 2, name, kwargs, rank), _train("cuda", 2, name, kwargs, rank)


@pytest.mark.parametrize("name", ["gradient_allreduce", "diloco"])
def test_two_ranks_on_one_gpu_through_gloo_match_cpu(name, tmp_path):
    runs = run_workers(_worker_two_ranks_gloo, 2, name, CASES[name], str(tmp_path / "store"), init_bagua=False,
                       timeout=300)
    for cpu, cuda in runs:
        for a, b in zip(cuda, cpu):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
