"""Run the original Bagua's own test suite (and the lightning-bagua plugin's) against this project.

The original's tests were written for CUDA/NCCL, torch 1.x and Python <= 3.10. This script copies them to a
scratch directory, applies a fixed list of mechanical edits (below, each with its reason; no assertion is touched),
and runs pytest on the in-scope files with a per-test timeout, then prints a per-file table.

Usage (the original's files are not part of this repository; fetch them yourself)::

    python tools/run_original_tests.py --bagua ORIG_BAGUA_DIR [--plugin ORIG_PLUGIN_DIR] [--work DIR]
        [--timeout 600] [-k EXPR] [FILE ...]

``ORIG_BAGUA_DIR`` holds the original repository's ``tests/`` (or is that directory); ``ORIG_PLUGIN_DIR`` the same
for Lightning-Universe/lightning-Bagua. ``FILE`` narrows the run to paths relative to ``tests/`` (for example
``torch_api/test_decentralized.py``). Run it from anywhere with this project importable (the script puts the
repository root on ``PYTHONPATH`` after the copied tests, so ``import tests`` finds the original's package).

Not part of the CI suite: CI has no copy of the original's files.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

__all__ = ["EDITS", "OUT_OF_SCOPE", "apply_edits", "prepare", "main"]

REPO = Path(__file__).resolve().parents[1]
STALE_FILESTORE = Path("/tmp/.bagua.test.filestore")  # init_method of the original's torch reference runs
LINGER_S = 60
FILE_TIMEOUT_S = 3600

#: (pattern, replacement, reason). Applied in order to every copied ``.py`` file, line by line.
EDITS: list[tuple[str, str, str]] = [
    (r"^[ \t]*@skip_if_lt_x_gpu\(\d+\)[ \t]*\n", "", "CUDA-only skip marker dropped"),
    (r"^[ \t]*@RunIf\(min_gpus=\d+\)[ \t]*\n", "", "CUDA-only skip marker dropped (plugin)"),
    (r"@RunIf\(min_gpus=\d+, standalone=True\)", "@RunIf(standalone=True)",
     "CUDA-only part of the plugin's marker dropped; standalone tests still run on their own, as upstream"),
    (r"not torch\.cuda\.is_available\(\)", "False", "CUDA-only skip (decorator and inline guards) dropped"),
    (r"torch\.cuda\.device_count\(\)", "2", "world size 2"),
    (r"\.cuda\([^()]*\)", ".cpu()", "cuda -> cpu"),
    (r"torch\.cuda\.Stream\(\)", 'torch.Stream("cpu")',
     "cuda -> cpu: torch.cpu.Stream is a stub without synchronize(); torch.Stream('cpu') is the CPU stream"),
    (r"torch\.cuda\.(set_device|Stream|stream|synchronize|current_stream)\b", r"torch.cpu.\1", "cuda -> cpu"),
    (r"([\"'])cuda(:\d+)?\1", r"\1cpu\1", "cuda -> cpu"),
    (r"accelerator=\"gpu\"", "accelerator=\"cpu\"", "cuda -> cpu (plugin)"),
    (r"([\"'])nccl\1", r"\1gloo\1", "nccl -> gloo"),
    (r"device_ids=\[rank\]", "device_ids=None", "cuda -> cpu: torch DDP takes no device_ids for a CPU module"),
    (r"inspect\.getargspec\(", "inspect.getfullargspec(",
     "Python 3.11 removed inspect.getargspec; getfullargspec(...).args is the same list"),
    (r"^( *)from torch\.nn\.parallel\._replicated_tensor_ddp_utils import \(\n.*\n\s*\)\n\n\s*"
     r"_set_ddp_with_replicated_tensor\(True\)\n",
     r"\1pass  # torch 1.13's replicated-tensor DDP switch: removed in torch 2.x, unused by Bagua\n",
     "harness (tests/internal/multi_process_v2.py): torch 1.13-only import removed"),
    (r"^( *)fn = getattr\(self, method_name\)\n\s*setattr\(self, method_name, self\.join_or_run\(fn\)\)\n",
     r"\1fn = getattr(self, method_name, None)\n"
     r"\1if fn is not None:\n\1    setattr(self, method_name, self.join_or_run(fn))\n",
     "harness (multi_process_v2.py): pytest >= 8 builds unittest classes as Class('runTest') while collecting; "
     "tolerated as torch's later copy of this harness does"),
]

#: Paths (relative to ``tests/``) not run, with the reason the issue gives.
OUT_OF_SCOPE: dict[str, str] = {
    "internal/": "the torch 1.9 test harness the original vendored (support code, no tests)",
    "torch_api/data_parallel/test_c10d_common.py": "vendored torch 1.9 DDP suite; needs torch._six",
    "torch_api/data_parallel/test_c10d_nccl.py": "imports test_c10d_common; NCCL process groups",
    "torch_api/data_parallel/test_bagua_ddp.py": "imports tests/internal/torch (torch._six)",
    "torch_api/test_process_group.py": "out of scope per issue 21 (the process-group API of the Rust core)",
    "pytorch_lightning/": "Lightning 1.x pytorch_lightning.strategies.BaguaStrategy",
    "pytorch-lightning/": "Lightning 1.x pytorch_lightning.strategies.BaguaStrategy",
    "service/": "the Flask autotune service (autotune here is built on Optuna)",
}


def apply_edits(text: str) -> str:
    """Return ``text`` with every edit of :data:`EDITS` applied."""
    for pattern, replacement, _ in EDITS:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    return text


def _tests_dir(path: Path) -> Path:
    return path if path.name == "tests" else path / "tests"


def prepare(source: Path, dest_root: Path) -> Path:
    """Copy ``source``'s ``tests/`` under ``dest_root``, edit it, and return the copied ``tests/`` directory.

    Every directory gets an ``__init__.py`` (the original's are empty files, which stored copies often lack), so
    ``from tests.internal... import`` and same-named files in two directories both work.
    """
    src = _tests_dir(source)
    dest = dest_root / "tests"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    for directory in [dest, *[p for p in dest.rglob("*") if p.is_dir()]]:
        (directory / "__init__.py").touch(exist_ok=True)
    for path in dest.rglob("*.py"):
        path.write_text(apply_edits(path.read_text()))
    return dest


def _in_scope(tests: Path) -> list[str]:
    files = sorted(str(p.relative_to(tests)) for p in tests.rglob("test_*.py"))
    return [f for f in files if not any(f.startswith(prefix) for prefix in OUT_OF_SCOPE)]


def _pytest(root: Path, targets: list[str], junit: Optional[Path], timeout: int, extra: list[str], env: dict) -> int:
    report = [f"--junitxml={junit}", "-o", "junit_family=xunit1", "-o", "junit_logging=all"] if junit else []
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", f"--timeout={timeout}",
           "--continue-on-collection-errors", *report, *extra, *targets]
    print("$ cd", root, "&&", " ".join(cmd), flush=True)
    # Several tests fork children and only join them with a timeout; a child that hangs keeps pytest from exiting
    # (multiprocessing joins every child at exit). Once pytest has written its report, its process group gets
    # LINGER_S seconds to exit, then it is killed; the whole file gets FILE_TIMEOUT_S.
    if STALE_FILESTORE.exists():
        STALE_FILESTORE.unlink()  # the fixed rendezvous file of several tests; a crashed run leaves it behind
    if junit is not None:
        junit.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True)
    start, reported = time.monotonic(), None
    while proc.poll() is None:
        time.sleep(1)
        if reported is None and junit is not None and junit.exists():
            reported = time.monotonic()
        now = time.monotonic()
        if (reported is not None and now - reported > LINGER_S) or now - start > FILE_TIMEOUT_S:
            print(f"!! killing pytest's process group ({'children left behind' if reported else 'file timeout'})")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return 1
    return proc.returncode


def _outcomes(junit: Path, suite: str) -> dict[tuple[str, str], str]:
    """Map (file, test name) to passed / failed / error / skipped / xfail, read from a JUnit XML report."""
    found: dict[tuple[str, str], str] = {}
    if not junit.exists():
        return found
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        kinds = {child.tag for child in case}
        skipped = case.find("skipped")
        if "failure" in kinds:
            outcome = "failed"
        elif "error" in kinds:
            outcome = "error"
        elif skipped is not None:
            outcome = "xfail" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            # Several of the original's tests do not check their child processes' exit codes: a child that died
            # leaves zeros in shared results, and zeros compare equal. Such a pass is reported apart.
            captured = " ".join(child.text or "" for child in case if child.tag in ("system-out", "system-err"))
            outcome = "passed, child traceback" if "Traceback (most recent call last)" in captured else "passed"
        found[(f"{suite}: {file}", case.get("name", ""))] = outcome
    return found


def _print_table(outcomes: dict[tuple[str, str], str]) -> None:
    cols = ["passed", "passed, child traceback", "failed", "error", "skipped", "xfail"]
    table: dict[str, dict[str, int]] = {}
    for (file, _), outcome in outcomes.items():
        table.setdefault(file, dict.fromkeys(cols, 0))[outcome] += 1
    print("\n| file | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    total = dict.fromkeys(cols, 0)
    for file in sorted(table):
        print(f"| {file} | " + " | ".join(str(table[file][c]) for c in cols) + " |")
        for c in cols:
            total[c] += table[file][c]
    print("| **total** | " + " | ".join(str(total[c]) for c in cols) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bagua", type=Path, help="directory holding the original Bagua's tests/")
    parser.add_argument("--plugin", type=Path, help="directory holding lightning-Bagua's tests/")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--timeout", type=int, default=600, help="per-test timeout in seconds")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("files", nargs="*", help="files relative to tests/ (default: every in-scope file)")
    args = parser.parse_args(argv)
    if args.bagua is None and args.plugin is None:
        parser.error("give --bagua, --plugin or both")

    work = args.work or Path(tempfile.mkdtemp(prefix="bagua-original-tests-"))
    extra = ["-k", args.keyword] if args.keyword else []
    outcomes: dict[tuple[str, str], str] = {}
    status = 0

    suites = [("bagua", args.bagua), ("lightning-bagua", args.plugin)]
    for name, source in suites:
        if source is None:
            continue
        root = work / name
        tests = prepare(source, root)
        # The copied suite comes first so that ``import tests`` is the original's package, not this project's.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))
        # One intra-op thread per process, as torchrun sets: the tests spawn 2 ranks each, and with a thread per
        # core each on a small machine a 1000-step test of a 3-layer MLP outlives the tests' 60 s join timeouts.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.pop("RUN_STANDALONE_TESTS", None)
        targets = [f"tests/{f}" for f in sorted(args.files or _in_scope(tests)) if (tests / f).exists()]
        if not targets:
            continue
        # One pytest process per file: some of the original's tests fork children (multiprocessing's default on
        # Linux), which would inherit a process group that an earlier file initialized in the pytest process.
        for target in targets:
            junit = root / f"junit-{target.replace('/', '_')}.xml"
            status |= _pytest(root, [target], junit, args.timeout, extra, env)
            outcomes.update(_outcomes(junit, name))
        if name == "lightning-bagua":
            # Upstream runs tests marked standalone one at a time (tests/run_standalone_tests.sh): a 2-device
            # Trainer re-launches the command line in each rank, which must then be this one test.
            for target in targets:
                for test in re.findall(r"standalone=True\)\s*\ndef (\w+)", (root / target).read_text()):
                    env_one = dict(env, RUN_STANDALONE_TESTS="1")
                    # Every rank runs this same command line, so no JUnit report (they would write one file at
                    # once): the exit status is the outcome, and it replaces the skip recorded by the first run.
                    rc = _pytest(root, [f"{target}::{test}"], None, args.timeout, extra, env_one)
                    status |= rc
                    outcomes[(f"{name}: {target}", test)] = "passed" if rc == 0 else "failed"
    print("\nedits applied:")
    for reason in dict.fromkeys(reason for _, _, reason in EDITS):
        print("  -", reason)
    print("out of scope:")
    for prefix, reason in OUT_OF_SCOPE.items():
        print(f"  - tests/{prefix}: {reason}")
    _print_table(outcomes)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
