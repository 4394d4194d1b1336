"""What a quorum per step costs a synchronous job without failures: fault-tolerant gradient allreduce against plain.

``--workers`` processes on this machine train the same small MLP (``--dim``, ``--hidden``; SGD) for ``--steps``
steps, each step's compute stretched to ``--step-s`` s by a sleep inside the forward (EMULATED compute: the
agreement can hide behind it as behind a real forward), through ``with_bagua`` and

- ``plain``: ``GradientAllReduceAlgorithm()`` in one gloo world of ``--workers`` ranks;
- ``ft``: ``GradientAllReduceAlgorithm(fault_tolerance=FaultTolerance(...))``, each worker a one-process job, a
  coordinator (``start_coordinator``).

Per run: the median step time (after ``--warmup`` steps) on the slowest worker; for ``ft`` also the median time the
training thread waited for the agreement after the backward (the part of the agreement not hidden) and the
agreement's own median time. The quorum's cost is ``ft / plain - 1`` of the step (goal: <= 3 %). ``--repeats``
pairs, the order alternating; the machine's load average is printed beside every figure.

    .venv/bin/python -m benchmarks.fault.sync_quorum --workers 2 --steps 80 --step-s 0.1 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run_job", "main"]

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


def _worker(args: argparse.Namespace) -> None:
    """One worker: train, then write its per-step times (and the agreement's) as JSON to ``--out``."""
    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    step_s = args.step_s

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(args.dim, args.hidden), torch.nn.ReLU(),
                                            torch.nn.Linear(args.hidden, args.dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            started = time.perf_counter()
            out = self.body(x)
            time.sleep(max(0.0, step_s - (time.perf_counter() - started)))  # emulated compute
            return out

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ft = None
    if args.mode == "ft":
        from bagua.torch_api.fault import FaultTolerance

        bagua.init_process_group()  # a job of one process
        ft = FaultTolerance(args.coordinator, worker=f"w{args.rank}", workers=args.workers, min_quorum=1)
        algorithm = GradientAllReduceAlgorithm(fault_tolerance=ft)
    else:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", args.port, args.workers, is_master=args.rank == 0)
        bagua.init_process_group(store=store, rank=args.rank, world_size=args.workers, local_world_size=1)
        algorithm = GradientAllReduceAlgorithm()
    model = model.with_bagua([opt], algorithm)
    g = torch.Generator().manual_seed(args.rank)
    times = []
    for _ in range(args.steps):
        x, y = torch.randn(32, args.dim, generator=g), torch.randn(32, args.dim, generator=g)
        started = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - started)
    out: dict[str, Any] = {"times": times}
    if ft is not None:
        steps = model.bagua_ddp.impl.steps
        out.update(wait=steps.wait_seconds, agree=steps.agree_seconds, retries=ft.retries)
        ft.close()
    Path(args.out).write_text(json.dumps(out))


def run_job(mode: str, workers: int, steps: int, step_s: float, dim: int, hidden: int,
            timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Run one job of ``workers`` processes in ``mode`` (``"plain"`` or ``"ft"``); return each worker's record."""
    from bagua.torch_api.fault.coordinator import start_coordinator

    port = _free_port()
    coordinator = start_coordinator("127.0.0.1", port) if mode == "ft" else None
    with tempfile.TemporaryDirectory(prefix="bagua-sync-quorum-") as tmp:
        outs = [Path(tmp) / f"w{r}.json" for r in range(workers)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.fault.sync_quorum", "--role", "worker",
                                   "--mode", mode, "--rank", str(r), "--workers", str(workers), "--port", str(port),
                                   "--coordinator", f"127.0.0.1:{port}", "--steps", str(steps), "--step-s",
                                   str(step_s), "--dim", str(dim), "--hidden", str(hidden), "--out", str(outs[r])],
                                  cwd=ROOT, env=env) for r in range(workers)]
        try:
            for p in procs:
                if p.wait(timeout=timeout_s) != 0:
                    raise RuntimeError(f"a {mode} worker exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            if coordinator is not None:
                coordinator.kill()
                coordinator.wait()
        return [json.loads(o.read_text()) for o in outs]


def _median_step(records: list[dict[str, Any]], warmup: int) -> float:
    return max(statistics.median(r["times"][warmup:]) for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["main", "worker"], default="main")
    ap.add_argument("--mode", choices=["plain", "ft"], default="ft")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    if args.role == "worker":
        _worker(args)
        return
    rows = []
    for repeat in range(args.repeats):
        order = ("plain", "ft") if repeat % 2 == 0 else ("ft", "plain")
        got: dict[str, Any] = {}
        for mode in order:
            load = _load()
            records = run_job(mode, args.workers, args.steps, args.step_s, args.dim, args.hidden)
            got[mode] = _median_step(records, args.warmup)
            got[f"{mode}_load"] = load
            if mode == "ft":
                got["wait_ms"] = 1e3 * max(statistics.median(r["wait"][args.warmup:]) for r in records)
                got["agree_ms"] = 1e3 * max(statistics.median(r["agree"][args.warmup:]) for r in records)
                got["retries"] = sum(r["retries"] for r in records)
        got["cost"] = got["ft"] / got["plain"] - 1
        rows.append(got)
        print(f"repeat {repeat}: plain {1e3 * got['plain']:.1f} ms/step (load {got['plain_load']}), ft "
              f"{1e3 * got['ft']:.1f} ms/step (load {got['ft_load']}): quorum cost {100 * got['cost']:+.1f} % of "
              f"the step; agreement {got['agree_ms']:.1f} ms, of which waited after the backward "
              f"{got['wait_ms']:.1f} ms; retries {got['retries']}", flush=True)
    print(json.dumps({"workers": args.workers, "steps": args.steps, "step_s": args.step_s, "dim": args.dim,
                      "hidden": args.hidden, "rows": rows}))


if __name__ == "__main__":
    main()
