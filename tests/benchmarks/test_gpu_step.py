"""``benchmarks.gpu.gpu_step``: the models' training step as the GPU-mapping column needs it, checked on CPU
(the GPU check runs the same code on CUDA)."""

from __future__ import annotations

import json

import pytest
import torch
from benchmarks.gpu import gpu_step
from benchmarks.common.gpt import lm_loss
from benchmarks.common.models import build_model


def test_the_timed_step_is_the_suites_training_step():
    # the same model, optimizer and batch trained plainly give the loss the measured run reports after its steps
    row = gpu_step.measure("gpt_tiny", "cpu", steps=3, warmup=2)
    net = build_model("gpt_tiny", 0)
    opt = torch.optim.Adam(net.parameters(), lr=0.001)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        x = torch.randint(256, (4, 17), generator=gen)
        batches.append((x[:, :-1], x[:, 1:]))
    for i in range(5):
        opt.zero_grad()
        loss = lm_loss(net(batches[i % 4][0]), batches[i % 4][1])
        loss.backward()
        opt.step()
    assert row["last_loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    assert (row["batch_size"], row["params"]) == (4, sum(p.numel() for p in net.parameters()))
    assert 0 < row["p10_s"] <= row["median_s"] <= row["p90_s"]


def test_batch_scale_and_bf16_and_bad_input():
    row = gpu_step.measure("resnet_tiny", "cpu", steps=2, warmup=0, precision="bf16", batch_scale=2)
    assert (row["batch_size"], row["precision"]) == (64, "bf16") and row["median_s"] > 0
    with pytest.raises(ValueError, match="precision"):
        gpu_step.measure("resnet_tiny", "cpu", precision="fp8")
    with pytest.raises(ValueError, match="batch_scale"):
        gpu_step.measure("resnet_tiny", "cpu", batch_scale=0)


def test_command_line_writes_the_rows(tmp_path):
    out = tmp_path / "step.json"
    gpu_step.main(["--models", "gpt_tiny", "--device", "cpu", "--steps", "2", "--warmup", "0", "--precisions", "fp32",
                   "--batch-scales", "1,2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [4, 8]
