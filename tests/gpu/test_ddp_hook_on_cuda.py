"""Bagua's DDP communication hooks on CUDA buckets (issue 31).

``bytegrad_hook`` runs each bucket on a thread of its own with a CUDA stream, and hands DDP a future over a CUDA
tensor; Lightning registers comm hooks only on CUDA, so this is the path its users take. On one rank over NCCL the
8-bit exchange has no peer and leaves the bucket as it is, so every hook must give plain DDP's weights bit for bit:
what is checked is the thread, its stream and events, and the future on the GPU. (At two ranks on one GPU the
exchange would be point-to-point on gloo, which takes CUDA pointers as host memory: tests/gpu/
test_algorithms_on_cuda.py says why; on several GPUs it runs on NCCL.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.contrib.test_ddp_hooks import STEPS, _batch, _model
from tests.harness import run_workers

pytestmark = pytest.mark.gpu

HOOKS = ("default", "bytegrad", "bytegrad_error_feedback", "local")


def _train_with(rank: int, hook: str, device: str = "cuda"):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bagua.torch_api.contrib.ddp_hooks import ByteGradState, bytegrad_hook, local_hook

    model = _model(rank).to(device)
    ddp = DDP(model, bucket_cap_mb=1024)
    state = None
    if hook.startswith("bytegrad"):
        state = ByteGradState(error_feedback=hook.endswith("error_feedback"))
        ddp.register_comm_hook(state, bytegrad_hook)
    elif hook == "local":
        ddp.register_comm_hook(None, local_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, STEPS + 1):
        x, y = (t.to(device) for t in _batch(rank, step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    weights = [p.detach().cpu() for p in model.parameters()]
    iters = None
    if state is not None:
        iters = state.iter
        state.close()
    return weights, iters


def _worker(rank, world_size, device="cuda"):
    return dist.get_backend(), {hook: _train_with(rank, hook, device) for hook in HOOKS}


def test_hooks_on_cuda_buckets_give_ddps_weights_on_one_rank():
    (backend, runs), = run_workers(_worker, 1, env={"BAGUA_COMM_TIMEOUT_S": "60"}, timeout=180)
    assert backend == "nccl"
    reference, _ = runs["default"]
    for hook in HOOKS[1:]:
        weights, iters = runs[hook]
        if hook.startswith("bytegrad"):
            assert iters == STEPS, (hook, iters)  # one bucket went through the hook's thread per step
        for got, want in zip(weights, reference):
            assert torch.equal(got, want), f"{hook}: max diff {(got - want).abs().max()}"
