"""Every example script runs to the end at a tiny size under the launcher, at 2 ranks, and prints its result."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _launch(script: str, *args: str, cwd: str, timeout: float = 90, nproc: int = 2) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "bagua.distributed.launch", f"--nproc_per_node={nproc}", os.path.join(EXAMPLES, script),
         *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )
    # A clean exit is part of the check: Bagua releases its process groups before the interpreter finalizes
    # (bagua.torch_api.comm.lifecycle), so gloo never aborts a finished script ("terminate called ...", SIGABRT).
    assert proc.returncode == 0, f"{script} exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_mnist(tmp_path):
    out = _launch("mnist.py", "--algorithm", "bytegrad", "--epochs", "1", "--log-interval", "100", cwd=str(tmp_path))
    m = re.search(r"algorithm bytegrad: 2 ranks, 1 epochs .* test accuracy ([\d.]+)%", out)
    assert m and float(m.group(1)) > 15.0, out  # above the 10% of chance after one epoch


def test_communication_primitives(tmp_path):
    out = _launch("communication_primitives.py", "--size", "64", cwd=str(tmp_path))
    assert "communication primitives: all 8 checks passed on 2 ranks" in out, out


def test_elastic_training_resumes_from_its_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = _launch("elastic_training.py", "--epochs", "1", "--checkpoint-dir", ckpt, cwd=str(tmp_path))
    assert "no checkpoint: starting from scratch" in first and "finished epoch 1 on 2 ranks" in first, first
    second = _launch("elastic_training.py", "--epochs", "2", "--checkpoint-dir", ckpt, cwd=str(tmp_path))
    assert "resumed from epoch 1" in second and "epoch 2:" in second and "epoch 1:" not in second, second


def test_moe(tmp_path):
    out = _launch("moe.py", "--epochs", "1", "--top-k", "2", cwd=str(tmp_path))
    assert re.search(r"moe: 4 experts on 2 ranks, top-2, test accuracy [\d.]+%", out), out


def test_synthetic_benchmark(tmp_path):
    out = _launch("synthetic_benchmark.py", "--model", "cnn", "--batch-size", "4", "--image-size", "16",
                  "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2", cwd=str(tmp_path))
    per_rank = re.search(r"Img/sec per rank: ([\d.]+) \+-", out)
    total = re.search(r"Total img/sec on 2 rank\(s\): ([\d.]+) \+-", out)
    assert per_rank and total and float(total.group(1)) == pytest.approx(2 * float(per_rank.group(1)), rel=1e-3), out


def test_fsdp_diloco(tmp_path):
    # 4 ranks: 2 replicas x 2 shards; 30 steps at H=10 (its 3 synchronizations) learn the synthetic rule
    out = _launch("fsdp_diloco.py", "--steps", "30", cwd=str(tmp_path), nproc=4, timeout=150)
    m = re.search(r"fsdp_diloco: 2 replicas x 2 shards, .*, 30 steps, 3 DiLoCo synchronizations, "
                  r"loss ([\d.]+) -> ([\d.]+)", out)
    assert m and float(m.group(2)) < 0.5 * float(m.group(1)), out
