"""Benchmarks of Bagua, run from a clone and never installed: ``python -m benchmarks.network`` is the
emulated-network suite.

- :mod:`benchmarks.netns`: test hosts as network namespaces joined by a bridge, tbf-shaped links, cleanup;
- :mod:`benchmarks.workload`: the training job each host runs, and the models it can train;
  its parts: :mod:`benchmarks.systems` (DDP variants and Bagua algorithms, wrapped and timed) and
  :mod:`benchmarks.measurements` (compute phase, codec cost, accuracy);
- :mod:`benchmarks.gpt`: a byte-level GPT language model on the standard library's sources;
- :mod:`benchmarks.resnet`: a BatchNorm ResNet on scikit-learn's digits;
- :mod:`benchmarks.to_target`: time to accuracy (``--to-target``);
- :mod:`benchmarks.network`: the suite (hosts x bandwidths x models x systems);
- :mod:`benchmarks.report` and :mod:`benchmarks.plots`: table, JSON, CSV and PNG plots.
- :mod:`benchmarks.cost_model`: a step-time model calibrated on the runs, and the paper's scale on paper.
  Its parts: :mod:`benchmarks.cost_equations` (the equations), :mod:`benchmarks.cost_calibration`
  (the fit) and :mod:`benchmarks.cost_paper` (the paper's setting).

See docs/benchmarks.md for the commands and the latest results.
"""

__all__ = [
    "cost_calibration", "cost_equations", "cost_model", "cost_paper", "gpt", "measurements", "netns", "network",
    "plots", "report", "resnet", "systems", "to_target", "workload",
]
