"""Training loops on CUDA (issue 31): fp16 autocast with a GradScaler around two wrapped models and the user's own
collective, and a checkpoint saved from CUDA tensors that loads where there is no CUDA at all.

The GradScaler loop is a GAN's generator step, ``D(G(z))``: two models wrapped apart, one backward through both,
the user's ``all_reduce`` of the loss between forward and backward, and an overflow on the last rank at
:data:`BAD_STEP`. It runs on one rank over NCCL (the engine's communication stream) and on two ranks of the one
GPU over gloo (real exchanges; NCCL refuses two ranks on one GPU). The reference is the same loop with torch DDP:
gradient allreduce within float rounding (``rtol=1e-5, atol=1e-6``), ByteGrad within ``atol=1e-3`` (8-bit codes
of the gradients, as in tests/torch_api/test_training_loops.py); every rank skips the bad step and halves its
scale once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.gpu.cuda_jobs import GLOO_P2P, init_gloo
from tests.harness import run_workers
from tests.torch_api.models import batch, make_model

pytestmark = pytest.mark.gpu

BAD_STEP = 2
STEPS = 5
INIT_SCALE = 2.0**10
ENV = {"BAGUA_COMM_TIMEOUT_S": "60"}


class _Pair(torch.nn.Module):
    """A generator and a discriminator of different sizes."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.g = torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 10))
        self.d = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _gan_loop(rank: int, world_size: int, system: str, device: str = "cuda"):
    """Train :class:`_Pair` on ``device`` under fp16 autocast and a GradScaler, wrapped by ``system`` ("ddp" or a
    Bagua algorithm name); return (weights, scales, logged losses)."""
    from bagua.torch_api.algorithms import Algorithm

    pair = _Pair(100 + rank).to(device)
    opt_g = torch.optim.SGD(pair.g.parameters(), lr=0.05, momentum=0.9)
    opt_d = torch.optim.SGD(pair.d.parameters(), lr=0.05, momentum=0.9)
    if system == "ddp":
        g, d = torch.nn.parallel.DistributedDataParallel(pair.g), torch.nn.parallel.DistributedDataParallel(pair.d)
    else:
        kwargs = {"hierarchical": False} if system == "bytegrad" else {}
        pair.g.with_bagua([opt_g], Algorithm.init(system, **kwargs))
        pair.d.with_bagua([opt_d], Algorithm.init(system, **kwargs))
        g, d = pair.g, pair.d
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
    scales, logged = [], []
    for step in range(STEPS):
        z = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank * 31 + step)).to(device)
        opt_g.zero_grad()
        opt_d.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = d(g(z)).float().square().mean()
        value = loss.detach().clone()
        dist.all_reduce(value)  # the user's own collective, between forward and backward
        logged.append(value.item())
        if step == BAD_STEP and rank == world_size - 1:
            loss = loss * float("inf")  # an fp16 overflow on one rank only
        scaler.scale(loss).backward()
        scaler.step(opt_g)
        scaler.step(opt_d)
        scaler.update()
        scales.append(scaler.get_scale())
    weights = [p.detach().cpu() for p in pair.parameters()]
    if system != "ddp":
        pair.g.bagua_ddp.close()
        pair.d.bagua_ddp.close()
    return weights, scales, logged


SYSTEMS = ["ddp", "gradient_allreduce", "bytegrad"]


def _systems(backend: str) -> list[str]:
    """ByteGrad's scatter-reduce is point-to-point on gloo, which cannot send CUDA tensors (:data:`GLOO_P2P`)."""
    return SYSTEMS if backend == "nccl" else [s for s in SYSTEMS if s not in GLOO_P2P]


def _worker_gan(rank, world_size, store_path, device="cuda"):
    if store_path is not None:
        init_gloo(rank, world_size, store_path)
    systems = _systems(dist.get_backend())
    return dist.get_backend(), {system: _gan_loop(rank, world_size, system, device) for system in systems}


@pytest.mark.parametrize("backend, world_size", [("nccl", 1), ("gloo", 2)], ids=["nccl-1-rank", "gloo-2-ranks"])
def test_grad_scaler_fp16_two_models_and_a_user_collective(backend, world_size, tmp_path):
    store = None if backend == "nccl" else str(tmp_path / "store")
    runs = run_workers(_worker_gan, world_size, store, init_bagua=store is None, env=ENV, timeout=300)
    expected_scales = [INIT_SCALE] * BAD_STEP + [INIT_SCALE / 2] * (STEPS - BAD_STEP)
    for rank, (got_backend, by_system) in enumerate(runs):
        assert got_backend == backend and list(by_system) == _systems(backend)
        ddp_weights = by_system["ddp"][0]
        for system, (weights, scales, logged) in by_system.items():
            assert scales == expected_scales, (system, rank, scales)
            assert logged == runs[0][1][system][2], f"{system}: rank {rank} logged another summed loss"
            assert all(torch.isfinite(w).all() for w in weights), (system, rank)
            tol = dict(rtol=0, atol=1e-3) if system == "bytegrad" else dict(rtol=1e-5, atol=1e-6)
            assert_close(weights, ddp_weights, **tol, msg=lambda m: f"{system} against DDP, rank {rank}: {m}")
    for system in _systems(backend):  # synchronous training: the ranks hold the same weights
        for a, b in zip(runs[0][1][system][0], runs[-1][1][system][0]):
            assert torch.equal(a, b), f"{system}: the ranks differ"


# -- a checkpoint saved on CUDA loads without CUDA -----------------------------------------------------------------


def _worker_save(rank, world_size, path, device="cuda"):
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.checkpoint import save_checkpoint

    model = make_model(rank).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    for step in range(3):
        x, y = (t.to(device) for t in batch(rank, step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    save_checkpoint(3, path, model, opt)
    state = {k: v.cpu() for k, v in opt.state[next(iter(model.parameters()))].items() if torch.is_tensor(v)}
    weights = [p.detach().cpu() for p in model.parameters()]
    model.bagua_ddp.close()
    return dist.get_backend(), weights, state


def _worker_load(rank, world_size, path):
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.checkpoint import load_checkpoint

    assert not torch.cuda.is_available(), "CUDA should be hidden from this process"
    model = make_model(rank + 1)  # other weights: the load must replace them
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    iteration = load_checkpoint(path, model, opt)
    state = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items() if torch.is_tensor(v)}
    weights = [p.detach().clone() for p in model.parameters()]
    x, y = batch(rank, 3)  # and training goes on, on CPU
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    devices = {p.device.type for p in model.parameters()} | {v.device.type for v in state.values()}
    model.bagua_ddp.close()
    return dist.get_backend(), iteration, weights, state, devices


def test_checkpoint_saved_on_cuda_loads_without_cuda(tmp_path):
    path = str(tmp_path / "ckpt")
    (backend, weights, state), = run_workers(_worker_save, 1, path, env=ENV, timeout=180)
    assert backend == "nccl"
    (backend, iteration, loaded, loaded_state, devices), = run_workers(
        _worker_load, 1, path, env={**ENV, "CUDA_VISIBLE_DEVICES": ""}, timeout=180
    )
    assert (backend, iteration, devices) == ("gloo", 3, {"cpu"})
    for a, b in zip(loaded, weights):
        assert torch.equal(a, b)
    assert state.keys() == loaded_state.keys()
    for key in state:
        assert torch.equal(loaded_state[key].cpu(), state[key]), key
