"""What the CUDA tests share: a gloo job over CUDA tensors, every algorithm built from its name, one training run.

One GPU holds every rank of these jobs. NCCL refuses two ranks on one GPU (``test_nccl_refuses_two_ranks_on_one_gpu``),
so a job of two ranks initializes ``torch.distributed`` with gloo itself (:func:`init_gloo`) before
``bagua.init_process_group()``, and keeps its tensors on ``cuda:0``; a job of one rank lets Bagua pick NCCL.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from tests.torch_api.models import batch, make_model

__all__ = ["KWARGS", "LR", "QADAM_LR", "algorithm_names", "build", "skip_reason", "init_gloo", "train", "train_each",
           "outcome"]

#: Constructor arguments per algorithm name; a name not listed here is built with its defaults.
KWARGS = {
    "async": dict(sync_interval_ms=20),
    "bytegrad": dict(hierarchical=False),
    "decentralized": dict(hierarchical=False),
    # two fragments that sync every 2 steps, one step of overlap on the communication thread, and the outer state
    # in pinned CPU memory: every CUDA path of DiLoCo within the tests' 5 steps
    "diloco": dict(sync_every=2, fragments=2, overlap_steps=1, offload_outer_state=True, hierarchical=False),
    "low_precision_decentralized": dict(hierarchical=False),
}
#: The algorithms whose exchanges gloo cannot make with CUDA tensors, and why.
_P2P = ("exchanges through point-to-point on gloo ({}), and gloo's send/recv take a CUDA tensor's pointer as host "
        "memory (torch's backend table: gloo send/recv CPU only); NCCL, which can, refuses two ranks on one GPU")
GLOO_P2P = {
    "bytegrad": _P2P.format("the 8-bit scatter-reduce"),
    "qadam": _P2P.format("the 8-bit scatter-reduce of the momentum, after its warmup"),
    "low_precision_decentralized": _P2P.format("the ring of 8-bit weight differences"),
}

LR = 0.05
QADAM_LR = 0.01


def algorithm_names() -> list[str]:
    """Every registered algorithm name, after importing every module of ``bagua.torch_api.algorithms``."""
    from benchmarks.common.systems import load_algorithm_modules
    from bagua.torch_api.algorithms import GlobalAlgorithmRegistry

    load_algorithm_modules()
    return GlobalAlgorithmRegistry.available_algorithms()


def build(name: str, model: torch.nn.Module):
    """``(optimizer, algorithm)`` for ``name``: QAdam with its own optimizer (2 warmup steps, so later steps run
    compressed), every other name with SGD and :data:`KWARGS` (defaults for a name it does not list)."""
    from bagua.torch_api.algorithms import Algorithm

    if name == "qadam":
        from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

        opt = QAdamOptimizer(model.parameters(), lr=QADAM_LR, warmup_steps=2)
        return opt, QAdamAlgorithm(opt, hierarchical=False)
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), Algorithm.init(name, **KWARGS.get(name, {}))


def skip_reason(name: str):
    """Why ``name`` cannot be built here (the parent process builds it once on CPU before spawning), or None."""
    try:
        build(name, torch.nn.Linear(2, 2))
    except (TypeError, ValueError) as exc:
        return (f"{name}: cannot be built with {KWARGS.get(name, 'its defaults')} ({exc}); add its constructor "
                "arguments to KWARGS in tests/gpu/cuda_jobs.py")
    return None


def init_gloo(rank: int, world_size: int, store_path: str) -> None:
    """``torch.distributed`` on gloo through a FileStore, then Bagua on that group (it keeps the backend it finds)."""
    import bagua.torch_api as bagua

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    bagua.init_process_group()


def train(rank: int, name: str, device: str, steps: int = 5) -> list[torch.Tensor]:
    """Wrap :func:`make_model` with ``name`` on ``device``, train ``steps`` SGD steps; return the weights on CPU.

    The engine is closed before returning, so the next run in the same process starts clean.
    """
    torch.backends.cuda.matmul.allow_tf32 = False  # CUDA against CPU: full float32 matmuls
    model = make_model(rank).to(device)
    opt, algorithm = build(name, model)
    model.with_bagua([opt], algorithm)
    try:
        for step in range(steps):
            x, y = (t.to(device) for t in batch(rank, step))
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        abort = getattr(model.bagua_algorithm, "abort", None)  # async averaging: stop its thread on every rank
        if abort is not None:
            abort(model)
        if device == "cuda":
            torch.cuda.synchronize()
        return [p.detach().cpu() for p in model.parameters()]
    finally:
        model.bagua_ddp.close()


def train_each(rank: int, names: list[str], device: str) -> dict:
    """:func:`train` every name in turn; ``{name: ("ok", weights) or ("error", traceback)}``, so one failing
    algorithm does not hide the others (jobs of one rank only: with peers, a failure on one rank can leave the
    others waiting in a collective)."""
    out = {}
    for name in names:
        try:
            out[name] = ("ok", train(rank, name, device))
        except Exception:  # noqa: BLE001 - reported per algorithm by the test
            out[name] = ("error", traceback.format_exc())
    return out


def outcome(result: tuple, what: str) -> list[torch.Tensor]:
    """The weights of an ``("ok", weights)`` result; fail the test with the traceback of an ``("error", ...)``."""
    status, value = result
    if status != "ok":
        pytest.fail(f"{what} failed:\n{value}")
    return value
