import os
import shutil

import pytest
import torch

# Without CUDA, Triton's kernels run through its interpreter on CPU tensors (tests/torch_api/test_triton_codecs.py).
# Triton reads TRITON_INTERPRET when it is first imported (its own library functions are decorated then), so it is
# set here, before any test imports it; nothing else in Bagua runs Triton on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow (torch.compile per optimizer)")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_redis = pytest.mark.skip(reason="needs a redis-server binary (apt-get install redis-server)")
    for item in items:
        if item.get_closest_marker("slow") is not None and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "redis" in item.keywords and shutil.which("redis-server") is None:
            item.add_marker(skip_redis)
