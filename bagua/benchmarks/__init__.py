"""Benchmarks of Bagua over emulated networks (``python -m bagua.benchmarks.network``, ``bagua-bench``).

- :mod:`bagua.benchmarks.netns`: test hosts as network namespaces joined by a bridge, tbf-shaped links, cleanup;
- :mod:`bagua.benchmarks.workload`: the training job each host runs;
- :mod:`bagua.benchmarks.network`: the suite (hosts x bandwidths x models x systems);
- :mod:`bagua.benchmarks.report`: table, JSON, CSV and PNG plot.

See docs/benchmarks.md for the commands and the latest results.
"""

__all__ = ["netns", "network", "report", "workload"]
