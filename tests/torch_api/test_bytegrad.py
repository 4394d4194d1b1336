"""ByteGrad against the maths written plainly on tensors, error feedback, and convergence on sklearn digits.

The reference below shares no code with the implementation: it re-implements MinMaxUInt8 with the original's
formula (``min(round(x*scale), upper) - lower``) one chunk at a time, and the scatter-reduce-gather on the raw
float32 gradients of all ranks (gathered with ``dist.all_gather``). It performs the same float32 operations in the
same order (decoded chunks added in rank order, then divided by the number of ranks), so the gradients are
expected to be **bit-identical**: the tolerance is exact (``rtol=atol=0``). A single float32 rounding difference
would flip an 8-bit code somewhere and show up as an error of a whole quantization step, so no small tolerance
would hide a real mismatch anyway.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import Net, batch, params_of

STEPS = 4


# -- the plain reference ---------------------------------------------------------------------------------------


def _ref_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """MinMaxUInt8 encode then decode of one chunk, as the original Bagua writes it."""
    mn, mx = x.min(), x.max()
    scale = 255.0 / (mx - mn + 1e-7)
    upper = torch.round(mx * scale)
    lower = upper - 255.0
    q = (torch.minimum(torch.round(x * scale), upper) - lower).to(torch.uint8)
    return (q.float() + lower) / scale


class _RefByteGrad:
    """ByteGrad on plain tensors, given every rank's flat (padded) bucket; optional error feedback."""

    def __init__(self, error_feedback: bool) -> None:
        self.error_feedback = error_feedback
        self.e: dict = {}  # (bucket, rank) -> residual
        self.s: dict = {}  # (bucket, chunk) -> owner's residual

    def __call__(self, key, flats: list[torch.Tensor], average: bool = True) -> torch.Tensor:
        n = len(flats)
        length = flats[0].numel() // n
        decoded = []
        for i, g in enumerate(flats):
            x = g + self.e[key, i] if self.error_feedback and (key, i) in self.e else g.clone()
            d = torch.cat([_ref_roundtrip(x[j * length : (j + 1) * length]) for j in range(n)])
            if self.error_feedback:
                self.e[key, i] = x - d
            decoded.append(d)
        out = torch.empty_like(flats[0])
        for j in range(n):
            acc = decoded[0][j * length : (j + 1) * length].clone()
            for i in range(1, n):
                acc = acc + decoded[i][j * length : (j + 1) * length]
            if average:
                acc = acc / n
            if self.error_feedback and (key, j) in self.s:
                acc = acc + self.s[key, j]
            d = _ref_roundtrip(acc)
            if self.error_feedback:
                self.s[key, j] = acc - d
            out[j * length : (j + 1) * length] = d
        return out


def _padded(t: torch.Tensor, multiple: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((-t.numel()) % multiple)])


def _all_gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


# -- construction ----------------------------------------------------------------------------------------------


def test_registered_by_name_and_validated():
    from bagua.torch_api.algorithms import Algorithm
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm

    assert Algorithm.init("bytegrad", error_feedback=True) == ByteGradAlgorithm(error_feedback=True)
    assert ByteGradAlgorithm() == ByteGradAlgorithm(hierarchical=True, average=True, error_feedback=False)
    with pytest.raises(ValueError, match="error_feedback=...\\) must be True or False"):
        ByteGradAlgorithm(error_feedback="yes")


# -- parity ----------------------------------------------------------------------------------------------------


