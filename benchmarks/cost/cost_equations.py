"""The cost model's equations: a model's shapes, the traffic of each collective, and one predicted step.

Part of :mod:`benchmarks.cost.cost_model` (whose docstring and docs/cost_model.md state the model); the
parameters it takes are fitted in :mod:`benchmarks.cost.cost_calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from bagua.torch_api.comm.cost import ring_allreduce_bytes, ring_allreduce_steps

__all__ = [
    "GBIT", "Shapes", "SHAPES", "Traffic", "ring_allreduce", "scatter_gather_allreduce", "peer_exchange",
    "intra_node", "bucket_count", "powersgd_elements", "ENCODE", "DECODE", "FP16_CASTS", "POWERSGD_PASSES",
    "HALF_HOOKS", "codec_passes", "Fit", "Net", "Step", "transfer_s", "predict",
]

GBIT = 1e9 / 8  # bytes per second in one Gbit/s

# ---------------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Shapes:
    """A model's parameters as PowerSGD sees them: matrices (rows, cols), conv weights flattened to
    (out, in*k*k), and the elements of every 1-D tensor (biases, norms); ``order`` lists the tensors' sizes in
    backward order (last layer first), which is how buckets fill."""

    matrices: tuple[tuple[int, int], ...]
    vector_elements: int
    order: tuple[int, ...]

    @property
    def elements(self) -> int:
        return sum(m * n for m, n in self.matrices) + self.vector_elements


def _layers(weights: Sequence[tuple[int, int]], biases: Sequence[int]) -> Shapes:
    order: list[int] = []
    for (m, n), b in zip(weights, biases):
        order += [m * n, b]
    return Shapes(tuple(weights), sum(biases), tuple(reversed([s for s in order if s])))


def _vgg16() -> Shapes:
    chans = [(3, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256), (256, 256), (256, 512),
             (512, 512), (512, 512), (512, 512), (512, 512), (512, 512)]
    weights = [(o, i * 9) for i, o in chans] + [(4096, 512 * 7 * 7), (4096, 4096), (1000, 4096)]
    return _layers(weights, [m for m, _ in weights])


def _bert_large() -> Shapes:
    h, ffn, layers = 1024, 4096, 24
    weights = [(30522, h), (512, h), (2, h)]  # word, position and token-type embeddings (no bias)
    biases = [0, 0, 2 * h]  # the embeddings' LayerNorm, counted with the last embedding
    for _ in range(layers):
        weights += [(h, h)] * 4 + [(ffn, h), (h, ffn)]
        biases += [h, h, h, h + 2 * h, ffn, h + 2 * h]  # Q, K, V, O (+LayerNorm), FFN in, FFN out (+LayerNorm)
    weights += [(h, h), (2, h)]  # pooler, SQuAD span head
    biases += [h, 2]
    return _layers(weights, biases)


#: The calibration models (benchmarks.common.models) and the paper's two (torchvision's VGG16 on ImageNet;
#: BERT-large uncased with a SQuAD head).
SHAPES: dict[str, Shapes] = {
    "mlp": _layers([(4096, 1024), (4096, 4096), (1024, 4096)], [4096, 4096, 1024]),
    "digits": _layers([(32, 9), (64, 32 * 9), (256, 64 * 16), (10, 256)], [32, 64, 256, 10]),
    "vgg16": _vgg16(),
    "bert_large": _bert_large(),
}

# ---------------------------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class Traffic:
    """What one host's interface sends for a collective, and how many sequential message rounds it takes."""

    bytes: float
    messages: int

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.bytes + other.bytes, self.messages + other.messages)


def ring_allreduce(nbytes: float, n: int) -> Traffic:
    """Ring allreduce of ``nbytes`` over ``n`` ranks: reduce-scatter then allgather, ``2(n-1)`` steps of
    ``nbytes / n`` each, so every rank sends ``2 (n-1) / n * nbytes``."""
    return Traffic(ring_allreduce_bytes(nbytes, n), ring_allreduce_steps(n))


def scatter_gather_allreduce(nbytes: float, n: int) -> Traffic:
    """ByteGrad's allreduce of an encoded buffer of ``nbytes``: point-to-point scatter of ``n - 1`` chunks, then
    an allgather of the reduced chunk: the same ``2 (n-1) / n * nbytes`` per rank as a ring."""
    return Traffic(ring_allreduce_bytes(nbytes, n), ring_allreduce_steps(n))


def peer_exchange(nbytes: float, peers: int) -> Traffic:
    """Send ``nbytes`` to each of ``peers`` peers at once (full duplex, so receiving is free)."""
    return Traffic(peers * nbytes, 1 if peers else 0)


def intra_node(nbytes: float, gpus: int) -> Traffic:
    """Hierarchical prologue and epilogue inside a node: a reduce to the leader and a broadcast back, each about
    ``nbytes`` through the leader's links (pipelined), ``2 (g-1)`` steps."""
    return Traffic(2 * nbytes, 2 * (gpus - 1)) if gpus > 1 else Traffic(0.0, 0)


