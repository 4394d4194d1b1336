"""The one interface of bucket operations (ops/base.py), the bucket's use of it, and the engine's public seams
(``bagua_tensors``, ``rebucket``) that autotune uses; no process group except in the one-process run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from bagua.autotune.settings import TuneSettings
from bagua.torch_api.bucket import BaguaBucket, BucketOp
from bagua.torch_api.ops.allreduce import CentralizedFullPrecisionOp, centralized_full_precision_op
from bagua.torch_api.ops.async_average import AsyncModelAverageOp
from bagua.torch_api.ops.base import FunctionOp
from bagua.torch_api.ops.compressed import CentralizedLowPrecisionOp, centralized_low_precision_op
from bagua.torch_api.ops.decentralized import DecentralizedOp, LowPrecisionDecentralizedOp, decentralized_op
from bagua.torch_api.tensor import weight_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _bucket() -> BaguaBucket:
    ts = [weight_tensor(torch.nn.Parameter(torch.ones(2)), f"p{i}") for i in range(2)]
    return BaguaBucket(ts, name="0", flatten=True)


class _Recording(BucketOp):
    def __init__(self) -> None:
        self.calls, self.rollbacks = 0, 0

    def __call__(self, bucket, flat):
        self.calls += 1
        flat.add_(1)

    def rollback(self) -> None:
        self.rollbacks += 1


def test_every_builtin_op_is_a_bucket_op():
    for cls in (CentralizedFullPrecisionOp, CentralizedLowPrecisionOp, DecentralizedOp, LowPrecisionDecentralizedOp,
                AsyncModelAverageOp, FunctionOp):
        assert issubclass(cls, BucketOp)
    # the original's function names build the same operations
    assert centralized_low_precision_op is CentralizedLowPrecisionOp
    assert centralized_full_precision_op is CentralizedFullPrecisionOp
    assert decentralized_op is DecentralizedOp


def test_defaults_of_the_interface():
    op = FunctionOp(lambda bucket, flat: None)
    assert not op.accepts_pending and not op.launches_async
    assert op.state_dict() == {}
    op.reset()
    op.rollback()
    op.load_state_dict({})
    with pytest.raises(ValueError, match="holds no state"):
        op.load_state_dict({"x": torch.zeros(1)})
    with pytest.raises(NotImplementedError):
        op.launch_async(None, torch.zeros(1))
    with pytest.raises(TypeError):
        BucketOp()  # abstract: __call__ is required


def test_bucket_wraps_plain_callables_and_runs_ops_in_order():
    bucket = _bucket()
    seen = []
    recording = _Recording()
    bucket.append_op(lambda b, flat: seen.append(flat.tolist()))  # a plain callable, as user algorithms write
    bucket.append_op(recording)
    bucket.append_python_op(lambda name: seen.append(name))
    assert isinstance(bucket.ops[0], FunctionOp) and bucket.ops[1] is recording and len(bucket.ops) == 3
    assert not bucket.accepts_pending() and bucket.async_launcher() is None
    bucket.execute()
    assert seen == [[1.0] * 4, "0"] and recording.calls == 1
    assert bucket.flat.tolist() == [2.0] * 4
    bucket.rollback()
    assert recording.rollbacks == 1


def test_low_precision_op_declares_its_interface():
    op = CentralizedLowPrecisionOp(None, error_feedback=True, codec="uint8")
    assert op.accepts_pending and not op.launches_async
    saved = {"residual": torch.ones(3), "server_residual": torch.zeros(3)}
    op.load_state_dict(saved)
    assert op.state_dict() == saved  # residuals not yet loaded into a workspace are kept
    op.reset()
    op.rollback()
    bucket = _bucket()
    bucket.append_op(op)
    assert bucket.accepts_pending() and bucket.async_launcher() is None
    with pytest.raises(ValueError, match="codec"):
        CentralizedLowPrecisionOp(None, codec="int3")


def test_full_precision_op_launches_async_only_flat():
    bucket = _bucket()
    bucket.append_op(CentralizedFullPrecisionOp(None))
    assert bucket.async_launcher() is not None
    for kwargs in (dict(hierarchical=True), dict(scattergather=True)):
        assert not CentralizedFullPrecisionOp(None, **kwargs).launches_async


def test_tune_settings_are_checked():
    assert TuneSettings().max_samples == 60
    for bad in (dict(max_samples=0), dict(warmup_time_s=-1), dict(settle_steps=-1), dict(min_window_steps=0)):
        with pytest.raises(ValueError):
            TuneSettings(**bad)


ENGINE = """
    import torch, bagua.torch_api as bagua
    from bagua.autotune import hooks
    from bagua.autotune.trial import bucket_plan
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    bagua.init_process_group()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    ddp = model.bagua_ddp
    names = [t.name for t in ddp.bagua_tensors]
    assert len(names) == 4 and len(ddp.bagua_buckets) == 1
    ddp.rebucket(bucket_plan(ddp.bagua_tensors, None, 1))  # one tensor per bucket
    assert [[t.name for t in b.tensors] for b in ddp.bagua_buckets] == [[n] for n in names]
    opt.zero_grad(); model(torch.randn(2, 5)).sum().backward(); opt.step()
    assert hooks._engine(ddp) is ddp and hooks._engine(model) is ddp
    try:
        hooks._engine(torch.nn.Linear(1, 1))
    except ValueError:
        print("OK")
"""


def test_engine_rebuckets_through_its_public_methods():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(ENGINE)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]
