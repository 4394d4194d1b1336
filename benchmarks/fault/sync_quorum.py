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

``--kill-every K``: instead, an ``ft`` job in which a worker (w1, w2, ..., in turn) SIGKILLs itself before every
``K``-th job step (not in the last ``K / 2``) and is restarted at once (it heals from a live peer and rejoins):
its wall time for the same steps against the failure-free ``ft`` job's, and the final training loss of both (a
teacher's regression; the mean over the workers' last batches).

    .venv/bin/python -m benchmarks.fault.sync_quorum --workers 2 --steps 80 --step-s 0.1 --repeats 2
    .venv/bin/python -m benchmarks.fault.sync_quorum --workers 3 --steps 250 --step-s 0.05 --kill-every 100
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
    teacher = torch.nn.Linear(args.dim, args.dim)
    torch.nn.init.normal_(teacher.weight, std=args.dim ** -0.5)
    times: list = []
    try:
        _train(args, model, opt, ft, teacher, times)
    except Exception as exc:  # a worker restarted after the job's last step is told so: not a failure here
        from bagua.torch_api.fault import JobEnded

        if not isinstance(exc, JobEnded):
            raise
        times.clear()
    out: dict[str, Any] = {"times": times, "loss": times[-1][1] if times else None}
    times[:] = [t for t, _ in times]
    if ft is not None:
        steps = model.bagua_ddp.impl.steps
        out.update(wait=steps.wait_seconds, agree=steps.agree_seconds, retries=ft.retries)
        ft.close()
    Path(args.out).write_text(json.dumps(out))


def _train(args: argparse.Namespace, model: Any, opt: Any, ft: Any, teacher: Any, times: list) -> None:
    """The training loop: append ``(step seconds, loss)`` per step to ``times``."""
    import torch

    for i in range(args.steps):
        step = model.bagua_ddp.impl.steps.steps + 1 if ft is not None else i + 1
        if step > args.steps:
            break
        if (args.kill_every and step % args.kill_every == 0 and args.rank > 0
                and step <= args.steps - args.kill_every // 2
                and 1 + (step // args.kill_every - 1) % (args.workers - 1) == args.rank):
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(args.rank * 100003 + step)
        x = torch.randn(32, args.dim, generator=g)
        with torch.no_grad():
            y = teacher(x)
        started = time.perf_counter()
        opt.zero_grad()
        loss_t = torch.nn.functional.mse_loss(model(x), y)
        loss_t.backward()
        opt.step()
        times.append((time.perf_counter() - started, float(loss_t.detach())))


def run_job(mode: str, workers: int, steps: int, step_s: float, dim: int, hidden: int, kill_every: int = 0,
            timeout_s: float = 600.0) -> tuple[list[dict[str, Any]], float]:
    """Run one job of ``workers`` processes in ``mode`` (``"plain"`` or ``"ft"``; ``kill_every``: see the module
    docstring); return each worker's record and the job's wall time."""
    from bagua.torch_api.fault.coordinator import start_coordinator

    port = _free_port()
    coordinator = start_coordinator("127.0.0.1", port) if mode == "ft" else None
    with tempfile.TemporaryDirectory(prefix="bagua-sync-quorum-") as tmp:
        outs = [Path(tmp) / f"w{r}.json" for r in range(workers)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

        def spawn(r: int) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", "benchmarks.fault.sync_quorum", "--role", "worker",
                                     "--mode", mode, "--rank", str(r), "--workers", str(workers), "--port",
                                     str(port), "--coordinator", f"127.0.0.1:{port}", "--steps", str(steps),
                                     "--step-s", str(step_s), "--dim", str(dim), "--hidden", str(hidden),
                                     "--kill-every", str(kill_every), "--out", str(outs[r])], cwd=ROOT, env=env)

        started = time.monotonic()
        procs = [spawn(r) for r in range(workers)]
        try:
            while any(p.poll() is None for p in procs):
                for r, p in enumerate(procs):
                    if p.poll() == -signal.SIGKILL:
                        procs[r] = spawn(r)  # its launcher restarts it at once
                if time.monotonic() - started > timeout_s:
                    raise RuntimeError(f"the {mode} job did not end within {timeout_s} s")
                time.sleep(0.02)
            wall = time.monotonic() - started
            if any(p.returncode != 0 for p in procs):
                raise RuntimeError(f"a {mode} worker exited with {[p.returncode for p in procs]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            if coordinator is not None:
                coordinator.kill()
                coordinator.wait()
        return [json.loads(o.read_text()) for o in outs], wall


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
    ap.add_argument("--kill-every", type=int, default=0)
    args = ap.parse_args()
    if args.role == "worker":
        _worker(args)
        return
    if args.kill_every:
        got = {}
        for name, kill in (("failure_free", 0), ("killed", args.kill_every)):
            load = _load()
            records, wall = run_job("ft", args.workers, args.steps, args.step_s, args.dim, args.hidden, kill)
            losses = [r["loss"] for r in records if r["loss"] is not None]  # None: it arrived after the end
            got[name] = {"wall_s": wall, "loss": statistics.mean(losses), "load": load,
                         "ended_before_rejoin": len(records) - len(losses)}
            print(f"{name}: {wall:.1f} s for {args.steps} steps, final loss {got[name]['loss']:.4f} (load {load}); "
                  f"workers restarted after the job's end: {got[name]['ended_before_rejoin']}", flush=True)
        print(f"killed / failure-free wall time: {got['killed']['wall_s'] / got['failure_free']['wall_s']:.3f}")
        print(json.dumps({"workers": args.workers, "steps": args.steps, "kill_every": args.kill_every, **got}))
        return
    rows = []
    for repeat in range(args.repeats):
        order = ("plain", "ft") if repeat % 2 == 0 else ("ft", "plain")
        got: dict[str, Any] = {}
        for mode in order:
            load = _load()
            records, _ = run_job(mode, args.workers, args.steps, args.step_s, args.dim, args.hidden)
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
