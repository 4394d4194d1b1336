"""Communication algorithms. Importing this package registers every built-in algorithm name.

| name | class | communicates |
|---|---|---|
| ``gradient_allreduce`` | :class:`~bagua.torch_api.algorithms.gradient_allreduce.GradientAllReduceAlgorithm` | gradients, fp32 |
"""

from bagua.torch_api.algorithms import gradient_allreduce
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry", "gradient_allreduce"]