def bucket_count(order: Sequence[int], cap_bytes: float, bytes_per_element: float = 4) -> int:
    """Buckets formed by filling tensors in backward order until a bucket reaches ``cap_bytes`` (a tensor is
    never split, as in DDP and Bagua)."""
    count, filled = 0, 0.0
    for size in order:
        filled += size * bytes_per_element
        if filled >= cap_bytes:
            count, filled = count + 1, 0.0
    return count + (1 if filled else 0)


def powersgd_elements(shapes: Shapes, rank: int) -> float:
    """Elements PowerSGD allreduces per step: ``rank (m + n)`` per matrix where that is smaller than ``m n``
    (torch's hook leaves the others and the 1-D tensors uncompressed)."""
    return sum(min(rank * (m + n), m * n) for m, n in shapes.matrices) + shapes.vector_elements


#: Memory passes over the fp32 gradient (read + write bytes / 4 per element) of each codec step: MinMaxUInt8
#: encode = min/max pass + read 4 B, write 1 B; decode = read 1 B, write 4 B; fp16 = a cast each way; PowerSGD
#: with error feedback = add the error, M Q, M^T P, P Q^T, the new error, the copy back (about 11).
ENCODE, DECODE, FP16_CASTS, POWERSGD_PASSES = 2.25, 1.25, 3.0, 11.0
#: torch's half-precision compression hooks: half of DDP's bytes, one cast each way
HALF_HOOKS = ("ddp_fp16", "ddp_bf16")


def codec_passes(system: str, n: int) -> float:
    """Memory passes over the gradient a system's codec makes per step with ``n`` ranks in the communicator
    (the same count the suite's *compress* column times)."""
    if system in ("bytegrad", "qadam", "qadam_1bit"):
        return (1 + 1 / n) * ENCODE + 2 * DECODE
    if system == "low_precision_decentralized":
        return ENCODE + 2 * DECODE
    if system in HALF_HOOKS:
        return FP16_CASTS
    if system == "ddp_powersgd":
        return POWERSGD_PASSES
    return 0.0

# ---------------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Fit:
    """The fitted parameters: ``efficiency`` of TCP on a shaped link, the software stack's bandwidth per CPU
    core (bytes/s), ``latency`` per message round (s) and the ``overlap`` fraction of compute that a gradient
    collective can hide behind."""

    efficiency: float = 0.9
    stack_Bps: float = 1.5e9
    latency_s: float = 1e-4
    overlap: float = 0.5


@dataclass(frozen=True)
class Net:
    """Where a step runs: ``hosts`` of ``gpus`` ranks each; a link of ``link_Bps`` per host (None: unshaped)
    whose token bucket holds ``burst_bytes``; the host stack's ceiling ``stack_Bps`` and whether that work runs
    on the core that computes (``shared_core``, the calibration machine); intra-node bandwidth and latency for
    hierarchical systems; the codec's memory rate; and whether PowerSGD runs as one bucket (torch's hook on gloo
    in the suite: it starts only after backward)."""

    hosts: int
    link_Bps: Optional[float]
    stack_Bps: float
    efficiency: float
    latency_s: float
    gpus: int = 1
    burst_bytes: float = 0.0
    shared_core: bool = False
    intra_Bps: float = 150e9
    intra_latency_s: float = 5e-6
    memory_Bps: float = 8e9
    powersgd_one_bucket: bool = True
    ddp_bucket_bytes: float = 25 * 2**20
    bagua_bucket_bytes: float = 10 * 2**20
    async_interval_s: float = 0.5


@dataclass
class Step:
    """A predicted step: its time, the communication time (hidden or not), the codec and the bytes one host's
    interface sends."""

    step_s: float
    comm_s: float
    codec_s: float
    bytes_per_host: float
    notes: list[str] = field(default_factory=list)


def transfer_s(net: Net, nbytes: float, idle_s: float) -> float:
    """Seconds to push ``nbytes`` out of a host: the stack and the link are two stages of one pipeline, so the
    slower sets the pace; a shaped link first lets through what its token bucket refilled while it idled
    (``idle_s``, at most ``burst_bytes``) at the stack's pace."""
    stack = nbytes / net.stack_Bps
    if net.link_Bps is None:
        return stack
    tokens = min(net.burst_bytes, net.link_Bps * idle_s)
    return max(stack, max(0.0, nbytes - tokens) / (net.efficiency * net.link_Bps))


def _comm(net: Net, traffic: Traffic, buckets: int, idle_s: float) -> tuple[float, float]:
    """(time on the wire, CPU time of the stack) of ``traffic`` sent as ``buckets`` collectives."""
    return (buckets * traffic.messages * net.latency_s + transfer_s(net, traffic.bytes, idle_s),
            traffic.bytes / net.stack_Bps)


def _intra(net: Net, nbytes: float, buckets: int) -> float:
    t = intra_node(nbytes, net.gpus)
    return buckets * t.messages * net.intra_latency_s + t.bytes / net.intra_Bps


