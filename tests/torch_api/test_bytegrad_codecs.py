"""ByteGrad with the block-wise codecs (``codec="uint8"``, ``"uint4"``) against the maths written plainly on tensors.

The reference (:class:`RefBlockByteGrad`) gathers every rank's flat bucket (``dist.all_gather``) and runs the
scatter-reduce-gather of ``bagua/torch_api/codecs/block_allreduce.py`` on plain tensors: chunks of whole blocks
(``test_block_allreduce._chunks``), each block quantized by the codec's formula as ``test_block_codec._reference``
writes it (no code shared with the module), the decoded copies of a chunk added in rank order in float32, divided by
the number of ranks (a true division), quantized again; with error feedback the rank residual ``e`` and the owner's
residual ``s``. Same float32 operations in the same order, so every comparison is exact (``rtol=atol=0``).

Also: a checkpoint resume (model, optimizer and residuals) equals the uninterrupted run; GradScaler with an Inf on
one rank skips that step on every rank, and with the residuals rescaled to the changing scale the run equals, bit
for bit, the run without a scaler that never saw that batch (scales are powers of two, so scaling is exact); the DDP
hook with a block codec equals ``with_bagua`` ByteGrad with it; bad codec names name the alternatives.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import Net, batch, make_model, params_of
from tests.torch_api.test_block_allreduce import _chunks, _dq

STEPS = 5


class RefBlockByteGrad:
    """ByteGrad with a block codec on plain tensors, given every rank's flat bucket; optional error feedback."""

    def __init__(self, codec: str, block: int, error_feedback: bool) -> None:
        self.codec, self.block, self.error_feedback = codec, block, error_feedback
        self.e: dict = {}  # (bucket, rank) -> the rank's residual
        self.s: dict = {}  # (bucket, chunk) -> its owner's residual

    def __call__(self, key, flats: list[torch.Tensor], average: bool = True) -> torch.Tensor:
        n, codec, block = len(flats), self.codec, self.block
        bounds, _ = _chunks(flats[0].numel(), n, block)
        decoded = []
        for i, g in enumerate(flats):
            x = g + self.e[key, i] if self.error_feedback and (key, i) in self.e else g.clone()
            d = torch.cat([_dq(x[a:b], codec, block) for a, b in bounds])
            if self.error_feedback:
                self.e[key, i] = x - d
            decoded.append(d)
        out = torch.empty_like(flats[0])
        for j, (a, b) in enumerate(bounds):
            y = decoded[0][a:b]
            for i in range(1, n):
                y = y + decoded[i][a:b]
            if average:
                y = y / torch.tensor([float(n)])
            if self.error_feedback and (key, j) in self.s:
                y = y + self.s[key, j]
            out[a:b] = _dq(y, codec, block)
            if self.error_feedback:
                self.s[key, j] = y - out[a:b]
        return out


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


# -- parity with the plain reference, checkpoint resume ---------------------------------------------------------


def _wrap(model, opt, codec, block, hierarchical, error_feedback):
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm

    algorithm = ByteGradAlgorithm(hierarchical=hierarchical, error_feedback=error_feedback, codec=codec,
                                  block_size=block)
    return model.with_bagua([opt], algorithm)


