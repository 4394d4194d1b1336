"""A step-time cost model of every benchmarked system, calibrated on the emulated-network runs and used to
predict the Bagua paper's setting (16 hosts of 8 GPUs at 10, 25 and 100 Gbit/s).

The model, per training step of one host (docs/cost_model.md has the equations with their reasons):

- a collective costs ``messages * latency + bytes_sent_per_host / bandwidth``, with ``bandwidth`` the link and
  the host's software stack in series: ``1 / (1 / (efficiency * link) + 1 / stack)``;
- the collectives each system issues (:func:`ring_allreduce`, :func:`scatter_gather_allreduce`,
  :func:`peer_exchange`, :func:`intra_node`) and the codec passes over the gradient it makes are in
  :func:`predict`;
- ``step = compute + codec + exposed communication``, where a gradient collective hides behind a fraction
  ``overlap`` of the compute (backward), decentralized SGD behind all of it (it starts at forward), and
  low-precision decentralized behind none (it runs after the optimizer step); async averages off the critical
  path.

Four parameters are fitted (:class:`Fit`): link efficiency, stack bandwidth per core, latency per message and
overlap. Compute and codec times come from the measured rows.

Example:
    >>> rows = load_rows(["docs/results/network-mlp-2hosts.json"])  # doctest: +SKIP
    >>> fit = calibrate(rows)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional, Sequence

__all__ = [
    "Shapes", "SHAPES", "Net", "Fit", "Step", "ring_allreduce", "scatter_gather_allreduce", "peer_exchange",
    "intra_node", "bucket_count", "powersgd_elements", "codec_passes", "predict", "load_rows", "row_case",
    "calibrate", "nelder_mead", "paper_prediction", "PAPER", "main",
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


#: The calibration models (bagua.benchmarks.models) and the paper's two (torchvision's VGG16 on ImageNet;
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
    return Traffic(2 * (n - 1) / n * nbytes, 2 * (n - 1)) if n > 1 else Traffic(0.0, 0)


def scatter_gather_allreduce(nbytes: float, n: int) -> Traffic:
    """ByteGrad's allreduce of an encoded buffer of ``nbytes``: point-to-point scatter of ``n - 1`` chunks, then
    an allgather of the reduced chunk: the same ``2 (n-1) / n * nbytes`` per rank as a ring."""
    return Traffic(2 * (n - 1) / n * nbytes, 2 * (n - 1)) if n > 1 else Traffic(0.0, 0)


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


def codec_passes(system: str, n: int) -> float:
    """Memory passes over the gradient a system's codec makes per step with ``n`` ranks in the communicator
    (the same count the suite's *compress* column times)."""
    if system in ("bytegrad", "qadam", "qadam_1bit"):
        return (1 + 1 / n) * ENCODE + 2 * DECODE
    if system == "low_precision_decentralized":
        return ENCODE + 2 * DECODE
    if system == "ddp_fp16":
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
    if base in ("ddp", "gradient_allreduce", "ddp_fp16"):
        traffic = ring_allreduce(grad / 2 if base == "ddp_fp16" else grad, p)
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
    raise ValueError(f"no cost model for system {system!r}; available: ddp, ddp_fp16, ddp_powersgd, "
                     "gradient_allreduce, bytegrad, qadam, qadam_1bit, decentralized, "
                     "decentralized:peer_selection_mode=shift_one, low_precision_decentralized, async")

# ---------------------------------------------------------------------------------------------- calibration

#: The runs the model is calibrated on (docs/results): every system at 2 and 4 hosts. network.json merges the
#: first three, so it would only repeat their rows.
CALIBRATION_FILES = ("network-mlp-2hosts.json", "network-mlp-4hosts.json", "network-digits-2hosts.json",
                     "goals-bytegrad-2hosts.json", "goals-decentralized-4hosts.json")


@dataclass(frozen=True)
class Case:
    """One measured row, reduced to what the model needs."""

    source: str
    model: str
    hosts: int
    bandwidth: str
    system: str
    link_Bps: Optional[float]
    cores: int
    compute_s: float
    codec_s: Optional[float]
    memory_Bps: float
    step_s: float
    bytes_per_step: Optional[float]


def load_rows(paths: Sequence[str]) -> list[dict]:
    """The successful rows of the suite's JSON files, each with its ``source`` file and the machine's cores."""
    rows, seen = [], set()
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        cores = int(data.get("meta", {}).get("machine", {}).get("cpus") or 1)
        for row in data.get("results", []):
            key = (row.get("run"), row["model"], row["hosts"], row["bandwidth"], row["system"], row.get("repeat"))
            if row.get("status") != "ok" or row["model"] not in SHAPES or key in seen:
                continue
            seen.add(key)
            rows.append(dict(row, source=path.rsplit("/", 1)[-1], cores=cores))
    return rows


def row_case(row: dict, rows: Sequence[dict]) -> Case:
    """Reduce ``row`` to a :class:`Case`. The codec's memory rate (for PowerSGD, whose codec the suite does not
    time) comes from the measured MinMaxUInt8 codec of a ByteGrad row of the same run and configuration."""
    shapes = SHAPES[row["model"]]
    memory = 8e9
    for other in rows:
        same = all(other[k] == row[k] for k in ("source", "model", "hosts", "bandwidth"))
        if same and other["system"] == "bytegrad" and other.get("compress_s"):
            memory = codec_passes("bytegrad", row["hosts"]) * 4.0 * shapes.elements / other["compress_s"]
            break
    rate = row.get("rate_bps")
    return Case(row["source"], row["model"], row["hosts"], row["bandwidth"], row["system"],
                rate / 8 if rate else None, row["cores"], row["compute_s"], row.get("compress_s"), memory,
                row["step_s"], row.get("bytes_per_step"))


def case_net(case: Case, fit: Fit) -> Net:
    """The calibration host: one rank per emulated host; the hosts share the machine's cores."""
    share = min(1.0, case.cores / case.hosts)
    burst = 0.0 if case.link_Bps is None else max(case.link_Bps * 0.008, 256 * 1024)  # netns.tbf_burst_bytes
    return Net(hosts=case.hosts, link_Bps=case.link_Bps, stack_Bps=fit.stack_Bps * share,
               efficiency=fit.efficiency, latency_s=fit.latency_s, burst_bytes=burst, shared_core=True,
               memory_Bps=case.memory_Bps)


def predict_case(case: Case, fit: Fit) -> Step:
    """The model's step for a measured case under ``fit``."""
    return predict(case.system, SHAPES[case.model], case_net(case, fit), case.compute_s, fit.overlap,
                   codec_s=case.codec_s)


def nelder_mead(f: Callable[[list[float]], float], x0: Sequence[float], step: float = 0.5,
                iterations: int = 2000, tolerance: float = 1e-12) -> list[float]:
    """Minimize ``f`` from ``x0`` with the Nelder-Mead simplex (reflect 1, expand 2, contract 1/2, shrink 1/2)."""
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centre = [sum(x[j] for x in simplex[:-1]) / (len(simplex) - 1) for j in range(len(x0))]
        worst = simplex[-1]

        def towards(t: float) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centre, worst)]

        reflected = towards(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, xs)] for xs in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _unpack(x: Sequence[float]) -> Fit:
    return Fit(efficiency=_sigmoid(x[0]), stack_Bps=math.exp(x[1]), latency_s=math.exp(x[2]),
               overlap=_sigmoid(x[3]))


