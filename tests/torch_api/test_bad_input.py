"""Bad input fails early, with a message that says what to do, on every rank (never a hang)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_workers


def test_unknown_algorithm_suggests_the_nearest_name():
    from bagua.torch_api.algorithms import Algorithm

    with pytest.raises(ValueError, match=r"unknown algorithm 'gradient_allreduse'.*'gradient_allreduce'.*Available"):
        Algorithm.init("gradient_allreduse")


def test_with_bagua_before_init_process_group():
    import bagua.torch_api as bagua  # noqa: F401  (installs with_bagua)
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], GradientAllReduceAlgorithm())


def test_bad_bucket_size_and_algorithm_object():
    from bagua.torch_api.bucket import split_bucket_by_bucket_size

    with pytest.raises(ValueError, match="positive"):
        split_bucket_by_bucket_size([], 0)


def _worker_expect_error(rank, world_size, case):
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    if case == "shapes":
        model = torch.nn.Linear(4, 3 if rank == 0 else 5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    elif case == "foreign_params":
        model = torch.nn.Linear(4, 3)
        stray = torch.nn.Parameter(torch.zeros(7))
        params = list(model.parameters()) + ([stray] if rank == 1 else [])
        opt = torch.optim.SGD(params, lr=0.1)
    elif case == "optimizer_type":
        model = torch.nn.Linear(4, 3)
        opt = (torch.optim.SGD if rank == 0 else torch.optim.Adam)(model.parameters(), lr=0.1)
    elif case == "integer_param":
        model = torch.nn.Linear(4, 3)
        model.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
        model.count.requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # requires_grad=False parameters are not communicated: wrapping works
        model.with_bagua([opt], GradientAllReduceAlgorithm())
        return "ok"
    elif case == "not_an_algorithm":
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            model.with_bagua([opt], "gradient_allreduce")
        except TypeError as exc:
            return str(exc)
        return "no error"
    try:
        model.with_bagua([opt], GradientAllReduceAlgorithm())
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("shapes", r"model on rank\(s\) \[1\] differs from rank 0's.*same model on every rank"),
        ("foreign_params", r"optimizer on rank\(s\) \[1\] holds parameters that are not in the wrapped module"),
        ("optimizer_type", r"optimizers on rank\(s\) \[1\] differ"),
        ("not_an_algorithm", r"algorithm must be a bagua Algorithm instance"),
    ],
)
def test_errors_on_every_rank(case, pattern):
    import re

    messages = run_workers(_worker_expect_error, 2, case, timeout=60)
    for message in messages:
        assert re.search(pattern, message), message


def test_parameters_without_grad_are_skipped():
    assert run_workers(_worker_expect_error, 2, "integer_param", timeout=60) == ["ok", "ok"]


def test_integer_tensor_in_a_bucket_is_rejected():
    from bagua.torch_api.bucket import BaguaBucket
    from bagua.torch_api.tensor import weight_tensor

    t = weight_tensor(torch.zeros(3, dtype=torch.int32), "counts")
    with pytest.raises(ValueError, match="only floating-point tensors can be communicated"):
        BaguaBucket([t], "0")


def _worker_timeout(rank, world_size, algorithm="gradient_allreduce", done=""):
    """Rank 1 never joins the step: rank 0's backward must fail with a timeout naming the bucket, not hang. Rank 1
    stays stuck until rank 0 is done (the file ``done``; at most 40 s), not for a fixed time."""
    import time

    from bagua.torch_api.algorithms import Algorithm

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], Algorithm.init(algorithm, hierarchical=False))
    start = time.monotonic()
    if rank == 1:
        while not os.path.exists(done) and time.monotonic() - start < 40:  # a stuck peer
            time.sleep(0.05)
        return "stuck"
    try:
        model(torch.randn(2, 4)).sum().backward()
    except RuntimeError as exc:
        return f"{time.monotonic() - start:.1f}s: {exc}"
    finally:
        open(done, "w").close()
    return "no error"


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad"])  # collectives; point-to-point sends
def test_dead_peer_times_out_with_a_clear_error(algorithm, tmp_path):
    message, _ = run_workers(_worker_timeout, 2, algorithm, str(tmp_path / "done"), env={"BAGUA_COMM_TIMEOUT_S": "3"},
                             timeout=60)
    assert "rank 0" in message and "bucket '0'" in message, message
    assert "BAGUA_COMM_TIMEOUT_S" in message or "timed out" in message.lower() or "Timed out" in message, message


def test_misspelt_algorithm_keyword_lists_the_accepted_ones_and_suggests_the_nearest():
    from bagua.torch_api.algorithms import Algorithm

    with pytest.raises(TypeError, match=r"'bytegrad' \(ByteGradAlgorithm\) has no keyword 'hierachical'\. "
                                        r"Did you mean 'hierarchical'\? Accepted keywords: hierarchical, average"):
        Algorithm.init("bytegrad", hierachical=True)
    with pytest.raises(TypeError, match=r"no keyword 'zzz'\. Accepted keywords: .*peer_selection_mode"):
        Algorithm.init("decentralized", zzz=1)
    assert Algorithm.init("bytegrad", hierarchical=False).hierarchical is False
