"""Asynchronous DiLoCo under fault tolerance: workers of unequal speeds on a real coordinator.

Each worker is a ``FaultTolerance`` and ``DiLoCoOptimizer`` of its own (threads of the test, or, to be killed,
processes: tests/fault/ft_async_worker.py); the store orders the arrivals and every worker applies all of them:

- every worker applied the same arrivals in the same order and ends with the same global weights, bit for bit;
  they equal the recorded pseudo-gradients replayed in that order with the rule written plainly here (token
  weights ``w = tokens * t / (tokens of arrivals 1..t)``, ``lr_t = lr * min(1, ((t - 1) // N + 1) / W)``,
  ``g -= lr_t * w * delta / N``, every ``N``-th arrival ``m = beta * m + (sum of the last N w * delta) / N`` and
  ``g -= lr_t * beta * m``; float32, a different order of operations: atol 1e-5);
- a worker SIGKILLed mid-run and restarted heals from a live peer (its steps resume after its last round) and all
  end with the same weights;
- with a job secret, a junk arrival written into the log without it is skipped by every worker, with a warning,
  and a slot whose writer died before writing it is voided and skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from tests.fault.jobs import Job, python_module, run_job
from tests.torch_api.models import batch, make_model, params_of

H, LR, BETA, WARMUP = 4, 0.8, 0.5, 2


def _spawn(i: int, port: int, workers: int, steps: int, step_s: float, out: Path, log: Path,
           extra: list[str]) -> subprocess.Popen:
    return python_module("tests.fault.ft_async_worker", [
        "--coordinator", f"127.0.0.1:{port}", "--index", str(i), "--workers", str(workers), "--steps", str(steps),
        "--sync-every", str(H), "--step-s", str(step_s), "--outer", f"{LR},{BETA},{WARMUP}", "--out", str(out),
        *extra], log)


def _job(tmp_path: Path, workers: int, steps: int, step_s: float, die: dict[int, str],
         timeout_s: float = 120.0) -> list[dict]:
    """Run the job of worker processes, restarting (once) a worker that was SIGKILLed; the others hold their
    ``close()`` until the restarted one beats (so the job has not ended when it joins, however slow its start)."""
    hold = tmp_path / "go"
    beats: dict[int, int] = {}  # restarted worker -> its heartbeat count when restarted
    stores: dict[int, dist.TCPStore] = {}

    def beat(port: int, i: int) -> int:
        if port not in stores:
            stores[port] = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        return stores[port].add(f"async/hb/w{i}", 0)

    def spawn(i: int, port: int, out: Path, log: Path, again: bool) -> subprocess.Popen:
        if again:
            beats[i] = beat(port, i)
        extra = [] if again else ["--die", die[i]] if i in die else ["--hold", str(hold)]
        return _spawn(i, port, workers, steps, step_s, out, log, extra)

    def on_poll(job: Job) -> None:
        if set(beats) == set(die) and all(beat(job.port, i) > n + 1 for i, n in beats.items()):
            hold.touch()

    results, _, job = run_job(tmp_path, workers, spawn, on_poll=on_poll, timeout_s=timeout_s)
    assert set(job.restarted) == set(die), job.restarted
    return results


def _same_end(results: list[dict], steps: int) -> None:
    ref = results[0]["global"]
    assert torch.isfinite(ref).all()
    for r in results:
        assert torch.equal(r["global"], ref), "the workers' global weights differ"
        assert torch.equal(torch.cat([p.reshape(-1) for p in r["params"]]), ref)
        assert r["steps"] == steps
        assert r["stats"]["cursor"] == results[0]["stats"]["cursor"]


def _replay(start: torch.Tensor, log: list[tuple], sent: dict, n: int) -> torch.Tensor:
    """Delayed Nesterov over ``log`` ((seq, worker, tokens, base, version) in order), written plainly."""
    g, m, acc, total = start.clone(), torch.zeros_like(start), torch.zeros_like(start), 0
    for t, (seq, _, tokens, _, _) in enumerate(log, start=1):
        total += tokens
        lr_t = LR * min(1.0, ((t - 1) // n + 1) / WARMUP)
        d = sent[seq] * (tokens * t / total)
        g -= lr_t * d / n
        acc += d
        if t % n == 0:
            m = BETA * m + acc / n
            g -= lr_t * BETA * m
            acc = torch.zeros_like(start)
    return g


def _thread_worker(address: str, i: int, workers: int, steps: int, step_s: float) -> dict:
    """One worker as a thread of the test: ``DiLoCoOptimizer(asynchronous=True, fault_tolerance=...)``, its step
    padded by ``step_s * (i + 1)``; records each pseudo-gradient it posts, by sequence number."""
    from bagua.torch_api.contrib import DiLoCoOptimizer
    from bagua.torch_api.fault import FaultTolerance

    ft = FaultTolerance(address, f"w{i}", workers=workers, heartbeat_s=0.1, stale_s=1.5, timeout_s=60.0,
                        prefix="async")
    model = make_model(i)
    opt = DiLoCoOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), sync_every=H, asynchronous=True,
                          outer_lr=LR, outer_momentum=BETA, outer_lr_warmup=WARMUP, fault_tolerance=ft)
    d, run = opt.driver, opt.driver.asynchronous
    out = {"initial": {"global": d.fragments[0].global_.clone(), "cursor": run.cursor, "steps": d.steps}, "sent": {}}
    while d.steps < steps:
        x, y = batch(i, d.steps + 1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.inner.step()
        time.sleep(step_s * (i + 1))
        delta = d.fragments[0].global_ - torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        posted = len(run.posted)
        opt.after_inner_step()
        if len(run.posted) > posted:
            out["sent"][run.posted[-1]] = delta
    opt.close()
    ft.close()
    out.update(global_=d.fragments[0].global_.clone(), params=params_of(model), steps=d.steps,
               arrivals=[(a.seq, a.worker, a.arrival.tokens, a.arrival.base, a.arrival.version) for a in run.arrivals],
               stats={"heals": run.heals, "served": run.served, "ignored": run.ignored, "cursor": run.cursor,
                      "refused": ft.quorums.records.refused})
    out["global"] = out.pop("global_")
    return out


def _threads(address: str, workers: int, steps: int, step_s: float) -> list[dict]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda i: _thread_worker(address, i, workers, steps, step_s), range(workers)))


def test_arrivals_in_one_order_leave_identical_weights_equal_to_the_plain_rule(coordinator):
    steps = 24
    results = _threads(coordinator, workers=3, steps=steps, step_s=0.005)
    _same_end(results, steps)
    # one order: the logs agree where they overlap; a worker that started at slot 0 holds all of it
    full = next(r["arrivals"] for r in results if r["initial"]["cursor"] == 0)
    for r in results:
        assert full[len(full) - len(r["arrivals"]):] == r["arrivals"]
    assert [a[0] for a in full] == list(range(1, len(full) + 1)) and [a[4] for a in full] == [a[0] for a in full]
    sent = {seq: d for r in results for seq, d in r["sent"].items()}
    assert sorted(sent) == [a[0] for a in full] and len(full) == 3 * steps // H
    assert any(a[3] < a[4] - 1 for a in full), "no stale arrival: the workers ran in lock step"
    start = next(r["initial"]["global"] for r in results if r["initial"]["cursor"] == 0)
    torch.testing.assert_close(results[0]["global"], _replay(start, full, sent, 3), rtol=0, atol=1e-5)


def test_a_worker_killed_mid_run_heals_and_all_end_identical(tmp_path):
    # the slower worker outlives the killed one by seconds: it deletes what it applied, so the restarted one heals
    steps = 40
    results = _job(tmp_path, workers=2, steps=steps, step_s=0.05, die={0: "inner:7"})
    _same_end(results, steps)
    again = results[0]
    assert again["stats"]["heals"] >= 1 and again["initial"]["steps"] == H, again["stats"]
    assert sum(r["stats"]["served"] for r in results) >= 1
    assert "healed from" in again["log"]


def test_a_junk_arrival_and_an_empty_slot_are_skipped_by_every_worker(coordinator, monkeypatch, caplog):
    monkeypatch.setenv("BAGUA_JOB_SECRET", "0123456789abcdef0123456789abcdef")
    junk = torch.full((100,), 1e3).numpy().tobytes()
    host, port = coordinator.split(":")
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    assert store.add("async/async/n", 1) == 1
    store.set("async/async/data/mallory/1", junk)
    store.set("async/async/slot/1", json.dumps({
        "w": "mallory", "tokens": 1000, "base": 0, "data": "async/async/data/mallory/1",
        "sha": hashlib.sha256(junk).hexdigest(), "bytes": len(junk)}))
    assert store.add("async/async/n", 1) == 2  # a writer that died before writing its slot: voided after stale_s
    steps = 16
    with caplog.at_level(logging.WARNING):
        results = _threads(coordinator, workers=2, steps=steps, step_s=0.005)
    _same_end(results, steps)
    first = next(r for r in results if r["initial"]["cursor"] == 0)
    assert first["stats"]["ignored"] == 1 and first["stats"]["refused"] >= 1
    assert all(a[1] != "mallory" for r in results for a in r["arrivals"])
    assert first["arrivals"][0][0] == 3 and [a[4] for a in first["arrivals"]] == [a[0] - 2 for a in first["arrivals"]]
    assert any("async/async/slot/1" in r.getMessage() for r in caplog.records), caplog.text