def calibrate(cases: Sequence[Case], start: Fit = Fit()) -> Fit:
    """Fit the four parameters to the cases: least squares of ``log(predicted step / measured step)``.

    Efficiency and overlap are fitted through a logistic (they stay in (0, 1)), bandwidth and latency through
    their logarithms (they stay positive)."""

    def loss(x: list[float]) -> float:
        fit = _unpack(x)
        return sum(math.log(predict_case(c, fit).step_s / c.step_s) ** 2 for c in cases)

    x = [_logit(start.efficiency), math.log(start.stack_Bps), math.log(start.latency_s), _logit(start.overlap)]
    for _ in range(3):  # restarts: a simplex can stall on the kinks of max(0, .)
        x = nelder_mead(loss, x)
    return _unpack(x)

# ------------------------------------------------------------------------------------------ the paper's scale


@dataclass(frozen=True)
class PaperWorkload:
    """A task of the paper's benchmark: its model, per-GPU batch, per-GPU compute time of a step (forward,
    backward, optimizer) on a V100 with no communication, where that number comes from, and the speedup over
    PyTorch-DDP the paper's sources publish (None where only a figure exists)."""

    shapes: str
    batch: int
    compute_s: float
    compute_source: str
    bagua_system: str
    published: str


#: The paper's setting (shared/reference/bagua-original.md §7): 16 hosts of 8 V100 with NVLink, TCP between hosts.
PAPER: dict[str, PaperWorkload] = {
    "vgg16": PaperWorkload(
        "vgg16", 32, 0.160,
        "assumed: 15.5 GFLOP forward per 224x224 image, x3 for training, 32 images = 1.49 TFLOP at 9.3 TFLOP/s "
        "(60 % of a V100's 15.7 fp32 peak); a V100 fp32 VGG16 forward of 32 images takes 84 ms in PaddlePaddle's "
        "float16_benchmark.md (older cuDNN), i.e. about 250 ms for training: the range is 160-250 ms",
        "bytegrad",
        "ByteGrad 8-bit, 128 GPUs, 100 Gbit/s: inside '1.3-2x over DDP, Horovod, BytePS' (tutorial, all three "
        "tasks), 'up to 1.95x' (abstract); per-bandwidth values only in a figure (e2e_vgg16_128.png)"),
    "bert_large": PaperWorkload(
        "bert_large", 6, 0.686,
        "NVIDIA DeepLearningExamples TensorFlow/LanguageModeling/BERT/README.md: SQuAD v1.1 fine-tuning, "
        "sequence 384, 1x V100 32G, fp32, batch 4: 8.74 sequences/s, i.e. 114 ms per sequence, x6",
        "qadam",
        "QAdam ('1-bit' in the tutorial; 8-bit MinMaxUInt8 in the code), 128 GPUs, 100 Gbit/s: inside '1.3-2x' "
        "(tutorial), 'up to 1.95x' (abstract); the bandwidth sweep (100 to 1 Gbit/s) only in figures"),
}