def _exposed(net: Net, comm_s: float, cpu_s: float, hide_s: float) -> float:
    """Communication left on the critical path when ``hide_s`` of compute runs beside it. Where the stack runs
    on the computing core (``shared_core``) its CPU time cannot hide; only the waiting on the wire can."""
    if net.shared_core:
        return cpu_s + max(0.0, comm_s - cpu_s - hide_s)
    return max(0.0, comm_s - hide_s)


def predict(system: str, shapes: Shapes, net: Net, compute_s: float, overlap: float,
            codec_s: Optional[float] = None) -> Step:
    """Predict one step of ``system`` (see the module docstring). ``codec_s`` is the measured codec time; when
    None it is :func:`codec_passes` over the fp32 gradient at ``net.memory_Bps``.

    Flat systems (DDP and its hooks, gradient allreduce) ring over all ``hosts * gpus`` ranks, whose ring
    crosses each host's interface with ``2 (p-1) / p`` of the bytes; hierarchical ones (Bagua's defaults for
    ByteGrad, QAdam and both decentralized algorithms) reduce inside the node first and run among the
    ``hosts`` leaders.
    """
    base, options = (system.split(":", 1) + [""])[:2]
    grad = 4.0 * shapes.elements
    p, n = net.hosts * net.gpus, net.hosts
    hier = net.gpus > 1
    ranks = n if hier else p
    if codec_s is None:
        codec_s = codec_passes(base, ranks) * grad / net.memory_Bps
    ddp_buckets = bucket_count(shapes.order, net.ddp_bucket_bytes)
    bagua_buckets = bucket_count(shapes.order, net.bagua_bucket_bytes)
    intra = _intra(net, grad, bagua_buckets) if hier else 0.0
    hidden = overlap * compute_s
    if base in ("ddp", "gradient_allreduce", *HALF_HOOKS):
        traffic = ring_allreduce(grad / 2 if base in HALF_HOOKS else grad, p)
        comm, cpu = _comm(net, traffic, bagua_buckets if base == "gradient_allreduce" else ddp_buckets, compute_s)
        return Step(compute_s + codec_s + _exposed(net, comm, cpu, hidden), comm, codec_s, traffic.bytes)
    if base == "ddp_powersgd":
        traffic = ring_allreduce(4.0 * powersgd_elements(shapes, 1), p)
        buckets = 1 if net.powersgd_one_bucket else ddp_buckets
        comm, cpu = _comm(net, traffic, 2 * buckets, compute_s)  # two allreduces (P, then Q) per bucket
        hide = 0.0 if net.powersgd_one_bucket else hidden
        return Step(compute_s + codec_s + _exposed(net, comm, cpu, hide), comm, codec_s, traffic.bytes)
    if base in ("bytegrad", "qadam", "qadam_1bit"):
        bits = 1 if base == "qadam_1bit" else 8
        traffic = scatter_gather_allreduce(grad * bits / 32, ranks)
        comm, cpu = _comm(net, traffic, bagua_buckets, compute_s)
        comm += intra
        return Step(compute_s + codec_s + _exposed(net, comm, cpu, hidden), comm, codec_s, traffic.bytes)
    if base == "decentralized":
        if "shift_one" in options:
            traffic = peer_exchange(grad, 1 if ranks > 1 else 0)
        else:  # peer_selection_mode="all": an exact average of the weights
            traffic = ring_allreduce(grad, ranks)
        comm, cpu = _comm(net, traffic, 1, compute_s)  # one bucket, sent at forward: hides behind all compute
        comm += intra
        return Step(compute_s + _exposed(net, comm, cpu, compute_s), comm, 0.0, traffic.bytes)
    if base == "low_precision_decentralized":
        traffic = peer_exchange(grad / 4, min(2, ranks - 1))  # left and right neighbours (one when n = 2)
        comm, cpu = _comm(net, traffic, bagua_buckets, compute_s)
        comm += intra
        return Step(compute_s + codec_s + comm, comm, codec_s, traffic.bytes)  # after the optimizer: nothing hides
    if base == "async":
        # Background rounds every interval: an allreduce of the weights, off the critical path. Where the stack
        # shares the computing core its CPU time per step is taken from the compute.
        traffic = ring_allreduce(grad, p)
        comm, cpu = _comm(net, traffic, 1, net.async_interval_s)
        period = net.async_interval_s + comm
        steal = cpu * compute_s / period if net.shared_core else 0.0
        step = compute_s + steal
        return Step(step, comm, 0.0, traffic.bytes * step / period,
                    [f"a round every {period:.2f} s: the average is {period / step:.1f} steps old"])
    raise ValueError(f"no cost model for system {system!r}; available: ddp, ddp_fp16, ddp_bf16, ddp_powersgd, "
                     "gradient_allreduce, bytegrad, qadam, qadam_1bit, decentralized, "
                     "decentralized:peer_selection_mode=shift_one, low_precision_decentralized, async")
