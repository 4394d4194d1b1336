"""Eager updates (``DiLoCoAlgorithm(eager=True)``) against the maths written plainly on tensors in this file.

The reference trains an ordinary model on each of 2 ranks. When a fragment's exchange starts it forms this rank's
pseudo-gradient ``d = g - x`` and the average over the ranks ``avg`` (``dist.all_gather``, ``(d0 + d1) / 2``); it
takes the outer step written out (SGD with Nesterov momentum: ``buf = d`` at the first step, then
``buf = m * buf + d``; ``update = d + m * buf``; ``e = g - lr * update``) with ``d`` standing in for ``avg`` on a
copy of the momentum, and sets the weights to ``e``. ``tau`` inner steps later it takes the same step with ``avg``
on the real momentum (``g`` becomes ``g'``) and moves the weights by ``g' - e``. Each ``a + c * b`` is written as
``torch.add(a, b, alpha=c)``, which is how torch's SGD rounds; ``eager=False`` is Streaming DiLoCo's merge
``x = alpha * x + (1 - alpha) * g'``, which these settings ran before eager updates existed. ``overlap_keep=True``
leaves the weights where they are when the exchange starts (``x_sent``) and moves them by ``g' - x_sent`` when the
average arrives.

Tolerance: exact (rtol=0, atol=0): float32 averages of two ranks do not depend on their order, and the correction
``g' - e`` is rounded once, as in the library.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of

EXACT = dict(rtol=0, atol=0)
LR, M = 0.7, 0.9


def _halves(model):
    """The 2 fragments the library cuts this model into: its parameters in order, split at half the bytes."""
    params = list(model.parameters())
    total, acc = sum(p.numel() for p in params), 0
    for i, p in enumerate(params):
        acc += p.numel()
        if acc >= total / 2:
            return [params[: i + 1], params[i + 1 :]]
    raise AssertionError("unreachable")


def _mean_over_ranks(t):
    values = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(values, t.contiguous())
    return sum(values[1:], values[0]) / len(values)


def _nesterov(buf, grad):
    """One Nesterov SGD step's (new buffer, update) from ``buf`` (None at the first step) and ``grad``."""
    buf = grad.clone() if buf is None else torch.add(buf * M, grad)
    return buf, torch.add(grad, buf, alpha=M)


@torch.no_grad()
def _train_reference(rank, steps, H, F, tau, mode, alpha=0.5):
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    frags = _halves(model) if F == 2 else [list(model.parameters())]
    glob = [[p.detach().clone() for p in frag] for frag in frags]
    bufs = [[None] * len(frag) for frag in frags]
    offsets = [max(1, round((p + 1) * H / F)) for p in range(F)]
    in_flight = {}  # fragment -> (finish step, average, stand-in global weights)
    history = []
    for step in range(1, steps + 1):
        with torch.enable_grad():
            x, y = batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        for p in range(F):
            if p in in_flight and in_flight[p][0] == step:
                _, avg, stand_in = in_flight.pop(p)
                for i, (x, g, a) in enumerate(zip(frags[p], glob[p], avg)):
                    bufs[p][i], update = _nesterov(bufs[p][i], a)
                    g.add_(update, alpha=-LR)
                    if mode in ("eager", "keep"):
                        x.add_(g - stand_in[i])
                    else:
                        x.copy_(torch.lerp(x, g, 1 - alpha))
        for p in range(F):
            if step % H == offsets[p] % H:
                local = [g - x for g, x in zip(glob[p], frags[p])]
                avg = [_mean_over_ranks(d) for d in local]
                stand_in = []
                for i, (x, g, d) in enumerate(zip(frags[p], glob[p], local)):
                    if mode == "keep":  # the weights as they are: x_sent
                        stand_in.append(x.clone())
                        continue
                    _, update = _nesterov(bufs[p][i], d)  # a copy of the momentum: the real one waits for avg
                    stand_in.append(torch.add(g, update, alpha=-LR))
                    if mode == "eager":
                        x.copy_(stand_in[-1])
                in_flight[p] = (step + tau, avg, stand_in)
        history.append(params_of(model))
    return history


