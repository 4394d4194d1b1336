"""Asynchronous model averaging: the maths of a round, warmup, abort/resume cycles, early finish, convergence.

- A round while training is idle (between abort/resume) must leave every rank at the mean of the ranks' weights, computed here with
  ``dist.all_gather`` (tolerance atol=1e-6: the implementation computes ``x + (mean - x)``, not ``mean``).
- During ``warmup_steps`` the algorithm is gradient allreduce: weights equal torch DDP's (rtol=1e-5, atol=1e-6).
- abort/resume cycles during training never hang (the harness fails a worker after its timeout), each cycle
  averages at least once, and after the last abort nothing runs.
- A rank that stops early and calls ``abort`` stops its peers' averaging; none of them hangs.
- On digits the async model reaches within 3 points of gradient allreduce.

Waits for rounds poll the round counter until a generous deadline: a hang guard, not a timing assertion.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of
from tests.torch_api.test_decentralized import digits_accuracy

DEADLINE_S = 60.0


def _wait_for_rounds(impl, at_least):
    deadline = time.monotonic() + DEADLINE_S
    while impl.rounds < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {impl.rounds} averaging rounds after {DEADLINE_S} s (wanted {at_least})")
        time.sleep(0.005)


def _step(model, opt, rank, step):
    x, y = batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _idle_average(model, impl, rank):
    """Stop averaging, make the ranks' weights differ, resume with training idle; return (expected, got)."""
    impl.abort(model)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.mul_(1 + 0.5 * rank).add_(0.1 * (rank + i))
    expected = []
    for p in model.parameters():
        gathered = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, p.detach().contiguous())
        expected.append(sum(gathered[1:], gathered[0]) / len(gathered))
    impl.resume(model)
    _wait_for_rounds(impl, impl.rounds + 1)
    impl.abort(model)
    return expected, params_of(model)


def _worker_idle_round(rank, world_size):
    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model.with_bagua([opt], AsyncModelAverageAlgorithm(sync_interval_ms=1))
    _step(model, opt, rank, 0)  # the first forward starts the thread; lr=0 leaves the weights alone
    return _idle_average(model, model.bagua_algorithm, rank)


@pytest.mark.parametrize("world_size", [2, 4])
def test_idle_round_gives_every_rank_the_mean(world_size):
    results = run_workers(_worker_idle_round, world_size)
    for expected, got in results:
        assert_close(got, expected, rtol=0, atol=1e-6)


def _worker_warmup(rank, world_size):
    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    reference = make_model(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        _step(ddp, ref_opt, rank, step)

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.with_bagua([opt], AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=3))
    impl = model.bagua_algorithm
    for step in range(3):
        _step(model, opt, rank, step)
    after_warmup = params_of(model)
    rounds_during_warmup = impl.rounds
    _step(model, opt, rank, 3)  # the first async step starts the averaging thread
    _wait_for_rounds(impl, 1)
    impl.abort(model)
    return params_of(reference), after_warmup, rounds_during_warmup


def test_warmup_is_gradient_allreduce():
    for expected, got, rounds in run_workers(_worker_warmup, 2):
        assert rounds == 0
        assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _worker_cycles(rank, world_size, cycles):
    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=2)
    model.with_bagua([opt], algorithm)
    impl = model.bagua_algorithm
    step = 0
    rounds_per_cycle = []
    for cycle in range(cycles):
        start = impl.rounds
        for _ in range(5):
            _step(model, opt, rank, step)
            step += 1
        _wait_for_rounds(impl, start + 1)
        # both spellings of the original: on the algorithm object and on model.bagua_algorithm
        (algorithm if cycle % 2 else impl).abort(model)
        rounds_per_cycle.append(impl.rounds - start)
        frozen = impl.rounds
        _step(model, opt, rank, step)  # training after abort: no averaging
        step += 1
        stayed_stopped = impl.rounds == frozen and not impl.is_averaging()
        (algorithm if cycle % 2 else impl).resume(model)
        rounds_per_cycle[-1] = (rounds_per_cycle[-1], stayed_stopped)
    expected, got = _idle_average(model, impl, rank)
    impl.abort(model)  # a second abort returns at once
    return rounds_per_cycle, expected, got, not impl.is_averaging()


def test_abort_resume_cycles():
    for rounds_per_cycle, expected, got, stopped in run_workers(_worker_cycles, 2, 4):
        assert all(rounds >= 1 and stayed for rounds, stayed in rounds_per_cycle), rounds_per_cycle
        assert_close(got, expected, rtol=0, atol=1e-6)
        assert stopped


def _worker_early_finish(rank, world_size):
    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.with_bagua([opt], AsyncModelAverageAlgorithm(sync_interval_ms=1))
    impl = model.bagua_algorithm
    steps = 3 if rank == world_size - 1 else 30
    for step in range(steps):
        _step(model, opt, rank, step)
    _wait_for_rounds(impl, 1)
    if rank == world_size - 1:
        impl.abort(model)  # the last rank leaves early; its peers' threads stop in the same round
        return "left", not impl.is_averaging()
    deadline = time.monotonic() + DEADLINE_S
    while impl.is_averaging():
        assert time.monotonic() < deadline, "a peer's abort did not stop this rank's averaging thread"
        _step(model, opt, rank, steps)
        time.sleep(0.01)
    _step(model, opt, rank, steps + 1)  # training goes on without averaging
    impl.abort(model)
    return "stayed", not impl.is_averaging()


def test_rank_finishing_early_hangs_nobody():
    results = run_workers(_worker_early_finish, 3, timeout=120)
    assert results == [("stayed", True), ("stayed", True), ("left", True)]


def test_hyperparameters_are_validated():
    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    with pytest.raises(ValueError, match="choose one of 'all'"):
        AsyncModelAverageAlgorithm(peer_selection_mode="shift_one")
    with pytest.raises(ValueError, match="sync_interval_ms"):
        AsyncModelAverageAlgorithm(sync_interval_ms=-1)
    with pytest.raises(ValueError, match="warmup_steps"):
        AsyncModelAverageAlgorithm(warmup_steps=-2)
    with pytest.warns(UserWarning, match="never averages"):
        AsyncModelAverageAlgorithm(sync_interval_ms=0)


def _worker_digits(rank, world_size):
    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    baseline = digits_accuracy(rank, world_size, None)
    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=5, warmup_steps=20)
    rounds = []

    def finish(model):
        model.bagua_algorithm.abort(model)  # every rank, once it stops training
        rounds.append(model.bagua_algorithm.rounds)

    accuracy = digits_accuracy(rank, world_size, algorithm, finish=finish)
    return baseline, accuracy, rounds[0]


def test_digits_accuracy_close_to_gradient_allreduce():
    results = run_workers(_worker_digits, 2)
    baseline = min(b for b, _, _ in results)
    for _, accuracy, rounds in results:
        assert rounds >= 1
        assert accuracy >= baseline - 0.03, results
