"""One codec registry (bagua/torch_api/codecs/registry.py): its names and aliases, loud duplicates, the listing error
of every compressing entry point, and each gradient codec through the bucket API and ByteGrad/QAdam against the plain
references of test_bytegrad (MinMaxUInt8 per rank chunk) and test_bytegrad_codecs (block codecs); an alias gives
results bit-identical to its name."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from bagua.torch_api.codecs.block_allreduce import BlockWorkspace
from bagua.torch_api.codecs.compressed_allreduce import Workspace
from bagua.torch_api.codecs.registry import CodecRegistry, GlobalCodecRegistry, resolve_codec
from bagua.torch_api.codecs.workspace import make_workspace
from tests.harness import run_workers
from tests.torch_api.models import Net, batch, params_of
from tests.torch_api.test_bytegrad import _all_gather, _RefByteGrad
from tests.torch_api.test_bytegrad_codecs import RefBlockByteGrad

ALIASES = {"MinMaxUInt8": "chunk", "minmax_uint8": "chunk"}
GRADIENT_CODECS = ["chunk", "uint8", "uint4"]


def test_the_registry_names_every_codec_once():
    assert GlobalCodecRegistry.available() == ["chunk", "bf16", "uint8", "uint4", "nf2", "sign1", "topk"]
    assert GlobalCodecRegistry.available(for_gradients=True) == GRADIENT_CODECS
    for alias, name in ALIASES.items():
        assert resolve_codec(alias) is resolve_codec(name)
    block_codecs = [resolve_codec(n).block_codec for n in GlobalCodecRegistry]
    assert block_codecs == [None, "bf16", "uint8", "uint4", "nf2", "sign1", "topk"]


def test_register_works_as_a_decorator_and_refuses_duplicates():
    registry = CodecRegistry()

    @registry.register("mine", description="a test codec", aliases=("MINE",))
    def factory(*args):
        return args

    assert factory(1) == (1,) and registry.get("MINE").workspace is factory and registry.canonical("MINE") == "mine"
    for name, aliases in (("mine", ()), ("other", ("MINE",)), ("MINE", ())):
        with pytest.raises(ValueError, match="already registered .for 'mine'.; pick another name"):
            registry.register(name, factory, description="again", aliases=aliases)


@pytest.mark.parametrize("name", [*GlobalCodecRegistry.available(), *ALIASES])
def test_every_name_builds_its_workspace(name):
    ws = make_workspace(name, 1000, 2, torch.device("cpu"), block_size=64, error_feedback=True)
    spec = resolve_codec(name)
    if spec.chunked:
        assert isinstance(ws, Workspace) and ws.residual is not None
    else:
        assert isinstance(ws, BlockWorkspace) and (ws.codec, ws.block_size) == (spec.block_codec, 64)


def _bucket_api_error(name):
    from bagua.torch_api.bucket import BaguaBucket
    from bagua.torch_api.tensor import weight_tensor

    bucket = BaguaBucket([weight_tensor(torch.nn.Parameter(torch.ones(4)), "w")], name="0")
    bucket.append_centralized_synchronous_op(compression=name, group=object())


def _entry_points():
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
    from bagua.torch_api.contrib.ddp_hooks import ByteGradState
    from bagua.torch_api.ops.compressed import centralized_low_precision_op

    opt = QAdamOptimizer(torch.nn.Linear(2, 2).parameters())
    return {
        "make_workspace": (lambda n: make_workspace(n, 10, 2, torch.device("cpu")), "unknown codec 'int8'"),
        "ByteGradAlgorithm": (lambda n: ByteGradAlgorithm(codec=n), "ByteGradAlgorithm.codec='int8'. is not a codec"),
        "QAdamAlgorithm": (lambda n: QAdamAlgorithm(opt, codec=n), "QAdamAlgorithm.codec='int8'. is not a codec"),
        "ByteGradState": (lambda n: ByteGradState(codec=n), "ByteGradState.codec='int8'. is not a codec"),
        "op": (lambda n: centralized_low_precision_op(None, codec=n), "op.codec='int8'. is not a codec"),
        "bucket": (_bucket_api_error, "unknown compression 'int8'; available: None .float32., 'chunk'"),
        "LowPrecisionDecentralizedAlgorithm": (lambda n: LowPrecisionDecentralizedAlgorithm(codec=n),
                                               "LowPrecisionDecentralizedAlgorithm.codec='int8'. is not a codec"),
    }


@pytest.mark.parametrize("entry", ["make_workspace", "ByteGradAlgorithm", "QAdamAlgorithm", "ByteGradState", "op",
                                   "bucket", "LowPrecisionDecentralizedAlgorithm"])
def test_an_unknown_name_lists_the_available_ones(entry):
    make, message = _entry_points()[entry]
    with pytest.raises(ValueError, match=message) as error:
        make("int8")
    text = str(error.value)
    assert "'chunk' (MinMaxUInt8" in text and "'uint8'" in text and "'uint4'" in text and "'MinMaxUInt8' for" in text
    assert text.endswith("Did you mean 'uint8'?")


def test_aliases_become_the_codec_name_on_every_algorithm():
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
    from bagua.torch_api.contrib.ddp_hooks import ByteGradState

    opt = QAdamOptimizer(torch.nn.Linear(2, 2).parameters())
    for alias in ALIASES:
        assert ByteGradAlgorithm(codec=alias) == ByteGradAlgorithm(codec="chunk")
        assert QAdamAlgorithm(opt, codec=alias).codec == "chunk"
        assert ByteGradState(codec=alias).codec == "chunk"


# -- the bucket API with every gradient codec, against the plain references ------------------------------------


def _worker_bucket_api(rank, world_size):
    from bagua.torch_api import communication as comm
    from bagua.torch_api.bucket import BaguaBucket
    from bagua.torch_api.tensor import weight_tensor

    group = comm._get_default_group()
    torch.manual_seed(rank)
    values = [torch.randn(3000) * (10 ** k) for k in range(3)]  # three scales: block and chunk codes differ
    results = {}
    for name in [*GRADIENT_CODECS, *ALIASES]:
        tensors = [weight_tensor(torch.nn.Parameter(v.clone()), f"{name}.{i}") for i, v in enumerate(values)]
        bucket = BaguaBucket(tensors, name=name, alignment=world_size)
        bucket.append_centralized_synchronous_op(compression=name, group=group)
        bucket.execute()
        results[name] = bucket.flat.clone()
    flats = _all_gather(torch.cat(values))
    spec = resolve_codec
    refs = {n: (_RefByteGrad(False) if spec(n).chunked else RefBlockByteGrad(spec(n).block_codec, 4096, False))(
        0, flats) for n in GRADIENT_CODECS}
    return results, refs


def test_the_bucket_api_runs_every_gradient_codec_and_its_aliases():
    for results, refs in run_workers(_worker_bucket_api, 2):
        for name in GRADIENT_CODECS:
            assert_close(results[name], refs[name], rtol=0, atol=0, msg=name)
        for alias, name in ALIASES.items():
            assert torch.equal(results[alias], results[name]), alias


# -- ByteGrad and QAdam: an alias trains bit for bit like its name ------------------------------------------------


def _train(model, opt, rank, steps):
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return params_of(model)


def _worker_alias_training(rank, world_size, algorithm_name, codec):
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    torch.manual_seed(0)
    model = Net()
    if algorithm_name == "qadam":
        opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
        algorithm = QAdamAlgorithm(opt, hierarchical=False, codec=codec)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        algorithm = ByteGradAlgorithm(hierarchical=False, error_feedback=True, codec=codec)
    return _train(model.with_bagua([opt], algorithm), opt, rank, 5)


@pytest.mark.parametrize("algorithm_name", ["bytegrad", "qadam"])
def test_an_alias_trains_bit_for_bit_like_its_name(algorithm_name):
    by_name = run_workers(_worker_alias_training, 2, algorithm_name, "chunk")
    by_alias = run_workers(_worker_alias_training, 2, algorithm_name, "MinMaxUInt8")
    for a, b in zip(by_name, by_alias):
        assert all(torch.equal(p, q) for p, q in zip(a, b))


# -- the all-gather pattern, against the plain maths (single process: the all-gather is a list) -------------------


@pytest.mark.parametrize("codec", ["bf16", "uint8", "uint4", "nf2", "topk"])
def test_the_allgather_pattern_averages_the_decoded_wires_in_member_order(codec):
    from bagua.torch_api.codecs.workspace import allgather_average
    from tests.torch_api.test_block_allreduce import _dq

    from bagua.torch_api.codecs.block import encode

    block = 64
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1000, generator=g) * (m + 1) for m in range(3)]

    def all_gather(wire):  # member 0 calls; members 1 and 2 send their tensors encoded
        return [wire, *(encode(x, codec, block) for x in xs[1:])]

    average, own = allgather_average(xs[0], codec, all_gather, block)
    expected = _dq(xs[0], codec, block)
    for x in xs[1:]:
        expected = expected + _dq(x, codec, block)
    assert_close(average, expected / 3, rtol=0, atol=0)  # the same float32 sums in the same order
    weighted, _ = allgather_average(xs[0], codec, all_gather, block, weights=[2, 0, 1])
    # add_(alpha=) may fuse the multiply-add: a float32 rounding apart
    assert_close(weighted, _dq(xs[0], codec, block) * (2 / 3) + _dq(xs[2], codec, block) * (1 / 3))
    assert allgather_average(xs[0], codec, lambda wire: None, block) is None
    assert own.dtype == torch.uint8


def test_the_allgather_pattern_names_the_block_codecs_for_the_chunk_code():
    from bagua.torch_api.codecs.workspace import allgather_average

    with pytest.raises(ValueError, match="takes a block codec, not 'MinMaxUInt8'; available: 'bf16', 'uint8'"):
        allgather_average(torch.ones(4), "MinMaxUInt8", lambda wire: [wire])


# -- low-precision decentralized with every codec, against the ring simulation of its own test --------------------


def _worker_low_precision_decentralized(rank, world_size, codecs):
    import tests.torch_api.test_low_precision_decentralized as ring
    from bagua.torch_api.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
    from tests.torch_api.models import make_model
    from tests.torch_api.test_block_allreduce import _dq

    minmax_round_trip = ring._minmax_uint8_round_trip
    out = {}
    for codec in codecs:
        spec = resolve_codec(codec)
        # the simulation's round trip of d: MinMaxUInt8 over the bucket, or the block codec by its plain formulas
        ring._minmax_uint8_round_trip = (
            minmax_round_trip if spec.chunked else (lambda d, c=spec.block_codec: _dq(d, c, 64)))
        model = make_model(rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model.with_bagua([opt], LowPrecisionDecentralizedAlgorithm(hierarchical=False, codec=codec, block_size=64))
        layout = [[t.name for t in bucket.tensors] for bucket in model.bagua_buckets]
        for step in range(ring.STEPS):
            x, y = batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        expected = ring._train_reference(rank, world_size, 1, layout, 1, False)
        out[codec] = (params_of(model), expected)
    return out


def test_low_precision_decentralized_runs_every_codec_and_its_aliases():
    codecs = [*GlobalCodecRegistry.available(), *ALIASES]
    for by_codec in run_workers(_worker_low_precision_decentralized, 2, codecs):
        for codec in GlobalCodecRegistry.available():
            got, expected = by_codec[codec]
            assert_close(got, expected, rtol=0, atol=0, msg=lambda m, c=codec: f"{c}: {m}")
        for alias, name in ALIASES.items():
            assert all(torch.equal(a, b) for a, b in zip(by_codec[alias][0], by_codec[name][0])), alias
        assert not all(torch.equal(a, b) for a, b in zip(by_codec["uint4"][0], by_codec["chunk"][0]))


# -- DiLoCo takes the same keyword: codec= (compression=, its older name, still works) -----------------------------


def test_diloco_takes_codec_and_its_older_keyword():
    from bagua.torch_api.algorithms.diloco import COMPRESSIONS, DiLoCoAlgorithm
    from bagua.torch_api.contrib import DiLoCoOptimizer

    for name in COMPRESSIONS:
        by_codec, by_compression = DiLoCoAlgorithm(codec=name), DiLoCoAlgorithm(compression=name)
        assert by_codec == by_compression and by_codec.codec == by_codec.compression == name
    assert DiLoCoAlgorithm().codec == "none"
    with pytest.raises(ValueError, match=r"DiLoCoAlgorithm\(codec='MinMaxUInt8'\): choose one of 'none', 'bf16'"):
        DiLoCoAlgorithm(codec="MinMaxUInt8")  # the per-rank chunk code does not carry pseudo-gradients
    with pytest.raises(ValueError, match=r"DiLoCoAlgorithm\(compression='int4'\): choose one of .*'uint4'"):
        DiLoCoAlgorithm(compression="int4")
    with pytest.raises(ValueError, match="name two codecs: pass codec= alone"):
        DiLoCoAlgorithm(codec="uint4", compression="uint8")
    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"DiLoCoOptimizer\(codec='int8'\): choose one of"):
        DiLoCoOptimizer(inner, 2, codec="int8")


def _worker_diloco_codec(rank, world_size, keywords):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = DiLoCoAlgorithm(sync_every=2, hierarchical=False, block_size=8, **keywords)
    return _train(model.with_bagua([opt], algorithm), opt, rank, 6)


def test_diloco_trains_with_codec_bit_for_bit_like_compression():
    by_codec = run_workers(_worker_diloco_codec, 2, {"codec": "uint4"})
    by_compression = run_workers(_worker_diloco_codec, 2, {"compression": "uint4"})
    float32 = run_workers(_worker_diloco_codec, 2, {})
    for a, b, c in zip(by_codec, by_compression, float32):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
        assert not all(torch.equal(p, q) for p, q in zip(a, c))  # the codec is used, not dropped
