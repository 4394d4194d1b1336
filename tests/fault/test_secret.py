"""The job secret's record format and the screening rules, without processes: a sealed record opens only under its
own key, job and secret; junk is ignored with one warning; the samples and norms rules as written in
bagua/torch_api/fault/screen.py's docstring, checked against plain arithmetic here."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import time

import pytest

from bagua.torch_api.fault import secret as sec
from bagua.torch_api.fault.coordinator import main as coordinator_main
from bagua.torch_api.fault.screen import bound_samples, screen

SECRET = b"0123456789abcdef0123456789abcdef"
KEY = "job/q/3/slot/1"
PAYLOAD = '{"round": 3, "id": "w0"}'


def test_a_sealed_record_is_an_hmac_over_its_key_and_payload():
    sealed = sec.Records(SECRET, "job").seal(KEY, PAYLOAD)
    # the format, recomputed plainly: HMAC-SHA256 under a key derived from the secret and the job
    job_key = hmac.new(SECRET, b"bagua-ft/1\0records/job", hashlib.sha256).digest()
    tag = hmac.new(job_key, KEY.encode() + b"\0" + PAYLOAD.encode(), hashlib.sha256).hexdigest()
    assert sealed == f"bagua-hmac1:{tag}:{PAYLOAD}"
    assert sec.Records(SECRET, "job").open(KEY, sealed) == PAYLOAD


@pytest.mark.parametrize("case", ["tampered payload", "tampered tag", "another key", "another round", "another job",
                                  "wrong secret", "unsealed", "junk"])
def test_a_record_that_fails_is_ignored_and_counted(case):
    records = sec.Records(SECRET, "job")
    sealed = records.seal(KEY, PAYLOAD)
    reader, key, raw = sec.Records(SECRET, "job"), KEY, sealed
    if case == "tampered payload":
        raw = sealed.replace('"w0"', '"w9"')
    elif case == "tampered tag":
        raw = sealed[:20] + ("0" if sealed[20] != "0" else "1") + sealed[21:]
    elif case == "another key":
        key = "job/q/3/slot/2"  # replayed into another slot
    elif case == "another round":
        key = "job/q/4/slot/1"  # replayed into the next quorum
    elif case == "another job":
        reader, key = sec.Records(SECRET, "other"), "other/q/3/slot/1"
    elif case == "wrong secret":
        reader = sec.Records(b"another secret of enough length!", "job")
    elif case == "unsealed":
        raw = PAYLOAD  # what a process without the secret writes
    else:
        raw = "\x00\xffnot a record"
    assert reader.open(key, raw) is None and reader.refused == 1


def test_refused_records_warn_once_per_interval_with_a_count(caplog):
    records = sec.Records(SECRET, "job")
    with caplog.at_level(logging.WARNING, logger=sec.__name__):
        for i in range(50):
            assert records.open(f"job/q/{i}/closed", "junk") is None
    warnings = [r for r in caplog.records if "failed the job's checks" in r.getMessage()]
    assert records.refused == 50 and len(warnings) == 1


def test_an_open_job_reads_plain_records_and_refuses_to_read_a_sealed_job():
    open_job = sec.Records(None, "job")
    assert open_job.seal(KEY, PAYLOAD) == PAYLOAD and open_job.open(KEY, PAYLOAD) == PAYLOAD
    with pytest.raises(sec.NotAdmitted, match="sealed with a job secret that this worker does not have"):
        open_job.open(KEY, sec.Records(SECRET, "job").seal(KEY, PAYLOAD))


def test_new_secret_writes_an_owner_only_file_once_and_workers_read_it(tmp_path, monkeypatch, capsys):
    path = tmp_path / "job.secret"
    coordinator_main(["--new-secret", str(path)])
    assert "BAGUA_JOB_SECRET_FILE" in capsys.readouterr().out
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(path.read_text().strip()) == 64
    with pytest.raises(SystemExit):  # never overwritten
        coordinator_main(["--new-secret", str(path)])
    monkeypatch.delenv("BAGUA_JOB_SECRET", raising=False)
    monkeypatch.delenv("BAGUA_JOB_SECRET_FILE", raising=False)
    assert sec.load_secret() is None  # none configured: an open job
    assert sec.load_secret(str(path)) == path.read_text().strip().encode()
    monkeypatch.setenv("BAGUA_JOB_SECRET", "from-the-environment-0123")
    assert sec.load_secret() == b"from-the-environment-0123"
    monkeypatch.setenv("BAGUA_JOB_SECRET_FILE", str(path))  # the file wins over the variable
    assert sec.load_secret() == path.read_text().strip().encode()
    monkeypatch.setenv("BAGUA_JOB_SECRET", "short")
    monkeypatch.delenv("BAGUA_JOB_SECRET_FILE")
    with pytest.raises(ValueError, match="at least 16"):
        sec.load_secret()


def test_heal_keys_differ_per_purpose():
    keys = {sec.derive(SECRET, p) for p in ("records/job", "heal/job/3/w0/w1", "heal/job/3/w1/w0", "heal/job/4/w0/w1")}
    assert len(keys) == 4


def test_sample_claims_are_bounded_by_eight_times_the_median_of_the_others():
    assert bound_samples([100, 100, 10**9]) == [100, 100, 800]
    assert bound_samples([3, 1]) == [3, 1]  # within 8x: unchanged
    assert bound_samples([1000, 10**9]) == [1000, 8000]
    assert bound_samples([5, 0, -7]) == [5, 0, 0]  # a healed member (0) is no source; a negative claim counts 0
    assert bound_samples([1, 100], max_ratio=None) == [1, 100]


def test_contributions_not_finite_or_above_ten_times_the_median_norm_are_left_out():
    nan, inf = float("nan"), float("inf")
    assert screen([1.0, nan], [1, 1])[0] == [1, 0]
    assert screen([1.0, inf, 2.0], [1, 1, 1])[0] == [1, 0, 1]
    assert screen([1.0, 1e6], [1, 1])[0] == [1, 1]  # two sources: no median to judge by
    assert screen([1.0, 2.0, 20.0], [1, 1, 1])[0] == [1, 1, 1]  # 10x the median (2.0): kept
    assert screen([1.0, 2.0, 20.1], [1, 1, 1])[0] == [1, 1, 0]
    assert screen([1.0, nan, 1e3], [1, 0, 1])[0] == [1, 0, 1]  # a healed member (weight 0) is neither judged nor
    assert screen([1.0, 0.0, 1.0, 1e3], [1, 0, 1, 1])[0] == [1, 0, 1, 0]  # counted: 3 sources, median 1.0
    kept, why = screen([1.0, 1.0, 1e6, 1.0], [4, 4, 4, 4], max_ratio=None)
    assert kept == [4, 4, 4, 4] and why == {}


# -- on a real coordinator, workers as threads: the bound on distinct workers ------------------------------------


@pytest.mark.parametrize("max_workers", [None, 3])
def test_a_new_worker_past_max_workers_is_refused(coordinator, max_workers):
    """A job of 2 workers (with a secret) that started: a third id is left out of every quorum and told why
    (``NotAdmitted``), unless every worker allows 3; a restarted worker (its id known) is readmitted."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from bagua.torch_api.fault.quorum import Quorums
    from bagua.torch_api.fault.records import Member

    me = Member(round=0, joining=False, samples=1, part=0)
    kw = dict(heartbeat_s=0.1, stale_s=1.0, timeout_s=10.0, deadline_s=0.5, secret=SECRET, max_workers=max_workers,
              prefix=f"bound-{max_workers}")
    qs = [Quorums(coordinator, f"w{i}", 2, **kw) for i in range(2)]
    with ThreadPoolExecutor(3) as pool:
        first = list(pool.map(lambda q: q.wait(1, dataclasses.replace(me, joining=True)), qs))
        assert list(pool.map(lambda q: q.report(first[0], True), qs)) == [True, True]
        third = Quorums(coordinator, "w2", 2, **kw)
        restarted = Quorums(coordinator, "w1", 2, **kw)  # w1's new process: its id is known
        joiners = [pool.submit(third.wait, 2, dataclasses.replace(me, joining=True))]
        time.sleep(0.3)
        joiners.append(pool.submit(restarted.wait, 2, dataclasses.replace(me, joining=True)))
        time.sleep(0.3)
        closed = qs[0].wait(2, me)
        if max_workers is None:
            assert closed.ids == ["w0", "w1"]
            with pytest.raises(sec.NotAdmitted, match="already admitted max_workers=2 distinct workers"):
                joiners[0].result(timeout=10)
        else:
            assert closed.ids == ["w0", "w1", "w2"] and joiners[0].result(timeout=10).ids == closed.ids
        assert joiners[1].result(timeout=10).ids == closed.ids
    for q in qs + [third, restarted]:
        q.close()


def test_robust_averages_against_sorted_columns_written_plainly():
    import torch

    from bagua.torch_api.fault.robust import robust_average

    rows = torch.randn(5, 7, generator=torch.Generator().manual_seed(3))
    columns = [sorted(c) for c in zip(*rows.tolist())]
    trimmed = torch.tensor([sum(c[1:4]) / 3 for c in columns])
    torch.testing.assert_close(robust_average(rows, "trimmed_mean", trim=1), trimmed, rtol=0, atol=1e-6)
    assert torch.equal(robust_average(rows, "median"), torch.tensor([c[2] for c in columns]))
    even = torch.tensor([[sum(c[1:3]) / 2 for c in (sorted(c) for c in zip(*rows[:4].tolist()))]])
    torch.testing.assert_close(robust_average(rows[:4], "median"), even[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(robust_average(rows[:2], "trimmed_mean", trim=1), rows[:2].mean(0))  # too few: median
    with pytest.raises(ValueError, match="available: median, trimmed_mean"):
        robust_average(rows, "mean")
