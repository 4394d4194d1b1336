"""Checkpoints round-trip, and a crash while saving leaves the previous checkpoint as the latest."""

from __future__ import annotations

import os

import pytest
import torch
from torch.testing import assert_close

from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint


def _setup(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    return model, opt, sched


def test_round_trip(tmp_path):
    model, opt, sched = _setup(0)
    save_checkpoint(7, str(tmp_path), model, opt, sched)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert (tmp_path / "iter_0000007" / "mp_rank_00_model_states.pt").is_file()
    other, other_opt, other_sched = _setup(1)
    assert load_checkpoint(str(tmp_path), other, other_opt, other_sched) == 7
    assert_close(list(other.parameters()), list(model.parameters()), rtol=0, atol=0)
    assert_close(other_opt.state_dict()["state"], opt.state_dict()["state"], rtol=0, atol=0)
    assert other_sched.state_dict() == sched.state_dict()


def test_no_checkpoint_returns_zero(tmp_path):
    model, opt, _ = _setup(0)
    assert load_checkpoint(str(tmp_path / "missing"), model, opt) == 0


class _Unpicklable:
    def __reduce__(self):
        raise KeyboardInterrupt("crash in the middle of writing the checkpoint file")


class _Exploding:
    """A scheduler whose state makes torch.save fail after it has started writing the file."""

    def state_dict(self):
        return {"big": torch.zeros(100_000), "boom": _Unpicklable()}


def test_crash_while_saving_keeps_previous_latest(tmp_path):
    model, opt, _ = _setup(0)
    save_checkpoint(1, str(tmp_path), model, opt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(2, str(tmp_path), model, opt, _Exploding())
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not [f for d, _, fs in os.walk(tmp_path) for f in fs if f.startswith(".tmp-")]
    assert load_checkpoint(str(tmp_path), model, opt) == 1


def test_bad_tracker_content(tmp_path):
    model, _, _ = _setup(0)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(ValueError, match="expected an iteration number or 'release'"):
        load_checkpoint(str(tmp_path), model)


# -- a writer killed mid-save leaves a temporary file; the next save removes it, never a live writer's ----------

_KILLED_WRITER = """
import pathlib, sys, time
import torch
from bagua.torch_api.checkpoint import save_checkpoint

class Blocks:
    def __reduce__(self):
        pathlib.Path(sys.argv[2]).touch()  # torch.save is under way: the temporary file is open
        time.sleep(120)

class Scheduler:
    def state_dict(self):
        return {"big": torch.zeros(1_000_000), "blocks": Blocks()}

save_checkpoint(5, sys.argv[1], torch.nn.Linear(4, 2), None, Scheduler())
"""


def _tmp_files(root):
    return sorted(p for p in root.rglob(".tmp-*"))


def test_temp_file_of_a_killed_writer_is_removed_at_the_next_save(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    ckpt, marker = tmp_path / "ckpt", tmp_path / "writing"
    model, opt, _ = _setup(0)
    save_checkpoint(1, str(ckpt), model, opt)
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(ckpt), str(marker)])
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert writer.poll() is None and time.monotonic() < deadline, "the writer never started saving"
        time.sleep(0.05)
    writer.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not open(f"/proc/{writer.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    orphans = _tmp_files(ckpt)
    assert [p.parent.name for p in orphans] == ["iter_0000005"]  # left behind, next to where it was going
    assert f"-{writer.pid}-" in orphans[0].name

    # a temporary file that a live process of this host is writing, and files of other hosts, young and old
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        from bagua.torch_api.checkpoint.atomic import STALE_TMP_AGE_S, _host

        being_written = ckpt / f".tmp-{_host()}-{live.pid}-abc"
        other_young = ckpt / "iter_0000001" / ".tmp-otherhost-123-abc"
        other_old = ckpt / ".tmp-otherhost-456-abc"
        for path in (being_written, other_young, other_old):
            path.write_bytes(b"partial")
        old = time.time() - STALE_TMP_AGE_S - 60
        os.utime(other_old, (old, old))

        save_checkpoint(2, str(ckpt), model, opt)  # the killed writer is still a zombie: dead all the same
        assert _tmp_files(ckpt) == sorted([being_written, other_young])
        assert writer.wait(timeout=30) == -signal.SIGKILL
        assert load_checkpoint(str(ckpt), model, opt) == 2
    finally:
        live.kill()
        live.wait()
    save_checkpoint(3, str(ckpt), model, opt)  # now its writer is dead too
    assert _tmp_files(ckpt) == [other_young]


def test_temp_file_named_by_a_reused_pid_is_removed(tmp_path):
    import subprocess
    import sys
    import time

    from bagua.torch_api.checkpoint.atomic import _host

    model, opt, _ = _setup(0)
    younger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        # written an hour before the process that now holds its pid started: that process is not its writer
        reused = tmp_path / f".tmp-{_host()}-{younger.pid}-abc"
        reused.write_bytes(b"partial")
        past = time.time() - 3600
        os.utime(reused, (past, past))
        # pid 1 started before this file was written, so it may be writing it: kept
        kept = tmp_path / f".tmp-{_host()}-1-abc"
        kept.write_bytes(b"partial")
        save_checkpoint(1, str(tmp_path), model, opt)
        assert _tmp_files(tmp_path) == [kept]
    finally:
        younger.kill()
        younger.wait()


# -- ranks that do not share a filesystem: every rank loads the same iteration, or every rank raises -----------


def _worker_load_own_dir(rank, world_size, cases):
    import warnings

    out = []
    for base in cases:  # one spawn for every case: the collectives of each case are complete before the next
        model, opt, _ = _setup(100 + rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                iteration = load_checkpoint(os.path.join(base, f"rank{rank}"), model, opt)
            except (FileNotFoundError, ValueError, RuntimeError) as error:
                out.append((type(error).__name__, str(error)))
                continue
        out.append((iteration, [p.detach().clone() for p in model.parameters()], [str(w.message) for w in caught]))
    return out


def _save_per_rank(base, layout):
    """layout: rank -> what its directory holds, in order: iterations saved (the last one is the latest),
    "garbage" (an unreadable tracker) or "corrupt" (iteration 1's file overwritten)."""
    for rank, steps in layout.items():
        directory = base / f"rank{rank}"
        directory.mkdir(parents=True)
        for step in steps:
            if step == "garbage":
                (directory / "latest_checkpointed_iteration.txt").write_text("garbage")
            elif step == "corrupt":
                (directory / "iter_0000001" / "mp_rank_00_model_states.pt").write_bytes(b"not a zip")
            else:
                model, opt, _ = _setup(step)  # weights tell the iterations apart
                save_checkpoint(step, str(directory), model, opt)


_CASES = [  # (what each rank's own directory holds, the outcome on every rank)
    ({0: [1, 2], 1: [1]}, 1),  # rank 1 is behind: both load its latest, which rank 0 also has
    ({0: [3], 1: []}, ("FileNotFoundError", "rank(s) [1] have no checkpoint")),
    ({0: [2], 1: [1]}, ("FileNotFoundError", "rank(s) [0] lack iteration 1")),  # rank 0 kept only iteration 2
    ({0: [1], 1: ["garbage"]}, ("ValueError", "rank(s) [1] holds neither an iteration number")),
    ({0: [1], 1: [1, "corrupt"]}, ("RuntimeError", "failed on rank(s) [1]")),
    ({0: [], 1: []}, 0),
]


def test_ranks_without_a_shared_filesystem_agree_or_fail_together(tmp_path):
    from tests.harness import run_workers

    cases = []
    for number, (layout, _) in enumerate(_CASES):
        _save_per_rank(tmp_path / str(number), layout)
        cases.append(str(tmp_path / str(number)))
    results = run_workers(_worker_load_own_dir, 2, cases, timeout=60)  # the old code hung on case 1
    for number, (layout, outcome) in enumerate(_CASES):
        for rank in (0, 1):
            got = results[rank][number]
            if isinstance(outcome, int):  # every rank loads the same iteration
                assert got[0] == outcome, (layout, rank, got)
                if outcome:
                    assert_close(got[1], list(_setup(outcome)[0].parameters()), rtol=0, atol=0)
            else:  # every rank raises the same kind of error, naming the same ranks
                assert got[0] == outcome[0] and outcome[1] in got[1], (layout, rank, got)
    assert any("rank(s) [1] only have up to 1; every rank loads 1" in m for m in results[0][0][2])
