"""ByteGrad as a DDP communication hook, on plain torch DDP at 2 CPU ranks.

References:

- Bagua's own ByteGrad (``with_bagua``, one bucket) on the same model and data: the same weights, bit for bit
  (``torch.equal``). The two chunk the same bytes when each rank's chunk holds the same elements in both: DDP puts
  the parameters in model order in its first iteration, then rebuilds its bucket in gradient-ready order; Bagua
  uses reverse model order. With 2 ranks the bucket halves are the chunks, and the square MLP here (two
  ``Linear(d, d)`` with biases) has ``{fc1.weight, fc1.bias}`` in one half and ``{fc2.weight, fc2.bias}`` in the
  other in every one of those orders. The order of the elements inside a chunk does not matter: min/max, the codes
  and the rank-order sum are per element.
- Plain DDP (float32 allreduce): the hook's averaged gradient lies within the codec's bound of the exact average:
  per chunk, ``mean_i(range_i) / 510`` (each rank's quantization) ``+ range(result) / 510 * 1.01`` (the owner's
  second quantization; 1 % for the range of the average before it was quantized) ``+ 1e-6`` (float32 rounding).
- Accumulation with ``no_sync()``: the same weights as Bagua's ByteGrad with its own ``no_sync()``.
- GradScaler with an overflow on one rank: every rank skips the same step, lowers its scale alike and keeps the
  same weights (with error feedback too, whose residuals roll back).
- Several buckets in flight on gloo (where torch's PowerSGD hook deadlocks): the step finishes and every rank holds
  the same weights.

Every scenario runs in one job of 2 processes (a fixture), each test asserting its own part.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_workers

STEPS = 4
D = 24
BIG_BUCKET = {"BAGUA_DEFAULT_BUCKET_SIZE": str(1 << 30)}


class Square(torch.nn.Module):
    """Two ``Linear(D, D)`` with biases: each half of the flat gradient is one layer in any parameter order."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(D, D)
        self.fc2 = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _model(rank: int) -> Square:
    torch.manual_seed(1000 + rank)  # different on every rank: the wrap's broadcast is exercised
    return Square()


