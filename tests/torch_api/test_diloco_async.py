"""Asynchronous DiLoCo (``asynchronous=True``) against its rule replayed plainly on tensors in this file.

Each worker records, just before each exchange, the version it started from and its pseudo-gradient
``g_base - x``; rank 0 returns the server's ordered log of arrivals. The test replays the log with the rule
written out here (the ``t``-th arrival, ``N`` workers: ``w = tokens / mean tokens of arrivals 1..t``; ``lr_t =
lr * min(1, ((t - 1) // N + 1) / W)``; ``g -= lr_t * w * delta / N``; every ``N``-th arrival ``m = beta * m +
(sum of the last N w * delta) / N`` and ``g -= lr_t * beta * m``) and checks every rank ends with those weights.
Tolerance: every rank's final weights are equal bit for bit (they receive the server's bytes); against the replay,
float32 rounding of a different order of operations (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model

LR, MOMENTUM, WARMUP = 0.8, 0.5, 2
#: seconds each step of a rank is padded by: rank 1 is slow
PAD_S = {0: 0.0, 1: 0.03}
#: (inner steps per round, steps trained) of each rank: the optimizer's rank 1 takes shorter rounds (Async
#: Local-SGD's dynamic local updates, by hand); the engine checks its ranks' settings agree, so there both take 4
ROUNDS = {"optimizer": {0: (4, 24), 1: (2, 8)}, "with_bagua": {0: (4, 24), 1: (4, 12)}}


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _record_exchanges() -> list:
    """Wrap the exchange so that it records (base version, pseudo-gradient) in this process."""
    from bagua.torch_api.ops import diloco_async

    sent: list = []
    original = diloco_async.AsyncDiLoCo.exchange

    def exchange(self, fragment, tokens):
        local = torch.cat([p.detach().reshape(-1) for p in fragment.params])
        sent.append((self.version, fragment.global_ - local))
        return original(self, fragment, tokens)

    diloco_async.AsyncDiLoCo.exchange = exchange
    return sent


def _train(rank, model, opt, steps):
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        time.sleep(PAD_S[rank])  # a slow worker: its steps take longer
        opt.step()


def _worker_arrivals(rank, world_size, path):
    H, steps = ROUNDS[path][rank]
    sent = _record_exchanges()
    model = make_model(rank)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    settings = dict(asynchronous=True, outer_lr=LR, outer_momentum=MOMENTUM, outer_lr_warmup=WARMUP)
    if path == "optimizer":
        from bagua.torch_api.contrib import DiLoCoOptimizer

        opt = DiLoCoOptimizer(inner, sync_every=H, **settings)
        close = opt.close
        driver = opt.driver
    else:
        from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

        model = model.with_bagua([inner], DiLoCoAlgorithm(sync_every=H, **settings))  # as a user writes it
        opt = inner
        close = model.bagua_ddp.close
        driver = model.bagua_ddp.impl.driver
    start = _flat(model)
    _train(rank, model, opt, steps)
    close()
    log = [tuple(a) for a in driver.asynchronous.arrivals]
    return start, sent, log, _flat(model)


def _replay(start, log, sent, workers, rounds):
    g, m, acc = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    queues = {w: list(s) for w, s in sent.items()}
    tokens_seen = 0
    for t, (worker, tokens, base, version, staleness, weight) in enumerate(log, start=1):
        sent_base, delta = queues[worker].pop(0)
        assert (sent_base, version, staleness) == (base, t, t - 1 - base), (t, worker)
        assert tokens == rounds[worker][0]
        tokens_seen += tokens
        w = tokens / (tokens_seen / t)
        assert weight == pytest.approx(w)
        lr = LR * min(1.0, ((t - 1) // workers + 1) / WARMUP)
        g = g - lr * (w * delta) / workers
        acc = acc + w * delta
        if t % workers == 0:
            m = MOMENTUM * m + acc / workers
            g = g - lr * MOMENTUM * m
            acc = torch.zeros_like(acc)
    assert all(not q for q in queues.values()), "a recorded pseudo-gradient never arrived"
    return g


@pytest.mark.parametrize("path", ["optimizer", "with_bagua"])
def test_arrivals_replayed_in_the_logged_order_give_every_rank_the_final_weights(path):
    rounds = ROUNDS[path]
    (start0, sent0, log, final0), (start1, sent1, _, final1) = run_workers(_worker_arrivals, 2, path, timeout=120)
    assert torch.equal(start0, start1)
    assert torch.equal(final0, final1), "the ranks ended with different weights"
    assert len(log) == len(sent0) + len(sent1) == sum(steps // H for H, steps in rounds.values())
    assert any(a[4] > 0 for a in log), "no arrival was stale: the run was not asynchronous"
    assert_close(final0, _replay(start0, log, {0: sent0, 1: sent1}, 2, rounds), rtol=1e-5, atol=1e-6)


# -- compressed exchanges ----------------------------------------------------------------------------------


def _worker_compressed(rank, world_size, codec):
    from bagua.torch_api.contrib import DiLoCoOptimizer
    from bagua.torch_api.ops import diloco_async, diloco_async_outer, diloco_async_wire

    sent = _record_exchanges()  # the raw pseudo-gradients, before the codec
    applied, mirrors, held = [], [], []
    apply, encode_down, exchange = (diloco_async_outer.AsyncOuter.apply, diloco_async_wire.AsyncWire.encode_down,
                                    diloco_async.AsyncDiLoCo.exchange)

    def apply_recorded(self, worker, tokens, base, delta):
        applied.append((worker, delta.clone()))
        return apply(self, worker, tokens, base, delta)

    def encode_down_recorded(self, global_, mirror):
        wire = encode_down(self, global_, mirror)
        mirrors.append(mirror.clone())
        return wire

    def exchange_recorded(self, fragment, tokens):
        exchange(self, fragment, tokens)
        held.append(self._held.clone())

    diloco_async_outer.AsyncOuter.apply = apply_recorded
    diloco_async_wire.AsyncWire.encode_down = encode_down_recorded
    diloco_async.AsyncDiLoCo.exchange = exchange_recorded
    model = make_model(rank)
    opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=3, asynchronous=True,
                          outer_lr=LR, outer_momentum=MOMENTUM, outer_lr_warmup=WARMUP, compression=codec,
                          block_size=64)
    start = _flat(model)
    _train(rank, model, opt, 15 if rank == 0 else 9)
    residual = opt.driver.asynchronous.wire.residual
    opt.close()
    log = [tuple(a) for a in opt.driver.asynchronous.arrivals]
    return start, sent, applied, mirrors, held, residual, log, _flat(model)


@pytest.mark.parametrize("codec", ["uint4", "bf16"])
def test_compressed_exchanges_lose_nothing_over_time_and_end_equal(codec):
    """Up: the server applies what the worker's codec sent, and with error feedback the sum of what it applied
    is the sum of the raw pseudo-gradients less the worker's last residual. Down: the worker's copy of the global
    weights equals the server's mirror of it, bit for bit, after every answer. The end: every rank holds the
    replay of what the server applied."""
    r0, r1 = run_workers(_worker_compressed, 2, codec, timeout=120)
    start, sent0, applied, mirrors, _, _, log, final0 = r0
    _, sent1, _, _, held1, residual1, _, final1 = r1
    assert torch.equal(final0, final1), "the ranks ended with different weights"
    assert [w for w, _ in applied] == [a[0] for a in log]
    assert len(held1) == len(mirrors) == len(sent1) == 3
    for copy, mirror in zip(held1, mirrors):
        assert torch.equal(copy, mirror)
    for (w, d), (_, raw) in zip([a for a in applied if a[0] == 0], sent0):
        assert torch.equal(d, raw)  # rank 0's own worker calls the server in-process: nothing is encoded
    from_1 = [d for w, d in applied if w == 1]
    assert residual1.abs().max() > 0, "nothing was lost to the codec: the test does not test it"
    assert_close(sum(from_1), sum(raw for _, raw in sent1) - residual1, rtol=1e-5, atol=1e-6)
    sent = {w: [(base, d) for (_, d), base in zip([a for a in applied if a[0] == w],
                                                     [a[2] for a in log if a[0] == w])] for w in (0, 1)}
    assert_close(final0, _replay(start, log, sent, 2, {0: (3, 15), 1: (3, 9)}), rtol=1e-5, atol=1e-6)


# -- one worker: synchronous DiLoCo's maths -----------------------------------------------------------------


def _worker_single(rank, world_size):
    from bagua.torch_api.contrib import DiLoCoOptimizer

    finals = []
    for asynchronous in (True, False):
        model = make_model(0)
        opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=3, outer_lr=0.7,
                              outer_momentum=0.9, asynchronous=asynchronous)
        for step in range(1, 13):
            x, y = batch(0, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        if asynchronous:  # no consistent cut of a run in progress: refused, saying so
            with pytest.raises(ValueError, match="does not checkpoint a run in progress"):
                opt.state_dict()
        opt.close()
        assert "diloco" in opt.state_dict()  # after close() every rank holds the final weights: saved
        finals.append((_flat(model), opt.syncs))
    return finals


def test_one_worker_takes_synchronous_dilocos_nesterov_steps():
    """With one worker every arrival is fresh and a whole round: the rule is torch's Nesterov SGD step of
    synchronous DiLoCo (up to rounding: ``g - lr * d - lr * beta * m`` against ``g - lr * (d + beta * m)``)."""
    (asynchronous, syncs_a), (synchronous, syncs_s) = run_workers(_worker_single, 1, timeout=120)[0]
    assert syncs_a == syncs_s == 4
    assert_close(asynchronous, synchronous, rtol=1e-5, atol=1e-6)


# -- a peer that dies --------------------------------------------------------------------------------------


def _worker_dead_peer(rank, world_size):
    from bagua.torch_api.contrib import DiLoCoOptimizer

    model = make_model(rank)
    opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2, asynchronous=True)
    for step in range(1, 3 if rank == 1 else 5):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if rank == 1:
        return None  # leaves without close(): the server must not wait for it forever
    time.sleep(0.5)
    started = time.monotonic()
    try:
        opt.close()
    except RuntimeError as e:
        return str(e), time.monotonic() - started
    return "no error", time.monotonic() - started


def test_a_worker_that_leaves_without_closing_gives_an_error_not_a_hang():
    message, seconds = run_workers(_worker_dead_peer, 2, env={"BAGUA_COMM_TIMEOUT_S": "3"}, timeout=60)[0]
    assert "asynchronous=True" in message and "server on rank 0" in message, message
    assert seconds < 15


# -- settings ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    (dict(asynchronous="yes"), "must be True or False"),
    (dict(asynchronous=True, fragments=2, sync_every=4), "needs fragments=1"),
    (dict(asynchronous=True, overlap_steps=1, sync_every=4), "needs overlap_steps=0"),
    (dict(asynchronous=True, outer_optimizer=torch.optim.Adam), "needs outer_optimizer=None"),
])
def test_unsupported_settings_are_refused_with_the_reason(kwargs, words):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm, DiLoCoSettings

    for cls in (DiLoCoSettings, DiLoCoAlgorithm):
        with pytest.raises(ValueError, match=words):
            cls(**kwargs)


def test_fault_tolerance_is_accepted_and_its_other_limits_kept():
    from bagua.torch_api.algorithms.diloco import DiLoCoSettings, check_fault_tolerant_settings

    check_fault_tolerant_settings(DiLoCoSettings(asynchronous=True), "DiLoCoOptimizer")  # tests/fault/test_async_ft.py
    with pytest.raises(ValueError, match="needs warmup_steps=0"):
        check_fault_tolerant_settings(DiLoCoSettings(asynchronous=True, warmup_steps=2), "DiLoCoOptimizer")


# -- the other remedies measured (single process) ---------------------------------------------------------


def test_measured_remedies_follow_their_formulas():
    from bagua.torch_api.ops.diloco_async_outer import AsyncOuter

    deltas = [torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0]), torch.tensor([-3.0, 0.25])]
    bases = [0, 0, 0]  # the third arrival is stale: s = 2 = N
    for remedy in ("staleness", "heloco", "none"):
        g = torch.zeros(2)
        outer = AsyncOuter(g, workers=2, lr=0.5, momentum=0.9, remedy=remedy)
        ref, m, acc = torch.zeros(2), torch.zeros(2), torch.zeros(2)
        for t, (delta, base) in enumerate(zip(deltas, bases), start=1):
            outer.apply(worker=t % 2, tokens=4, base=base, delta=delta)
            s = t - 1 - base
            d = delta * (min(1.0, 2 / (1 + s)) if remedy == "staleness" else 1.0)
            if remedy == "heloco" and s >= 2 and float(d @ m) < 0:
                d = d - m * float(d @ m) / float(m @ m)
            if remedy == "none":
                m = 0.9 * m + d
                ref = ref - 0.5 / 2 * (d + 0.9 * m)
                continue
            ref = ref - 0.5 * d / 2
            acc = acc + d
            if t % 2 == 0:
                m = 0.9 * m + acc / 2
                ref = ref - 0.5 * 0.9 * m
                acc = torch.zeros(2)
        assert_close(g, ref, rtol=1e-6, atol=1e-7, msg=remedy)
    with pytest.raises(ValueError, match="different runs"):
        outer.apply(worker=0, tokens=4, base=99, delta=deltas[0])
