"""DiLoCoOptimizer on plain torch DDP at 2 CPU ranks, against the plain-tensor DiLoCo of tests/torch_api/test_diloco.py
and against ``with_bagua`` + ``DiLoCoAlgorithm``.

References and tolerances:

- the plain reference (rank 0's weights, the inner optimizer on each rank's own data, pseudo-gradients averaged,
  SGD-Nesterov written out): exact (``rtol=atol=0``) for float32 exchanges at 2 ranks, with the local gradients
  kept by ``ddp_hooks.local_hook`` and, separately, by ``no_sync()`` around every backward; plain DiLoCo and
  Streaming DiLoCo with 2 fragments and an overlapped exchange (tau = 1);
- ``DiLoCoAlgorithm`` with a warm-up of 2 gradient-averaging steps (``LocalState(warmup_steps=2)``): exact (the
  hook's allreduce divides each rank's gradient by 2 before the sum, Bagua's divides the sum; both exact in binary);
- GradScaler with an overflow on one rank: that rank skips its inner step and still synchronizes with the other
  at step H (exact, against the reference with that step skipped; power-of-two scales unscale exactly);
- ``state_dict`` / ``load_state_dict`` in the middle of a round with an exchange in flight: bit for bit the
  uninterrupted run.

Every scenario runs in one job of 2 processes (a fixture), each test asserting its own part.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of
from tests.torch_api.test_diloco import _adamw, _mean_over_ranks, _outer, _sgd
from tests.torch_api.test_diloco import _train_reference as _reference

EXACT = dict(rtol=0, atol=0)
CONFIGS = {  # name: (H, F, tau, alpha, steps)
    "diloco": (3, 1, 0, 0.5, 9),
    "streaming-2-overlap": (4, 2, 1, 0.5, 9),
}


def _ddp(rank, hook_state="local", **ddp_kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bagua.torch_api.contrib.ddp_hooks import local_hook

    ddp = DDP(make_model(rank), **ddp_kwargs)
    if hook_state is not None:
        ddp.register_comm_hook(None if hook_state == "local" else hook_state, local_hook)
    return ddp


def _train(ddp, opt, rank, first, last, no_sync=False, history=None):
    history = [] if history is None else history
    for step in range(first, last + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        with ddp.no_sync() if no_sync else contextlib.nullcontext():
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        history.append(params_of(ddp.module))
    return history


def _run_config(rank, name, no_sync=False):
    from bagua.torch_api.contrib import DiLoCoOptimizer

    H, F, tau, alpha, steps = CONFIGS[name]
    ddp = _ddp(rank, hook_state=None if no_sync else "local")
    opt = DiLoCoOptimizer(_adamw(ddp.parameters()), sync_every=H, fragments=F, overlap_steps=tau,
                          overlap_alpha=alpha, outer_lr=0.7, outer_momentum=0.9)
    got = _train(ddp, opt, rank, 1, steps, no_sync=no_sync)
    opt.close()
    return got, _reference(rank, steps, H, F, tau, alpha, 0.7, 0.9, _adamw), opt.syncs


def _run_warmup(rank):
    import bagua.torch_api  # noqa: F401  (installs with_bagua)
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm
    from bagua.torch_api.contrib import DiLoCoOptimizer
    from bagua.torch_api.contrib.ddp_hooks import LocalState

    ddp = _ddp(rank, hook_state=LocalState(warmup_steps=2))
    opt = DiLoCoOptimizer(_sgd(ddp.parameters()), sync_every=3, warmup_steps=2)
    got = _train(ddp, opt, rank, 1, 8)
    model = make_model(rank)
    inner = _sgd(model.parameters())
    model = model.with_bagua([inner], DiLoCoAlgorithm(sync_every=3, warmup_steps=2, hierarchical=False))
    expected = []
    for step in range(1, 9):
        x, y = batch(rank, step)
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        expected.append(params_of(model))
    model.bagua_ddp.close()
    return got, expected


def _run_scaler(rank, H=3, skip_step=3):
    from bagua.torch_api.contrib import DiLoCoOptimizer

    ddp = _ddp(rank)
    opt = DiLoCoOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.05), sync_every=H, outer_lr=0.7,
                          outer_momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    got = []
    for step in range(1, 2 * H + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if rank == 0 and step == skip_step:
            loss = loss * float("inf")  # an overflow on this rank only
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        got.append(params_of(ddp.module))
    # the reference: rank 0 skips that inner step and synchronizes at every H-th step all the same
    model = make_model(0)
    ref = torch.optim.SGD(model.parameters(), lr=0.05)
    glob, bufs, expected = [p.detach().clone() for p in model.parameters()], [None], []
    for step in range(1, 2 * H + 1):
        x, y = batch(rank, step)
        ref.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if not (rank == 0 and step == skip_step):
            ref.step()
        if step % H == 0:
            avg = [_mean_over_ranks(g - p.detach()) for g, p in zip(glob, model.parameters())]
            _outer(list(model.parameters()), glob, bufs, 0, avg, 0.7, 0.9, 0.0)
        expected.append(params_of(model))
    return got, expected, scaler.get_scale()


def _run_resume(rank, save_at=6, steps=9):
    from bagua.torch_api.contrib import DiLoCoOptimizer

    def fresh():
        ddp = _ddp(rank)
        return ddp, DiLoCoOptimizer(_adamw(ddp.parameters()), sync_every=4, fragments=2, overlap_steps=1,
                                    outer_lr=0.7, outer_momentum=0.9)  # with momentum: its buffer is resumed

    ddp, opt = fresh()
    straight = _train(ddp, opt, rank, 1, steps)
    opt.close()
    ddp, opt = fresh()
    _train(ddp, opt, rank, 1, save_at)
    saved = {"model": {k: v.clone() for k, v in ddp.module.state_dict().items()}, "opt": opt.state_dict()}
    opt.close()
    ddp, opt = fresh()
    ddp.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    resumed = _train(ddp, opt, rank, save_at + 1, steps)
    opt.close()
    return straight[save_at:], resumed, sorted(saved["opt"]["diloco"])


def _run_compressed(rank, steps=6):
    """uint8 pseudo-gradients (block codec, error feedback): the weights of DiLoCoAlgorithm, and a resume."""
    import bagua.torch_api  # noqa: F401  (installs with_bagua)
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm
    from bagua.torch_api.contrib import DiLoCoOptimizer

    ddp = _ddp(rank)
    opt = DiLoCoOptimizer(_adamw(ddp.parameters()), sync_every=3, compression="uint8", block_size=64)
    got = _train(ddp, opt, rank, 1, steps)
    model = make_model(rank)
    inner = _adamw(model.parameters())
    model = model.with_bagua([inner], DiLoCoAlgorithm(sync_every=3, compression="uint8", block_size=64,
                                                      hierarchical=False))
    expected = []
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        expected.append(params_of(model))
    model.bagua_ddp.close()
    return got, expected


def _worker_all(rank, world_size):
    import importlib.util

    out = {f"{name}/hook": _run_config(rank, name) for name in CONFIGS}
    if importlib.util.find_spec("bagua.torch_api.codecs.block_allreduce") is not None:
        out["uint8"] = _run_compressed(rank)
    out["diloco/no_sync"] = _run_config(rank, "diloco", no_sync=True)
    out["warmup"] = _run_warmup(rank)
    out["scaler"] = _run_scaler(rank)
    out["resume"] = _run_resume(rank)
    return out


@pytest.fixture(scope="module")
def job():
    return run_workers(_worker_all, 2, timeout=240)


def _assert_histories(got, expected, rank, what):
    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected), start=1):
        for a, b in zip(g, e):
            assert_close(a, b, **EXACT, msg=lambda m: f"{what}, rank {rank}, step {step}: {m}")


@pytest.mark.parametrize("case", ["diloco/hook", "streaming-2-overlap/hook", "diloco/no_sync"])
def test_matches_the_plain_reference(job, case):
    H, F, tau, _, steps = CONFIGS[case.split("/")[0]]
    for rank, result in enumerate(job):
        got, expected, syncs = result[case]
        _assert_histories(got, expected, rank, case)
        assert syncs == sum(1 for s in range(1, steps + 1) for p in range(F)
                            if s - tau >= 1 and (s - tau) % H == max(1, round((p + 1) * H / F)) % H)
    if F == 1:  # plain DiLoCo: every rank holds the same weights after each synchronization
        for a, b in zip(job[0][case][0][H - 1], job[1][case][0][H - 1]):
            assert torch.equal(a, b)


def test_warmup_matches_diloco_algorithm(job):
    for rank, result in enumerate(job):
        got, expected = result["warmup"]
        _assert_histories(got, expected, rank, "warm-up")


def test_gradscaler_skip_on_one_rank_keeps_the_schedule(job):
    for rank, result in enumerate(job):
        got, expected, _ = result["scaler"]
        _assert_histories(got, expected, rank, "GradScaler")
    assert job[0]["scaler"][2] < job[1]["scaler"][2]  # only rank 0 lowered its scale
    for a, b in zip(job[0]["scaler"][0][-1], job[1]["scaler"][0][-1]):
        assert torch.equal(a, b)  # both synchronized at step 2H


def test_resume_is_bit_identical(job):
    for rank, result in enumerate(job):
        straight, resumed, keys = result["resume"]
        _assert_histories(resumed, straight, rank, "resume")
        # the checkpoint format: one step counter, then per fragment (fragment 0's exchange of step 6 in flight)
        assert keys == ["0.global", "0.outer.momentum_buffer", "0.pending_average", "0.pending_finish", "1.global",
                        "1.outer.momentum_buffer", "steps"]


def test_compressed_matches_diloco_algorithm(job):
    if "uint8" not in job[0]:
        pytest.skip("bagua.torch_api.codecs.block_allreduce is not in this version")
    for rank, result in enumerate(job):
        got, expected = result["uint8"]
        _assert_histories(got, expected, rank, "uint8")
    for a, b in zip(job[0]["uint8"][0][2], job[1]["uint8"][0][2]):
        assert torch.equal(a, b)  # the same weights on both ranks after the synchronization at step 3


def test_bad_arguments_name_the_fix():
    from bagua.torch_api.contrib import DiLoCoOptimizer

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"DiLoCoOptimizer\(sync_every=...\) must be an integer >= 1"):
        DiLoCoOptimizer(torch.optim.SGD(params, lr=0.1), sync_every=0)
    with pytest.raises(ValueError, match="must be a torch.optim.Optimizer"):
        DiLoCoOptimizer(params)
    with pytest.raises(ValueError, match="compression"):
        DiLoCoOptimizer(torch.optim.SGD(params, lr=0.1), compression="uint9")
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="init_process_group"):
            DiLoCoOptimizer(torch.optim.SGD(params, lr=0.1))
