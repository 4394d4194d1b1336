"""Algorithms written the way the original Bagua's documentation teaches, against the built-in ones.

Each user algorithm subclasses ``Algorithm`` / ``AlgorithmImpl``, registers its tensors with the original's tensor
API (``param.bagua_ensure_grad().ensure_bagua_tensor(...)``, ``bagua_mark_communication_ready()``) and builds its
buckets' work with one op appender. At 2 ranks it must train to the same weights as the built-in algorithm it
mirrors, exactly (``torch.equal``): the same operations run in the same order. For asynchronous averaging, where
rounds run whenever a thread gets to them, two things are compared: with rounds run on demand after every step,
the weights equal the built-in's with its rounds run at the same moments (``torch.equal``); with the user's own
background thread, a round while training is idle gives every rank the mean of the ranks' weights (atol=1e-6:
the round computes ``x + (mean - x)``).

The tensor methods are checked one by one against plain-tensor expectations, in one process.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.tensor import BaguaTensor
from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of

STEPS = 6


# -- user algorithms, one per op appender ------------------------------------------------------------------------


def _grad_tensors(bagua_ddp):
    """The original's default tensors: every parameter's gradient, in reverse order, through the tensor API."""
    return [
        param.bagua_ensure_grad().ensure_bagua_tensor(
            name,
            bagua_ddp.bagua_module_name,
            getter_closure=lambda param: param.grad,
            setter_closure=lambda param, t: setattr(param, "grad", t),
        )
        for name, param in reversed(bagua_ddp.bagua_build_params())
    ]


def _weight_tensors(bagua_ddp):
    return [param.ensure_bagua_tensor(name, bagua_ddp.bagua_module_name)
            for name, param in reversed(bagua_ddp.bagua_build_params())]


class UserAllReduceImpl(AlgorithmImpl):
    """Gradient allreduce with ``append_centralized_synchronous_op``; re-initializes once (``need_reset``)."""

    def __init__(self, process_group, reset_at):
        super().__init__(process_group)
        self.reset_at = reset_at
        self.step = 0
        self.inits = 0

    def need_reset(self):
        self.step += 1
        return self.step == self.reset_at

    def init_tensors(self, bagua_ddp):
        self.inits += 1
        self.tensors = _grad_tensors(bagua_ddp)
        self.names = {t.bagua_tensor_name for t in self.tensors}
        return self.tensors

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(hierarchical=False, average=True, group=self.process_group)

    def init_backward_hook(self, bagua_ddp):
        def hook(parameter_name, parameter):
            if parameter_name in self.names:
                parameter.bagua_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp):
        return lambda: bagua_ddp.wait_pending_comm_ops()


@dataclass
class UserAllReduce(Algorithm):
    reset_at: int = 3

    def reify(self, process_group):
        return UserAllReduceImpl(process_group, self.reset_at)


class UserPythonOpImpl(UserAllReduceImpl):
    """Gradient averaging written as a Python op: allreduce each tensor of the bucket, then divide."""

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        buckets = {b.name: b for b in bagua_ddp.bagua_buckets}

        def average(bucket_name):
            for tensor in buckets[bucket_name].tensors:
                grad = tensor.bagua_getter_closure()
                bagua.allreduce_inplace(grad, bagua.ReduceOp.SUM)
                grad.div_(bagua.get_world_size())

        bucket.append_python_op(average, group=self.process_group)


@dataclass
class UserPythonOp(Algorithm):
    reset_at: int = 0

    def reify(self, process_group):
        return UserPythonOpImpl(process_group, self.reset_at)


class UserDecentralizedImpl(AlgorithmImpl):
    """Decentralized SGD with ``append_decentralized_synchronous_op``, as the original's algorithm is written."""

    def __init__(self, process_group, peer_selection_mode):
        super().__init__(process_group)
        self.peer_selection_mode = peer_selection_mode

    def init_tensors(self, bagua_ddp):
        self.tensors = _weight_tensors(bagua_ddp)
        return self.tensors

    def tensors_to_buckets(self, tensors, do_flatten):
        all_tensors = [t for group in tensors for t in group]
        return [BaguaBucket(all_tensors, flatten=do_flatten, name="0")]

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        peer_weight = bucket.flattened_tensor().ensure_bagua_tensor("peer_weight", bagua_ddp.bagua_module_name)
        self.op = bucket.append_decentralized_synchronous_op(
            peer_weight=peer_weight, hierarchical=False, peer_selection_mode=self.peer_selection_mode,
            group=self.process_group,
        )

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(input):
            for tensor in self.tensors:
                tensor.bagua_mark_communication_ready()

        return hook

    def init_backward_hook(self, bagua_ddp):
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            bagua_ddp.wait_pending_comm_ops()
            self.op.copy_back_peer_weight(bagua_ddp.bagua_buckets[0])

        return hook


