"""The wheel holds the library and nothing else: no benchmarks, no time-to-target campaign modules.

The wheel is built offline (``pip wheel --no-deps --no-build-isolation``, with the test environment's setuptools,
which builds wheels itself since 70.1) from a copy of the checkout's files: setuptools would pack a stale ``build/``
folder of an earlier build again, so a module the tree no longer has could come back in the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The modules that ran the time-to-target campaigns (benchmarks/to_target*.py); they lived in the package once.
CAMPAIGN_MODULES = ("to_target", "to_target_plan", "to_target_table")


def _checkout_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [f for f in out.stdout.splitlines() if os.path.isfile(os.path.join(ROOT, f))]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[list[str], str]:
    """Build the wheel; return its file names and its metadata's version."""
    # setuptools >= 70.1 builds wheels itself (no `wheel` package); without build isolation it must be installed
    pytest.importorskip("setuptools.command.bdist_wheel", reason="needs setuptools >= 70.1 to build offline")
    src = tmp_path_factory.mktemp("src")
    for f in _checkout_files():
        os.makedirs(src / os.path.dirname(f), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), src / f)
    dist = tmp_path_factory.mktemp("dist")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (wheel,) = dist.glob("bagua-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist(), _metadata_version(zf)


def _metadata_version(zf: zipfile.ZipFile) -> str:
    (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
    lines = zf.read(metadata).decode("utf-8").splitlines()
    return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Version:"))


@pytest.fixture(scope="module")
def wheel_names(wheel) -> list[str]:
    return wheel[0]


def test_wheel_version_is_bagua_version(wheel):
    from bagua.version import __version__

    assert wheel[1] == __version__  # pyproject.toml reads it from bagua/version.py


def test_wheel_has_no_benchmarks_or_campaigns(wheel_names):
    assert not [n for n in wheel_names if "benchmarks/" in n]
    stems = {os.path.splitext(os.path.basename(n))[0] for n in wheel_names}
    assert not stems & set(CAMPAIGN_MODULES)


@pytest.mark.parametrize("path", [
    "bagua/torch_api/comm/", "bagua/torch_api/codecs/", "bagua/torch_api/ops/", "bagua/version.py",
    "bagua/script/baguarun.py", "bagua/torch_api/data_parallel/functional.py", "lightning_bagua/__init__.py",
    "bagua/advise/picks.json",
])
def test_wheel_has_the_library(wheel_names, path):
    assert any(n.startswith(path) for n in wheel_names), path
