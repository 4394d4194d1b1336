"""Only the job's workers: real processes, a real coordinator, a job secret (BAGUA_JOB_SECRET_FILE).

- Two DiLoCo workers with the secret, and beside them a process without it and one with another secret, each
  claiming to be a worker of the job: neither is ever admitted (they stop with an error saying why; no quorum
  holds them, no state is sent to them), and the two workers end with the global weights of the same job run
  alone, bit for bit.
- Junk written into the coordinator's store under the job's keys (slots, closed quorums, verdicts, the latest
  quorum, registrations, the admitted workers), before and while the job runs: it is ignored with a warning
  (rate-limited), and the job ends with the same weights, bit for bit.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bagua.torch_api.fault.secret import new_secret

ROOT = Path(__file__).resolve().parents[2]
JOB = ["--workers", "2", "--steps", "16", "--sync-every", "4", "--outer", "0.7,0.9"]


def _spawn(coordinator: str, i: int, out: Path, log: Path, secret: Path | None, extra: list[str] = ()
           ) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BAGUA_JOB_SECRET")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if secret is not None:
        env["BAGUA_JOB_SECRET_FILE"] = str(secret)
    cmd = [sys.executable, "-m", "tests.fault.ft_worker", "--coordinator", coordinator, "--index", str(i),
           *JOB, "--out", str(out), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait(procs: list[subprocess.Popen], timeout_s: float = 150.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _job(coordinator: str, tmp: Path, secret: Path) -> list[dict]:
    """The two honest workers of the job; their saved results and logs."""
    outs, logs = [tmp / f"w{i}.pt" for i in range(2)], [tmp / f"w{i}.log" for i in range(2)]
    procs = [_spawn(coordinator, i, outs[i], logs[i], secret) for i in range(2)]
    assert _wait(procs) == [0, 0], [log.read_text()[-3000:] for log in logs]
    return [dict(torch.load(o), log=log.read_text()) for o, log in zip(outs, logs)]


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    return Path(new_secret(str(tmp_path_factory.mktemp("secret") / "job.secret")))


@pytest.fixture(scope="module")
def alone(secret, tmp_path_factory) -> list[dict]:
    """The job run alone: its workers' results (the reference)."""
    from bagua.torch_api.fault.coordinator import start_coordinator
    from tests.fault.jobs import free_port as _free_port

    port = _free_port()
    proc = start_coordinator("127.0.0.1", port)
    try:
        return _job(f"127.0.0.1:{port}", tmp_path_factory.mktemp("alone"), secret)
    finally:
        proc.kill()
        proc.wait()


def _same_weights(runs: list[dict], reference: list[dict]) -> None:
    for r, ref in zip(runs, reference):
        assert all(torch.equal(a, b) for a, b in zip(r["global"], ref["global"]))
        assert all(torch.equal(a, b) for a, b in zip(r["params"], ref["params"]))
        assert r["stats"]["members"] == ["w0", "w1"] and r["stats"]["rounds"] == ref["stats"]["rounds"] == 5


def test_a_process_without_the_secret_is_never_admitted(coordinator, tmp_path, secret, alone):
    other = Path(new_secret(str(tmp_path / "other.secret")))
    intruders = [_spawn(coordinator, 7, tmp_path / "w7.pt", tmp_path / "w7.log", None),  # no secret at all
                 _spawn(coordinator, 8, tmp_path / "w8.pt", tmp_path / "w8.log", other, ["--timeout-s", "8"])]
    runs = _job(coordinator, tmp_path, secret)
    codes = _wait(intruders, timeout_s=60.0)
    _same_weights(runs, alone)
    # no state sent to them: w0 served w1 once (the job's start), as when run alone; no round held them
    assert [r["stats"]["served"] for r in runs] == [r["stats"]["served"] for r in alone] == [1, 0]
    assert all(r["stats"]["refused"] > 0 and "failed the job's checks" in r["log"] for r in runs)
    assert codes[0] != 0 and "NotAdmitted" in (tmp_path / "w7.log").read_text()
    assert "sealed with a job secret that this worker does not have" in (tmp_path / "w7.log").read_text()
    assert codes[1] != 0 and "TimeoutError" in (tmp_path / "w8.log").read_text()
    assert not (tmp_path / "w7.pt").exists() and not (tmp_path / "w8.pt").exists()


def _junk(coordinator: str, stop: threading.Event) -> None:
    """Write junk under the job's keys: every kind of record, before the job and, for slots, while it runs."""
    host, _, port = coordinator.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    k = "bagua-ft"
    for q in range(1, 12):
        store.set(f"{k}/q/{q}/closed", '{"key": %d, "members": [], "epoch": 1, "first": false}' % q)
        store.set(f"{k}/q/{q}/verdict", "ok")
        store.set(f"{k}/q/{q}/slot/{store.add(f'{k}/q/{q}/n', 1)}",
                  '{"round": 99, "joining": false, "samples": 1, "part": 0, "id": "evil"}')
    for key, value in (("latest", "999"), ("admitted", '["evil"]'), ("started", "1"), ("finished/w1", "3")):
        store.set(f"{k}/{key}", value)
    store.set(f"{k}/workers/{store.add(f'{k}/workers/n', 1)}", "evil")
    while not stop.wait(0.3):  # a slot of junk in every quorum, as the job goes
        for q in range(1, 12):
            store.set(f"{k}/q/{q}/slot/{store.add(f'{k}/q/{q}/n', 1)}", "bagua-hmac1:00:{}")


def test_junk_in_the_store_is_ignored_with_a_warning(coordinator, tmp_path, secret, alone):
    stop = threading.Event()
    junk = threading.Thread(target=_junk, args=(coordinator, stop), daemon=True)
    junk.start()
    time.sleep(0.5)  # the first junk is there before the workers
    try:
        runs = _job(coordinator, tmp_path, secret)
    finally:
        stop.set()
        junk.join(timeout=10)
    _same_weights(runs, alone)
    for r in runs:
        assert r["stats"]["refused"] > 10
        warnings = r["log"].count("failed the job's checks")
        assert 1 <= warnings <= 3, r["log"][-3000:]  # rate-limited: one per 30 s, not one per poll
