"""The advisor's CUDA path: the synthetic step on the GPU, timed with synchronisation, and the allreduce probe on
CUDA tensors over NCCL (one rank: the lent machines have one GPU, and NCCL refuses two ranks on it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bagua.advise.measure import max_over_ranks, probe_allreduce, synthetic_step, time_step

pytestmark = pytest.mark.gpu


def test_cuda_step_and_nccl_probe(tmp_path):
    device = torch.device("cuda", 0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    try:
        group = dist.new_group(backend="nccl")
        step, nbytes, what = synthetic_step(1_000_000, device)
        times = time_step(step, 2, 3, device)
        assert len(times) == 3 and min(times) > 0 and what.startswith("SYNTHETIC")
        assert nbytes == 4 * (1000 * 1000 + 1000)  # one 1000 x 1000 layer and its bias
        probe, skipped = probe_allreduce([4096, 2**20, 2**24], 2, 10.0, group, device)
        assert [size for size, _ in probe] == [4096, 2**20, 2**24] and skipped == []
        assert min(t for _, t in probe) > 0
        assert max_over_ranks([1.5, 2.5], group, device) == [1.5, 2.5]
    finally:
        dist.destroy_process_group()