def _train(rank, steps, algorithm):
    import bagua.torch_api as bagua  # noqa: F401  (installs with_bagua)

    model = make_model(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    model = model.with_bagua([opt], algorithm)
    history = []
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        history.append(params_of(model))
    globals_ = [f.global_.clone() for f in model.bagua_algorithm.fragments]
    return history, globals_


def _worker(rank, world_size, H, tau):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    def algorithm(eager, keep=False, **codec):
        return DiLoCoAlgorithm(sync_every=H, fragments=2, overlap_steps=tau, eager=eager, overlap_keep=keep,
                               hierarchical=False, outer_lr=LR, outer_momentum=M, outer_lr_warmup=0, **codec)

    steps = 3 * H + tau
    eager, _ = _train(rank, steps, algorithm(True))
    merge, _ = _train(rank, steps, algorithm(False))
    keep, _ = _train(rank, steps, algorithm(False, keep=True))
    _, coded_globals = _train(rank, steps, algorithm(True, compression="uint4", block_size=16))
    _, keep_coded_globals = _train(rank, steps, algorithm(False, keep=True, compression="uint4", block_size=16))
    return {mode: (got, _train_reference(rank, steps, H, 2, tau, mode))
            for mode, got in (("eager", eager), ("merge", merge), ("keep", keep))} | {
                "uint4": coded_globals, "keep_uint4": keep_coded_globals}


def test_eager_matches_plain_tensor_reference_and_composes():
    """Eager updates and ``overlap_keep`` with 2 fragments and 2 steps of overlap, against the reference; the same
    run with neither still gives the merge, bit for bit; with the uint4 codec the ranks' global weights agree."""
    H = 4
    results = run_workers(_worker, 2, H, 2, timeout=180)
    for mode in ("eager", "merge", "keep"):
        for rank, result in enumerate(results):
            got, expected = result[mode]
            for step, (g, e) in enumerate(zip(got, expected), start=1):
                for a, b in zip(g, e):
                    assert_close(a, b, **EXACT, msg=lambda m: f"{mode} rank {rank} step {step}: {m}")
    # the stand-in is each rank's own: right after a fragment's exchange starts the ranks' weights differ
    assert any(not torch.equal(a, b) for a, b in zip(results[0]["eager"][0][1], results[1]["eager"][0][1]))
    for key in ("uint4", "keep_uint4"):
        for a, b in zip(results[0][key], results[1][key]):
            assert torch.equal(a, b)
    # keeping the inner steps is not the merge: the two runs part after the first exchange lands
    assert any(not torch.equal(a, b) for a, b in zip(results[0]["keep"][0][-1], results[0]["merge"][0][-1]))


def test_eager_settings_refused_where_they_cannot_run():
    from bagua.torch_api.algorithms.diloco import DiLoCoSettings, check_fault_tolerant_settings

    with pytest.raises(ValueError, match="eager=True. needs overlap_steps >= 1"):
        DiLoCoSettings(eager=True)
    with pytest.raises(ValueError, match="True or False"):
        DiLoCoSettings(eager="yes", overlap_steps=1)
    with pytest.raises(ValueError, match="overlap_keep=True. needs overlap_steps >= 1 and eager=False"):
        DiLoCoSettings(overlap_keep=True)
    with pytest.raises(ValueError, match="overlap_keep=True. needs overlap_steps >= 1 and eager=False"):
        DiLoCoSettings(overlap_keep=True, eager=True, overlap_steps=1)
    with pytest.raises(ValueError, match="fault_tolerance=.... needs overlap_steps=0"):
        check_fault_tolerant_settings(DiLoCoSettings(overlap_keep=True, overlap_steps=1), "DiLoCoOptimizer")
    with pytest.raises(ValueError, match="asynchronous=True. needs overlap_steps=0"):
        DiLoCoSettings(eager=True, overlap_steps=1, asynchronous=True)
    with pytest.raises(ValueError, match="fault_tolerance=.... needs overlap_steps=0"):
        check_fault_tolerant_settings(DiLoCoSettings(eager=True, overlap_steps=1), "DiLoCoOptimizer")


@pytest.mark.parametrize("start", ["eager_step", "keep_step"])
def test_a_checkpoint_in_flight_keeps_the_stand_in(start):
    from bagua.torch_api.ops.diloco import Fragment

    def sgd(params):
        return torch.optim.SGD(params, lr=LR, momentum=M, nesterov=True)

    def run(resume):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(6))
        frag = Fragment(0, [w], sgd)
        with torch.no_grad():
            w.sub_(0.1)
        frag.pseudo_gradient()
        getattr(frag, start)()
        frag.pending = (1, None)
        frag.delta.fill_(0.05)  # the average that arrived
        if resume:
            state = frag.state_dict(1.0)
            frag = Fragment(0, [w], sgd)
            frag.load_state_dict(state, lambda: None)
        with torch.no_grad():
            w.add_(0.01)  # an inner step while the exchange travelled
        frag.finish(1.0, 0.0, "test", eager=True)
        return w.detach().clone(), frag.global_.clone()

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