#: The paper's hosts (V100 SXM2 with NVLink, TCP between hosts) and what we assume of them.
PAPER_HOSTS, PAPER_GPUS, PAPER_GBITS = 16, 8, (10, 25, 100)
PAPER_LATENCY_S = 20e-6  # assumed: one TCP message round between hosts in a data centre
PAPER_NVLINK_BPS = 150e9  # the brief's NVLink figure (6 links of 25 GB/s each way on a V100 SXM2)
PAPER_HBM_BPS = 800e9  # assumed achievable of the V100's 900 GB/s HBM2, for the memory-bound codecs
#: Bagua-Net's tutorial (reference §6): VGG16 on 4 hosts x 8 V100, 100 Gbit/s TCP, batch 32 per GPU, NCCL's own
#: TCP transport: 85.8 images/s per GPU (with Bagua-Net's transport: 126.5). The only measured step at scale
#: the reference has; it calibrates the hosts' stack bandwidth.
BAGUA_NET_BASELINE = dict(hosts=4, gbits=100, images_per_gpu_s=85.8, with_bagua_net=126.5)
PAPER_SYSTEMS = ("ddp", "ddp_fp16", "ddp_powersgd", "gradient_allreduce", "bytegrad", "qadam", "qadam_1bit",
                 "decentralized", "decentralized:peer_selection_mode=shift_one", "low_precision_decentralized",
                 "async")


def paper_net(stack_Bps: float, fit: Fit, gbits: float, hosts: int = PAPER_HOSTS) -> Net:
    """A host of the paper's cluster: 8 GPUs behind one TCP interface of ``gbits``."""
    return Net(hosts=hosts, gpus=PAPER_GPUS, link_Bps=gbits * GBIT, stack_Bps=stack_Bps,
               efficiency=fit.efficiency, latency_s=PAPER_LATENCY_S, intra_Bps=PAPER_NVLINK_BPS,
               memory_Bps=PAPER_HBM_BPS, powersgd_one_bucket=False)