def _batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 7919 + step * 31 + micro)
    return torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _ddp_with_hook(rank: int, error_feedback: bool = False, **ddp_kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bagua.torch_api.contrib.ddp_hooks import ByteGradState, bytegrad_hook

    ddp = DDP(_model(rank), **{"bucket_cap_mb": 1024, **ddp_kwargs})
    state = ByteGradState(error_feedback=error_feedback)
    ddp.register_comm_hook(state, bytegrad_hook)
    return ddp, state


def _train(model, opt, rank: int, steps: int, micro_batches: int = 1, no_sync=None) -> list[list[torch.Tensor]]:
    history = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        for micro in range(micro_batches):
            x, y = _batch(rank, step, micro)
            last = micro == micro_batches - 1
            ctx = no_sync() if (no_sync is not None and not last) else _nullcontext()
            with ctx:
                torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        history.append(_params(model))
    return history


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _worker_parity(rank, world_size, micro_batches):
    import bagua.torch_api  # noqa: F401  (installs with_bagua)
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm

    ddp, state = _ddp_with_hook(rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    hook = _train(ddp, opt, rank, STEPS, micro_batches, ddp.no_sync)
    state.close()

    model = _model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = model.with_bagua([opt], ByteGradAlgorithm(hierarchical=False))
    assert len(model.bagua_buckets) == 1
    bagua = _train(model, opt, rank, STEPS, micro_batches, model.bagua_ddp.no_sync)
    model.bagua_ddp.close()
    return hook, bagua, state.iter, state.buckets


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["plain", "no_sync-accumulation"])
def test_same_weights_as_bagua_bytegrad(job, micro_batches):
    results = [r[f"parity{micro_batches}"] for r in job]
    for rank, (hook, bagua, iters, buckets) in enumerate(results):
        assert iters == STEPS and buckets == STEPS, (iters, buckets)  # one bucket, one exchange per step
        for step, (h, b) in enumerate(zip(hook, bagua), start=1):
            for name, x, y in zip(("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"), h, b):
                assert torch.equal(x, y), f"rank {rank} step {step} {name}: max diff {(x - y).abs().max()}"
    for x, y in zip(results[0][0][-1], results[1][0][-1]):
        assert torch.equal(x, y)


def _worker_codec_bound(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp, state = _ddp_with_hook(rank)
    exact = DDP(_model(rank), bucket_cap_mb=1024)
    x, y = _batch(rank, 1)
    out = []
    for model in (ddp, exact):
        torch.nn.functional.mse_loss(model(x), y).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    # each rank's local gradient, for the bound: the hook's bucket is model order in the first iteration
    local = Square()
    local.load_state_dict(exact.module.state_dict())
    torch.nn.functional.mse_loss(local(x), y).backward()
    mine = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    state.close()
    return out[0], out[1], every


def test_within_the_codec_bound_of_ddp(job):
    hooked, exact, every = job[0]["bound"]
    n = len(every)
    length = -(-hooked.numel() // n)
    assert not torch.equal(hooked, exact)  # compressed, not a float32 allreduce
    for j in range(n):
        sl = slice(j * length, (j + 1) * length)
        ranges = [float(g[sl].max() - g[sl].min()) for g in every]
        result_range = float(hooked[sl].max() - hooked[sl].min())
        bound = sum(ranges) / n / 510 + result_range / 510 * 1.01 + 1e-6
        err = float((hooked[sl] - exact[sl]).abs().max())
        assert err <= bound, f"chunk {j}: error {err} above the codec's bound {bound}"


def _worker_scaler(rank, world_size, error_feedback):
    ddp, state = _ddp_with_hook(rank, error_feedback=error_feedback)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    history, scales = [], []
    for step in range(1, 6):
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if rank == 1 and step == 3:
            loss = loss * float("inf")  # an overflow on one rank only
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        history.append(_params(ddp))
    state.close()
    return history, scales, state.nonfinite_buckets


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "error-feedback"])
def test_gradscaler_overflow_on_one_rank_skips_the_step_everywhere(job, error_feedback):
    (h0, s0, bad0), (h1, s1, bad1) = [r[f"scaler{int(error_feedback)}"] for r in job]
    assert s0 == s1 and s0[2] == s0[1] / 2, s0  # both ranks lowered their scale at step 3
    assert bad0 == bad1 == 1
    for step, (a, b) in enumerate(zip(h0, h1), start=1):
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"step {step}"
            assert torch.isfinite(x).all(), f"step {step}"
    for x, y in zip(h0[1], h0[2]):
        assert torch.equal(x, y)  # step 3 changed nothing
    assert any(not torch.equal(x, y) for x, y in zip(h0[2], h0[3]))  # and training went on


class Deep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _worker_many_buckets(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bagua.torch_api.contrib.ddp_hooks import ByteGradState, bytegrad_hook

    torch.manual_seed(rank)
    ddp = DDP(Deep(), bucket_cap_mb=0.02)  # about one bucket per layer: several in flight at once
    state = ByteGradState(error_feedback=True)
    ddp.register_comm_hook(state, bytegrad_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(1, 6):
        g = torch.Generator().manual_seed(rank * 100 + step)
        opt.zero_grad()
        ddp(torch.randn(16, 64, generator=g)).square().mean().backward()
        opt.step()
    state.close()
    return _params(ddp), state.buckets, state.iter


def test_several_buckets_in_flight_on_gloo(job):
    (p0, buckets, iters), (p1, _, _) = [r["many"] for r in job]
    assert iters == 5 and buckets >= 1 + 4 * 3, (buckets, iters)  # one bucket, then three per step
    for x, y in zip(p0, p1):
        assert torch.equal(x, y)


def _worker_all(rank, world_size):
    """Every scenario of this file, one after the other in one job (spawning a job costs seconds)."""
    return {
        "parity1": _worker_parity(rank, world_size, 1),
        "parity2": _worker_parity(rank, world_size, 2),
        "bound": _worker_codec_bound(rank, world_size),
        "scaler0": _worker_scaler(rank, world_size, False),
        "scaler1": _worker_scaler(rank, world_size, True),
        "many": _worker_many_buckets(rank, world_size),
    }


@pytest.fixture(scope="module")
def job():
    return run_workers(_worker_all, 2, env=BIG_BUCKET, timeout=240)


def test_arguments_are_checked_and_name_the_fix():
    from bagua.torch_api.contrib.ddp_hooks import ByteGradState, LocalState

    with pytest.raises(ValueError, match="codec='uint8x'\\) is not a codec; available: 'chunk'"):
        ByteGradState(codec="uint8x")
    with pytest.raises(ValueError, match="must be True or False"):
        ByteGradState(error_feedback="yes")
    with pytest.raises(ValueError, match="warmup_steps"):
        LocalState(warmup_steps=-1)


def _worker_plain_torch(rank, world_size, store_path):
    """A plain torch script: no Bagua initialization, and the state built before torch.distributed (as Lightning
    builds DDPStrategy's arguments before its processes rendezvous)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bagua.torch_api.contrib.ddp_hooks import ByteGradState, bytegrad_hook

    state = ByteGradState()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    ddp = DDP(_model(rank))
    ddp.register_comm_hook(state, bytegrad_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    history = _train(ddp, opt, rank, 3)
    state.close()
    return history, state.ranks


def test_plain_torch_without_bagua_and_a_state_built_before_init(tmp_path):
    (h0, ranks), (h1, _) = run_workers(_worker_plain_torch, 2, str(tmp_path / "store"), init_bagua=False,
                                       timeout=120)
    assert ranks == [0, 1]
    for x, y in zip(h0[-1], h1[-1]):
        assert torch.equal(x, y)
    assert any(not torch.equal(x, y) for x, y in zip(h0[0], h0[-1]))
