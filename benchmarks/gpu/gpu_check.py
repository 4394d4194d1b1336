"""``benchmarks/gpu/gpu_check.sh OUT_DIR`` (``python -m benchmarks.gpu.gpu_check``): Bagua's CUDA paths in one command.

Made for a lent GPU machine (one H100 or H200, 16 cores, torch with CUDA, no package index; docs/gpu.md). The
stages (``--stage``, run in this order) write what they find to ``OUT_DIR/gpu_check.json`` and
``OUT_DIR/gpu_check.log``:

1. ``install`` (:mod:`~benchmarks.gpu.gpu_check_install`): the wheels the machine lacks, from ``--wheels DIR``
   (``--fetch DIR`` downloads them where PyPI is reachable), then ``pip install --no-deps --no-build-isolation -e .``
   (no index: no build isolation); it reports the versions found, and whether ``ip`` and ``tc`` are there.
2. ``tests``: the gpu-marked tests first, with CUDA; then the rest of the suite with CUDA hidden, because the test
   harness lets ``bagua.init_process_group`` pick NCCL whenever CUDA is visible, and its two-rank CPU jobs would
   then put two ranks on one GPU, which NCCL refuses.
3. ``codec``: MinMaxUInt8 encode and decode of ``--codec-elements`` (64 Mi) float32 in GB/s against the card's
   device-to-device copy (bytes read plus written); the goal is 40 % each. Then the codecs' Triton kernels against
   the whole-tensor path and the time their memory traffic takes, with their bytes checked against the CPU's
   (``benchmarks/codecs/codec_fused.py``), and torch's fused Adam against ``fuse_optimizer`` (with the timing functions of
   ``benchmarks/codecs/codec.py`` and ``benchmarks/micro/fused_optimizer.py``).
4. ``step`` (:mod:`~benchmarks.gpu.gpu_step`): the GPT's and the ResNet's training step on the GPU, fp32 and bf16.
5. ``network`` and ``latency``: :mod:`benchmarks.gpu.gpu_check_network`.

Without CUDA (or with ``--dry-run``) every stage still runs and each part that needs CUDA says so in one
``SKIP (no CUDA)`` line: the gpu-marked tests skip, the codec and the fused Adam are timed on CPU at the sizes
given, so CI runs this script (tests/test_gpu_check.py) and it cannot rot.

One time budget covers the call (``--budget-s``, 540 s: the device tool runs one command for at most 600 s). Each
stage leaves the later stages of the call their share (:data:`RESERVE_S`): the test suite is stopped, and network
runs are skipped, where they would overrun; the JSON says what was cut.

Example::

    benchmarks/gpu/gpu_check.sh "$OUT" --stage install,tests,codec --wheels .whl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Optional, Sequence

from benchmarks.gpu.gpu_check_install import ROOT, fetch, stage_install
from benchmarks.gpu.gpu_step import add_stage_arguments, stage_step

__all__ = ["STAGES", "RESERVE_S", "Run", "pytest_summary", "gpu_tests_seconds", "stage_tests", "copy_bandwidth",
           "codec_speeds", "stage_codec", "parse_args", "main"]

STAGES = ("install", "tests", "codec", "step", "network", "latency")
#: Seconds a stage keeps for itself from the stages before it in the same call.
RESERVE_S = {"install": 30, "tests": 120, "codec": 90, "step": 60, "network": 300, "latency": 150}
CODEC_GOAL = 0.40
#: Seconds the gpu-marked tests get at least with ``--gpu-tests-only`` (they took 68-71 s on the H100, 4 workers).
GPU_TESTS_S = 150.0


class Run:
    """One call: its output folder, deadline and stages, whether CUDA parts run, and what each stage found."""

    def __init__(self, out_dir: str, budget_s: float, cuda: bool, stages: Sequence[str]) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.deadline = time.monotonic() + budget_s
        self.cuda = cuda
        self.stages = list(stages)
        self.results: dict = {"meta": {}, "stages": {}}
        self._log = open(os.path.join(out_dir, "gpu_check.log"), "a")

    def say(self, line: str) -> None:
        print(line, flush=True)
        self._log.write(line + "\n")
        self._log.flush()

    def skip_cuda(self, stage: str, what: str) -> None:
        """The one line a dry run prints for a part that needs CUDA."""
        self.say(f"{stage}: SKIP (no CUDA): {what}")

    def left_s(self, stage: str) -> float:
        """Seconds ``stage`` may use: what remains less the reserves of the stages after it in this call, or, in
        a budget too small for those, its share of what remains in proportion to the reserves."""
        later = self.stages[self.stages.index(stage) + 1:] if stage in self.stages else []
        remaining = self.deadline - time.monotonic()
        share = RESERVE_S[stage] / (RESERVE_S[stage] + sum(RESERVE_S[s] for s in later))
        return max(remaining - sum(RESERVE_S[s] for s in later), remaining * share)

    def record(self, stage: str, result: dict) -> None:
        self.results["stages"][stage] = result
        self.save()

    def save(self) -> None:
        with open(os.path.join(self.out_dir, "gpu_check.json"), "w") as f:
            json.dump(self.results, f, indent=1, default=str)

    def command(self, argv: Sequence[str], timeout_s: float, env: Optional[dict] = None) -> tuple[Optional[int], str]:
        """Run ``argv`` in the checkout (its output goes to the log); ``(None, output)`` when stopped at
        ``timeout_s``, with every process it started (its own session: pytest's workers and their jobs too)."""
        self.say("$ " + " ".join(shlex.quote(a) for a in argv))
        start = time.monotonic()
        with tempfile.TemporaryFile(mode="w+") as out:
            proc = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc: Optional[int] = proc.wait(timeout=max(timeout_s, 1.0))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
            out.seek(0)
            text = out.read()
        self._log.write(text + ("" if text.endswith("\n") else "\n"))
        self._log.flush()
        if rc is None:
            self.say(f"   stopped after {timeout_s:.0f} s: the time budget (--budget-s) ran out")
        else:
            self.say(f"   exit status {rc} after {time.monotonic() - start:.0f} s")
        return rc, text


# -- tests ------------------------------------------------------------------------------------------------------

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?|deselected)")
_SUMMARY_LINE = re.compile(r"^=*\s*(\d+ (passed|failed|skipped|xfailed|xpassed|errors?|deselected|warnings?)"
                           r"|no tests ran).* in [\d.]+s")