def paper_stack(fit: Fit, vgg_compute_s: float, images_per_gpu_s: float) -> float:
    """The stack bandwidth at which the model's DDP step for VGG16 on Bagua-Net's 4 x 8 V100 at 100 Gbit/s
    equals the measured ``32 / images_per_gpu_s`` (bisection on its logarithm)."""
    target = PAPER["vgg16"].batch / images_per_gpu_s
    lo, hi = math.log(1e7), math.log(1e13)
    for _ in range(100):
        mid = (lo + hi) / 2
        net = paper_net(math.exp(mid), fit, BAGUA_NET_BASELINE["gbits"], hosts=BAGUA_NET_BASELINE["hosts"])
        if predict("ddp", SHAPES["vgg16"], net, vgg_compute_s, fit.overlap).step_s > target:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def paper_prediction(fit: Fit, compute: Optional[dict[str, float]] = None,
                     overlap: Optional[float] = None) -> dict:
    """Every system's step and speedup over DDP for VGG16 and BERT-large on 16 x 8 V100 at 10, 25, 100 Gbit/s.

    ``compute`` overrides workloads' per-GPU compute step; ``overlap`` replaces the fitted one (the calibration
    machine's single core per host cannot hide communication behind backward; a GPU can)."""
    compute = {name: w.compute_s for name, w in PAPER.items()} | (compute or {})
    if overlap is not None:
        fit = replace(fit, overlap=overlap)
    stack = paper_stack(fit, compute["vgg16"], BAGUA_NET_BASELINE["images_per_gpu_s"])
    rows = []
    for name, work in PAPER.items():
        for gbits in PAPER_GBITS:
            net = paper_net(stack, fit, gbits)
            ddp = predict("ddp", SHAPES[work.shapes], net, compute[name], fit.overlap)
            for system in PAPER_SYSTEMS:
                step = predict(system, SHAPES[work.shapes], net, compute[name], fit.overlap)
                rows.append(dict(workload=name, gbits=gbits, system=system, step_s=step.step_s,
                                 compute_s=compute[name], comm_s=step.comm_s, codec_s=step.codec_s,
                                 mb_per_host=step.bytes_per_host / 1e6, speedup=ddp.step_s / step.step_s,
                                 bagua_pick=system == work.bagua_system, notes=step.notes))
    return dict(stack_Bps=stack, overlap=fit.overlap, latency_s=PAPER_LATENCY_S, nvlink_Bps=PAPER_NVLINK_BPS, hbm_Bps=PAPER_HBM_BPS,
                compute_s=compute, sources={n: w.compute_source for n, w in PAPER.items()},
                published={n: w.published for n, w in PAPER.items()}, rows=rows)

# ------------------------------------------------------------------------------------------------------ CLI


def _default_files() -> list[str]:
    import os

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "results")
    return [os.path.normpath(os.path.join(root, name)) for name in CALIBRATION_FILES]


def calibration_table(cases: Sequence[Case], fit: Fit) -> list[dict]:
    """Predicted against measured, one row per case."""
    table = []
    for c in cases:
        p = predict_case(c, fit)
        table.append(dict(source=c.source, model=c.model, hosts=c.hosts, bandwidth=c.bandwidth, system=c.system,
                          measured_ms=1e3 * c.step_s, predicted_ms=1e3 * p.step_s,
                          error=p.step_s / c.step_s - 1,
                          measured_mb=None if c.bytes_per_step is None else c.bytes_per_step / 1e6,
                          predicted_mb=p.bytes_per_host / 1e6))
    return table


def _print_calibration(fit: Fit, table: Sequence[dict], stack_check: Optional[float]) -> None:
    print("fitted parameters (least squares of log(predicted/measured) over every row):")
    print(f"  link efficiency        {fit.efficiency:.3f}  (TCP goodput / tbf rate)")
    print(f"  stack bandwidth        {fit.stack_Bps / 1e9:.3f} GB/s per core (gloo + TCP + Python on one core)")
    if stack_check:
        print(f"    cross-check: collectives-2ranks.json, 100 MB allreduce on loopback: {stack_check / 1e9:.3f} GB/s")
    print(f"  latency per message    {fit.latency_s * 1e6:.0f} us")
    print(f"  overlap                {fit.overlap:.3f}  (fraction of compute a gradient collective hides behind)")
    print()
    print(f"{'model':7} {'hosts':>5} {'bandwidth':>9} {'system':44} {'meas ms':>8} {'pred ms':>8} {'err':>6} "
          f"{'meas MB':>8} {'pred MB':>8}")
    for r in table:
        mb = "-" if r["measured_mb"] is None else f"{r['measured_mb']:.1f}"
        print(f"{r['model']:7} {r['hosts']:>5} {r['bandwidth']:>9} {r['system']:44} {r['measured_ms']:8.0f} "
              f"{r['predicted_ms']:8.0f} {100 * r['error']:+5.0f}% {mb:>8} {r['predicted_mb']:8.1f}")
    errors = [abs(r["error"]) for r in table]
    print(f"\n|error| over {len(errors)} rows: median {100 * statistics.median(errors):.0f} %, "
          f"max {100 * max(errors):.0f} %")
    by_system: dict[str, list[float]] = {}
    for r in table:
        by_system.setdefault(r["system"], []).append(abs(r["error"]))
    print("median |error| per system: " + ", ".join(
        f"{s} {100 * statistics.median(e):.0f} %" for s, e in sorted(by_system.items())))


