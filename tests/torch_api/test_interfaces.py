"""The engine and the bucket satisfy the small interfaces that algorithms and bucket operations see them through."""

from __future__ import annotations

import inspect

import pytest

from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.data_parallel.bagua_distributed import BaguaDistributedDataParallel
from bagua.torch_api.interfaces import Bucket, Engine
from tests.torch_api.test_single_process import _run


def _methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]


@pytest.mark.parametrize("protocol, real", [(Engine, BaguaDistributedDataParallel), (Bucket, BaguaBucket)])
def test_every_declared_method_exists_with_the_same_parameters(protocol, real):
    assert _methods(protocol), protocol
    for name in _methods(protocol):
        declared = list(inspect.signature(getattr(protocol, name)).parameters)
        assert list(inspect.signature(getattr(real, name)).parameters) == declared, name


def test_a_live_engine_and_its_buckets_satisfy_the_interfaces():
    proc = _run("""
        import torch, bagua.torch_api as bagua
        from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
        from bagua.torch_api.interfaces import Bucket, Engine
        bagua.init_process_group()
        model = torch.nn.Linear(5, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.with_bagua([opt], GradientAllReduceAlgorithm())
        assert isinstance(model.bagua_ddp, Engine)
        assert model.bagua_buckets and all(isinstance(b, Bucket) for b in model.bagua_buckets)
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]
