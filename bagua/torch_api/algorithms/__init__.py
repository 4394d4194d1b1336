"""Communication algorithms. Importing this package registers every built-in algorithm name.

| name | class | communicates |
|---|---|---|
| ``gradient_allreduce`` | :class:`~.gradient_allreduce.GradientAllReduceAlgorithm` | gradients, fp32 allreduce |
| ``bytegrad`` | :class:`~.bytegrad.ByteGradAlgorithm` | gradients, 8-bit scatter-reduce-gather |
| ``decentralized`` | :class:`~.decentralized.DecentralizedAlgorithm` | weights, with peers |
| ``low_precision_decentralized`` | :class:`~.decentralized.LowPrecisionDecentralizedAlgorithm` | 8-bit weight differences, ring |
| ``async`` | :class:`~.async_model_average.AsyncModelAverageAlgorithm` | weights, in a background thread |
| ``diloco`` | :class:`~.diloco.DiLoCoAlgorithm` | weight changes every ``H`` steps, outer optimizer (Streaming: fragments, 8/4-bit) |
| ``qadam`` | :class:`~.q_adam.QAdamAlgorithm` | Adam momentum, 8-bit, after a warmup |
"""

from bagua.torch_api.algorithms import (
    async_model_average,
    bytegrad,
    decentralized,
    diloco,
    gradient_allreduce,
    q_adam,
)
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry

__all__ = [
    "Algorithm",
    "AlgorithmImpl",
    "GlobalAlgorithmRegistry",
    "async_model_average",
    "bytegrad",
    "decentralized",
    "diloco",
    "gradient_allreduce",
    "q_adam",
]