def _print_paper(paper: dict) -> None:
    print(f"\nthe paper's setting: {PAPER_HOSTS} hosts x {PAPER_GPUS} V100, NVLink {paper['nvlink_Bps'] / 1e9:.0f} "
          f"GB/s inside, TCP between; stack {paper['stack_Bps'] / 1e9:.2f} GB/s per host (fitted to Bagua-Net's "
          f"DDP baseline), latency {paper['latency_s'] * 1e6:.0f} us per message, overlap {paper['overlap']:.2f}")
    for name, seconds in paper["compute_s"].items():
        print(f"  {name}: compute {1e3 * seconds:.0f} ms per step ({paper['sources'][name]})")
    systems = list(dict.fromkeys(r["system"] for r in paper["rows"]))
    for name in paper["compute_s"]:
        print(f"\n{name}: speedup over DDP (DDP step in ms), '*' = the algorithm the paper ran for this task")
        print(f"{'system':44} " + " ".join(f"{g:>8} Gb" for g in PAPER_GBITS))
        for system in systems:
            cells = [r for r in paper["rows"] if r["workload"] == name and r["system"] == system]
            mark = "*" if cells[0]["bagua_pick"] else " "
            text = " ".join(f"{r['speedup']:10.2f}" if system != "ddp" else f"{1e3 * r['step_s']:8.0f}ms"
                            for r in cells)
            print(f"{mark}{system:43} {text}")
        print(f"  published: {paper['published'][name]}")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Fit the model on the measured runs, print predicted against measured, and predict the paper's setting."""
    parser = argparse.ArgumentParser(prog="python -m bagua.benchmarks.cost_model", description=main.__doc__)
    parser.add_argument("files", nargs="*", help="suite JSON files (default: the calibration runs in docs/results)")
    parser.add_argument("--json", metavar="OUT", help="also write the fit, the table and the prediction here")
    parser.add_argument("--paper-compute", action="append", default=[], metavar="MODEL=SECONDS",
                        help="override a paper workload's per-GPU compute step, e.g. vgg16=0.25")
    parser.add_argument("--paper-overlap", type=float, metavar="FRACTION",
                        help="overlap of communication with backward at the paper's scale (default: the fitted one)")
    args = parser.parse_args(argv)
    compute = {}
    for item in args.paper_compute:
        name, _, value = item.partition("=")
        if name not in PAPER or not value:
            parser.error(f"--paper-compute {item!r}: expected MODEL=SECONDS with MODEL in {', '.join(PAPER)}")
        compute[name] = float(value)
    files = args.files or _default_files()
    rows = load_rows(files)
    if not rows:
        parser.error(f"no usable rows (models {', '.join(m for m in SHAPES if m in ('mlp', 'digits'))}) in {files}")
    cases = [row_case(r, rows) for r in rows]
    fit = calibrate(cases)
    table = calibration_table(cases, fit)
    stack_check = _collectives_check(files)
    _print_calibration(fit, table, stack_check)
    if args.paper_overlap is not None and not 0 <= args.paper_overlap <= 1:
        parser.error(f"--paper-overlap {args.paper_overlap}: a fraction of the compute, between 0 and 1")
    paper = paper_prediction(fit, compute, args.paper_overlap)
    _print_paper(paper)
    errors = [abs(r["error"]) for r in table]
    result = dict(fit=asdict(fit), files=[f.rsplit("/", 1)[-1] for f in files], calibration=table,
                  median_abs_error=statistics.median(errors), max_abs_error=max(errors), paper=paper,
                  stack_check_Bps=stack_check)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")
    return result


def _collectives_check(files: Sequence[str]) -> Optional[float]:
    """Bytes/s one rank sent in the 100 MB allreduce of collectives-2ranks.json (2 ranks send ``nbytes`` each),
    an independent reading of the stack bandwidth; None when the file is not beside the calibration files."""
    import os

    path = os.path.join(os.path.dirname(files[0]) if files else ".", "collectives-2ranks.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        results = json.load(f)["results"]
    times = [r for r in results if r["op"] == "torch.all_reduce SUM" and r["bytes"] >= 1e8]
    return times[0]["bytes"] / times[0]["median_s"] if times else None


if __name__ == "__main__":
    main()
