"""Tests of the emulated network: a 2-host namespace run of a tiny model against an in-process reference,
the loopback fallback, and cleanup on error, on SIGTERM and on Ctrl-C.

Tests marked ``netns`` need root and iproute2 and are skipped otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import torch
from benchmarks.common import netns
from benchmarks.network import Job, run_job
from benchmarks.common.workload import _batches, build_model

_AVAILABLE, _WHY = netns.netns_available()
needs_netns = [pytest.mark.netns, pytest.mark.skipif(not _AVAILABLE, reason=_WHY)]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _reference_final_loss(warmup: int, steps: int, world: int) -> float:
    """Plain single-process SGD on the average of every rank's loss: what synchronous data parallel computes."""
    model = build_model("tiny", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    args = Namespace(model="tiny", batch_size=32, warmup=warmup, steps=steps)
    data = [_batches(args, r, world)[0] for r in range(world)]
    losses = [[] for _ in range(world)]
    for i in range(warmup + steps):
        opt.zero_grad()
        per_rank = [torch.nn.functional.mse_loss(model(data[r][i][0]), data[r][i][1]) for r in range(world)]
        for r, loss in enumerate(per_rank):
            losses[r].append(loss.item())
        (sum(per_rank) / world).backward()
        opt.step()
    return sum(sum(ls[-5:]) / len(ls[-5:]) for ls in losses) / world


@pytest.mark.parametrize("system", ["ddp", "gradient_allreduce"])
@pytest.mark.netns
@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
def test_two_hosts_in_namespaces_train_like_the_reference(system, tmp_path):
    with netns.NetnsCluster(2, prefix=f"bgt{os.getpid()}") as cluster:
        cluster.shape("1gbit")
        row = run_job(cluster, Job("tiny", system, 2, 10**9, warmup=1, steps=2, epochs=1), str(tmp_path),
                      port=29411, timeout_s=120)
        created = set(cluster.namespaces())
        assert created <= _namespaces()
    assert not created & _namespaces(), "namespaces left behind"
    assert row["status"] == "ok", row.get("error")
    assert row["final_loss"] == pytest.approx(_reference_final_loss(1, 2, 2), rel=1e-5)
    # any 2-rank allreduce of S bytes makes each host send at least S/2 (plus headers)
    assert row["bytes_per_step"] >= 0.5 * 4 * row["params"]
    assert 0 < row["line_rate"] < 1.05
    assert row["compute_s"] > 0 and row["wait_s"] is not None


@pytest.mark.netns
@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
def test_cluster_is_deleted_when_the_body_raises():
    prefix = f"bge{os.getpid()}"
    with pytest.raises(RuntimeError, match="boom"):
        with netns.NetnsCluster(2, prefix=prefix) as cluster:
            cluster.shape("100mbit")
            qdisc = subprocess.run(["ip", "netns", "exec", f"{prefix}h0", "tc", "qdisc", "show", "dev", "veth0"],
                                   capture_output=True, text=True, timeout=20).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
            assert {f"{prefix}s", f"{prefix}h0", f"{prefix}h1"} <= _namespaces()
            raise RuntimeError("boom")
    assert not any(ns.startswith(prefix) for ns in _namespaces())


@pytest.mark.netns
@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
def test_failed_run_is_reported_and_cleaned_up(tmp_path):
    prefix = f"bgf{os.getpid()}"
    with netns.NetnsCluster(2, prefix=prefix) as cluster:
        row = run_job(cluster, Job("tiny", "no_such_algorithm", 2, None, warmup=1, steps=1, epochs=1),
                      str(tmp_path), port=29412, timeout_s=120)
    assert row["status"] == "failed"
    assert "no_such_algorithm" in row["error"]
    assert not any(ns.startswith(prefix) for ns in _namespaces())


@pytest.mark.netns
@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_deletes_namespaces_and_kills_hosts(sig, tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.network", "--hosts", "2", "--bandwidths", "100mbit",
           "--models", "tiny", "--systems", "ddp", "--warmup", "1", "--steps", "100000", "--out-dir", ""]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    prefix = f"bgb{proc.pid}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            hosts = [ns for ns in _namespaces() if ns.startswith(prefix)]
            pids = [subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20).stdout
                    for ns in hosts if ns.endswith(("h0", "h1"))]
            if len(pids) == 2 and all(p.strip() for p in pids):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the workload did not start in the namespaces within 60 s")
        host_pids = [int(p) for text in pids for p in text.split()]
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not any(ns.startswith(prefix) for ns in _namespaces())
    for pid in host_pids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


def test_falls_back_to_loopback_without_ip(tmp_path):
    # with no `ip` on PATH the suite must say so and run on loopback, unshaped only
    env = dict(os.environ, PATH="/nonexistent")
    out_dir = tmp_path / "res"
    cmd = [sys.executable, "-m", "benchmarks.network", "--hosts", "2", "--bandwidths", "unshaped,1gbit",
           "--models", "tiny", "--systems", "ddp", "--warmup", "1", "--steps", "2",
           "--out-dir", str(out_dir), "--name", "fb"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "falling back to loopback" in done.stderr and "`ip` was not found" in done.stderr
    data = json.loads((out_dir / "fb.json").read_text())
    assert data["meta"]["emulated"] is False
    rows = sorted(data["results"], key=lambda r: r["system"])
    assert [(r["system"], r["bandwidth"], r["status"]) for r in rows] == [("ddp", "unshaped", "ok")]
    for r in rows:
        assert r["final_loss"] == pytest.approx(_reference_final_loss(1, 2, 2), rel=1e-5)
    assert (out_dir / "fb.png").exists()  # the speedup plot needs the DDP row and (out_dir / "fb.csv").exists()