@dataclass
class UserDecentralized(Algorithm):
    peer_selection_mode: str = "all"

    def reify(self, process_group):
        return UserDecentralizedImpl(process_group, self.peer_selection_mode)


class UserLowPrecisionDecentralizedImpl(AlgorithmImpl):
    """Low-precision decentralized SGD with ``append_low_precision_decentralized_synchronous_op``."""

    def init_tensors(self, bagua_ddp):
        return _weight_tensors(bagua_ddp)

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_low_precision_decentralized_synchronous_op(
            weight=bucket.flattened_tensor(),
            left_peer_weight=bucket.flattened_tensor(),
            right_peer_weight=bucket.flattened_tensor(),
            hierarchical=False,
            compression="MinMaxUInt8",
            group=self.process_group,
        )

    def init_backward_hook(self, bagua_ddp):
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp):
        return lambda: None

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            for bucket in bagua_ddp.bagua_buckets:
                for tensor in bucket.tensors:
                    tensor.bagua_mark_communication_ready()
            bagua_ddp.wait_pending_comm_ops()

        return hook


@dataclass
class UserLowPrecisionDecentralized(Algorithm):
    def reify(self, process_group):
        return UserLowPrecisionDecentralizedImpl(process_group)


class UserAsyncImpl(AlgorithmImpl):
    """Asynchronous model averaging with ``append_asynchronous_model_average_op``: the training thread holds the
    weight lock from forward to the optimizer step; a thread of the algorithm's own runs rounds."""

    def __init__(self, process_group, sync_interval_ms):
        super().__init__(process_group)
        self.sync_interval_ms = sync_interval_ms
        self.thread = None
        self.rounds = 0

    def init_tensors(self, bagua_ddp):
        self.tensors = _weight_tensors(bagua_ddp)
        return self.tensors

    def tensors_to_buckets(self, tensors, do_flatten):
        return [BaguaBucket([t for group in tensors for t in group], flatten=do_flatten, name="0")]

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        # the op averages on a torch group of its own, so its thread never meets the training thread's collectives
        self.op = bucket.append_asynchronous_model_average_op(peer_selection_mode="all", group=self.process_group)

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(input):
            if self.sync_interval_ms > 0 and self.thread is None:
                self.thread = threading.Thread(target=self._loop, args=(bagua_ddp,), daemon=True)
                self.thread.start()
            self.op.lock_weight()

        return hook

    def init_backward_hook(self, bagua_ddp):
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp):
        return lambda: None

    def init_post_optimizer_step_hook(self, bagua_ddp):
        return lambda optimizer: self.op.unlock_weight()

    def average_now(self, bagua_ddp):
        """One round: mark every tensor ready, wait for the bucket's op."""
        for tensor in self.tensors:
            tensor.bagua_mark_communication_ready_without_synchronization()
        bagua_ddp.wait_pending_comm_ops()
        self.rounds += 1

    def _loop(self, bagua_ddp):
        while self.op.get_status():
            time.sleep(self.sync_interval_ms / 1000)
            self.average_now(bagua_ddp)

    def abort(self):
        self.op.abort()
        if self.thread is not None:
            self.thread.join(60)

    def resume(self, bagua_ddp):
        self.op.reset()
        self.thread = threading.Thread(target=self._loop, args=(bagua_ddp,), daemon=True)
        self.thread.start()


@dataclass
class UserAsync(Algorithm):
    sync_interval_ms: int = 0

    def reify(self, process_group):
        return UserAsyncImpl(process_group, self.sync_interval_ms)


# -- training ---------------------------------------------------------------------------------------------------


