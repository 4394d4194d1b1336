"""DiLoCo's rounds by time on FSDP2-sharded replicas: 4 processes as 2 replicas x 2 shards on CPU/gloo (the
smallest mesh where a replica has several shards and there are several replicas).

- A slow replica (one of its two shard ranks sleeps 0.5 s plus 3x its own step's compute in every step, more
  than the noise of a step on the loaded 2-core machine, where a step of this model takes 0.05-0.3 s; its other
  shard waits for it in FSDP2's all-gather) takes fewer inner steps per round after the first, the same number on both of its shards, and the new
  global weights of each shard are the token-weighted mean of the replicas' local weights (outer SGD with lr 1,
  momentum 0: ``g_new = sum w_i x_i / sum w_i``), written plainly here from what each rank recorded, within 1e-6.
  Every rank records the same rounds (steps, tokens, speeds): the shards of a replica reported the same row.
- Equal speeds with ``rounds="time"`` give ``rounds="steps"``' weights bit for bit (two fragments, an exchange
  overlapped on the driver's thread); ``speed_tolerance=10`` keeps timing noise on the shared CPU cores from
  giving a replica fewer steps.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tests.harness import run_workers
from tests.sharded.common import batch as _batch
from tests.sharded.common import model as _model

H = 8
ROUNDS = 4
SAMPLES = (3, 5)  # per step, by replica
PAD, PAD_S = 3.0, 0.5  # the slow shard sleeps 0.5 s plus 3x its own step's compute, every step


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _sharded(mesh, optimizer_of, before=None):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = optimizer_of(model)
    if before is not None:  # registered first: runs after the inner step, before Bagua's end-of-step work
        optimizer.register_step_post_hook(
            lambda *_: before.__setitem__(slice(None), [p.to_local().detach().clone() for p in model.parameters()]))
    return model, optimizer


def _worker_slow(rank, world):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    mesh = _mesh()
    before: list = []
    model, optimizer = _sharded(mesh, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), before)
    model = model.with_bagua([optimizer], DiLoCoAlgorithm(sync_every=H, rounds="time", outer_lr=1.0,
                                                          outer_momentum=0.0),
                             device_mesh=mesh, replicate_dim="replicate")
    driver = model.bagua_sharded.driver
    samples = SAMPLES[rank // 2]
    out, steps, step = [], 0, 0
    while driver.syncs < ROUNDS:
        step += 1
        x, y = _batch(rank, step)
        started = time.perf_counter()
        optimizer.zero_grad()
        driver.add_samples(samples)  # this step's samples: counted at its backward
        torch.nn.functional.mse_loss(model(x), y).backward()
        if rank == 2:  # one shard of replica 1 is slow; the replica is as slow as its slowest shard
            time.sleep(PAD_S + PAD * (time.perf_counter() - started))
        syncs = driver.syncs
        optimizer.step()
        steps += 1
        if driver.syncs > syncs:
            out.append((steps, list(before), [p.to_local().detach().clone() for p in model.parameters()]))
            steps = 0
    records = [(r.steps, r.tokens, r.speed) for r in driver.records]
    dist.barrier()
    model.bagua_sharded.close()
    return out, records


def test_a_slow_replica_takes_fewer_steps_on_all_its_shards_and_weighs_by_its_tokens():
    results = run_workers(_worker_slow, 4, timeout=240)
    steps = [[n for n, _, _ in out] for out, _ in results]
    assert steps[0] == steps[1] == [H] * ROUNDS, steps
    assert steps[2] == steps[3], steps  # both shards of the slow replica take the same steps
    assert steps[2][0] == H and all(n < H for n in steps[2][1:]), steps
    for shard in range(2):
        (fast, _), (slow, _) = results[shard], results[2 + shard]
        for (n0, x0, g0), (n1, x1, g1) in zip(fast, slow):
            w0, w1 = SAMPLES[0] * n0, SAMPLES[1] * n1
            for a, b, p0, p1 in zip(x0, x1, g0, g1):
                expected = (w0 * a.double() + w1 * b.double()) / (w0 + w1)
                torch.testing.assert_close(p0.double(), expected, rtol=0, atol=1e-6)
                assert torch.equal(p0, p1)  # the same global shard on both replicas
    # every rank recorded the same rounds: steps, tokens and speeds, the replica's on each of its shards
    records = [r for _, r in results]
    assert len(records[0]) == ROUNDS - 1 and all(r == records[0] for r in records), records
    assert [r[0] for r in records[0]] == [[a, b] for a, b in zip(steps[0], steps[2])][: ROUNDS - 1]


def _worker_equal(rank, world):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    mesh = _mesh()
    runs = {}
    for rounds in ("steps", "time"):
        model, optimizer = _sharded(mesh, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))
        model = model.with_bagua([optimizer], DiLoCoAlgorithm(sync_every=4, fragments=2, overlap_steps=1,
                                                              rounds=rounds, speed_tolerance=10.0, outer_lr=0.7,
                                                              outer_momentum=0.9),
                                 device_mesh=mesh, replicate_dim="replicate")
        history = []
        for step in range(1, 14):
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            history.append([p.to_local().detach().clone() for p in model.parameters()])
        dist.barrier()
        model.bagua_sharded.close()
        runs[rounds] = history
    return runs


def test_equal_speeds_give_rounds_by_steps_bit_for_bit():
    for runs in run_workers(_worker_equal, 4, timeout=240):
        for a, b in zip(runs["steps"], runs["time"]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
