"""DiLoCo for workers of different speeds and links that change (``rounds="time"``, ``sync_every_max``).

- the plan and the link rule as pure functions, and the settings' checks (no processes);
- a slow rank (it sleeps 4x the fast one's step in every step) takes fewer inner steps per round after the first,
  and the new global weights are the token-weighted mean of the ranks' weights (outer SGD with lr 1, momentum 0:
  ``g_new = sum w_i x_i / sum w_i``), written plainly here from what each rank recorded, within 1e-6;
- equal speeds with ``rounds="time"`` give ``rounds="steps"``' weights bit for bit, through ``DiLoCoOptimizer``
  (two fragments, an exchange overlapped on its own thread) and ``with_bagua`` (the engine's thread). The ranks
  run the same code at the same speed; ``speed_tolerance=10`` keeps timing noise on the 2 shared CPU cores from
  giving one of them fewer steps (what it would measure is not a speed difference);
- the link rule raises ``sync_every`` while the exchange is slow and lowers it when it recovers. The slow link is
  emulated by padding the exchange (a sleep in ``OverRanks.average``), not shaped with tc: the harness' workers
  share one network namespace.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm, DiLoCoSettings
from bagua.torch_api.ops.diloco_pace import Pace, link_sync_every, plan_steps
from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of

# -- pure functions --------------------------------------------------------------------------------------------


def test_plan_gives_the_fastest_sync_every_and_the_others_their_share():
    assert plan_steps([0.1, 0.2, 0.4], 8, 0.1) == [8, 4, 2]
    assert plan_steps([0.2, 0.1], 10, 0.1) == [5, 10]
    # within the tolerance, or not measured yet: sync_every
    assert plan_steps([0.1, 0.109, 0.0], 10, 0.1) == [10, 10, 10]
    assert plan_steps([0.0, 0.0], 10, 0.1) == [10, 10]
    # never below min_steps (the fragments, or overlap_steps + 1)
    assert plan_steps([0.1, 10.0], 10, 0.1, min_steps=3) == [10, 3]
    assert plan_steps([0.1, 10.0], 10, 0.1) == [10, 1]


def test_link_rule_raises_holds_and_lowers_within_bounds():
    # exchange 1 s on 10 steps of 0.1 s: 100 % of the compute, over 10 % -> aim at 8 %: ceil(1 / 0.008) = 125
    assert link_sync_every(10, 1.0, 0.1, low=10, high=1000, share=0.1) == 125
    assert link_sync_every(10, 1.0, 0.1, low=10, high=50, share=0.1) == 50  # capped
    # inside the band [share / 2, share]: unchanged (hysteresis)
    assert link_sync_every(125, 1.0, 0.1, low=10, high=1000, share=0.1) == 125
    assert link_sync_every(125, 0.7, 0.1, low=10, high=1000, share=0.1) == 125
    # the link recovers: below half the share -> lowered, not below sync_every
    assert link_sync_every(125, 0.2, 0.1, low=10, high=1000, share=0.1) == 25
    assert link_sync_every(125, 0.01, 0.1, low=10, high=1000, share=0.1) == 10
    # off, or nothing measured
    assert link_sync_every(10, 1.0, 0.1, low=10, high=None, share=0.1) == 10
    assert link_sync_every(10, 1.0, 0.0, low=10, high=100, share=0.1) == 10


def test_pace_schedules_each_fragment_once_per_round_of_changing_length():
    pace = Pace(DiLoCoSettings(sync_every=4, fragments=2, rounds="time"))
    assert [pace.due(s) for s in range(1, 5)] == [[], [0], [], [1]] and pace.round_over(4)
    table = torch.tensor([[4, 0.1, 4, 0, 0], [4, 0.4, 4, 0, 0]], dtype=torch.float64)
    assert pace.plan(table, me=1) == [4, 2]  # min_steps = fragments = 2
    pace.new_round(4)
    assert pace.steps == 2 and [pace.due(s) for s in (5, 6)] == [[0], [1]] and pace.round_over(6)
    state = pace.state_dict()
    other = Pace(DiLoCoSettings(sync_every=4, fragments=2, rounds="time"))
    other.load_state_dict(state)
    assert (other.round, other.start, other.steps, other.offsets) == (1, 4, 2, [1, 2])
    assert Pace(DiLoCoSettings()).state_dict() == {}  # inactive: today's checkpoints


@pytest.mark.parametrize("kwargs, match", [
    (dict(rounds="tim"), "Did you mean 'time'"),
    (dict(speed_tolerance=-1), "speed_tolerance"),
    (dict(sync_every=10, sync_every_max=5), "at least sync_every=10"),
    (dict(sync_every_max=2.5), "sync_every_max"),
    (dict(max_exchange_share=0), "max_exchange_share"),
])
def test_bad_pace_settings_say_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCoAlgorithm(**kwargs)


def test_fault_tolerant_sharded_workers_refuse_paced_rounds_saying_why():
    from types import SimpleNamespace

    from bagua.torch_api.ops.diloco_driver import DiLoCoDriver

    # sharded replicas without fault tolerance run them (tests/sharded/test_paced_rounds.py)
    DiLoCoDriver(DiLoCoSettings(rounds="time"), "DiLoCo (sharded)").build([torch.nn.Parameter(torch.zeros(3))],
                                                                          units=[1])
    fault = SimpleNamespace(workers=2, ranks=None, worker="w0", quorums=SimpleNamespace(store=None, prefix="job"))
    driver = DiLoCoDriver(DiLoCoSettings(rounds="time"), "DiLoCo (sharded)", fault=fault)
    with pytest.raises(ValueError, match="fault-tolerant sharded workers"):
        driver.build([torch.nn.Parameter(torch.zeros(3))], units=[1])


class _Store:
    """What the live table reads of a torch Store: add, set, get, check."""

    def __init__(self):
        self.kv = {}

    def add(self, key, n):
        self.kv[key] = str(int(self.kv.get(key, b"0")) + n).encode()
        return int(self.kv[key])

    def set(self, key, value):
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.kv[key]

    def check(self, keys):
        return all(k in self.kv for k in keys)


def test_live_table_reads_published_rows_and_leaves_malformed_ones_out():
    from bagua.torch_api.fault.top import format_table
    from bagua.torch_api.ops.diloco_stats import RoundRecord, StoreRows, read_rows

    store = _Store()
    record = RoundRecord(7, 10, ["w0", "w1"], [50.0, 20.0], [10, 4], [10.0, 4.0], [0.5, 0.0], [0.1, 0.2])
    for i, worker in enumerate(["w1", "w0"]):
        row = dict(record.row(1 - i), time=100.0)
        StoreRows(store, "job", worker)(json.dumps(row))
    StoreRows(store, "job", "w2")("{not json")
    rows = read_rows(store, "job")
    assert [(r["worker"], r["steps"], r["speed"]) for r in rows] == [("w0", 10, 50.0), ("w1", 4, 20.0)]
    lines = format_table(rows, now=101.0).splitlines()
    assert lines[0].split() == ["worker", "round", "sync_every", "steps/s", "steps", "tokens", "wait", "s",
                                "exchange", "s", "age", "s"]
    assert lines[2].split() == ["w1", "7", "10", "20", "4", "4", "0.000", "0.200", "1.0"]


# -- a slow rank: fewer steps, its tokens weigh ----------------------------------------------------------------


def _run(rank, opt, model, rounds, step_s, samples, pad=None):
    """Train until ``rounds`` outer steps; per round: (steps, tokens, weights before, weights after the sync)."""
    out, steps, tokens, step = [], 0, 0, 0
    while opt.syncs < rounds:
        step += 1
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.inner.step()
        time.sleep(step_s)
        before, syncs = params_of(model), opt.syncs
        steps, tokens = steps + 1, tokens + samples
        opt.driver.add_samples(samples)
        if pad is not None:
            pad(opt.syncs)
        opt.after_inner_step()
        if opt.syncs > syncs:
            out.append((steps, tokens, before, params_of(model)))
            steps = tokens = 0
    return out


def _worker_slow(rank, world_size):
    from bagua.torch_api.contrib import DiLoCoOptimizer

    model = make_model(rank)
    opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=8, rounds="time",
                          outer_lr=1.0, outer_momentum=0.0)
    out = _run(rank, opt, model, 4, 0.005 if rank == 0 else 0.02, samples=3 if rank == 0 else 5)
    records = [(r.steps, r.tokens) for r in opt.driver.records]
    opt.close()
    return out, records


def test_a_slow_rank_takes_fewer_steps_and_weighs_by_its_tokens():
    fast, slow = run_workers(_worker_slow, 2)
    (fast, fast_records), (slow, _) = fast, slow
    assert [r[0] for r in fast] == [8] * 4
    assert slow[0][0] == 8 and all(r[0] < 8 for r in slow[1:]), [r[0] for r in slow]
    for (n0, w0, x0, g0), (n1, w1, x1, g1) in zip(fast, slow):
        assert (w0, w1) == (3 * n0, 5 * n1)
        for a, b, p0, p1 in zip(x0, x1, g0, g1):
            expected = (w0 * a.double() + w1 * b.double()) / (w0 + w1)
            torch.testing.assert_close(p0.double(), expected, rtol=0, atol=1e-6)
            assert torch.equal(p0, p1)  # the same global weights on both ranks
    # the records: rounds 0..2 written (a round's is written at the next round's report), steps and tokens
    assert fast_records == [([n0, n1], [float(w0), float(w1)]) for (n0, w0, *_), (n1, w1, *_) in zip(fast, slow)][:3]


# -- equal speeds: today's DiLoCo, bit for bit -----------------------------------------------------------------


def _worker_equal(rank, world_size):
    import bagua.torch_api  # noqa: F401  (installs with_bagua)
    from bagua.torch_api.contrib import DiLoCoOptimizer

    runs = {}
    for rounds in ("steps", "time"):
        model = make_model(rank)
        opt = DiLoCoOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), sync_every=4, fragments=2,
                              overlap_steps=1, rounds=rounds, speed_tolerance=10.0, outer_lr=0.7, outer_momentum=0.9)
        history = []
        for step in range(1, 15):
            x, y = batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            history.append(params_of(model))
        opt.close()
        model = make_model(rank)
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        model = model.with_bagua([inner], DiLoCoAlgorithm(sync_every=3, rounds=rounds, speed_tolerance=10.0,
                                                          hierarchical=False))
        engine = []
        for step in range(1, 11):
            x, y = batch(rank, step)
            inner.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()
            engine.append(params_of(model))
        runs[rounds] = (history, engine, len(opt.driver.records))
    return runs


def test_equal_speeds_give_todays_diloco_bit_for_bit():
    for runs in run_workers(_worker_equal, 2):
        (steps_opt, steps_engine, none), (time_opt, time_engine, records) = runs["steps"], runs["time"]
        assert none == 0 and records >= 1
        for a, b in zip(steps_opt + steps_engine, time_opt + time_engine):
            for p, q in zip(a, b):
                assert torch.equal(p, q)


# -- links that change: sync_every rises and falls ------------------------------------------------------------


def _worker_link(rank, world_size):
    from bagua.torch_api.contrib import DiLoCoOptimizer
    from bagua.torch_api.ops import diloco_exchange

    slow = [False]
    average = diloco_exchange.OverRanks.average

    def padded(self, delta):
        if slow[0]:
            time.sleep(0.2)  # the emulated slow link: 0.2 s more per exchange
        return average(self, delta)

    diloco_exchange.OverRanks.average = padded
    model = make_model(rank)
    opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=4, sync_every_max=16,
                          max_exchange_share=0.3)

    def pad(syncs):
        slow[0] = 2 <= syncs < 4

    _run(rank, opt, model, 9, 0.03, samples=1, pad=pad)
    opt.close()
    return [r.sync_every for r in opt.driver.records], [r.steps for r in opt.driver.records]


def test_link_rule_raises_sync_every_on_a_slow_link_and_lowers_it_after():
    for sync_every, steps in run_workers(_worker_link, 2):
        # rounds 2 and 3 exchange slowly (0.2 s, 1.7x the compute of 4 steps); the rule reads a round's exchange at
        # the next round's end. Recovered, the exchange (milliseconds, noisy on 2 shared cores) sets H back to 4,
        # or a little above when a noisy exchange crosses the band: at most 8
        assert sync_every[:3] == [4, 4, 4], sync_every
        assert 16 in sync_every[3:6], sync_every
        assert sync_every[-1] <= 8, sync_every
        assert steps == [[h, h] for h in sync_every]  # equal speeds: both ranks take the fastest's steps


# -- the same rule on a link shaped with tc (network namespaces; needs root and iproute2) ----------------------


def _shaped_link_available():
    try:
        from benchmarks.common import netns
    except ImportError as exc:  # pragma: no cover - the benchmarks folder is not installed
        return False, f"benchmarks.common.netns is not importable: {exc}"
    return netns.netns_available()


_NETNS, _NETNS_WHY = _shaped_link_available()


@pytest.mark.netns
@pytest.mark.skipif(not _NETNS, reason=_NETNS_WHY)
def test_link_rule_follows_a_link_shaped_down_and_up(tmp_path):
    """Two emulated hosts; the link is unshaped for rounds 0-1, shaped to 8 Mbit/s (a 1 MB exchange: about 1 s,
    eight times the round's compute) from round 2, and unshaped again from round 5."""
    import os
    import subprocess
    import sys

    from benchmarks.common import netns

    progress, outs = tmp_path / "progress", [tmp_path / f"out{r}.json" for r in range(2)]
    with netns.NetnsCluster(2, prefix=f"bgp{os.getpid()}") as cluster:
        procs = []
        for host in cluster.hosts:
            env = dict(os.environ, RANK=str(host.index), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       NODE_RANK=str(host.index), MASTER_ADDR=cluster.hosts[0].address, MASTER_PORT="29561",
                       GLOO_SOCKET_IFNAME=host.iface, OMP_NUM_THREADS="1")
            procs.append(netns.popen(host.exec_prefix() + [sys.executable, "-m", "tests.torch_api.pace_link_worker",
                                                            "--progress", str(progress), "--out", str(outs[host.index])],
                                     env, subprocess.PIPE, subprocess.STDOUT))
        deadline, shaped = time.monotonic() + 120, None
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            done = int(progress.read_text()) if progress.exists() else 0
            want = "8mbit" if 2 <= done < 5 else None
            if want != shaped:
                cluster.shape(want)
                shaped = want
            time.sleep(0.02)
        for p in procs:
            if p.poll() is None:
                p.kill()
            out = p.communicate()[0].decode(errors="replace")
            assert p.returncode == 0, out[-3000:]
    for out in outs:
        sync_every = [h for h, _ in json.loads(out.read_text())]
        assert sync_every[:2] == [4, 4], sync_every
        assert 16 in sync_every, sync_every
        assert sync_every[-1] <= 8, sync_every  # back: 4, or a little above after a noisy exchange
