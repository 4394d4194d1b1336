"""One bad worker cannot stop or swamp a round: real processes, a real coordinator, a job secret.

- Three workers of FaultTolerance alone (tests/fault/ft_toy_worker.py) average known tensors; the third sends NaN,
  then ``x1e6``, then its honest tensor, then claims 10**9 samples, then NaN through DiLoCo's compressed all-gather
  path. Every round completes on every worker, the bad contribution is left out and named, and the result is the
  average over the workers kept, written plainly here (the samples claim bounded to 8x the median of the others).
- Three DiLoCo workers (tests/fault/ft_worker.py), the third sending ``x1e6`` pseudo-gradients every round: nobody raises, every round leaves it out, and every worker ends with the global weights of a job of the
  two honest workers alone, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bagua.torch_api.fault.secret import new_secret
from tests.fault.ft_toy_worker import y

ROOT = Path(__file__).resolve().parents[2]


def _env(secret: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", BAGUA_JOB_SECRET_FILE=str(secret))


def _run(cmds: list[list[str]], env: dict, logs: list[Path], timeout_s: float = 120.0) -> list[int]:
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
             for c, log in zip(cmds, logs)]
    deadline = time.monotonic() + timeout_s
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_bad_contribution_is_left_out_named_and_the_round_goes_on(coordinator, tmp_path):
    secret = Path(new_secret(str(tmp_path / "job.secret")))
    outs, logs = [tmp_path / f"w{i}.pt" for i in range(3)], [tmp_path / f"w{i}.log" for i in range(3)]
    cmds = [[sys.executable, "-m", "tests.fault.ft_toy_worker", "--coordinator", coordinator, "--index", str(i),
             "--bad", "--out", str(outs[i])] for i in range(3)]
    assert _run(cmds, _env(secret), logs) == [0, 0, 0], [log.read_text()[-3000:] for log in logs]
    results = [torch.load(o) for o in outs]
    plain = {
        1: (y(0, 1) + y(1, 1)) / 2,  # NaN: left out
        2: (y(0, 2) + y(1, 2)) / 2,  # x1e6: left out (3 members, far above 10x their median norm)
        3: (y(0, 3) + y(1, 3) + y(2, 3)) / 3,  # honest: kept
        4: (2 * y(0, 4) + 2 * y(1, 4) + 16 * y(2, 4)) / 20,  # 10**9 samples claimed: 8x the others' median
    }
    for r in results:  # the bad worker too: it holds the round's average of the others
        assert all(r[k]["ok"] for k in range(1, 6))
        for k in (1, 2):
            assert torch.equal(r[k]["y"], plain[k]), (k, r[k]["y"], plain[k])
        torch.testing.assert_close(r[3]["y"], plain[3], rtol=1e-6, atol=1e-6)
        assert r[4]["weights"] == (2, 2, 16)
        torch.testing.assert_close(r[4]["y"], plain[4], rtol=1e-6, atol=1e-6)
        # round 5: compressed (bf16) all-gather, NaN left out: the mean of the two honest ones, to bf16's precision
        torch.testing.assert_close(r[5]["y"], (y(0, 5) + y(1, 5)) / 2, rtol=1e-2, atol=1e-2)
        assert [(k, w) for k, w, _ in r["dropped"]] == [(2, "w2"), (3, "w2"), (6, "w2")]
    for log in logs:  # named in the log, on every worker
        text = log.read_text()
        assert text.count("worker 'w2' is left out of quorum") == 3, text[-3000:]
        assert "NaN or Inf" in text and "the median" in text and "claims 1000000000 samples" in text


def _diloco(tmp_path: Path, name: str, workers: int, secret: Path, coordinator: str,
            poison: dict[int, str], extra: tuple[str, ...] = ()) -> list[dict]:
    outs = [tmp_path / f"{name}{i}.pt" for i in range(workers)]
    logs = [tmp_path / f"{name}{i}.log" for i in range(workers)]
    cmds = [[sys.executable, "-m", "tests.fault.ft_worker", "--coordinator", coordinator, "--index", str(i),
             "--workers", str(workers), "--steps", "16", "--sync-every", "4", "--outer", "0.7,0.9",
             "--out", str(outs[i]), *extra] + (["--poison", poison[i]] if i in poison else []) for i in range(workers)]
    codes = _run(cmds, _env(secret), logs)
    assert codes == [0] * workers, [log.read_text()[-3000:] for log in logs]
    return [dict(torch.load(o), log=log.read_text()) for o, log in zip(outs, logs)]


def test_diloco_goes_on_without_a_poisoning_worker(tmp_path):
    from bagua.torch_api.fault.coordinator import start_coordinator
    from tests.fault.jobs import free_port as _free_port

    secret = Path(new_secret(str(tmp_path / "job.secret")))
    runs = {}
    for name, workers, poison in (("poisoned", 3, {2: "x1e6"}), ("honest", 2, {})):
        port = _free_port()
        proc = start_coordinator("127.0.0.1", port)
        try:
            runs[name] = _diloco(tmp_path, name, workers, secret, f"127.0.0.1:{port}", poison)
        finally:
            proc.kill()
            proc.wait()
    honest = runs["honest"][0]["global"]
    for r in runs["poisoned"]:
        assert all(torch.equal(a, b) for a, b in zip(r["global"], honest))  # the two honest workers' job, bit for bit
        assert r["stats"]["rounds"] == 5 and r["stats"]["retries"] == 0  # the start and 4 exchanges, none retried
        assert {w for _, w, _ in r["stats"]["dropped"]} == {"w2"} and len(r["stats"]["dropped"]) == 4
        assert "worker 'w2' is left out of quorum" in r["log"]


def test_a_robust_average_is_the_coordinate_wise_trimmed_mean_of_the_sources(coordinator, tmp_path):
    """robust="trimmed_mean" (trim 1, 3 workers): a lie within the norm bound (-2 y) moves no coordinate past the
    honest values; a NaN is left out first, and the trimmed mean of the two kept is their mean."""
    secret = Path(new_secret(str(tmp_path / "job.secret")))
    outs, logs = [tmp_path / f"w{i}.pt" for i in range(3)], [tmp_path / f"w{i}.log" for i in range(3)]
    cmds = [[sys.executable, "-m", "tests.fault.ft_toy_worker", "--coordinator", coordinator, "--index", str(i),
             "--bad", "--robust", "trimmed_mean", "--out", str(outs[i])] for i in range(3)]
    assert _run(cmds, _env(secret), logs) == [0, 0, 0], [log.read_text()[-3000:] for log in logs]
    sent = [y(0, 1).tolist(), y(1, 1).tolist(), (-2 * y(2, 1)).tolist()]
    middle = torch.tensor([sorted(column)[1] for column in zip(*sent)])  # of 3 values, 1 dropped at each end
    for r in (torch.load(o) for o in outs):
        assert r[1]["ok"] and r[2]["ok"]
        assert torch.equal(r[1]["y"], middle), (r[1]["y"], middle)
        assert torch.equal(r[2]["y"], (y(0, 2) + y(1, 2)) / 2)
        assert [(k, w) for k, w, _ in r["dropped"]] == [(3, "w2")]


def test_a_compressed_round_leaves_one_nan_out_and_keeps_the_worker_after(coordinator, tmp_path):
    """uint8 rounds with error feedback: a worker whose first pseudo-gradient is NaN is left out of that round
    only (its residual is not replaced by a NaN one), and every worker ends with the same global weights."""
    secret = Path(new_secret(str(tmp_path / "job.secret")))
    runs = _diloco(tmp_path, "once", 3, secret, coordinator, {2: "nan-once"}, ("--compression", "uint8"))
    for r in runs:
        assert [(k, w) for k, w, _ in r["stats"]["dropped"]] == [(2, "w2")] and r["stats"]["retries"] == 0
        assert all(torch.equal(a, b) for a, b in zip(r["global"], runs[0]["global"]))
        assert all(torch.isfinite(g).all() for g in r["global"])
    assert all(torch.isfinite(t).all() for t in runs[2]["residuals"].values())

