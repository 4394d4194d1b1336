"""Bagua's DiLoCo against torchft's ``DiLoCo``, a peer that shares no code with it (issue 27).

Two replicas, one process each, CPU and gloo, the same MLP and per-rank batches (``tests/torch_api/models.py``) on both sides, H = 5 inner steps,
3 synchronizations, outer SGD lr 0.7 with Nesterov momentum 0.9: Bagua's ``DiLoCoAlgorithm(compression="none")``
ends with weights bit-identical to torchft's, for AdamW and SGD as the inner optimizer. torchft runs with
``init_sync=False``: with its default ``True`` the first quorum (at the first synchronization) makes replica 1 take
replica 0's model and inner state, so the first outer step uses replica 0's pseudo-gradient alone.

Needs the ``bench-torchft`` extra (``pip install -e '.[bench-torchft]'``: torchft 0.2.0, whose lighthouse and
manager are Rust in the wheel); skipped without it, as in CI. torchft's quantized path needs Triton (CUDA): on CPU
``should_quantize=True`` silently falls back to float32, so only ``compression="none"`` is compared.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from benchmarks.to_target.torchft_peer import bind_to
from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of

torchft = pytest.importorskip("torchft")

H, SYNCS = 5, 3


def _inner(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05)


def _train(model, opt, rank) -> list[torch.Tensor]:
    for step in range(1, H * SYNCS + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return params_of(model)


def _bagua(rank, world_size, inner_name):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    model = make_model(0)  # the same weights on every replica: torchft with init_sync=False broadcasts nothing
    opt = _inner(inner_name, model.parameters())
    model.with_bagua([opt], DiLoCoAlgorithm(sync_every=H, outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                                            compression="none", hierarchical=False))
    return _train(model, opt, rank)


def _torchft(rank, world_size, lighthouse, inner_name):
    import os

    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    bind_to("127.0.0.1")  # torchft binds its servers to every interface otherwise
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = make_model(0)
    inner = _inner(inner_name, model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    timeout = timedelta(seconds=30)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2, use_async_quorum=False,
                      init_sync=False, rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=lighthouse, replica_id=str(rank), hostname="127.0.0.1", port=0,
                      load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                      state_dict=lambda: {"model": model.state_dict()},
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=H, backup_device=torch.device("cpu"),
                    pin_memory=False):
            return _train(model, inner, rank)
    finally:
        manager.shutdown(wait=False)


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_same_weights_as_torchft_diloco(inner):
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    try:
        theirs = run_workers(_torchft, 2, lighthouse.address(), inner, init_bagua=False, timeout=120)
    finally:
        lighthouse.shutdown()
    ours = run_workers(_bagua, 2, inner, timeout=120)
    for rank in range(2):
        for i, (a, b) in enumerate(zip(ours[rank], theirs[rank])):
            assert torch.equal(a, b), f"rank {rank} parameter {i}: max |diff| {(a - b).abs().max().item():.3e}"
    # not trivially equal: the replicas trained on different batches and synchronized
    assert not torch.equal(ours[0][0], make_model(0).fc1.weight)
