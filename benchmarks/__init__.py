"""Benchmarks of Bagua, run from a clone and never installed, grouped by the question they answer.

``python -m benchmarks.network`` is the emulated-network suite (hosts x bandwidths x models x systems), kept at the
top because every campaign starts there. The folders:

- :mod:`benchmarks.common`: the suite's machinery: test hosts as network namespaces (``netns``), the job each host
  runs (``job``, ``workload``, ``systems``, ``measurements``), the models (``models``, ``gpt``, ``resnet``), and the
  results (``report``, ``plots``);
- :mod:`benchmarks.to_target`: time to accuracy (``--to-target``: ``to_target``, ``to_target_plan``,
  ``to_target_table``) and the campaigns built on it (``diloco_sweep``, ``torchft_peer``, ``muon_cost``);
- :mod:`benchmarks.cost`: the step-time cost model (``cost_model``, ``cost_equations``, ``cost_calibration``,
  ``cost_paper``) and the GPU mapping column (``gpu_mapping``);
- :mod:`benchmarks.fault`: workers that fail alone (``fault_kill``, ``fault_gpt``, ``kills``, ``heal_transfer``);
- :mod:`benchmarks.gpu`: every CUDA path on a GPU machine (``gpu_check.sh``, ``gpu_check*``) and ``gpu_step``;
- :mod:`benchmarks.codecs`: codec speed (``codec``, ``codec_fused``) and ``bytegrad_timeline``;
- :mod:`benchmarks.sharded`: FSDP2 replicas between islands (``islands``, ``sharded_gpt``) and ``sharded_memory``;
- :mod:`benchmarks.micro`: one piece at a time (``engine_overhead``, ``collectives``, ``fused_optimizer``,
  ``fused_grad_fold``, ``cached_dataset``, ``load_balancing``, ``tcp_tuning``, ``autotune``).

See docs/benchmarks.md for the results and docs/benchmarks_method.md for the commands.
"""

__all__ = ["codecs", "common", "cost", "fault", "gpu", "micro", "network", "sharded", "to_target"]