def pytest_summary(rc: Optional[int], output: str) -> dict:
    """Counts, and the failed, xfailed and skipped lines of pytest's ``-q -rfEsxX`` output.

    Example:
        >>> pytest_summary(1, "FAILED tests/a.py::t - boom\\n1 failed, 2 passed, 3 skipped in 1.00s")["counts"]
        {'failed': 1, 'passed': 2, 'skipped': 3}
    """
    lines = output.splitlines()
    final = next((line for line in reversed(lines) if _SUMMARY_LINE.match(line)), "")
    counts = {word if not word.startswith("error") else "errors": int(n) for n, word in _COUNT.findall(final)}
    pick = lambda prefix: [line for line in lines if line.startswith(prefix)][:300]  # noqa: E731
    status = {0: "ok", 5: "ok", None: "partial"}.get(rc, "failed")  # 5: nothing selected
    return {"status": status, "rc": rc, "counts": counts, "summary": final.strip("= "), "failed": pick("FAILED ") +
            pick("ERROR "), "xfailed": pick("XFAIL "), "skipped": pick("SKIPPED ")}


def gpu_tests_seconds(run: Run, only: bool) -> float:
    """Seconds the gpu-marked tests may take: with the rest of the suite to follow, half the stage's time (at least
    4 minutes of it); alone (``--gpu-tests-only``), the stage's time but at least :data:`GPU_TESTS_S` where the call
    has it (they took 68-71 s on the H100: a small budget's share for the stage, 60 s in one call, cut them)."""
    left = run.left_s("tests")
    if only:
        return max(left, min(run.deadline - time.monotonic(), GPU_TESTS_S))
    return min(left, max(240.0, left / 2))


