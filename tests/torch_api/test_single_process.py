"""Without a launcher, init_process_group starts a one-process job (no port opened); CUDA paths when available."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _run(code: str, extra_env=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=ROOT, **(extra_env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


TRAIN = """
    import torch, bagua.torch_api as bagua
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    bagua.init_process_group()
    device = "{device}"
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).to(device)
    ref = torch.nn.Linear(5, 3).to(device); ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1); ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    for i in range(3):
        x = torch.randn(4, 5, device=device)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(); m(x).square().sum().backward(); o.step()
    assert bagua.get_world_size() == 1 and bagua.communication.get_backend() == "{backend}"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    print("OK", model.bagua_buckets[0].flat.device)
"""


def test_plain_python_script_is_a_one_process_job():
    proc = _run(TRAIN.format(device="cpu", backend="gloo"))
    assert proc.returncode == 0 and "OK cpu" in proc.stdout, proc.stderr[-2000:]


def test_init_twice_is_an_error():
    proc = _run("""
        import bagua.torch_api as bagua
        bagua.init_process_group()
        try:
            bagua.init_process_group()
        except RuntimeError as e:
            print("ERR", e)
    """)
    assert "ERR trying to initialize the default process group twice" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.gpu
def test_nccl_world_size_one_on_cuda():
    proc = _run(TRAIN.format(device="cuda", backend="nccl"))
    assert proc.returncode == 0 and "OK cuda" in proc.stdout, proc.stderr[-2000:]


def test_unwrapped_modules_read_as_empty_and_torch_compile_works():
    """Bagua's attributes on nn.Module never raise on a module that is not wrapped (None or empty), because
    torch.compile reads every attribute of dir(module) and fails on one that raises."""
    proc = _run("""
        import torch, bagua.torch_api as bagua
        m = torch.nn.Linear(4, 2)
        assert m.bagua_algorithm is None and m.bagua_buckets == [] and m.bagua_optimizers == []
        x = torch.randn(3, 4)
        assert torch.allclose(torch.compile(m, backend="eager")(x), m(x))
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]