def _train(rank, algorithm, after_step=None, lr=0.05):
    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.with_bagua([opt], algorithm)
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if after_step is not None:
            after_step(model)
    return model


def _builtin(name, **kwargs):
    return Algorithm.init(name, **kwargs)


def _worker_pair(rank, world_size, user, builtin):
    model = _train(rank, user)
    reference = _train(rank, builtin)
    impl = model.bagua_algorithm
    assert model.bagua_ddp.bagua_algorithm is impl and isinstance(impl, AlgorithmImpl)
    assert model.bagua_ddp.algorithm is user  # the hyper-parameters stay apart from their implementation
    assert [n for n, _ in model.bagua_build_params()] == [n for n, _ in model.named_parameters()]
    assert model.bagua_module_name == model.bagua_ddp.bagua_module_name
    return params_of(model), params_of(reference), getattr(impl, "inits", None)


PAIRS = {
    "centralized": (UserAllReduce(reset_at=3), _builtin("gradient_allreduce")),
    "python_op": (UserPythonOp(), _builtin("gradient_allreduce")),
    "decentralized_all": (UserDecentralized("all"), _builtin("decentralized", hierarchical=False)),
    "decentralized_shift_one": (
        UserDecentralized("shift_one"), _builtin("decentralized", hierarchical=False, peer_selection_mode="shift_one")
    ),
    "low_precision_decentralized": (
        UserLowPrecisionDecentralized(), _builtin("low_precision_decentralized", hierarchical=False)
    ),
}


@pytest.mark.parametrize("case", list(PAIRS))
def test_user_algorithm_trains_like_the_builtin(case):
    user, builtin = PAIRS[case]
    results = run_workers(_worker_pair, 2, user, builtin)
    for rank, (got, expected, inits) in enumerate(results):
        for g, e in zip(got, expected):
            assert torch.equal(g, e), (case, rank, (g - e).abs().max())
        if case == "centralized":
            assert inits == 2  # need_reset re-ran the initialization once, through the tensor API again
    # and the weights moved: the comparison is not between two untrained models
    assert not all(torch.equal(a, b) for a, b in zip(results[0][0], params_of(make_model(0))))


def _worker_bucket_state(rank, world_size):
    """What the original's tests read on the bucket: ``_peer_weight`` and the low-precision replicas."""
    snapshots = []
    model = _train(rank, UserDecentralized("all"), after_step=lambda m: snapshots.append(params_of(m)))
    bucket = model.bagua_buckets[0]
    # the last round averaged the weights as they were before the last step's forward, flattened in bucket order
    before_last = dict(zip([n for n, _ in model.named_parameters()], snapshots[-2]))
    flat = torch.cat([before_last[t.name].reshape(-1) for t in bucket.tensors])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    peer_weight_expected = sum(gathered[1:], gathered[0]) / world_size

    model = _train(rank, UserLowPrecisionDecentralized())
    replicas = [(b._weight.clone(), b._left_peer_weight.clone(), b._right_peer_weight.clone())
                for b in model.bagua_buckets]
    flats = [b.flattened_tensor() for b in model.bagua_buckets]
    return bucket._peer_weight.clone(), peer_weight_expected, replicas, flats


def test_bucket_keeps_peer_weight_and_replicas():
    (pw0, exp0, rep0, flat0), (pw1, exp1, rep1, flat1) = run_workers(_worker_bucket_state, 2)
    assert_close(pw0, exp0, rtol=0, atol=1e-6)  # an allreduce-average against sum / 2 of the gathered weights
    assert_close(pw1, exp1, rtol=0, atol=1e-6)
    for (mine0, left0, right0), (mine1, left1, right1), f0, f1 in zip(rep0, rep1, flat0, flat1):
        # with two ranks each one's neighbours are the other: its copies of the peer's replica are exact
        assert torch.equal(left0, mine1) and torch.equal(right0, mine1)
        assert torch.equal(left1, mine0) and torch.equal(right1, mine0)
        # and the weights are the public replica
        assert torch.equal(f0, mine0) and torch.equal(f1, mine1)