def stage_tests(run: Run, args: argparse.Namespace) -> dict:
    import importlib.util

    from bagua.torch_api import env

    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEsxX", *args.tests_path]
    hidden = dict(env.environ_snapshot(), CUDA_VISIBLE_DEVICES="")
    left = gpu_tests_seconds(run, args.gpu_tests_only)  # a hung gpu test must leave the rest of the suite its time
    workers = args.pytest_workers
    if workers is None:
        workers = min(8, (os.cpu_count() or 1) // 2) if (os.cpu_count() or 1) >= 8 else 0
    parallel = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 and importlib.util.find_spec("xdist") else []
    # the gpu-marked tests share the one GPU between at most 4 workers (each job takes well under 1 GiB of it)
    gpu_parallel = ["-n", str(min(workers, 4)), "--dist", "loadfile"] if parallel else []
    rc, out = run.command(base + ["-m", "gpu", *gpu_parallel], left,
                          env=env.environ_snapshot() if run.cuda else hidden)
    gpu = pytest_summary(rc, out)
    if run.cuda:
        run.say(f"tests: gpu-marked, with CUDA: {gpu['summary'] or 'no summary'}")
        for line in gpu["xfailed"]:  # which algorithms gloo cannot run on CUDA tensors, and why
            run.say("tests: " + line)
    else:
        run.skip_cuda("tests", f"the gpu-marked tests skip here ({gpu['summary'] or 'no summary'})")
    if args.gpu_tests_only:
        for line in gpu["failed"]:
            run.say("tests: " + line)
        run.say("tests: the rest: not run (--gpu-tests-only)")
        return {"status": gpu["status"], "gpu_marked": gpu, "rest": {"status": "skipped", "summary": "not run: "
                "--gpu-tests-only", "failed": []}}
    if run.left_s("tests") < 30:
        run.say("tests: the rest: not run, the time budget is spent (run --stage tests in a call of its own)")
        rest = {"status": "partial", "summary": "not run: no time left", "failed": []}
        return {"status": "failed" if gpu["status"] == "failed" else "partial", "gpu_marked": gpu, "rest": rest}
    rc, out = run.command(base + ["-m", "not gpu", *parallel], run.left_s("tests"), env=hidden)
    rest = pytest_summary(rc, out)
    run.say(f"tests: the rest, CUDA hidden{' (' + str(workers) + ' xdist workers)' if parallel else ''}: "
            f"{rest['summary'] or 'no summary'}")
    for line in gpu["failed"] + rest["failed"]:
        run.say("tests: " + line)
    statuses = (gpu["status"], rest["status"])
    status = "failed" if "failed" in statuses else "partial" if "partial" in statuses else "ok"
    return {"status": status, "gpu_marked": gpu, "rest": rest}


# -- codec and fused Adam -----------------------------------------------------------------------------------------


def copy_bandwidth(numel: int, device: str, repeats: int) -> float:
    """Bytes per second of a float32 ``copy_`` of ``numel`` elements on ``device``, bytes read plus written
    (median of ``repeats``; CUDA events on the GPU)."""
    import torch

    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 8 * numel / statistics.median(times)


def codec_speeds(rows: Sequence[dict], copy_bps: float, goal: float = CODEC_GOAL) -> list[dict]:
    """Encode and decode against the copy: ``GB/s`` of float32 elements (4 bytes each, the codec benchmark's unit)
    over the copy's bytes per second; also the bytes they must move (5 per element: 4 float32 + 1 code).

    Example:
        >>> codec_speeds([{"op": "encode", "numel": 10**9, "ms": 2000.0}], 4e9)[0]["of_copy"]
        0.5
    """
    out = []
    for row in rows:
        if row["op"] in ("encode", "decode"):
            seconds = row["ms"] / 1e3
            gbps = 4 * row["numel"] / seconds / 1e9
            of_copy = gbps * 1e9 / copy_bps
            out.append({"op": row["op"], "numel": row["numel"], "ms": row["ms"], "gb_per_s": round(gbps, 2),
                        "copy_gb_per_s": round(copy_bps / 1e9, 2), "of_copy": round(of_copy, 4),
                        "moved_of_copy": round(5 * row["numel"] / seconds / copy_bps, 4), "goal": goal,
                        "met": of_copy >= goal})
    return out


def _benchmark_script(name: str):
    """``benchmarks/<name>.py`` (``name`` like ``"codecs/codec"``) as a module, loaded from its file."""
    import importlib.util

    path = os.path.join(ROOT, "benchmarks", *f"{name}.py".split("/"))
    spec = importlib.util.spec_from_file_location(f"_bagua_benchmark_{name.replace('/', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stage_codec(run: Run, args: argparse.Namespace) -> dict:
    import torch

    device = "cuda" if run.cuda else "cpu"
    if not run.cuda:
        run.skip_cuda("codec", f"the GPU's copy bandwidth and the codec on CUDA; timing {args.codec_elements} "
                               "elements on cpu instead")
    copy_bps = copy_bandwidth(args.codec_elements, device, args.repeats)
    codec = _benchmark_script("codecs/codec")
    rows = codec.bench(args.codec_elements, args.codec_chunks, torch.device(device), args.repeats)
    speeds = codec_speeds(rows, copy_bps)
    for r in speeds:
        run.say(f"codec: {device} {r['op']}: {r['gb_per_s']:.1f} GB/s of float32 = {r['of_copy']:.0%} of the "
                f"{r['copy_gb_per_s']:.0f} GB/s copy (goal {r['goal']:.0%}: {'met' if r['met'] else 'missed'}; "
                f"counting the bytes it must move: {r['moved_of_copy']:.0%})")
    blocks = codec.bench_blocks(args.codec_elements, args.codec_block, args.codec_chunks, torch.device(device),
                                args.repeats)
    for r in blocks:
        r["of_copy"] = round(r["gb_per_s"] * 1e9 / copy_bps, 4)
        run.say(f"codec: {device} block-wise {r['codec']} {r['op']} (block {r['block']}): {r['ms']:.2f} ms, "
                f"{r['gb_per_s']:.1f} GB/s of float32 = {r['of_copy']:.0%} of the copy")
    kernels = None
    if run.cuda:  # the Triton kernels against the traffic bound and the whole-tensor path, and their bytes
        try:
            kernels = _benchmark_script("codecs/codec_fused").bench_fused(args.codec_elements, args.codec_block,
                                                                   args.codec_chunks)
            for line in _benchmark_script("codecs/codec_fused").describe(kernels):
                run.say("codec kernels: " + line)
        except Exception:  # noqa: BLE001 - reported in the JSON and the log, the other stages still run
            kernels = {"error": traceback.format_exc()}
            run.say("codec kernels failed:\n" + kernels["error"])
    if not run.cuda:
        run.skip_cuda("fused adam", "torch's fused Adam against fuse_optimizer on the GPU; timing "
                                    f"{args.adam_params} x {args.adam_shape}^2 on cpu instead")
    fused = _benchmark_script("micro/fused_optimizer")
    shape = (args.adam_shape, args.adam_shape)
    # compiled (Triton) on the GPU only: on a CPU dry run a compile would cost more than the stage's budget
    ms = fused.time_round_robin(fused.variants("adam", args.adam_params, shape, device, None, compiled=run.cuda),
                                args.repeats, 2, device, "wall")
    against = (f", torch fused {ms['torch_fused']:.2f} ms (fuse_optimizer takes {ms['fused'] / ms['torch_fused']:.2f}x "
               "its time)" if "torch_fused" in ms else ", torch fused: unavailable")
    run.say(f"fused adam: {device}, {args.adam_params} x {args.adam_shape}^2, median of {args.repeats} steps: unfused "
            f"{ms['unfused']:.2f} ms, fuse_optimizer {ms['fused']:.2f} ms"
            + (f", compile=True {ms['compiled']:.2f} ms" if "compiled" in ms else "")
            + f", foreach {ms['foreach']:.2f} ms" + against)
    return {"status": "ok", "device": device, "copy_gb_per_s": round(copy_bps / 1e9, 2), "codec": speeds,
            "codec_rows": rows, "block_rows": blocks, "kernels": kernels,
            "fused_adam_ms": ms}


# -- the command line -------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from benchmarks.gpu.gpu_check_network import add_arguments

    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", help="folder of gpu_check.json, gpu_check.log and the network CSVs")
    p.add_argument("--stage", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    p.add_argument("--budget-s", type=float, default=540.0, help="seconds for the whole call")
    p.add_argument("--dry-run", action="store_true", help="skip the CUDA parts even where CUDA is available")
    p.add_argument("--wheels", default=".whl", help="folder of the wheels to install (install stage)")
    p.add_argument("--fetch", metavar="DIR", help="instead: download the wheels (and iproute2 .debs) into DIR")
    p.add_argument("--tests-path", nargs="+", default=["tests"], help="what pytest runs (tests stage)")
    p.add_argument("--gpu-tests-only", action="store_true", help="the tests stage runs the gpu-marked tests alone")
    p.add_argument("--pytest-workers", type=int, default=None, help="pytest-xdist workers for the non-gpu tests "
                                                                      "(default: up to 8 on 8 cores or more)")
    p.add_argument("--codec-elements", type=int, default=64 << 20, help="float32 elements the codec encodes")
    p.add_argument("--codec-chunks", type=int, default=8, help="chunks (ranks of a bucket) of the codec run")
    p.add_argument("--codec-block", type=int, default=4096, help="block size of the block-wise codecs' timing")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats of the codec and the fused Adam steps")
    p.add_argument("--adam-params", type=int, default=100, help="parameters of the fused Adam comparison")
    p.add_argument("--adam-shape", type=int, default=1024, help="each an N x N matrix")
    add_arguments(p)
    add_stage_arguments(p)
    args = p.parse_args(argv)
    args.stages = [s.strip() for s in args.stage.split(",") if s.strip()]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        p.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    args.stages = [s for s in STAGES if s in args.stages]
    if not args.fetch and not args.out_dir:
        p.error("give the output folder (or --fetch DIR)")
    return args


def _machine(cuda: bool) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
            "cpus": os.cpu_count(), "kernel": platform.release(), "cuda": cuda, "started": time.strftime("%F %T")}
    if cuda:
        prop = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        info.update(gpu=prop.name, gpus=torch.cuda.device_count(), gpu_memory_gib=round(prop.total_memory / 2**30, 1),
                    capability=f"{prop.major}.{prop.minor}", nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple)
                    else str(nccl))
    return info


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the stages; 0 when none failed (a stage cut short by the budget is not a failure)."""
    args = parse_args(argv)
    if args.fetch:
        return fetch(args.fetch)
    import torch
    from benchmarks.gpu import gpu_check_network
    cuda = torch.cuda.is_available() and not args.dry_run
    run = Run(args.out_dir, args.budget_s, cuda, args.stages)
    run.results["meta"] = dict(_machine(cuda), argv=list(sys.argv[1:] if argv is None else argv))
    where = run.results["meta"].get("gpu", "none: a dry run, the CUDA parts are skipped with one line each")
    run.say(f"gpu_check: stages {','.join(args.stages)}, budget {args.budget_s:.0f} s, torch {torch.__version__}, "
            f"CUDA: {where}")
    stages = {"install": stage_install, "tests": stage_tests, "codec": stage_codec, "step": stage_step,
              "network": gpu_check_network.stage_network, "latency": gpu_check_network.stage_latency}
    for name in args.stages:
        run.say(f"== {name} ({max(run.left_s(name), 0):.0f} s of the budget)")
        try:
            run.record(name, stages[name](run, args))
        except Exception:  # noqa: BLE001 - one broken stage must not stop the others
            run.say(f"{name}: error:\n{traceback.format_exc()}")
            run.record(name, {"status": "error", "error": traceback.format_exc()})
    statuses = {name: run.results["stages"][name]["status"] for name in args.stages}
    run.say(f"gpu_check: {', '.join(f'{k} {v}' for k, v in statuses.items())}; wrote {run.out_dir}/gpu_check.json "
            "and gpu_check.log")
    return 0 if all(s in ("ok", "partial") for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
