"""Every registered algorithm on CUDA, against the same algorithm on CPU (issue 31).

Two settings, each compared with the CPU run of the same configuration:

- one rank on NCCL (``bagua.init_process_group`` picks NCCL when CUDA is there): the engine's CUDA events and
  communication stream, and every algorithm's tensors on the GPU; the reference is a one-rank gloo job on CPU;
- two ranks on the one GPU through gloo, with CUDA tensors; the reference is the same job on CPU tensors. NCCL
  refuses two ranks on one GPU (:func:`test_nccl_refuses_two_ranks_on_one_gpu`), so gloo is the only way to run
  two ranks on a machine of one GPU.

Gloo reduces CUDA tensors in ``all_reduce`` and ``broadcast`` (and has CUDA all-to-all); torch's backend table
marks its ``send``/``recv`` CPU-only, and ``ProcessGroupGloo::send``/``recv`` hand the tensor's pointer to gloo's
TCP transport as host memory, with no check of the device (on the first GPU run: "Connection closed by peer"). The
algorithms that exchange through point-to-point on gloo (:data:`GLOO_P2P`: ByteGrad's and QAdam's scatter-reduce,
the low-precision ring) therefore refuse CUDA tensors on gloo with a ``ValueError`` that names the fix
(``BaguaCommunicator.check_point_to_point``), on every rank before any byte moves: their test checks that error;
the others must match the CPU run.

Tolerances, CUDA against CPU (TF32 off): fp32 algorithms ``rtol=1e-5, atol=1e-6`` (matmuls sum in another order);
8-bit codes ``atol=1e-3`` (a value at a rounding boundary may take the neighbouring code: one quantization step
times the learning rate); QAdam ``2 * lr`` per compressed step with a median within ``1e-3``; async averaging (a
timed background thread) finite weights that moved. A name this table does not know yet gets ``atol=1e-3``: it
catches a missing or doubled step, not a rounding drift; add the name to :data:`TOLERANCE`.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.testing import assert_close

from tests.gpu.cuda_jobs import GLOO_P2P, QADAM_LR, algorithm_names, init_gloo, outcome, skip_reason, train, train_each
from tests.harness import WorkerError, run_workers
from tests.torch_api.models import make_model

pytestmark = pytest.mark.gpu

NAMES = algorithm_names()
TOLERANCE = {
    "gradient_allreduce": dict(rtol=1e-5, atol=1e-6),
    "decentralized": dict(rtol=1e-5, atol=1e-6),
    "diloco": dict(rtol=1e-5, atol=1e-5),  # fp32 exchanges; the outer Nesterov step (lr 0.7) scales the rounding
    "bytegrad": dict(rtol=0, atol=1e-3),
    "low_precision_decentralized": dict(rtol=0, atol=1e-3),
    "qadam": dict(rtol=0, atol=2 * QADAM_LR * 3),
}
UNKNOWN = dict(rtol=0, atol=1e-3)
ONLY_FINITE = {"async"}
SYNC = {"gradient_allreduce", "bytegrad", "qadam"}  # every rank ends with the same weights, bit for bit
ENV = {"BAGUA_COMM_TIMEOUT_S": "60"}  # a hung collective fails in a minute, naming the operation


def _skip_unbuildable(name: str) -> None:
    reason = skip_reason(name)
    if reason is not None:
        pytest.skip(reason)


def _compare(name: str, got: list, want: list, what: str, rank: int) -> None:
    for g, w in zip(got, want):
        assert torch.isfinite(g).all(), f"{what}: {name}: rank {rank} has non-finite weights"
    if name in ONLY_FINITE:
        start = [p.detach() for p in make_model(rank).parameters()]
        assert any(not torch.equal(g, s) for g, s in zip(got, start)), f"{what}: {name}: the weights never moved"
        return
    tol = TOLERANCE.get(name, UNKNOWN)
    for g, w in zip(got, want):
        assert_close(g, w, **tol, msg=lambda m: f"{what}: {name}: rank {rank}: CUDA against CPU: {m}")
    if name == "qadam":
        assert max((g - w).abs().median().item() for g, w in zip(got, want)) <= 1e-3, f"{what}: {name}: rank {rank}"


# -- one rank on NCCL --------------------------------------------------------------------------------------------


def _worker_nccl(rank, world_size, names):
    import torch.distributed as dist

    return dist.get_backend(), train_each(rank, names, "cuda")


def _worker_cpu_reference(rank, world_size, names, store_path):
    init_gloo(rank, world_size, store_path)
    return train_each(rank, names, "cpu")


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    names = [n for n in NAMES if skip_reason(n) is None]
    (backend, cuda), = run_workers(_worker_nccl, 1, names, env=ENV, timeout=300)
    store = str(tmp_path_factory.mktemp("gloo") / "store")
    cpu, = run_workers(_worker_cpu_reference, 1, names, store, init_bagua=False, env=ENV, timeout=300)
    return backend, cuda, cpu


@pytest.mark.parametrize("name", NAMES)
def test_one_rank_on_nccl_matches_cpu(one_rank_runs, name):
    _skip_unbuildable(name)
    backend, cuda, cpu = one_rank_runs
    assert backend == "nccl"
    want = outcome(cpu[name], f"{name} on CPU (gloo, one rank)")
    got = outcome(cuda[name], f"{name} on CUDA (NCCL, one rank)")
    _compare(name, got, want, "NCCL, one rank", 0)


# -- two ranks on one GPU through gloo ---------------------------------------------------------------------------


def _worker_two_ranks(rank, world_size, name, store_path):
    init_gloo(rank, world_size, store_path)
    cpu = train(rank, name, "cpu")  # first: a CUDA failure cannot spoil the reference
    try:
        return cpu, train(rank, name, "cuda"), None
    except Exception as exc:  # noqa: BLE001 - the parent decides: gloo's refusal or a bug
        import traceback

        return cpu, None, (f"{type(exc).__name__}: {exc}", traceback.format_exc())


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_on_one_gpu_through_gloo_match_cpu(name, tmp_path):
    _skip_unbuildable(name)
    runs = run_workers(_worker_two_ranks, 2, name, str(tmp_path / "store"), init_bagua=False, env=ENV,
                       timeout=150 if name in GLOO_P2P else 300)
    if name in GLOO_P2P:  # a clear error on every rank, not gloo reading GPU memory as host memory
        for rank, (_, cuda, error) in enumerate(runs):
            assert cuda is None and error is not None, f"{name}: rank {rank} trained on CUDA through gloo p2p"
            assert "the gloo backend cannot do with CUDA tensors" in error[0] and "backend='nccl'" in error[0], error
        return
    for rank, (cpu, cuda, error) in enumerate(runs):
        if error is not None:
            pytest.fail(f"{name} on CUDA through gloo failed on rank {rank}: {error[0][:500]}\n{error[1]}")
        _compare(name, cuda, cpu, "gloo, two ranks on one GPU", rank)
    if name in SYNC:
        for a, b in zip(runs[0][1], runs[1][1]):
            assert torch.equal(a, b), f"{name}: the two ranks differ on CUDA"


# -- NCCL and two ranks on one GPU -------------------------------------------------------------------------------


def _worker_nccl_pair(rank, world_size):
    return rank  # bagua.init_process_group already ran a collective over NCCL (the node layout)


def test_nccl_refuses_two_ranks_on_one_gpu():
    """NCCL builds no communicator with two ranks on one device ("Duplicate GPU detected", ncclInvalidUsage):
    the two-rank tests above use gloo for that reason."""
    if torch.cuda.device_count() > 1:
        pytest.skip("several GPUs: each rank gets its own")
    with pytest.raises(WorkerError) as info:
        run_workers(_worker_nccl_pair, 2, env=ENV, timeout=180)
    text = str(info.value)
    assert re.search(r"(?i)duplicate GPU|invalid ?usage", text), (
        "expected NCCL to refuse two ranks on one GPU (ncclInvalidUsage, 'Duplicate GPU detected'); if it now "
        f"accepts them, run the two-rank tests on NCCL too and update docs/gpu.md. Got:\n{text[-3000:]}"
    )
