"""The advisor: which algorithm and settings the measured tables recommend for your step and your link.

Run it on your own cluster, one process per node, under a launcher::

    torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        -m bagua.advise --script train_step.py

It times your training step (a ``step()`` callable), measures the link between the nodes (allreduces of a few
sizes, fitted as latency + bytes / bandwidth), and prints the pick of the nearest row of the measured
time-to-target tables (README, docs/benchmarks.md), its settings, its expected time to target against DDP and
the cost model's reasoning. Only rank 0 prints. See docs/advise.md.

Words used exactly here:

- **step**: one forward, backward and optimizer step of one replica, without communication.
- **exchange**: DDP's allreduce of the model's gradient between the hosts, once per step.
- **ratio**: exchange / step, DDP's communication-to-compute ratio; what a table row is matched on.
- **host**: a node; the advisor runs one process per host.

Example:
    >>> from bagua.advise import recommend
    >>> recommend(step_s=0.70, model_bytes=43_180_032, bandwidth_bps=1e8, latency_s=2e-3, hosts=4).pick
    'warmed-up diloco'
"""

from __future__ import annotations

from bagua.advise.pick import Recommendation, exchange_seconds, recommend
from bagua.advise.table import TABLES, TableRow

__all__ = ["Recommendation", "recommend", "exchange_seconds", "TABLES", "TableRow"]