def _worker_async_on_demand(rank, world_size):
    user = _train(rank, UserAsync(sync_interval_ms=0), after_step=lambda m: m.bagua_algorithm.average_now(m.bagua_ddp))
    with pytest.warns(UserWarning):
        builtin = _builtin("async", sync_interval_ms=0)  # never averages by itself: rounds run on demand below
    reference = _train(rank, builtin, after_step=lambda m: m.bagua_algorithm._average_once())
    return params_of(user), params_of(reference), user.bagua_algorithm.rounds


def test_user_async_rounds_equal_the_builtin_rounds():
    for got, expected, rounds in run_workers(_worker_async_on_demand, 2):
        assert rounds == STEPS
        for g, e in zip(got, expected):
            assert torch.equal(g, e), (g - e).abs().max()


def _worker_async_thread(rank, world_size):
    """Train with the user's thread averaging meanwhile; stop it; make the ranks' weights differ; resume it while
    training is idle: one round then gives every rank the mean, computed here with all_gather."""
    model = _train(rank, UserAsync(sync_interval_ms=1))
    impl = model.bagua_algorithm
    trained_rounds = impl.rounds
    impl.abort()  # every rank's op stops at the same round (the first rank to abort decides it)
    assert not impl.thread.is_alive() and not impl.op.get_status()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.mul_(1 + 0.5 * rank).add_(0.1 * (rank + i))
    expected = []
    for p in model.parameters():
        gathered = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(gathered, p.detach().contiguous())  # also: every rank has stopped its thread
        expected.append(sum(gathered[1:], gathered[0]) / world_size)
    impl.resume(model.bagua_ddp)
    deadline = time.monotonic() + 60
    start = impl.rounds
    while impl.rounds < start + 1:
        assert time.monotonic() < deadline, "no averaging round within 60 s"
        time.sleep(0.005)
    impl.abort()
    return expected, params_of(model), trained_rounds


def test_user_async_thread_averages_while_idle():
    for expected, got, trained_rounds in run_workers(_worker_async_thread, 2):
        assert_close(got, expected, rtol=0, atol=1e-6)


# -- the tensor API, one method at a time -------------------------------------------------------------------------


def test_bagua_ensure_grad_creates_a_zero_gradient_once():
    p = torch.nn.Parameter(torch.randn(2, 3))
    assert p.bagua_ensure_grad() is p
    assert torch.equal(p.grad, torch.zeros(2, 3))
    grad = p.grad
    grad.add_(1.5)
    assert p.bagua_ensure_grad().grad is grad  # an existing gradient is kept
    with pytest.raises(ValueError, match="leaf"):
        (p * 2).bagua_ensure_grad()


def test_ensure_bagua_tensor_registers_in_place():
    p = torch.nn.Parameter(torch.arange(6.0))
    assert not p.is_bagua_tensor()
    assert p.ensure_bagua_tensor("fc.weight", "net") is p
    assert p.is_bagua_tensor() and p.bagua_tensor_name == "fc.weight" and p.bagua_module_name == "net"
    proxy = p.bagua_backend_tensor()
    assert isinstance(proxy, BaguaTensor) and proxy.name == "fc.weight" and proxy.param is p
    assert p.ensure_bagua_tensor("fc.weight").bagua_backend_tensor().module_name == "net"  # again: kept
    with pytest.raises(ValueError, match="renamed"):
        p.ensure_bagua_tensor("other")
    with pytest.raises(ValueError, match="getter_closure"):
        torch.zeros(2).ensure_bagua_tensor("t", setter_closure=lambda t, v: None)
    with pytest.raises(TypeError, match="ensure_bagua_tensor"):
        torch.zeros(2).bagua_getter_closure()


def test_getter_and_setter_closures():
    p = torch.nn.Parameter(torch.arange(4.0))
    # default: the effective tensor is the tensor itself (same storage, same values)
    p.ensure_bagua_tensor("w")
    eff = p.bagua_getter_closure()
    assert torch.equal(eff, torch.arange(4.0)) and eff.data_ptr() == p.data_ptr()
    p.bagua_setter_closure(torch.full((4,), 7.0))
    assert torch.equal(p.detach(), torch.full((4,), 7.0))
    # the gradient's closures, as the original's default init_tensors gives them
    q = torch.nn.Parameter(torch.ones(3)).bagua_ensure_grad()
    q.ensure_bagua_tensor("g", getter_closure=lambda t: t.grad, setter_closure=lambda t, v: setattr(t, "grad", v))
    assert q.bagua_getter_closure() is q.grad
    new = torch.tensor([1.0, 2.0, 3.0])
    q.bagua_setter_closure(new)
    assert q.grad is new and q.bagua_getter_closure() is new


