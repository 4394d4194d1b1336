"""QAdam: torch Adam bit for bit during warmup; the compressed stage against the maths written on plain tensors.

The reference of the compressed stage uses the plain ByteGrad reference of ``test_bytegrad`` (no code shared
with the implementation) and the same torch ops as ``torch.optim.Adam`` for the moments (``lerp_``, ``addcmul_``),
so the parameters are expected to be bit-identical: the tolerance is exact (``rtol=atol=0``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import Net, batch, params_of
from tests.torch_api.test_bytegrad import _all_gather, _digits_run, _padded, _RefByteGrad


def _adam_pair(weight_decay, groups):
    from bagua.torch_api.algorithms.q_adam import QAdamOptimizer

    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())

    def param_groups(m):
        if not groups:
            return m.parameters()
        rest = list(m.fc2.parameters()) + list(m.fc3.parameters())
        return [{"params": m.fc1.parameters(), "lr": 3e-3}, {"params": rest}]

    q = QAdamOptimizer(param_groups(a), lr=1e-3, warmup_steps=10_000, weight_decay=weight_decay)
    t = torch.optim.Adam(param_groups(b), lr=1e-3, weight_decay=weight_decay)
    return a, b, q, t


@pytest.fixture
def one_thread():
    # intra-op threads only slow these tiny tensors down (badly so on a loaded machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("weight_decay,groups", [(0.0, False), (0.01, True)])
def test_equals_torch_adam_during_warmup(weight_decay, groups, one_thread):
    a, b, q, t = _adam_pair(weight_decay, groups)
    for step in range(300):
        x, y = batch(0, step)
        for model, opt in ((a, q), (b, t)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert_close(params_of(a), params_of(b), rtol=0, atol=0)
    assert_close(
        [q.state[p]["exp_avg_sq"] for p in a.parameters()], [t.state[p]["exp_avg_sq"] for p in b.parameters()],
        rtol=0, atol=0,
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"warmup_steps": 0}, "warmup_steps must be a positive integer"),
        ({"warmup_steps": -5}, "warmup_steps must be a positive integer"),
        ({"warmup_steps": 2.5}, "warmup_steps must be a positive integer"),
        ({"warmup_steps": 0.2}, "pass total_steps"),
        ({"warmup_steps": 10, "total_steps": 0}, "total_steps must be a positive integer"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"lr": -1.0}, "lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
    ],
)
def test_bad_optimizer_arguments(kwargs, match):
    from bagua.torch_api.algorithms.q_adam import QAdamOptimizer

    with pytest.raises(ValueError, match=match):
        QAdamOptimizer(torch.nn.Linear(2, 2).parameters(), **kwargs)


def test_warmup_defaults_to_a_fifth_of_a_known_run():
    from bagua.torch_api.algorithms.q_adam import QAdamOptimizer

    def warmup(**kwargs):
        return QAdamOptimizer(torch.nn.Linear(2, 2).parameters(), **kwargs).warmup_steps

    assert warmup() == 100  # the original's default when the run's length is unknown
    assert warmup(total_steps=480) == 96
    assert warmup(warmup_steps=0.25, total_steps=480) == 120
    assert warmup(warmup_steps=30, total_steps=480) == 30
    assert warmup(total_steps=2) == 1  # never zero


def test_algorithm_needs_a_qadam_optimizer():
    from bagua.torch_api.algorithms import Algorithm
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    with pytest.raises(ValueError, match="QAdamOptimizer"):
        QAdamAlgorithm(torch.optim.Adam(torch.nn.Linear(2, 2).parameters()))
    opt = QAdamOptimizer(torch.nn.Linear(2, 2).parameters(), warmup_steps=5)
    assert Algorithm.init("qadam", q_adam_optimizer=opt) == QAdamAlgorithm(opt, hierarchical=True)


# -- the compressed stage against a plain reference ------------------------------------------------------------

WARMUP, STEPS, LR, WD, BETAS, EPS = 3, 8, 0.01, 0.01, (0.9, 0.999), 1e-8


def _worker_parity(rank, world_size, hierarchical, codec="chunk"):
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
    from tests.torch_api.test_bytegrad_codecs import RefBlockByteGrad

    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    opt = QAdamOptimizer(model.parameters(), lr=LR, warmup_steps=WARMUP, betas=BETAS, eps=EPS, weight_decay=WD)
    model.with_bagua([opt], QAdamAlgorithm(opt, hierarchical=hierarchical, codec=codec, block_size=64))

    names = [n for n, _ in reversed(list(ref_model.named_parameters()))]  # one bucket, reverse order
    params = dict(model.named_parameters())
    ref_params = dict(ref_model.named_parameters())
    bytegrad = _RefByteGrad(error_feedback=False) if codec == "chunk" else RefBlockByteGrad(codec, 64, False)
    history, compressing = [], []
    b1, b2 = BETAS
    for t in range(1, STEPS + 1):
        # one step of the reference from the implementation's current state
        with torch.no_grad():
            for n in names:
                ref_params[n].copy_(params[n])
            state = {n: opt.state[params[n]] for n in names}
            m = {n: state[n]["exp_avg"].clone() if state[n] else torch.zeros_like(params[n]) for n in names}
            v = {n: state[n]["exp_avg_sq"].clone() if state[n] else torch.zeros_like(params[n]) for n in names}
        x, y = batch(rank, t)
        ref_model.zero_grad()
        torch.nn.functional.mse_loss(ref_model(x), y).backward()
        with torch.no_grad():
            if t <= WARMUP:  # float32 average of the gradients, then Adam's moments
                flats = _all_gather(torch.cat([ref_params[n].grad.reshape(-1) for n in names]))
                avg = flats[0]
                for f in flats[1:]:
                    avg = avg + f
                avg = avg / world_size
                offset = 0
                for n in names:
                    p = ref_params[n]
                    g = avg[offset : offset + p.numel()].view_as(p).add(p, alpha=WD)
                    offset += p.numel()
                    m[n].lerp_(g, 1 - b1)
                    v[n].mul_(b2).addcmul_(g, g, value=1 - b2)
            else:  # each rank's momentum from its own gradient, averaged by the ByteGrad reference; v frozen
                local = torch.cat(
                    [m[n].lerp(ref_params[n].grad.add(ref_params[n], alpha=WD), 1 - b1).reshape(-1) for n in names]
                )
                flats = _all_gather(_padded(local, world_size if codec == "chunk" else 1))  # block codecs: unpadded
                if hierarchical:  # two nodes of two ranks: float32 average inside each node first
                    flats = [(flats[0] + flats[1]) / 2, (flats[2] + flats[3]) / 2]
                avg = bytegrad(t, flats)
                offset = 0
                for n in names:
                    m[n] = avg[offset : offset + m[n].numel()].view_as(m[n])
                    offset += m[n].numel()
                    # the frozen v is raised to the averaged momentum: sqrt(v_hat) >= |m_hat|
                    v[n] = torch.maximum(v[n], m[n] ** 2 * ((1 - b2**WARMUP) / (1 - b1**t) ** 2))
            for n in names:
                denom = (v[n].sqrt() / (1 - b2 ** min(t, WARMUP)) ** 0.5).add_(EPS)
                ref_params[n].addcdiv_(m[n], denom, value=-LR / (1 - b1**t))

        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        compressing.append(model.bagua_ddp.impl.compressing)
        history.append((t, params_of(model), params_of(ref_model)))
    return history, compressing, len(model.bagua_buckets)


@pytest.mark.parametrize("world_size,hierarchical,codec", [(2, False, "chunk"), (4, True, "chunk"), (2, False, "uint8")])
def test_compressed_stage_matches_plain_reference(world_size, hierarchical, codec):
    results = run_workers(_worker_parity, world_size, hierarchical, codec, local_size=2 if hierarchical else None)
    for history, compressing, n_buckets in results:
        assert n_buckets == 1
        assert compressing == [t > WARMUP for t in range(1, STEPS + 1)]
        for t, got, expected in history:
            if t <= WARMUP and world_size > 2:
                # gloo may add 4 gradients in another order than the reference: float32 rounding only
                assert_close(got, expected, rtol=1e-6, atol=1e-7)
            else:
                assert_close(got, expected, rtol=0, atol=0)
    for history, _, _ in results[1:]:
        assert_close(history[-1][1], results[0][0][-1][1], rtol=0, atol=0)  # identical weights everywhere


# -- convergence on a real dataset -----------------------------------------------------------------------------


def _worker_digits(rank, world_size):
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    def adam(params):
        return torch.optim.Adam(params, lr=3e-3)

    def qadam(params):
        return QAdamOptimizer(params, lr=3e-3, warmup_steps=40)  # about 20% of the 176 steps

    return {
        "gradient_allreduce": _digits_run(rank, world_size, adam, lambda opt: GradientAllReduceAlgorithm()),
        "qadam": _digits_run(rank, world_size, qadam, lambda opt: QAdamAlgorithm(opt)),
    }


def test_digits_accuracy_within_two_points_of_gradient_allreduce():
    results = run_workers(_worker_digits, 2)
    assert_close(results[1]["qadam"][1], results[0]["qadam"][1], rtol=0, atol=0)
    acc = {name: a for name, (a, _) in results[0].items()}
    assert acc["gradient_allreduce"] > 90, acc
    assert acc["qadam"] >= acc["gradient_allreduce"] - 2, acc


# -- coordinates without gradient during the warmup --------------------------------------------------------------


def _worker_rare_feature(rank, world_size, use_qadam):
    """Regression on 8 features, the first of which is absent (always 0) during the warmup and present after it:
    its first-layer weights end the warmup with ``v == 0`` exactly (a blank pixel, a dead unit, a rare feature)."""
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    warmup, steps, lr = 20, 200, 0.01
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    w_true = torch.linspace(2.0, -1.0, 8)
    if use_qadam:
        opt = QAdamOptimizer(model.parameters(), lr=lr, warmup_steps=warmup)
        model.with_bagua([opt], QAdamAlgorithm(opt))
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        model.with_bagua([opt], GradientAllReduceAlgorithm())
    gen = torch.Generator().manual_seed(100 + rank)
    losses, max_moves, v_at_switch = [], [], None
    for t in range(1, steps + 1):
        x = torch.randn(32, 8, generator=gen)
        if t <= warmup:
            x[:, 0] = 0.0
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ w_true)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if use_qadam and t == warmup:
            v_at_switch = opt.state[model[0].weight]["exp_avg_sq"][:, 0].clone()
        if t > warmup:
            max_moves.append(max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before)))
    return losses, max_moves, v_at_switch, params_of(model)


def _worker_rare_feature_both(rank, world_size):
    return _worker_rare_feature(rank, world_size, True), _worker_rare_feature(rank, world_size, False)


def test_coordinates_without_gradient_during_warmup_stay_bounded_and_converge():
    # The 1-bit Adam maths divide the momentum of the absent feature's weights by sqrt(0) + eps: their first
    # compressed step moves them by about lr * 0.1 * g / 1e-8 ~ 1e5 and training diverges to NaN (the original's
    # behaviour, and ours before the variance floor). With the floor no coordinate moves by more than lr.
    results = run_workers(_worker_rare_feature_both, 2)
    (losses, max_moves, v_at_switch, weights), (adam_losses, _, _, _) = results[0]
    assert_close(results[1][0][3], weights, rtol=0, atol=0)  # identical weights on every rank
    assert torch.all(v_at_switch == 0), v_at_switch  # the hazard is there
    assert all(math.isfinite(loss) for loss in losses), losses
    assert max(max_moves) <= 0.01 * (1 + 1e-5), max(max_moves)
    assert all(torch.isfinite(w).all() for w in weights)
    final, adam_final = sum(losses[-20:]) / 20, sum(adam_losses[-20:]) / 20
    print(f"loss when the feature appears {losses[20]:.4f}, final QAdam {final:.4f}, Adam {adam_final:.4f}")
    assert final < 0.05 * losses[20], (final, losses[20])
    assert final < 2 * adam_final + 0.01, (final, adam_final)


def _worker_nonfinite_after_warmup(rank, world_size, poison):
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    opt = QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=2)
    model.with_bagua([opt], QAdamAlgorithm(opt, hierarchical=False))
    for step in range(7):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank * 100 + step))
        if step == 3:
            if not poison:
                continue  # the reference: a run that never saw this batch
            if rank == 1:
                x[0, 3] = float("nan")  # one bad input on one rank only, in the compressed stage
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()] + [opt.state[model.weight]["exp_avg"].clone()]


def test_nonfinite_gradient_in_the_compressed_stage_skips_that_step_on_every_rank():
    # one rank's NaN must never reach the momentum (it would poison every later step): the ranks agree at the end
    # of backward and every rank skips the step; what follows equals, bit for bit, a run without that batch
    poisoned = run_workers(_worker_nonfinite_after_warmup, 2, True)
    clean = run_workers(_worker_nonfinite_after_warmup, 2, False)
    for rank in range(2):
        for got, want in zip(poisoned[rank], clean[rank]):
            assert torch.isfinite(got).all()
            assert torch.equal(got, want)