def _worker_parity(rank, world_size, codec, block, hierarchical, error_feedback, resume_at):
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    model = _wrap(model, opt, codec, block, hierarchical, error_feedback)
    layout = [[t.name for t in b.tensors] for b in model.bagua_buckets]
    ref_params = dict(ref_model.named_parameters())
    ref = RefBlockByteGrad(codec, block, error_feedback)
    local = 2 if hierarchical else 1
    history = []
    for step in range(STEPS):
        if step == resume_at:  # a checkpoint round trip: new model, optimizer and engine from the three states
            states = (model.state_dict(), opt.state_dict(), model.bagua_ddp.impl.state_dict())
            torch.manual_seed(1)
            model = Net()
            model.load_state_dict(states[0])
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            opt.load_state_dict(states[1])
            model = _wrap(model, opt, codec, block, hierarchical, error_feedback)
            model.bagua_ddp.impl.load_state_dict(states[2])
        x, y = batch(rank, step)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref_model(x), y).backward()
        for b, names in enumerate(layout):
            flats = _all_gather(torch.cat([ref_params[n].grad.reshape(-1) for n in names]))
            if local > 1:  # two nodes of two ranks: float32 average inside each node, the codec between nodes
                flats = [(flats[k] + flats[k + 1]) / 2 for k in range(0, world_size, 2)]
            result = ref(b, flats)
            offset = 0
            for n in names:
                p = ref_params[n]
                p.grad.copy_(result[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        ref_opt.step()

        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        history.append(([p.grad.clone() for p in model.parameters()], [p.grad.clone() for p in ref_model.parameters()]))
        opt.step()
    residuals = model.bagua_ddp.impl.state_dict()
    ref_residuals = {}
    if error_feedback and not hierarchical:
        for b in range(len(layout)):
            ref_residuals[f"{b}.residual"] = ref.e[b, rank]
            ref_residuals[f"{b}.server_residual"] = ref.s[b, rank]
    return history, params_of(model), params_of(ref_model), len(layout), residuals, ref_residuals


@pytest.mark.parametrize(
    "world_size,codec,block,hierarchical,error_feedback,resume_at,bucket_bytes",
    [
        (2, "uint8", 64, False, True, 2, 2048),  # several buckets (tags), error feedback, resumed at step 2
        (2, "uint4", 128, False, True, None, None),  # 4 bits, error feedback, one bucket
        (4, "uint8", 64, True, True, None, None),  # two nodes of two ranks
    ],
    ids=["uint8-ef-resume-buckets", "uint4-ef", "uint8-hierarchical-ef"],
)
def test_matches_plain_reference(world_size, codec, block, hierarchical, error_feedback, resume_at, bucket_bytes):
    env = {"BAGUA_DEFAULT_BUCKET_SIZE": str(bucket_bytes)} if bucket_bytes else None
    results = run_workers(_worker_parity, world_size, codec, block, hierarchical, error_feedback, resume_at,
                          env=env, local_size=2 if hierarchical else None, timeout=180)
    for rank, (history, got, expected, n_buckets, residuals, ref_residuals) in enumerate(results):
        for step, (grads, ref_grads) in enumerate(history):
            assert_close(grads, ref_grads, rtol=0, atol=0, msg=lambda m: f"rank {rank} step {step}: {m}")
        assert_close(got, expected, rtol=0, atol=0)
        assert n_buckets > 1 if bucket_bytes else n_buckets == 1
        for key, want in ref_residuals.items():  # the residuals after the last step, resumed ones included
            assert_close(residuals[key][: want.numel()], want, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    for _, got, _, _, _, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0][1]))  # identical weights on every rank


# -- GradScaler: a non-finite step skipped everywhere, residuals rolled back and rescaled --------------------------

BAD = 2


def _worker_scaler(rank, world_size):
    runs = {codec: _scaler_runs(rank, codec) for codec in ("uint8", "uint4")}  # one job: spawning costs seconds
    runs["hook"] = _scaler_runs(rank, "uint8", hook=True)  # the DDP comm hook's residuals follow the scale too
    return runs