def _worker_parity(rank, world_size, hierarchical, error_feedback, small_segments, average=True, deferred=False):
    from bagua.torch_api.codecs import compressed_allreduce, minmax_uint8 as compression
    from bagua.torch_api.algorithms import bytegrad
    from bagua.torch_api.bucket import BaguaBucket

    if small_segments:  # exercise the pipelined segments and the cache blocks with a tiny model
        compressed_allreduce.SEGMENT, compression.BLOCK = 160, 48
    read_in_place = []
    if deferred:  # fresh gradients of every size are read in place, never copied into the bucket first
        BaguaBucket.MIN_DEFERRED = 1
        encode_pieces = compressed_allreduce.encode_pieces
        compressed_allreduce.encode_pieces = lambda *a, **k: read_in_place.append(1) or encode_pieces(*a, **k)
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    model.with_bagua(
        [opt], bytegrad.ByteGradAlgorithm(hierarchical=hierarchical, average=average, error_feedback=error_feedback)
    )
    layout = [[t.name for t in b.tensors] for b in model.bagua_buckets]
    ref_params = dict(ref_model.named_parameters())
    ref = _RefByteGrad(error_feedback)
    local = 2 if hierarchical else 1
    grads_equal = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref_model(x), y).backward()
        for b, names in enumerate(layout):
            flat = _padded(torch.cat([ref_params[n].grad.reshape(-1) for n in names]), world_size)
            flats = _all_gather(flat)
            if local > 1:  # nodes of `local` ranks: float32 average inside the node, ByteGrad among nodes
                nodes = [flats[k * local : (k + 1) * local] for k in range(world_size // local)]
                flats = [(node[0] + node[1]) / 2 if average else node[0] + node[1] for node in nodes]
            # one node: the leader is alone in the exchange and the node average stays exact (no 8-bit round trip)
            result = ref(b, flats, average) if len(flats) > 1 else flats[0]
            offset = 0
            for n in names:
                p = ref_params[n]
                p.grad.copy_(result[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        ref_opt.step()

        opt.zero_grad()  # set_to_none: every gradient is a fresh tensor, not the bucket's view
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads_equal.append([(p.grad.clone(), ref_params[n].grad.clone()) for n, p in model.named_parameters()])
        if deferred:  # the views are the gradients again after the step's communication
            assert all(b.check_flatten() and not b.has_pending() for b in model.bagua_buckets)
            assert read_in_place or hierarchical or error_feedback  # these two copy into the bucket first
        opt.step()
    return grads_equal, params_of(model), params_of(ref_model), len(layout)


@pytest.mark.parametrize(
    "world_size,hierarchical,error_feedback,small_segments,bucket_size,average,deferred",
    [
        (2, False, False, True, 1024, True, False),  # several buckets, several segments per chunk
        (2, False, False, True, 1024, True, True),  # the same, gradients read in place (no copy into the bucket)
        (2, False, True, False, None, False, True),  # error feedback (residuals carried over steps), sum
        (4, False, False, False, 2048, True, True),
        (2, True, False, False, None, False, False),  # one node: the node sum, exact
        (4, True, False, True, None, True, True),  # two nodes of two ranks
        (4, True, True, False, None, True, False),
    ],
)
def test_matches_plain_reference(
    world_size, hierarchical, error_feedback, small_segments, bucket_size, average, deferred
):
    env = {"BAGUA_DEFAULT_BUCKET_SIZE": str(bucket_size)} if bucket_size else None
    results = run_workers(
        _worker_parity,
        world_size,
        hierarchical,
        error_feedback,
        small_segments,
        average,
        deferred,
        env=env,
        local_size=2 if hierarchical else None,
    )
    for steps, got, expected, n_buckets in results:
        for pairs in steps:
            assert_close([g for g, _ in pairs], [r for _, r in pairs], rtol=0, atol=0)
        assert_close(got, expected, rtol=0, atol=0)
        if bucket_size:
            assert n_buckets > 1
    for _, got, _, _ in results[1:]:
        assert_close(got, results[0][1], rtol=0, atol=0)  # every rank holds identical weights


def _worker_variants(rank, world_size):
    from bagua.torch_api import communication
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm, low_precision_allreduce_inplace

    out = {}
    for flatten in (True, False):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.with_bagua([opt], ByteGradAlgorithm(hierarchical=False), do_flatten=flatten)
        for step in range(3):
            x, y = batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        out[flatten] = params_of(model)
    # a size that does not split evenly, and half precision, go through a float32 zero-padded staging copy
    c = communication._get_default_group().get_global_communicator()
    g = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
    odd, padded = g.clone(), _padded(g, world_size)
    low_precision_allreduce_inplace(odd, c)
    low_precision_allreduce_inplace(padded, c)
    half, as_float = g.half(), g.half().float()
    low_precision_allreduce_inplace(half, c)
    low_precision_allreduce_inplace(as_float, c)
    out["odd"] = (odd, padded[:1001])
    out["half"] = (half, as_float.half())
    return out


def test_unflattened_odd_sized_and_half_precision_buckets():
    for out in run_workers(_worker_variants, 2):
        assert_close(out[False], out[True], rtol=0, atol=0)
        for got, expected in (out["odd"], out["half"]):
            assert_close(got, expected, rtol=0, atol=0)


def _worker_grouped_sends(rank, world_size):
    from bagua.torch_api import communication
    from bagua.torch_api.codecs import compressed_allreduce as bytegrad
    bytegrad.SEGMENT = 100  # several segments per chunk
    c = communication._get_default_group().get_global_communicator()
    g = torch.randn(world_size * 1000, generator=torch.Generator().manual_seed(rank))
    eager, grouped = g.clone(), g.clone()
    assert bytegrad._post_receives_first(c.group)  # gloo
    bytegrad.low_precision_allreduce_inplace(eager, c)
    bytegrad._post_receives_first = lambda group: False  # the NCCL order: each segment's sends and receives grouped
    bytegrad.low_precision_allreduce_inplace(grouped, c)
    return eager, grouped


@pytest.mark.parametrize("world_size", [2, 4])
def test_grouped_sends_of_nccl_give_the_same_result(world_size):
    results = run_workers(_worker_grouped_sends, world_size)
    for eager, grouped in results:
        assert_close(grouped, eager, rtol=0, atol=0)
        assert_close(eager, results[0][0], rtol=0, atol=0)


# -- error feedback --------------------------------------------------------------------------------------------


def _worker_error_feedback_accumulates(rank, world_size, steps):
    from bagua.torch_api import communication
    from bagua.torch_api.algorithms.bytegrad import Workspace, low_precision_allreduce_inplace

    c = communication._get_default_group().get_global_communicator()
    # per chunk: one outlier sets a coarse quantization step (2/255), so the small entries are rounded the
    # same wrong way at every step
    g = torch.full((64,), 0.003 * (rank + 1))
    g[0], g[1], g[32], g[33] = 1.0, -1.0, 1.0, -1.0
    exact = (0.003 + 0.006) / 2 * steps
    errors = {}
    for ef in (False, True):
        ws = Workspace(64, world_size, torch.device("cpu"), error_feedback=ef)
        total = torch.zeros(64)
        for _ in range(steps):
            out = g.clone()
            low_precision_allreduce_inplace(out, c, average=True, workspace=ws)
            total += out
        small = torch.ones(64, dtype=torch.bool)
        small[[0, 1, 32, 33]] = False
        errors[ef] = (total[small] - exact).abs().max().item()
        if ef:  # telescoping: sum of results = steps * mean(g) - mean_i(e_i) - s, exactly up to float rounding
            e_mean = sum(_all_gather(ws.residual.reshape(-1))) / world_size
            s = torch.cat(_all_gather(ws.server_residual))
            identity = (total + e_mean + s - steps * (g + _other(g, rank)) / 2)[small].abs().max().item()
            errors["identity"] = identity
    return errors


def _other(g: torch.Tensor, rank: int) -> torch.Tensor:
    other = g.clone()
    other[g.abs() < 0.5] = 0.003 * (2 - rank)
    return other


def test_error_feedback_keeps_the_accumulated_error_bounded():
    steps = 40
    for errors in run_workers(_worker_error_feedback_accumulates, 2, steps):
        step = 2 / 255
        assert errors[False] > 0.05  # without feedback the same rounding error adds up every step
        assert errors[True] < step  # with feedback it stays below a quantization step
        assert errors["identity"] < 1e-4


# -- convergence on a real dataset -----------------------------------------------------------------------------

DIGITS_EPOCHS = 8


def _digits_data(rank: int, world_size: int):
    """sklearn's 8x8 digits (bundled, offline): 397 test images, the rest split evenly across ranks."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_test = 397
    per_rank = (len(y) - n_test) // world_size
    shard = slice(n_test + rank * per_rank, n_test + (rank + 1) * per_rank)
    return (x[shard], y[shard]), (x[:n_test], y[:n_test])


def _digits_run(rank, world_size, make_optimizer, make_algorithm, epochs=DIGITS_EPOCHS, batch_size=32):
    """Train a small MLP with ``make_algorithm(optimizer)``; return the test accuracy (percent) and the weights."""
    (x, y), (x_test, y_test) = _digits_data(rank, world_size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = make_optimizer(model.parameters())
    model.with_bagua([opt], make_algorithm(opt))
    order_gen = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=order_gen)
        for start in range(0, len(y) - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item() * 100
    return accuracy, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _worker_digits(rank, world_size):
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    def sgd(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    return {
        "gradient_allreduce": _digits_run(rank, world_size, sgd, lambda opt: GradientAllReduceAlgorithm()),
        "bytegrad": _digits_run(rank, world_size, sgd, lambda opt: ByteGradAlgorithm()),
        "bytegrad_ef": _digits_run(rank, world_size, sgd, lambda opt: ByteGradAlgorithm(error_feedback=True)),
    }


def test_digits_accuracy_within_two_points_of_gradient_allreduce():
    results = run_workers(_worker_digits, 2)
    for name, (_, weights) in results[0].items():
        assert_close(results[1][name][1], weights, rtol=0, atol=0)  # every rank holds the same model
    acc = {name: a for name, (a, _) in results[0].items()}
    assert acc["gradient_allreduce"] > 90, acc
    for name in ("bytegrad", "bytegrad_ef"):
        assert acc[name] >= acc["gradient_allreduce"] - 2, acc
    # error feedback keeps the compressed run closer to the float32 one
    reference = results[0]["gradient_allreduce"][1]
    distance = {name: (results[0][name][1] - reference).abs().max().item() for name in ("bytegrad", "bytegrad_ef")}
    assert distance["bytegrad_ef"] < distance["bytegrad"], distance


def _worker_nonfinite(rank, world_size, policy):
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], ByteGradAlgorithm(hierarchical=False, nonfinite=policy))
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 64)
    if rank == 1:
        x[0, 3] = float("nan")  # one bad input on one rank only
    opt.zero_grad()
    try:
        model(x).square().sum().backward()
    except FloatingPointError as exc:
        return "raised: " + str(exc)
    opt.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    grads_none = all(p.grad is None for p in model.parameters())
    # the next, finite step trains normally on every rank
    opt.zero_grad()
    model(torch.randn(4, 64)).square().sum().backward()
    opt.step()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return f"skipped={unchanged and grads_none} finite_after={finite}"


def test_nonfinite_gradient_raises_on_every_rank():
    for message in run_workers(_worker_nonfinite, 2, "raise"):
        assert message.startswith("raised:") and "NaN/Inf in bucket(s)" in message and "nonfinite='propagate'" in message


def test_nonfinite_gradient_skips_the_step_on_every_rank():
    assert run_workers(_worker_nonfinite, 2, "skip") == ["skipped=True finite_after=True"] * 2


def _worker_verdict_from_headers(rank, world_size):
    from bagua.torch_api.codecs import compressed_allreduce
    from bagua.torch_api.algorithms import bytegrad, nonfinite

    scans = []
    exact = compressed_allreduce.all_finite
    compressed_allreduce.all_finite = nonfinite.all_finite = lambda t: scans.append(t.numel()) or exact(t)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], bytegrad.ByteGradAlgorithm(hierarchical=False))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
    return scans


def test_finite_steps_are_vouched_for_by_the_headers_without_reading_the_gradients():
    # the NaN/Inf verdict of a finite step comes from the 8-bit chunks' headers: no pass over the gradients
    assert run_workers(_worker_verdict_from_headers, 2) == [[], []]


def test_nonfinite_policy_is_validated():
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm

    with pytest.raises(ValueError, match="choose one of"):
        ByteGradAlgorithm(nonfinite="warn")


def test_all_finite_is_exact_even_when_the_sum_overflows():
    from bagua.torch_api.algorithms.bytegrad import all_finite

    big = torch.full((4,), 3e38)  # finite, but its float32 sum is inf: the exact test must decide
    assert all_finite(big) and all_finite(torch.randn(1000)) and all_finite(torch.arange(5))
    assert all_finite(torch.full((8,), 6e4, dtype=torch.float16))  # sum overflows float16, not float32
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(1000)
        x[777] = bad
        assert not all_finite(x) and not all_finite(x.half())
    y = big.clone()
    y[1] = -float("inf")
    assert not all_finite(y)
