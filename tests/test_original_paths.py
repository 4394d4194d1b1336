"""Every import path of the original Bagua 0.9.2 that a user's code could name, with the names it offered there.

The list follows the original's public API (its ``bagua.torch_api`` package, the algorithms, contrib, checkpoint,
MoE, ``bagua.bagua_define``, ``bagua.version``, the launcher modules and the ``baguarun`` script) and the names
lightning-bagua imports. All are imported in one fresh interpreter, so no import made earlier by the test session
hides a module that only works when something else was imported first.
"""

from __future__ import annotations

import json
import subprocess
import sys


_COLLECTIVES = [
    "send", "recv", "allgather", "allgather_inplace", "allreduce", "allreduce_inplace", "alltoall",
    "alltoall_inplace", "alltoall_v", "alltoall_v_inplace", "barrier", "broadcast", "gather", "gather_inplace",
    "reduce", "reduce_inplace", "reduce_scatter", "reduce_scatter_inplace", "scatter", "scatter_inplace",
]
_ALGORITHMS = "bagua.torch_api.algorithms"
_CONTRIB = "bagua.torch_api.contrib"

#: module -> the names the original offered there (an empty list: the module itself is the name).
ORIGINAL_PATHS: dict[str, list[str]] = {
    "bagua": ["__version__"],
    "bagua.version": ["__version__"],
    "bagua.bagua_define": ["BaguaHyperparameter", "TensorDeclaration", "TensorDtype"],
    "bagua.torch_api": [
        "get_backend", "init_process_group", *_COLLECTIVES, "ReduceOp", "BaguaModule", "BaguaTensor",
        "get_local_rank", "get_local_size", "get_rank", "get_world_size",
        "contrib", "communication", "algorithms", "checkpoint", "data_parallel", "moe",
    ],
    "bagua.torch_api.communication": [
        "get_backend", "init_process_group", *_COLLECTIVES, "ReduceOp", "new_group", "from_torch_group",
        "is_initialized", "broadcast_object", "BaguaProcessGroup", "broadcast_coalesced",
        "allreduce_coalesced_inplace",
    ],
    "bagua.torch_api.bucket": ["BaguaBucket"],
    "bagua.torch_api.tensor": ["BaguaTensor"],
    "bagua.torch_api.distributed": ["BaguaModule"],
    "bagua.torch_api.env": [
        "get_world_size", "get_rank", "get_local_rank", "get_local_size", "get_node_rank",
        "get_default_bucket_size", "get_master_addr", "get_bagua_service_port", "is_report_metrics_switch_on",
        "get_autotune_level", "get_autotune_max_samples", "get_autotune_sampling_confidence_time_s",
        "get_autotune_warmup_time_s", "get_is_output_autotune_log", "get_autotune_server_wait_time",
        "find_free_network_port",
    ],
    "bagua.torch_api.utils": [
        "flatten", "unflatten", "check_contiguous", "apply_flattened_call", "to_bagua_datatype",
        "to_bagua_reduce_op", "StatisticalAverage",
    ],
    _ALGORITHMS: ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry"],
    f"{_ALGORITHMS}.base": ["Algorithm", "AlgorithmImpl"],
    f"{_ALGORITHMS}.gradient_allreduce": ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"],
    f"{_ALGORITHMS}.bytegrad": ["ByteGradAlgorithm", "ByteGradAlgorithmImpl"],
    f"{_ALGORITHMS}.decentralized": [
        "DecentralizedAlgorithm", "DecentralizedAlgorithmImpl", "LowPrecisionDecentralizedAlgorithm",
        "LowPrecisionDecentralizedAlgorithmImpl",
    ],
    f"{_ALGORITHMS}.async_model_average": ["AsyncModelAverageAlgorithm", "AsyncModelAverageAlgorithmImpl"],
    f"{_ALGORITHMS}.q_adam": ["QAdamAlgorithm", "QAdamAlgorithmImpl", "QAdamOptimizer"],
    "bagua.torch_api.checkpoint": ["save_checkpoint", "load_checkpoint"],
    "bagua.torch_api.checkpoint.checkpointing": ["save_checkpoint", "load_checkpoint"],
    _CONTRIB: [
        "fuse_optimizer", "LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler", "CacheLoader",
        "CachedDataset",
    ],
    f"{_CONTRIB}.cache_loader": ["CacheLoader"],
    f"{_CONTRIB}.cached_dataset": ["CachedDataset"],
    f"{_CONTRIB}.load_balancing_data_loader": [
        "LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler",
    ],
    f"{_CONTRIB}.fuse.optimizer": ["fuse_optimizer", "fuse_step", "is_fused_optimizer"],
    f"{_CONTRIB}.sync_batchnorm": ["SyncBatchNorm"],
    f"{_CONTRIB}.utils.store": ["Store", "ClusterStore"],
    f"{_CONTRIB}.utils.redis_store": ["RedisStore"],
    "bagua.torch_api.data_parallel": ["DistributedDataParallel"],
    "bagua.torch_api.data_parallel.bagua_distributed": ["BaguaDistributedDataParallel"],
    "bagua.torch_api.data_parallel.distributed": ["DistributedDataParallel", "DistributedDataParallel_V1_9_0"],
    "bagua.torch_api.data_parallel.functional": ["all_reduce"],
    "bagua.torch_api.model_parallel.moe": ["MoE"],
    "bagua.distributed.launch": ["main"],
    "bagua.distributed.run": ["main"],
    "bagua.script.baguarun": ["main"],
}

# What lightning-bagua imports (its strategy.py) and mocks (its tests), beyond the modules above.
LIGHTNING_BAGUA_IMPORTS: dict[str, list[str]] = {
    _ALGORITHMS: ["Algorithm"],
    f"{_ALGORITHMS}.q_adam": ["QAdamOptimizer"],
    "bagua.torch_api.communication": [
        "ReduceOp", "allreduce_inplace", "barrier", "broadcast_object", "is_initialized",
    ],
    "bagua.torch_api.data_parallel.distributed": ["DistributedDataParallel_V1_9_0"],
    "bagua.torch_api.data_parallel.bagua_distributed": ["BaguaDistributedDataParallel"],
}

_PROBE = """
import importlib, json, sys
missing = {}
for module, names in json.loads(sys.argv[1]).items():
    try:
        m = importlib.import_module(module)
    except Exception as e:  # report every failure at once, not the first
        missing[module] = f"import failed: {type(e).__name__}: {e}"
        continue
    absent = [n for n in names if not hasattr(m, n)]
    if absent:
        missing[module] = absent
print(json.dumps(missing))
"""


def _missing(paths: dict[str, list[str]]) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(paths)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def _merged() -> dict[str, list[str]]:
    merged: dict[str, list[str]] = {}
    for paths in (ORIGINAL_PATHS, LIGHTNING_BAGUA_IMPORTS):
        for module, names in paths.items():
            merged.setdefault(module, []).extend(n for n in names if n not in merged[module])
    return merged


def test_every_original_import_path_and_name_exists():
    assert _missing(_merged()) == {}


def test_the_version_has_one_source():
    import bagua
    import bagua.version

    assert bagua.__version__ is bagua.version.__version__


def test_baguarun_script_module_runs_help():
    out = subprocess.run([sys.executable, "-m", "bagua.script.baguarun", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "baguarun" in out.stdout and "--host_list" in out.stdout
