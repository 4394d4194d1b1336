"""The recommendation: a measured step and link, matched to the nearest row of the measured tables.

The cost model of DDP's exchange (docs/cost_model.md, as ``benchmarks/cost/gpu_mapping.py`` applies it): one ring
allreduce of the model's gradient per step, in buckets of 25 MiB,

    exchange_s = buckets * latency_s + 2 (n - 1) / n * model_bytes * 8 / bandwidth_bps
    ratio      = exchange_s / step_s

with ``n`` the hosts, ``latency_s`` the fixed cost of one allreduce and ``bandwidth_bps`` the bus bandwidth
(bits per second each host's link carries, as nccl-tests' "busbw"). The ratio is matched, on a log scale, to the
nearest row of :data:`bagua.advise.table.TABLES` for the host count, and that row's pick is the recommendation.

Example:
    >>> rec = recommend(step_s=0.70, model_bytes=43_180_032, bandwidth_bps=10e6, latency_s=2e-3, hosts=2)
    >>> rec.algorithm, rec.row.link, round(rec.ratio)
    ('diloco', '10 Mbit/s', 49)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from bagua.advise.table import TABLES, TableRow
from bagua.torch_api.comm.cost import ring_allreduce_bytes

__all__ = ["Recommendation", "recommend", "exchange_seconds", "table_hosts", "format_rate", "DDP_BUCKET_BYTES"]

#: DDP's default bucket (``bucket_cap_mb=25``): each bucket is one allreduce and pays the latency once.
DDP_BUCKET_BYTES = 25 * 2**20
# A ratio this far (x) beyond the first or last row is outside what was measured: still the nearest row's pick,
# but said so.
_EXTRAPOLATION = 3.0


@dataclass(frozen=True)
class Recommendation:
    """What to run, what the tables expect of it, and why.

    Args:
        algorithm: the registry name to build (``Algorithm.init(algorithm, **settings)``).
        pick: the pick as the README names it.
        settings: the README's settings string ("defaults" when none).
        code: the line that builds it.
        vs_ddp: the row's median time to target against DDP's (higher is better).
        ratio: the measured communication-to-compute ratio.
        exchange_s: the modelled allreduce of the model's gradient between the hosts.
        step_s, model_bytes, bandwidth_bps, latency_s, hosts: the inputs.
        row: the matched table row.
        reasoning: the cost model's steps, one sentence each.
    """

    algorithm: str
    pick: str
    settings: str
    code: str
    vs_ddp: float
    ratio: float
    exchange_s: float
    step_s: float
    model_bytes: int
    bandwidth_bps: float
    latency_s: float
    hosts: int
    row: TableRow
    reasoning: tuple[str, ...]

    def to_dict(self) -> dict:
        """Return the recommendation as plain JSON-ready values."""
        return asdict(self)


def exchange_seconds(model_bytes: int, bandwidth_bps: float, latency_s: float, hosts: int) -> float:
    """Return the modelled seconds of one ring allreduce of ``model_bytes`` over ``hosts`` (module equation).

    Example:
        >>> exchange_seconds(10**8, 1e9, 0.0, 2)
        0.8
    """
    buckets = max(1, math.ceil(model_bytes / DDP_BUCKET_BYTES))
    return buckets * latency_s + ring_allreduce_bytes(model_bytes, hosts) * 8 / bandwidth_bps


def format_rate(bits_per_s: float) -> str:
    """Return a rate in Gbit/s or Mbit/s, three digits.

    Example:
        >>> format_rate(9.4e6), format_rate(2.5e9)
        ('9.4 Mbit/s', '2.5 Gbit/s')
    """
    return f"{bits_per_s / 1e9:.3g} Gbit/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:.3g} Mbit/s"


def table_hosts(hosts: int) -> int:
    """Return the measured host count whose table serves ``hosts``: 2 for 2, 4 for 3 to 5, 8 from 6 (the nearest
    on a log scale; 3 hosts already grow DDP's global batch, which is what changed the picks from 2 to 4 hosts).

    Example:
        >>> [table_hosts(n) for n in (2, 3, 5, 6, 64)]
        [2, 4, 4, 8, 8]
    """
    return 2 if hosts <= 2 else 4 if hosts <= 5 else 8


def _code(row: TableRow) -> str:
    args = "" if row.settings == "defaults" else ", " + row.settings
    return f'Algorithm.init("{row.algorithm}"{args})'


def _nearest(rows: tuple[TableRow, ...], ratio: float) -> TableRow:
    return min(rows, key=lambda row: abs(math.log(ratio / row.ddp_ratio)))


def _reasoning(step_s: float, model_bytes: int, bandwidth_bps: float, latency_s: float, hosts: int,
               exchange_s: float, rows: tuple[TableRow, ...], row: TableRow) -> tuple[str, ...]:
    ratio = exchange_s / step_s
    buckets = max(1, math.ceil(model_bytes / DDP_BUCKET_BYTES))
    lines = [
        f"DDP's exchange per step: one allreduce of the {model_bytes / 1e6:.1f} MB gradient between {hosts} hosts "
        f"= {buckets} x {latency_s * 1e3:.2f} ms latency + 2({hosts}-1)/{hosts} x {model_bytes / 1e6:.1f} MB at "
        f"{format_rate(bandwidth_bps)} = {exchange_s:.3g} s",
        f"communication-to-compute ratio: {exchange_s:.3g} s / {step_s:.3g} s step = {ratio:.3g}",
        f"nearest measured row at {row.hosts} hosts (log scale; rows: "
        + ", ".join(f"{r.link} {r.ddp_ratio:g}" for r in rows)
        + f"): {row.link}, ratio {row.ddp_ratio:g} (on GPUs: {row.gpu_setting})",
        f"there {row.pick} reached the target {row.vs_ddp:g}x as fast as DDP: {row.why}",
    ]
    if hosts != row.hosts:
        lines.append(f"the tables measured 2, 4 and 8 hosts; the {row.hosts}-host table stands in for {hosts} hosts")
    if ratio < rows[0].ddp_ratio / _EXTRAPOLATION or ratio > rows[-1].ddp_ratio * _EXTRAPOLATION:
        lines.append(f"the ratio {ratio:.3g} lies beyond the measured rows "
                     f"({rows[0].ddp_ratio:g}-{rows[-1].ddp_ratio:g}): the nearest row's pick, extrapolated")
    if row.alternatives:
        lines.append("also measured there: " + "; ".join(row.alternatives))
    return tuple(lines)


def recommend(step_s: float, model_bytes: int, bandwidth_bps: float, latency_s: float, hosts: int) -> Recommendation:
    """Return the measured tables' pick for a step of ``step_s`` seconds on a model of ``model_bytes`` gradient
    bytes, between ``hosts`` hosts linked at ``bandwidth_bps`` (bus bandwidth, bits/s) and ``latency_s`` per
    allreduce. Pure: no process group, no clock.

    Args:
        step_s: one training step of one replica (forward, backward, optimizer), without communication.
        model_bytes: the bytes DDP allreduces per step (4 per fp32 parameter).
        bandwidth_bps: bits per second each host's link carries during an allreduce.
        latency_s: the fixed cost of one allreduce.
        hosts: the nodes that exchange (one advisor process each).

    Returns:
        The :class:`Recommendation`, with the cost model's reasoning.

    Example:
        >>> recommend(0.70, 43_180_032, 1e9, 2e-3, 2).algorithm
        'decentralized'
    """
    if hosts < 2:
        raise ValueError(f"a recommendation needs at least 2 hosts, got hosts={hosts}; run one advisor process on "
                         "each node (torchrun --nproc_per_node=1 --nnodes=N)")
    for name, value in (("step_s", step_s), ("model_bytes", model_bytes), ("bandwidth_bps", bandwidth_bps)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    if latency_s < 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")
    rows = TABLES[table_hosts(hosts)]
    exchange_s = exchange_seconds(model_bytes, bandwidth_bps, latency_s, hosts)
    ratio = exchange_s / step_s
    row = _nearest(rows, ratio)
    reasoning = _reasoning(step_s, model_bytes, bandwidth_bps, latency_s, hosts, exchange_s, rows, row)
    return Recommendation(algorithm=row.algorithm, pick=row.pick, settings=row.settings, code=_code(row),
                          vs_ddp=row.vs_ddp, ratio=ratio, exchange_s=exchange_s, step_s=step_s,
                          model_bytes=model_bytes, bandwidth_bps=bandwidth_bps, latency_s=latency_s, hosts=hosts,
                          row=row, reasoning=reasoning)