def _scaler_runs(rank, codec, hook=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.contrib.ddp_hooks import ByteGradState, bytegrad_hook

    runs = {}
    for scaled in (True, False):
        model = make_model(rank)
        # scale 2**10, doubled every 2 good steps, halved by the overflow: the residuals change units 3 times
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if scaled else None
        if hook:
            model = DDP(model)
            state = ByteGradState(error_feedback=True, codec=codec, block_size=64, grad_scaler=scaler)
            model.register_comm_hook(state, bytegrad_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            model = model.with_bagua([opt], ByteGradAlgorithm(hierarchical=False, error_feedback=True, codec=codec,
                                                              block_size=64, grad_scaler=scaler))
        scales, skipped = [], []
        for step in range(STEPS + 1):
            if step == BAD and not scaled:
                continue  # the reference never sees the batch of the overflow
            x, y = batch(rank, step)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step == BAD and rank == 1:
                loss = loss * float("inf")  # one rank overflows
            if not scaled:
                loss.backward()
                opt.step()
                continue
            before = params_of(model)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            if all(torch.equal(a, b) for a, b in zip(before, params_of(model))):
                skipped.append(step)
        if hook:
            state.close()
        runs[scaled] = (params_of(model), scales, skipped)
    return runs


def test_gradscaler_overflow_skips_everywhere_and_residuals_follow_the_scale():
    results = run_workers(_worker_scaler, 2, timeout=120)
    for codec in ("uint8", "uint4", "hook"):
        for rank, by_codec in enumerate(results):
            runs = by_codec[codec]
            weights, scales, skipped = runs[True]
            assert skipped == [BAD], (codec, rank, skipped)  # every rank skipped the overflow, and only it
            assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11, 2.0**11], scales
            for i, (got, want) in enumerate(zip(weights, runs[False][0])):
                assert torch.equal(got, want), f"{codec} rank {rank} parameter {i}: max {(got - want).abs().max()}"
        assert all(torch.equal(a, b) for a, b in zip(results[0][codec][True][0], results[1][codec][True][0]))


# -- the DDP hook equals with_bagua ---------------------------------------------------------------------------


def _worker_hook(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.contrib.ddp_hooks import ByteGradState, bytegrad_hook
    from tests.contrib.test_ddp_hooks import _model, _train

    out = {}
    for codec in ("uint8", "uint4"):
        # blocks of 600: each block (and chunk) is one layer of the square MLP in every parameter order DDP uses
        ddp = DDP(_model(rank), bucket_cap_mb=1024)
        state = ByteGradState(codec=codec, block_size=600)
        ddp.register_comm_hook(state, bytegrad_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        hook = _train(ddp, opt, rank, 3)
        state.close()
        model = _model(rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model = model.with_bagua([opt], ByteGradAlgorithm(hierarchical=False, codec=codec, block_size=600))
        out[codec] = hook, _train(model, opt, rank, 3), state.buckets
        model.bagua_ddp.close()
    return out


def test_ddp_hook_equals_with_bagua():
    results = run_workers(_worker_hook, 2, env={"BAGUA_DEFAULT_BUCKET_SIZE": str(1 << 30)}, timeout=120)
    for rank, out in enumerate(results):
        for codec, (hook, bagua, buckets) in out.items():
            assert buckets == 3
            for step, (h, b) in enumerate(zip(hook, bagua)):
                for x, y in zip(h, b):
                    assert torch.equal(x, y), f"{codec} rank {rank} step {step}: max diff {(x - y).abs().max()}"


# -- arguments ------------------------------------------------------------------------------------------------


def test_codec_arguments_are_checked_and_parsed():
    from benchmarks.common.systems import split_system
    from bagua.torch_api.algorithms import Algorithm
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
    from bagua.torch_api.contrib.ddp_hooks import ByteGradState

    available = "available: 'chunk'.*'uint8'.*'uint4'"
    with pytest.raises(ValueError, match=f"ByteGradAlgorithm\\(codec='int8'\\) is not a codec; {available}"):
        ByteGradAlgorithm(codec="int8")
    with pytest.raises(ValueError, match="block_size=3\\) must be a positive even integer"):
        ByteGradAlgorithm(codec="uint8", block_size=3)
    with pytest.raises(ValueError, match="must be a torch.amp.GradScaler"):
        ByteGradAlgorithm(error_feedback=True, grad_scaler=object())
    with pytest.warns(UserWarning, match="only rescales error-feedback residuals"):
        ByteGradAlgorithm(grad_scaler=torch.amp.GradScaler("cpu"))
    opt = QAdamOptimizer(torch.nn.Linear(2, 2).parameters(), warmup_steps=5)
    with pytest.raises(ValueError, match=f"QAdamAlgorithm\\(codec='bf16'\\) is not a codec; {available}"):
        QAdamAlgorithm(opt, codec="bf16")
    with pytest.raises(ValueError, match=f"ByteGradState\\(codec='uint5'\\) is not a codec; {available}"):
        ByteGradState(codec="uint5")
    assert ByteGradState(codec="minmax_uint8").codec == "chunk"  # its former name
    assert ByteGradAlgorithm().codec == "chunk"
    # the benchmark's system spec: strings stay strings, ints and bools are parsed
    name, kwargs = split_system("bytegrad:codec=uint8:error_feedback=True:block_size=2048")
    assert Algorithm.init(name, **kwargs) == ByteGradAlgorithm(codec="uint8", error_feedback=True, block_size=2048)
