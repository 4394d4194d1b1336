"""The top-k energy probe (benchmarks.to_target.topk_energy) on a hand-made pseudo-gradient, its figures worked
out here by hand."""

from __future__ import annotations

import pytest
import torch

from benchmarks.to_target import topk_energy


def test_energy_and_cosine_per_density(monkeypatch):
    # one block of 256: values 1..256 in magnitude, signs alternating; top k keeps the k largest
    d = torch.arange(1, 257, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(128)
    monkeypatch.setattr(topk_energy, "pseudo_gradient", lambda model, steps, seed=0: d)
    out = {what: (energy, cos) for what, energy, cos in topk_energy.main(["--steps", "1"])}
    total = sum(v * v for v in range(1, 257))
    for k in (8, 16, 32, 64, 128):
        top = sum(v * v for v in range(257 - k, 257)) / total
        energy, cos = out[f"exact top {k} of 256"]
        assert energy == pytest.approx(top, rel=1e-5) and cos == pytest.approx(top ** 0.5, rel=1e-5)
    assert out["uint4 (block 4096)"][1] > 0.99
    assert out["topk (block 256)"][1] == pytest.approx(out["exact top 8 of 256"][1], abs=0.01)
    # sign1: mean -0.5, mean |d - mean| 128.5, so the odd (positive) values decode to 128 and the even to -129
    y = torch.where(d > 0, 128.0, -129.0)
    energy, cos = out["sign1 (block 256)"]
    assert energy == pytest.approx(float(y.square().sum() / total), rel=1e-6)
    assert cos == pytest.approx(float(torch.dot(y, d) / (y.norm() * d.norm())), rel=1e-6)
