import shutil

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_redis = pytest.mark.skip(reason="needs a redis-server binary (apt-get install redis-server)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "redis" in item.keywords and shutil.which("redis-server") is None:
            item.add_marker(skip_redis)
