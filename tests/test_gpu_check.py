"""The GPU check (benchmarks/gpu/gpu_check.sh, issue 31) in its dry run: every stage runs at tiny sizes, and each part
that needs CUDA is skipped with one line, so the script that a lent GPU machine runs cannot rot unnoticed.

``--dry-run`` skips the CUDA parts even on a machine with CUDA. The network stage runs one tiny job (in network
namespaces as root, over loopback otherwise); the latency stage runs only where the kernel has sch_netem, and
says in one line why not elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from benchmarks.gpu import gpu_check, gpu_check_network
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--stage", "install,tests,codec,step,network,latency", "--dry-run", "--budget-s", "300",
        "--tests-path", "tests/gpu/test_kernels_on_cuda.py", "--codec-elements", "4096", "--codec-chunks", "2",
        "--repeats", "2", "--adam-params", "2", "--adam-shape", "8",
        "--step-models", "gpt_tiny", "--step-steps", "2", "--step-warmup", "1", "--step-batch-scales", "1,2",
        "--network-hosts", "2", "--network-models", "tiny", "--network-rates", "100mbit",
        "--network-systems", "gradient_allreduce", "--network-warmup", "1", "--network-steps", "1",
        "--latency-ms", "0,5", "--latency-systems", "ddp", "--latency-model", "tiny", "--latency-rate", "100mbit"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu", "gpu_check.sh"), str(out), *TINY], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    with open(out / "gpu_check.json") as f:
        return proc, json.load(f), out


def test_every_stage_runs_and_succeeds(dry_run):
    proc, result, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["meta"]["cuda"] is False
    assert {name: stage["status"] for name, stage in result["stages"].items()} == dict.fromkeys(gpu_check.STAGES, "ok")


def test_each_cuda_part_is_skipped_with_one_line(dry_run):
    proc, _, out = dry_run
    skips = [line for line in proc.stdout.splitlines() if "SKIP (no CUDA)" in line]
    assert [line.split(":")[0] for line in skips] == ["tests", "codec", "fused adam", "step"], skips
    with open(out / "gpu_check.log") as f:
        assert f.read().count("SKIP (no CUDA)") == 4


def test_stages_report_what_they_measured(dry_run):
    _, result, out = dry_run
    stages = result["stages"]
    assert stages["install"]["versions"]["torch"] and stages["install"]["versions"]["bagua"]
    gpu = stages["tests"]["gpu_marked"]
    assert gpu["counts"]["skipped"] > 0 and "passed" not in gpu["counts"]  # no CUDA: every gpu test skips
    assert [r["op"] for r in stages["codec"]["codec"]] == ["encode", "decode"]
    assert all(r["gb_per_s"] > 0 and r["of_copy"] > 0 for r in stages["codec"]["codec"])
    assert {"unfused", "fused", "foreach"} <= set(stages["codec"]["fused_adam_ms"])
    assert [(r["precision"], r["batch_size"]) for r in stages["step"]["rows"]] == [
        ("fp32", 4), ("fp32", 8), ("bf16", 4), ("bf16", 8)]
    assert all(0 < r["p10_s"] <= r["median_s"] <= r["p90_s"] for r in stages["step"]["rows"])
    (row,) = stages["network"]["rows"]
    assert (row["system"], row["status"]) == ("gradient_allreduce", "ok"), row.get("error")
    assert (out / "network.csv").exists()
    latency = stages["latency"]
    assert "skipped" in latency or {r["status"] for r in latency["rows"]} == {"ok"}


def test_pytest_summary_reads_counts_and_failures():
    out = "\n".join(["FAILED tests/a.py::test_x - AssertionError: boom",
                     "SKIPPED [2] tests/b.py:3: needs a CUDA device", "XFAIL tests/c.py::test_y - gloo cannot",
                     "1 failed, 5 passed, 2 skipped, 1 xfailed in 3.10s"])
    summary = gpu_check.pytest_summary(1, out)
    assert summary["counts"] == {"failed": 1, "passed": 5, "skipped": 2, "xfailed": 1}
    assert summary["status"] == "failed" and len(summary["failed"]) == 1 and len(summary["xfailed"]) == 1
    assert gpu_check.pytest_summary(None, "")["status"] == "partial"  # stopped at the budget
    assert gpu_check.pytest_summary(5, "no tests ran in 0.1s")["status"] == "ok"  # nothing selected


def test_codec_speeds_against_the_copy():
    rows = [{"op": "encode", "numel": 1 << 26, "ms": 0.2}, {"op": "decode", "numel": 1 << 26, "ms": 0.5},
            {"op": "plain_encode", "numel": 1 << 26, "ms": 1.0}]
    encode, decode = gpu_check.codec_speeds(rows, copy_bps=3.0e12)
    assert encode["met"] and not decode["met"]  # 1342 GB/s = 45 % of the copy's 3 TB/s; 537 GB/s = 18 %
    assert encode["of_copy"] == pytest.approx(4 * (1 << 26) / 0.2e-3 / 3.0e12, rel=1e-3)
    assert encode["moved_of_copy"] == pytest.approx(encode["of_copy"] * 5 / 4, rel=1e-3)


def test_lanes_start_when_their_hosts_fit_and_ddp_runs_first():
    Lane, next_lane = gpu_check_network.Lane, gpu_check_network.next_lane
    pending = [Lane("4h-mlp", 4), Lane("4h-gpt", 4), Lane("2h-mlp", 2)]
    assert next_lane(pending, used=12, capacity=14).name == "2h-mlp"  # the first that fits beside the running
    assert next_lane(pending, used=13, capacity=14) is None
    assert next_lane([Lane("big", 16)], used=0, capacity=14).name == "big"  # too large for the cores: alone
    systems = ["ddp_powersgd", "qadam", "ddp", "decentralized:peer_selection_mode=shift_one", "ddp_fp16"]
    assert gpu_check_network.order_systems(systems) == [
        "ddp", "qadam", "decentralized:peer_selection_mode=shift_one", "ddp_powersgd", "ddp_fp16"]


def test_gpu_tests_only_skips_the_rest(tmp_path):
    # the gpu-marked tests alone, as a short device call runs them
    args = ["--stage", "tests,network", "--gpu-tests-only", "--dry-run", "--budget-s", "100",
            "--tests-path", "tests/gpu/test_kernels_on_cuda.py", "--network-models", "tiny", "--network-hosts", "2",
            "--network-rates", "100mbit", "--network-systems", "gradient_allreduce", "--network-warmup", "1",
            "--network-steps", "1"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.gpu_check", str(tmp_path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "gpu_check.json") as f:
        tests = json.load(f)["stages"]["tests"]
    assert tests["rest"]["status"] == "skipped" and "--gpu-tests-only" in tests["rest"]["summary"]
    assert tests["gpu_marked"]["status"] == "ok"


def test_the_gpu_tests_keep_their_time_in_a_short_call(tmp_path):
    run = gpu_check.Run(str(tmp_path), budget_s=100, cuda=False, stages=["tests", "network"])
    share = run.left_s("tests")  # the network stage's reserve leaves the tests a proportional share
    assert share < 40
    assert gpu_check.gpu_tests_seconds(run, only=True) == pytest.approx(100, abs=1)  # all of the call's 100 s
    assert gpu_check.gpu_tests_seconds(run, only=False) == pytest.approx(share, abs=1)
    long = gpu_check.Run(str(tmp_path), budget_s=540, cuda=False, stages=["tests", "codec"])
    assert gpu_check.gpu_tests_seconds(long, only=True) == pytest.approx(long.left_s("tests"), abs=1)
