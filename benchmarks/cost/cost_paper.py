"""The cost model at the Bagua paper's scale: its workloads, its hosts, and every system's predicted speedup.

Part of :mod:`benchmarks.cost.cost_model`; the equations are in :mod:`benchmarks.cost.cost_equations`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from benchmarks.cost.cost_equations import GBIT, SHAPES, Fit, Net, predict

__all__ = [
    "PaperWorkload", "PAPER", "PAPER_HOSTS", "PAPER_GPUS", "PAPER_GBITS", "PAPER_LATENCY_S", "PAPER_NVLINK_BPS",
    "PAPER_HBM_BPS", "BAGUA_NET_BASELINE", "PAPER_SYSTEMS", "paper_net", "paper_stack", "paper_prediction",
]


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
