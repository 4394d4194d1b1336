"""The launchers start real multi-process jobs; an elastic job survives a dead rank and resumes from checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train_tiny.py")


def _run(args, timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=timeout)


def _finals(out):
    return [torch.load(os.path.join(out, f"final_rank{r}.pt")) for r in range(2)]


def test_launch_with_original_flags(tmp_path):
    proc = _run(["bagua.distributed.launch", "--nproc_per_node=2", "--set_additional_flag",
                 "--default_bucket_size=1MiB", SCRIPT, str(tmp_path), "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = _finals(tmp_path)
    assert_close(r0["params"], r1["params"], rtol=0, atol=0)
    assert (r0["local_rank_arg"], r1["local_rank_arg"]) == (0, 1)  # --set_additional_flag passed --local-rank


def test_elastic_run_restarts_after_a_rank_dies_and_matches_an_uninterrupted_run(tmp_path):
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    clean.mkdir()
    crashed.mkdir()
    proc = _run(["bagua.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT, str(clean), "8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run(["bagua.distributed.run", "--standalone", "--nproc_per_node=2", "--max_restarts=2",
                 SCRIPT, str(crashed), "8", "--crash-at", "5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, got = _finals(clean), _finals(crashed)
    assert got[0]["attempt"] == 1 and got[0]["start"] == 5  # restarted once, resumed from the step-5 checkpoint
    for r in range(2):
        assert_close(got[r]["params"], ref[r]["params"], rtol=0, atol=0)


def test_launcher_rejects_invalid_flags():
    proc = _run(["bagua.distributed.launch", "--nproc_per_node=2", "--default_bucket_size=0", SCRIPT, "x", "1"])
    assert proc.returncode != 0 and "bucket size must be positive" in proc.stderr


@pytest.mark.parametrize("module", ["bagua.distributed.run", "bagua.distributed.launch", "bagua.distributed.baguarun"])
def test_help_lists_bagua_flags(module):
    proc = _run([module, "--help"], timeout=60)
    assert proc.returncode == 0 and "--autotune_level" in proc.stdout and "--nproc" in proc.stdout
