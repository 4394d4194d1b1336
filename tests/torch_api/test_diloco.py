"""DiLoCo and Streaming DiLoCo against the maths written plainly on tensors in this file.

The reference trains an ordinary model with the same inner optimizer on every rank; at each fragment's
synchronization it all-gathers every rank's weights with ``dist.all_gather``, forms the pseudo-gradients
``g - x``, averages them (``(d0 + d1) / 2``), applies SGD with Nesterov momentum written out (``buf = avg`` at the
first step, then ``buf = m * buf + avg``; ``update = avg + m * buf``; ``g -= lr * update``, each ``a + c * b`` as
``torch.add(a, b, alpha=c)``, which is how torch's SGD rounds; with an outer-lr warm-up of ``W`` outer steps a
fragment's ``k``-th outer step, from 1, uses ``lr * min(1, k / W)``) and sets the weights (``x = g``, or
``alpha * x + (1 - alpha) * g`` when the exchange overlapped ``tau`` steps).

Tolerance: exact (rtol=0, atol=0) for float32 exchanges at 2 ranks (the sum of two numbers does not depend on
their order). ``H = 1``, outer SGD lr 1 without momentum and inner SGD is gradient averaging up to float32
rounding (``g - (g - (g - lr * grad))``): atol 1e-6. Compressed exchanges: every rank holds the same weights bit
for bit, and the first synchronization's global weights lie within the codec's error of the exact ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of

EXACT = dict(rtol=0, atol=0)


# -- the reference ------------------------------------------------------------------------------------------


def _fragments(model, fragments):
    """Parameters in model order cut into ``fragments`` consecutive runs of about equal bytes (as documented)."""
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    total, runs, current, acc = sum(sizes), [], [], 0
    for i, p in enumerate(params):
        current.append(p)
        acc += sizes[i]
        left = len(params) - i - 1
        if len(runs) < fragments - 1 and acc >= total * (len(runs) + 1) / fragments and left >= fragments - 1 - len(
                runs):
            runs.append(current)
            current = []
    runs.append(current)
    assert len(runs) == fragments and all(runs)
    return runs


def _mean_over_ranks(t):
    values = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(values, t.contiguous())
    return sum(values[1:], values[0]) / len(values)


def _train_reference(rank, steps, H, F, tau, alpha, lr, m, inner, warmup=0):
    model = make_model(0)
    opt = inner(model.parameters())
    frags = _fragments(model, F)
    glob = [[p.detach().clone() for p in frag] for frag in frags]
    bufs = [None] * F
    offsets = [max(1, round((p + 1) * H / F)) for p in range(F)]
    in_flight = {}  # fragment -> (finish step, averaged pseudo-gradients)
    taken = [0] * F  # outer steps of each fragment

    def outer(p, avg, a):
        taken[p] += 1
        rate = lr * min(1.0, taken[p] / warmup) if warmup else lr
        _outer(frags[p], glob[p], bufs, p, avg, rate, m, a)

    history = []
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        for p in range(F):
            if p in in_flight and in_flight[p][0] == step:
                outer(p, in_flight.pop(p)[1], alpha if tau else 0.0)
        for p in range(F):
            if step % H == offsets[p] % H:
                avg = [_mean_over_ranks(g - x.detach()) for g, x in zip(glob[p], frags[p])]
                in_flight[p] = (step + tau, avg)
                if tau == 0:
                    outer(p, in_flight.pop(p)[1], 0.0)
        history.append(params_of(model))
    return history


@torch.no_grad()
def _outer(params, glob, bufs, p, avg, lr, m, alpha):
    if m > 0:
        if bufs[p] is None:
            bufs[p] = [a.clone() for a in avg]
        else:
            bufs[p] = [torch.add(b * m, a) for b, a in zip(bufs[p], avg)]  # buf.mul_(m).add_(avg)
        updates = [torch.add(a, b, alpha=m) for a, b in zip(avg, bufs[p])]  # nesterov
    else:
        updates = avg
    for g, u in zip(glob, updates):
        g.add_(u, alpha=-lr)
    for x, g in zip(params, glob):
        x.copy_(g if alpha == 0 else torch.lerp(x, g, 1 - alpha))


def _train_diloco(rank, steps, algorithm, inner):
    import bagua.torch_api as bagua  # noqa: F401  (installs with_bagua)

    model = make_model(rank)
    opt = inner(model.parameters())
    model = model.with_bagua([opt], algorithm)
    history = []
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        history.append(params_of(model))
    return history


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def _worker_parity(rank, world_size, steps, H, F, tau, alpha, W):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    algorithm = DiLoCoAlgorithm(sync_every=H, fragments=F, overlap_steps=tau, overlap_alpha=alpha,
                                hierarchical=False, outer_lr_warmup=W, outer_lr=0.7, outer_momentum=0.9)
    got = _train_diloco(rank, steps, algorithm, _adamw)
    expected = _train_reference(rank, steps, H, F, tau, alpha, 0.7, 0.9, _adamw, warmup=W)
    return got, expected


@pytest.mark.parametrize(
    "H,F,tau,alpha,W",
    [(3, 1, 0, 0.5, 0), (4, 2, 0, 0.5, 0), (6, 3, 1, 0.5, 0), (4, 2, 1, 0.0, 0), (2, 2, 0, 0.5, 3)],
    ids=["diloco", "streaming-2", "streaming-3-overlap", "streaming-2-overlap-alpha0", "streaming-2-lr-warmup-3"],
)
def test_matches_plain_tensor_reference(tmp_path, H, F, tau, alpha, W):
    steps = 3 * H + tau if not W else (W + 1) * H
    results = run_workers(_worker_parity, 2, steps, H, F, tau, alpha, W, timeout=120)
    for rank, (got, expected) in enumerate(results):
        for step, (g, e) in enumerate(zip(got, expected), start=1):
            for a, b in zip(g, e):
                assert_close(a, b, **EXACT, msg=lambda m: f"rank {rank} step {step}: {m}")
    # plain DiLoCo: every rank holds the same weights after each synchronization
    if F == 1:
        for step in range(H, steps + 1, H):
            for a, b in zip(results[0][0][step - 1], results[1][0][step - 1]):
                assert torch.equal(a, b)


def _worker_h1(rank, world_size, steps):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    got = _train_diloco(rank, steps, DiLoCoAlgorithm(sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                                                     hierarchical=False), _sgd)
    # gradient averaging written plainly: every rank steps with the mean gradient
    model = make_model(0)
    expected = []
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.05 * _mean_over_ranks(p.grad))
        expected.append(params_of(model))
    return got, expected


def test_h1_outer_lr1_is_gradient_averaging(tmp_path):
    for got, expected in run_workers(_worker_h1, 2, 5, timeout=120):
        for g, e in zip(got, expected):
            for a, b in zip(g, e):
                assert_close(a, b, rtol=0, atol=1e-6)


# -- compressed pseudo-gradients: identical ranks, within the codec's error ---------------------------------


def _worker_compressed(rank, world_size, compression, H):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    algorithm = DiLoCoAlgorithm(sync_every=H, compression=compression, hierarchical=False, outer_lr=0.7,
                                outer_momentum=0.9)
    got = _train_diloco(rank, 2 * H, algorithm, _adamw)
    # the exact run up to its first synchronization: the same inner steps, then a float32 average
    model = make_model(0)
    opt = _adamw(model.parameters())
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(1, H + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    deltas = [g - p.detach() for g, p in zip(start, model.parameters())]
    spread = torch.cat([d.reshape(-1) for d in deltas])
    ranges = [torch.empty(2) for _ in range(world_size)]
    dist.all_gather(ranges, torch.stack([spread.min(), spread.max()]))
    avg = [_mean_over_ranks(d) for d in deltas]
    exact = [torch.add(g, a, alpha=-0.7 * 1.9) for g, a in zip(start, avg)]  # first outer step: (1 + m) * avg
    return got, exact, max(float(r[1] - r[0]) for r in ranges), max(float(d.abs().max()) for d in deltas)


@pytest.mark.parametrize("compression", ["bf16", "uint8", "uint4"])
def test_compressed_ranks_agree_and_stay_within_the_codec_bound(compression):
    H = 3
    results = run_workers(_worker_compressed, 2, compression, H, timeout=120)
    for step in (H, 2 * H):  # bit for bit after each synchronization, whatever the codec
        for a, b in zip(results[0][0][step - 1], results[1][0][step - 1]):
            assert torch.equal(a, b), (compression, step)
    # first synchronization: the average is quantized twice (each rank's chunk, then the owner's average), each
    # within half a step of its block's range (the average's range is at most the largest rank's range);
    # bf16 rounds twice to 8 significant bits
    widest, largest = max(r[2] for r in results), max(r[3] for r in results)
    levels = {"uint8": 255, "uint4": 15}.get(compression)
    avg_error = 1.01 * widest / levels + 1e-7 if levels else 2 * largest * 2.0**-8
    for rank, (got, exact, _, _) in enumerate(results):
        errors = [float((a - b).abs().max()) for a, b in zip(got[H - 1], exact)]
        assert max(errors) <= 0.7 * 1.9 * avg_error, (compression, rank, errors, avg_error)
        assert max(errors) > 0, "the codec changed nothing: this test could not see a wrong average"


@pytest.mark.parametrize("compression, cosine", [("nf2", 0.8), ("sign1", 0.5)])
def test_centred_codes_ranks_agree_and_keep_the_direction_of_the_outer_step(compression, cosine):
    """nf2's and sign1's errors have no range bound (outliers are clipped at 1.51 RMS, or at the mean deviation):
    the ranks still end bit for bit equal, and the first outer step keeps the exact one's direction (cosine above
    0.8 for nf2, 0.5 for 1-bit sign1, which is coded twice; a wrong average, a lost chunk or a sign error would fall
    far below)."""
    H = 3
    results = run_workers(_worker_compressed, 2, compression, H, timeout=120)
    for step in (H, 2 * H):
        for a, b in zip(results[0][0][step - 1], results[1][0][step - 1]):
            assert torch.equal(a, b), step
    start = torch.cat([p.detach().reshape(-1) for p in make_model(0).parameters()])
    for got, exact, _, _ in results:
        moved = torch.cat([t.reshape(-1) for t in got[H - 1]]) - start
        wanted = torch.cat([t.reshape(-1) for t in exact]) - start
        got_cosine = float(torch.nn.functional.cosine_similarity(moved, wanted, dim=0))
        assert got_cosine > cosine  # when written: nf2 0.92, sign1 0.66
        assert not torch.equal(moved, wanted), "the codec changed nothing: this test could not see a wrong average"


def _worker_bytes(rank, world_size):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1000), torch.nn.Linear(1000, 744))  # 1 M parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = model.with_bagua([opt], DiLoCoAlgorithm(sync_every=2, compression="uint4", hierarchical=False))
    for step in range(4):
        opt.zero_grad()
        model(torch.randn(4, 256)).square().mean().backward()  # (a model of a few blocks pads more, see below)
        opt.step()
    impl = model.bagua_algorithm
    return impl.bytes_sent / impl.syncs, sum(p.numel() for p in model.parameters())


def test_uint4_sends_half_a_byte_per_parameter():
    # 2 ranks: a rank sends half of its encoded pseudo-gradient to the other chunk's owner, then its encoded
    # half of the average: params x 0.5 bytes per synchronization, plus the per-block min/max headers (0.4 %) and
    # the all-gather's padding of the shorter chunk to the longer (chunks are whole blocks of 4096: 1 % here, 5 %
    # for a model of 29 blocks, nothing for a large one)
    for per_sync, params in run_workers(_worker_bytes, 2, timeout=120):
        assert params * 0.5 <= per_sync <= 1.05 * params * 0.5, (per_sync, params)
