"""What a newcomer installs: lmdb is a core dependency, `all` covers every extra, and a missing optional package
is reported before any work with the extra that installs it.

Packages are hidden from a subprocess by a ``sitecustomize`` that sets ``sys.modules[name] = None``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_without(tmp_path, modules, argv, timeout=60):
    """Run ``python argv`` with ``modules`` impossible to import (in it and in its children)."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), ROOT]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)


def test_lmdb_is_a_core_dependency_and_all_covers_every_extra():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert any(d.startswith("lmdb") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    # bench-torchft is a peer to measure against (torchft's DiLoCo), not a part of Bagua: never in "all"
    everything = {d for name, deps in extras.items() if name not in ("all", "dev", "bench-torchft") for d in deps}
    assert not any(d.startswith("torchft") for d in extras["all"] + extras["dev"])
    assert set(extras["all"]) == everything
    assert set(extras["examples"]) <= set(extras["dev"])  # `make test` can run the demo too


def test_bench_without_scikit_learn_stops_before_any_work_and_names_the_extra(tmp_path):
    proc = _run_without(tmp_path, ["sklearn"], ["-m", "benchmarks.network", "--models", "mlp,digits",
                                                "--out-dir", str(tmp_path / "out")])
    assert proc.returncode != 0
    assert "the digits model needs scikit-learn" in proc.stderr and "pip install 'bagua[bench]'" in proc.stderr
    assert "bagua-bench:" in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing ran


def test_bench_without_matplotlib_still_writes_json_and_csv(tmp_path):
    # The suite's jobs are replaced by two finished rows: what is tested is main's path from the import check to
    # the files, with matplotlib really unimportable (the jobs have their own tests in tests/benchmarks/).
    out = tmp_path / "out"
    script = (
        "import sys\n"
        "from benchmarks import network\n"
        "row = {'model': 'tiny', 'hosts': 2, 'bandwidth': 'unshaped', 'status': 'ok', 'step_s': 0.01,"
        " 'samples_per_s': 6400.0}\n"
        "network.run_suite = lambda args: ([dict(row, system='ddp'), dict(row, system='gradient_allreduce')],"
        " {'command': 'test'})\n"
        f"sys.exit(network.main(['--loopback', '--models', 'tiny', '--systems', 'ddp,gradient_allreduce',"
        f" '--out-dir', {str(out)!r}, '--name', 't']))\n")
    proc = _run_without(tmp_path, ["matplotlib"], ["-c", script])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "matplotlib is not installed" in proc.stderr and "pip install 'bagua[bench]'" in proc.stderr
    assert (out / "t.json").exists() and (out / "t.csv").exists() and not (out / "t.png").exists()
    assert "wrote " + str(out / "t.json") in proc.stdout


def test_missing_lmdb_names_what_to_install(tmp_path):
    proc = _run_without(tmp_path, ["lmdb"], ["-c", (
        "from bagua.torch_api.contrib.utils.lmdb_store import LmdbStore\n"
        f"LmdbStore({str(tmp_path / 'db')!r})")])
    assert proc.returncode != 0 and "pip install lmdb" in proc.stderr and "backend='redis'" in proc.stderr


@pytest.mark.parametrize("module", ["bagua.torch_api", "bagua.distributed.run"])
def test_core_imports_need_no_extra(tmp_path, module):
    hidden = ["sklearn", "matplotlib", "redis", "optuna", "lightning", "pytorch_lightning"]
    proc = _run_without(tmp_path, hidden, ["-c", f"import {module}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
