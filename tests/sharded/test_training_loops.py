"""The training loops users write around FSDP2, with Bagua between the sharded replicas: 4 processes as
2 replicas x 2 shards on CPU/gloo.

Each test holds Bagua against a reference that shares no code with it: native HSDP (``fully_shard`` on the 2-D
mesh, which does the replicate dimension itself) running the same loop, or, for DiLoCo, its maths written out
below on two full, unsharded replicas in one process. The loops: bf16 ``MixedPrecisionPolicy``,
``clip_grad_norm_`` over the DTensor gradients, gradient accumulation with ``set_requires_gradient_sync``, and
``torch.amp.GradScaler``.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_workers

STEPS = 6
MAX_NORM = 0.05  # below the gradients' norm at every step, so clip_grad_norm_ does scale them
INNER_LR, INNER_MOMENTUM = 0.1, 0.9
DILOCO = {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())))


def _batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * micro + 1000 * rank + step)
    return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)


def _sharded_model(mesh: Any, case: str) -> torch.nn.Module:
    """The model, ``fully_shard``-ed layer by layer and as a whole over ``mesh`` (bf16 compute for ``"bf16"``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if case == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _full_value(t: Any) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _worker(rank: int, world: int, case: str, mode: str, algorithm: str, kwargs: dict,
            nan_at: Optional[tuple[int, int]] = None) -> dict:
    """Train STEPS steps of the loop ``case`` ("plain", "bf16", "clip", "accum", "scaler") with ``mode`` "bagua"
    (FSDP2 over the shard dimension, Bagua's ``algorithm`` between replicas) or "hsdp" (native HSDP).
    ``nan_at=(rank, step)``: that rank's batch of that step is NaN, so that GradScaler skips the step."""
    from torch.distributed.device_mesh import init_device_mesh

    from bagua.torch_api.algorithms import Algorithm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded_model(mesh if mode == "hsdp" else mesh["shard"], case)
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM)
    if mode == "bagua":
        model.with_bagua([optimizer], Algorithm.init(algorithm, **kwargs), device_mesh=mesh,
                         replicate_dim="replicate")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if case == "scaler" else None
    micros = 2 if case == "accum" else 1
    out: dict[str, Any] = {"norms": [], "scales": []}
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(micros):
            if micros > 1:  # reduce-scatter (and Bagua's exchange) only after the last micro-batch
                model.set_requires_gradient_sync(micro == micros - 1)
            x, y = _batch(rank, step, micro)
            if nan_at == (rank, step):
                x.fill_(float("nan"))
            prediction = model(x)
            out.setdefault("dtype", prediction.dtype)
            loss = torch.nn.functional.mse_loss(prediction, y) / micros
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if case == "clip":
            out["norms"].append(_full_value(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        else:
            optimizer.step()
    out["full"] = [_full_value(p) for p in model.parameters()]
    driver = getattr(getattr(model, "bagua_sharded", None), "driver", None)
    if driver is not None:
        out["steps"], out["syncs"] = driver.steps, driver.syncs
    dist.barrier()  # FSDP2's gloo teardown: every rank done before the groups go
    return out


def _run(case: str, mode: str, algorithm: str = "gradient_allreduce", kwargs: Optional[dict] = None,
         nan_at: Optional[tuple[int, int]] = None) -> list[dict]:
    return run_workers(_worker, 4, case, mode, algorithm, kwargs or {}, nan_at, timeout=240)


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# -- gradient allreduce against native HSDP ---------------------------------------------------------------------


@pytest.mark.parametrize("case", ["bf16", "clip", "accum"])
def test_gradient_allreduce_loop_equals_native_hsdp_bitwise(case):
    """bf16 compute with float32 reduction, clipping by the global norm, and 2 micro-batches per step: the
    replicas' average is taken where HSDP takes it (after the reduce-scatter, in ``reduce_dtype``), so the
    weights, and the norms clip_grad_norm_ returns, are the same bits."""
    bagua = _run(case, "bagua")
    hsdp = _run(case, "hsdp")
    for r in range(4):
        _assert_bitwise(bagua[r]["full"], hsdp[r]["full"])
        _assert_bitwise(bagua[r]["norms"], hsdp[r]["norms"])
    assert bagua[0]["dtype"] == hsdp[0]["dtype"] == (torch.bfloat16 if case == "bf16" else torch.float32)
    if case == "clip":  # the clip did act: the pre-clip norm is above MAX_NORM at every step
        assert len(hsdp[0]["norms"]) == STEPS and all(float(n) > MAX_NORM for n in hsdp[0]["norms"])


def test_gradient_allreduce_with_grad_scaler_equals_native_hsdp_bitwise():
    """GradScaler on float32 gradients, with a NaN batch at rank 0 in step 2: the NaN reaches every rank through
    the reduce-scatter and Bagua's allreduce, so every rank skips that step and halves its scale, as in HSDP."""
    bagua = _run("scaler", "bagua", nan_at=(0, 2))
    hsdp = _run("scaler", "hsdp", nan_at=(0, 2))
    for r in range(4):
        _assert_bitwise(bagua[r]["full"], hsdp[r]["full"])
        assert bagua[r]["scales"] == hsdp[r]["scales"] == [2.0**10] * 2 + [2.0**9] * (STEPS - 2)


# -- DiLoCo against its maths -----------------------------------------------------------------------------------


def _diloco_reference(micros: int, skipped: Optional[tuple[int, int]] = None) -> list[list[torch.Tensor]]:
    """DiLoCo on two full replicas in one process: replica r trains on the batches of ranks 2r and 2r+1 (the mean
    of their losses, as FSDP2's reduce-scatter averages them), every ``sync_every`` optimizer steps the replicas'
    ``global - local`` is averaged, the outer Nesterov SGD steps the global weights, and both replicas restart from
    them. ``skipped=(replica, step)``: that replica takes no inner step there, but the step counts."""
    start = [p.detach().clone() for p in _model().parameters()]
    replicas = [_model() for _ in range(2)]
    inner = [torch.optim.SGD(m.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM) for m in replicas]
    global_ = [torch.nn.Parameter(p.clone()) for p in start]
    outer = torch.optim.SGD(global_, lr=DILOCO["outer_lr"], momentum=DILOCO["outer_momentum"], nesterov=True)
    for step in range(STEPS):
        for r, (model, opt) in enumerate(zip(replicas, inner)):
            if skipped == (r, step):
                continue
            opt.zero_grad()
            for micro in range(micros):
                for rank in (2 * r, 2 * r + 1):
                    x, y = _batch(rank, step, micro)
                    (torch.nn.functional.mse_loss(model(x), y) / micros / 2).backward()
            opt.step()
        if (step + 1) % DILOCO["sync_every"] == 0:
            with torch.no_grad():
                for i, g in enumerate(global_):
                    g.grad = sum(g - list(m.parameters())[i] for m in replicas) / 2
                outer.step()
                for model in replicas:
                    for p, g in zip(model.parameters(), global_):
                        p.copy_(g)
    return [[p.detach().clone() for p in m.parameters()] for m in replicas]


@pytest.mark.parametrize("case", ["accum", "scaler"])
def test_diloco_loop_equals_its_maths(case):
    """2 micro-batches per step: optimizer steps, not micro-batches, drive sync_every (3 syncs in 6 steps).
    GradScaler on float32 (every step finite): scaling by a power of two and back is exact, so it is DiLoCo."""
    sharded = _run(case, "bagua", "diloco", DILOCO)
    reference = _diloco_reference(2 if case == "accum" else 1)
    for r in range(4):
        assert (sharded[r]["steps"], sharded[r]["syncs"]) == (STEPS, STEPS // DILOCO["sync_every"])
        for a, b in zip(sharded[r]["full"], reference[r // 2], strict=True):
            # a sum of two halves (the reduce-scatter) instead of one loss over 8 rows: rounding
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    _assert_bitwise(sharded[0]["full"], sharded[2]["full"])  # the last step synchronized the replicas


def test_diloco_with_grad_scaler_counts_a_skipped_step_on_every_replica():
    """Replica 0's step 1 is NaN: GradScaler skips it on replica 0's ranks only. DiLoCo's schedule must still
    count it, as the maths (and unsharded DiLoCo) do, or the replicas synchronize at different steps: here 6
    steps with sync_every=2 give 3 synchronizations on replica 1 and 2 on replica 0, and a rank would wait for
    the third forever, so the test runs without synchronizing (sync_every above STEPS) and compares counts."""
    sharded = _run("scaler", "bagua", "diloco", dict(DILOCO, sync_every=STEPS + 1), nan_at=(0, 1))
    assert [r["scales"][1] for r in sharded] == [2.0**9, 2.0**9, 2.0**10, 2.0**10]  # replica 0 skipped
    assert [r["steps"] for r in sharded] == [STEPS] * 4
