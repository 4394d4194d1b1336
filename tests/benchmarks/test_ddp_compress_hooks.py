"""The suite's ``ddp_fp16`` and ``ddp_bf16`` systems: every rank's gradient after backward is torch's compression
hook written out on tensors (each rank's gradient cast to the wire type, divided there by the world size, summed
in that type, cast back), not the plain float32 mean. Tolerance: bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_workers

WIRE = {"ddp_fp16": torch.float16, "ddp_bf16": torch.bfloat16}


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(256, (4, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    from benchmarks.common import gpt
    gpt.lm_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, system: str) -> tuple[dict, dict]:
    from benchmarks.common.models import build_model
    from benchmarks.common.systems import make_system

    x, y = _batch(rank)
    local = _grads(build_model("gpt_tiny", seed=0), x, y)  # this rank's own gradient, no communication
    wrapped = make_system(system, build_model("gpt_tiny", seed=0), "adam", 1e-3, 2)
    try:
        synced = _grads(wrapped.model, x, y)
    finally:
        wrapped.close()
    return local, {n.removeprefix("module."): g for n, g in synced.items()}


@pytest.mark.parametrize("system", sorted(WIRE))
def test_compress_hook_systems_average_in_the_wire_type(system):
    world = 2
    results = run_workers(_worker, world, system, timeout=180)
    wire = WIRE[system]
    local = [r[0] for r in results]
    for name, got in results[0][1].items():
        # cast first, then divide in the wire type (float16's subnormals lose a bit there); 2 terms: any order
        expected = sum(g[name].to(wire) / world for g in local).float()
        assert torch.equal(got, expected), name
        assert torch.equal(results[1][1][name], got), name  # every rank holds the same average
    plain = {n: sum(g[n] for g in local) / world for n in local[0]}
    assert any(not torch.equal(results[0][1][n], plain[n]) for n in plain)  # it did compress
