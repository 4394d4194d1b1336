"""The measured tables behind the advisor: per host count, one row per emulated link, with its pick.

Each row is one link of the time-to-target tables in docs/benchmarks.md (the 10.8 M-parameter GPT trained to
validation loss 2.40, medians of 3 seeds, one rank per host, ``hierarchical=False``) and of the README's "Which
algorithm for my link" table. A row carries DDP's **communication-to-compute ratio** at that link (the tables'
last row: one uncompressed ring allreduce of the GPT's fp32 gradient, from the cost model, over its measured
compute step), which is what carries over from the emulated hosts to a user's cluster
(docs/benchmarks.md#the-gpu-mapping-column): a user whose measured ratio is nearest a row's sees what that row saw.

The figures are copied from those tables, not recomputed; ``benchmarks/`` (not installed) holds the campaigns
that measured them.

Example:
    >>> [row.link for row in TABLES[2]]
    ['unshaped', '1 Gbit/s', '100 Mbit/s', '10 Mbit/s']
    >>> TABLES[4][2].algorithm, TABLES[4][2].vs_ddp
    ('diloco', 5.57)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["TableRow", "TABLES", "GPT_PARAMS", "STREAMING_DILOCO", "PLAIN_DILOCO", "WARM_DILOCO", "WARM_DILOCO_NF2",
           "BENCHMARKS_DOC"]

#: Parameters of the benchmark GPT the tables were measured on (docs/results/to-target-gpt-*.json).
GPT_PARAMS = 10_795_008
BENCHMARKS_DOC = "docs/benchmarks.md"

# The README's settings strings, verbatim.
STREAMING_DILOCO = ('sync_every=10, outer_lr=1.0, outer_momentum=0.0, compression="uint4", fragments=2, '
                    'overlap_steps=3')
PLAIN_DILOCO = 'sync_every=10, outer_lr=1.0, outer_momentum=0.0, compression="uint4"'
WARM_DILOCO = 'sync_every=10, outer_lr=1.0, outer_momentum=0.5, outer_lr_warmup=10, compression="uint4"'
WARM_DILOCO_NF2 = ('sync_every=10, outer_lr=1.0, outer_momentum=0.5, outer_lr_warmup=10, compression="nf2", '
                   'block_size=256')


@dataclass(frozen=True)
class TableRow:
    """One emulated link of one host count, and what won there.

    Args:
        hosts: hosts of the table (2, 4 or 8).
        link: the emulated link, as the tables name it ("10 Mbit/s", "unshaped").
        rate_bps: its rate in bits per second; ``None`` for unshaped (the hosts' software stack alone).
        ddp_ratio: DDP's communication-to-compute ratio there (the tables' last row).
        gpu_setting: the GPU setting with the same ratio (nodes of 8 H100 and the per-node link).
        pick: the pick, as the README names it ("streaming diloco").
        algorithm: its registry name (``Algorithm.init(algorithm, ...)``).
        settings: its settings, the README's string ("defaults" when none).
        vs_ddp: its median time to target against DDP's (higher is better).
        why: why it won there, in one sentence from the tables' notes.
        alternatives: other rows of the same column worth knowing, with their ratios.
        evidence: the section of docs/benchmarks.md with the runs.
    """

    hosts: int
    link: str
    rate_bps: Optional[int]
    ddp_ratio: float
    gpu_setting: str
    pick: str
    algorithm: str
    settings: str
    vs_ddp: float
    why: str
    alternatives: tuple[str, ...]
    evidence: str


_AT2 = f"{BENCHMARKS_DOC}#time-to-target-at-2-hosts-per-link"
_AT4 = f"{BENCHMARKS_DOC}#time-to-target-at-4-hosts-per-link"
_ALLREDUCE = f"{BENCHMARKS_DOC}#baguas-gradient-allreduce-run-to-the-target-2026-11-27"
_DECENTRALIZED = f"{BENCHMARKS_DOC}#decentralized-sgd-to-the-same-target-2026-11-26-3-seeds"

_TWO_HOSTS = (
    TableRow(2, "unshaped", None, 0.093, "below 2 x 8 H100's latency floor", "gradient_allreduce (or torch DDP)",
             "gradient_allreduce", "defaults", 1.05,
             "communication is under a tenth of the step, so nothing has much to save; gradient allreduce is DDP's "
             "maths and ran DDP's run bit for bit",
             ("streaming diloco 1.09x, within DDP's spread",), _ALLREDUCE),
    TableRow(2, "1 Gbit/s", 10**9, 0.53, "2 x 8 H100 at 199 Gbit/s", "decentralized", "decentralized",
             "hierarchical=False", 1.35,
             "communication is about half of the compute; decentralized SGD reached the target in fewer steps "
             "(440 against 500) and was faster than DDP on every seed",
             (f"streaming diloco ({STREAMING_DILOCO}) 1.31x, within decentralized's spread",
              "bytegrad (error_feedback=True) 1.15x, if every step must be synchronous"), _DECENTRALIZED),
    TableRow(2, "100 Mbit/s", 10**8, 5.2, "2 x 8 H100 at 15 Gbit/s", "streaming diloco", "diloco",
             STREAMING_DILOCO, 5.95,
             "communication is five times the compute; streaming DiLoCo exchanges half the model in 4 bits every "
             "5 steps behind 3 inner steps, at DDP's step count",
             (f"plain diloco ({PLAIN_DILOCO}) 5.29x",
              "bytegrad (error_feedback=True) 3.27x, if every step must be synchronous"), _AT2),
    TableRow(2, "10 Mbit/s", 10**7, 52.0, "2 x 8 H100 at 1.5 Gbit/s", "streaming diloco", "diloco",
             STREAMING_DILOCO, 52.5,
             "communication is fifty times the compute; only the systems that communicate every few steps keep "
             "the step near compute, and streaming DiLoCo hides its exchange behind inner steps",
             (f"plain diloco ({PLAIN_DILOCO}) 30.4x", "async 27.2x"), _AT2),
)

_NF2 = f"{BENCHMARKS_DOC}#two-bit-pseudo-gradients-at-4-hosts-2026-11-29-3-seeds"
_WARM = f"{BENCHMARKS_DOC}#the-warmed-up-outer-step-to-the-target-and-per-link-at-4-hosts-2026-11-28-3-seeds"
_WARM_WHY = ("DiLoCo's warmed-up Nesterov outer step reached the target in fewer steps than DDP (240 against 320 on "
             "the median, fewer on every seed) at a step near compute")
_FOUR_HOSTS = (
    TableRow(4, "unshaped", None, 0.13, "below 4 x 8 H100's latency floor", "warmed-up diloco", "diloco",
             WARM_DILOCO, 1.42,
             _WARM_WHY + "; the gain is in steps, not in communication",
             ("gradient_allreduce (or torch DDP) 0.85-1.00x: DDP's maths",), _WARM),
    TableRow(4, "1 Gbit/s", 10**9, 0.35, "4 x 8 H100 at 1158 Gbit/s", "warmed-up diloco", "diloco", WARM_DILOCO,
             1.66, _WARM_WHY + ", where DDP's global batch doubles with the hosts",
             (f"plain diloco ({PLAIN_DILOCO}) 1.01x, within DDP's spread",), _WARM),
    TableRow(4, "100 Mbit/s", 10**8, 3.5, "4 x 8 H100 at 25 Gbit/s", "warmed-up diloco", "diloco", WARM_DILOCO, 5.57,
             "communication is three to four times the compute; " + _WARM_WHY,
             (f"plain diloco ({PLAIN_DILOCO}) 3.59x", f"streaming diloco ({STREAMING_DILOCO}) 3.19x",
              "bytegrad (error_feedback=True) 2.23x, if every step must be synchronous"), _WARM),
    TableRow(4, "10 Mbit/s", 10**7, 35.0, "4 x 8 H100 at 2.3 Gbit/s", "warmed-up diloco, 2-bit", "diloco",
             WARM_DILOCO_NF2, 29.7, "communication is thirty-five times the compute; " + _WARM_WHY
             + "; its exchange every 10 steps is exposed, and 2-bit nf2 codes send 56 % of uint4's bytes at the "
             "same median steps (240): 1.11x uint4's time in the same block (timed on a boot whose compute step "
             "was 2.2 s, not 1.5 s, so every DiLoCo ratio there is lower)",
             (f"warmed-up diloco with uint4 ({WARM_DILOCO}) 26.9x in the same block, 34.7x on 2026-11-28",
              f"streaming diloco ({STREAMING_DILOCO}) 29.0x (2026-11-26 block)",
              f"plain diloco ({PLAIN_DILOCO}) 21.1x", "async 12.0x",
              "bytegrad (error_feedback=True) 2.91x, if every step must be synchronous"), _NF2),
)

_AT8 = f"{BENCHMARKS_DOC}#time-to-target-on-the-gpt-at-8-hosts-2026-11-29-3-seeds"
_AT8_WHY = ("DiLoCo's warmed-up Nesterov outer step reached the target in 200 steps against DDP's 300 (medians, "
            "fewer on every seed)")
_AT8_ONLY = ("only DDP and this point were run at 8 hosts",)
_EIGHT_HOSTS = (
    TableRow(8, "unshaped", None, 0.15, "below 8 x 8 H100's latency floor", "warmed-up diloco", "diloco",
             WARM_DILOCO, 1.58, _AT8_WHY + "; the gain is in steps, not in communication", _AT8_ONLY, _AT8),
    TableRow(8, "1 Gbit/s", 10**9, 0.22, "below 8 x 8 H100's latency floor", "warmed-up diloco", "diloco",
             WARM_DILOCO, 1.78, _AT8_WHY + ", where DDP's global batch grows with the hosts", _AT8_ONLY, _AT8),
    TableRow(8, "100 Mbit/s", 10**8, 1.8, "8 x 8 H100 at 65 Gbit/s", "warmed-up diloco", "diloco", WARM_DILOCO,
             3.75, "communication is about twice the compute; " + _AT8_WHY, _AT8_ONLY, _AT8),
    TableRow(8, "10 Mbit/s", 10**7, 19.0, "8 x 8 H100 at 4.4 Gbit/s", "warmed-up diloco", "diloco", WARM_DILOCO,
             24.8, "communication is twenty times the compute; " + _AT8_WHY
             + ", though its 4-bit exchange every 10 steps adds a third to the step", _AT8_ONLY, _AT8),
)

#: The rows of each measured host count, fastest link first.
TABLES: dict[int, tuple[TableRow, ...]] = {2: _TWO_HOSTS, 4: _FOUR_HOSTS, 8: _EIGHT_HOSTS}