def test_to_bagua_tensor_shares_storage_and_leaves_the_original():
    t = torch.arange(5.0)
    b = t.to_bagua_tensor("copy")
    assert b is not t and not t.is_bagua_tensor() and b.is_bagua_tensor()
    assert b.data_ptr() == t.data_ptr()
    t[0] = 42.0
    assert b.bagua_getter_closure()[0] == 42.0


@pytest.mark.parametrize("kind", ["weight", "grad"])
def test_bagua_set_storage_points_into_the_storage_without_copy(kind):
    flat = torch.arange(10.0)
    p = torch.nn.Parameter(torch.zeros(2, 2)).bagua_ensure_grad()
    if kind == "weight":
        p.ensure_bagua_tensor("w")
    else:
        p.ensure_bagua_tensor("g", getter_closure=lambda t: t.grad, setter_closure=lambda t, v: setattr(t, "grad", v))
    p.bagua_set_storage(flat.untyped_storage(), 3)
    eff = p.bagua_getter_closure()
    assert torch.equal(eff, flat[3:7].view(2, 2))  # reads what the storage holds: no copy of the old value
    flat[3:7] = -1.0
    assert torch.equal(eff, torch.full((2, 2), -1.0))  # and stays a view of it
    target = p.detach() if kind == "weight" else p.grad
    assert target.data_ptr() == flat[3:].data_ptr()


def test_bucket_accepts_registered_tensors_and_flattens_them():
    params = [torch.nn.Parameter(torch.full((2,), float(i))) for i in range(3)]
    tensors = [p.ensure_bagua_tensor(f"p{i}", "net") for i, p in enumerate(params)]
    bucket = BaguaBucket(tensors, name="0", flatten=True)
    assert [t.name for t in bucket.tensors] == ["p0", "p1", "p2"]
    assert torch.equal(bucket.flat, torch.tensor([0.0, 0, 1, 1, 2, 2]))
    bucket.flat.mul_(10)
    assert torch.equal(params[2].detach(), torch.tensor([20.0, 20.0]))  # the parameters are views of the bucket
    with pytest.raises(TypeError, match="ensure_bagua_tensor"):
        BaguaBucket([torch.zeros(2)], name="1")


def test_bagua_build_params_needs_a_wrapped_module():
    with pytest.raises(RuntimeError, match="with_bagua"):
        torch.nn.Linear(2, 2).bagua_build_params()


def test_mark_ready_without_a_wrapped_module_names_the_fix():
    t = torch.nn.Parameter(torch.zeros(2)).ensure_bagua_tensor("w", "no_such_module")
    with pytest.raises(RuntimeError, match="module_name=model.bagua_module_name"):
        t.bagua_mark_communication_ready()


def test_registry_register_with_the_original_signature():
    GlobalAlgorithmRegistry.register("user_allreduce_test", UserAllReduce, description="allreduce, user-written")
    try:
        assert GlobalAlgorithmRegistry.get("user_allreduce_test") is UserAllReduce
        assert GlobalAlgorithmRegistry["user_allreduce_test"] == {
            "algorithm": UserAllReduce, "description": "allreduce, user-written"
        }
        assert GlobalAlgorithmRegistry.description("user_allreduce_test") == "allreduce, user-written"
        assert "user_allreduce_test" in GlobalAlgorithmRegistry.available_algorithms()
        assert Algorithm.init("user_allreduce_test", reset_at=5) == UserAllReduce(reset_at=5)
        with pytest.raises(ValueError, match="already registered"):
            GlobalAlgorithmRegistry.register("user_allreduce_test", UserPythonOp)
        with pytest.raises(ValueError, match="user_allreduce_test"):
            GlobalAlgorithmRegistry.get("user_allreduce_tset")  # the nearest name is suggested
    finally:
        del GlobalAlgorithmRegistry["user_allreduce_test"]
    with pytest.raises(TypeError, match="str"):
        GlobalAlgorithmRegistry.register(3, UserAllReduce)
