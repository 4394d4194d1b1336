"""The install stage of :mod:`benchmarks.gpu.gpu_check`, and ``--fetch``: what a lent GPU machine lacks.

The machine has torch, numpy, tqdm, pytest, pytest-timeout, pytest-xdist, scikit-learn, matplotlib and Lightning,
and no package index. :data:`WHEELS` lists what Bagua and its tests need beyond those; ``--fetch DIR`` downloads
them for the machine's Python where PyPI is reachable, with :data:`DEBS` (iproute2, for the network stages, where
``apt-get`` works), and the install stage installs the wheels the machine lacks from ``--wheels DIR``, then Bagua
itself in editable mode.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from typing import Optional

__all__ = ["ROOT", "WHEELS", "DEVICE_PYTHON", "DEBS", "fetch", "stage_install"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Distribution -> the version tested here: a dependency of Bagua the image lacks (lmdb), and what the tests of
#: the Redis cache and of autotuning import (redis; optuna and the packages it needs that the image lacks).
WHEELS = {"lmdb": "3.0.0", "redis": "8.1.0", "optuna": "5.0.0", "alembic": "1.20.1", "sqlalchemy": "2.1.9",
          "mako": "1.4.3", "colorlog": "6.12.0"}
#: The lent machine's Python, for which ``--fetch`` downloads.
DEVICE_PYTHON = "3.12"
#: iproute2 and the libraries its ``ip`` and ``tc`` link (Debian names), carried where ``ip``/``tc`` are missing.
DEBS = ("iproute2", "libbpf1", "libelf1", "libmnl0", "libbsd0", "libmd0", "libcap2", "libxtables12")


def _version(dist: str) -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _wheel_of(folder: str, dist: str) -> Optional[str]:
    pattern = re.compile(re.escape(dist.replace("-", "_")) + r"-[^-]+-.*\.whl$", re.IGNORECASE)
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return next((os.path.join(folder, n) for n in names if pattern.match(n)), None)


def _bagua_checkout() -> Optional[str]:
    """Where ``import bagua`` leads from outside the checkout (None: not installed)."""
    out = subprocess.run([sys.executable, "-c", "import bagua; print(bagua.__file__)"], cwd="/", capture_output=True,
                         text=True, timeout=120)
    return out.stdout.strip() if out.returncode == 0 else None


def stage_install(run, args: argparse.Namespace) -> dict:
    """Install what the machine lacks (see the module docstring); report the versions found and ``ip``/``tc``."""
    result: dict = {"status": "ok"}
    missing = [d for d in WHEELS if _version(d) is None]
    wheels = {d: _wheel_of(args.wheels, d) for d in missing}
    found = [w for w in wheels.values() if w]
    if not missing:
        run.say(f"install: wheels: none needed ({', '.join(WHEELS)} are installed)")
    if found:
        rc, _ = run.command([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--no-cache-dir", *found], run.left_s("install"))
        result["status"] = "ok" if rc == 0 else "failed"
    absent = [d for d, w in wheels.items() if not w]
    if absent:
        run.say(f"install: no wheel of {', '.join(absent)} in {args.wheels}/: tests that need them fail or skip "
                f"(benchmarks/gpu/gpu_check.sh --fetch {args.wheels} downloads them; docs/gpu.md)")
    location = _bagua_checkout()
    if location and os.path.abspath(location).startswith(ROOT + os.sep):
        run.say(f"install: bagua: installed from this checkout ({os.path.dirname(location)})")
    else:
        rc, _ = run.command([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                             ROOT], run.left_s("install"))
        result["status"] = "ok" if rc == 0 and result["status"] == "ok" else "failed"
    result["versions"] = {d: _version(d) for d in ("bagua", "torch", "lightning", "pytest", "pytest-xdist",
                                                   "pytest-timeout", "numpy", *WHEELS)}
    result["iproute2"] = {tool: shutil.which(tool) for tool in ("ip", "tc")}
    run.say("install: " + ", ".join(f"{d} {v or '-'}" for d, v in result["versions"].items()))
    if not all(result["iproute2"].values()):
        run.say("install: no ip/tc (iproute2): the network stages fall back to loopback; carry the .debs "
                f"({' '.join(DEBS)}) in {args.wheels}/debs (docs/gpu.md)")
    return result


def fetch(dest: str) -> int:
    """Download :data:`WHEELS` for the lent machine's Python into ``dest`` and, where apt-get works, :data:`DEBS`
    into ``dest/debs``; return pip's exit status."""
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                             "manylinux2014_x86_64", "manylinux1_x86_64") for a in ("--platform", p)]
    rc = subprocess.call([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                          "--python-version", DEVICE_PYTHON, "--implementation", "cp", *platforms, "-d", dest,
                          *(f"{d}=={v}" for d, v in WHEELS.items())])
    debs = os.path.join(dest, "debs")
    os.makedirs(debs, exist_ok=True)
    if not shutil.which("apt-get") or subprocess.call(["apt-get", "download", *DEBS], cwd=debs) != 0:
        print(f"gpu_check: could not download {' '.join(DEBS)} with apt-get (needed only where ip/tc are missing)")
    return rc
