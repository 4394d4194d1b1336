"""The runner of the fault tests' jobs: worker processes on a real coordinator, a SIGKILLed one restarted once.

Each test module says how to start one of its workers (``spawn(i, port, out, log, restarted)``); :func:`run_job`
starts a coordinator and every worker, restarts (once) each worker that ended by SIGKILL, calls ``on_poll(job)`` at
every poll for what a test adds (SIGCONT a stopped worker, kill the coordinator, release a held file), kills what
is left on a timeout with the logs' tails in the error, and returns what every worker saved::

    results, codes, job = run_job(tmp_path, 3, lambda i, port, out, log, again: Popen(...))
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from bagua.torch_api.fault.coordinator import start_coordinator

__all__ = ["ROOT", "Job", "free_port", "tails", "python_module", "run_job"]

ROOT = Path(__file__).resolve().parents[2]
#: ``spawn(index, port, out, log, restarted)``: start worker ``index`` (``restarted``: after its SIGKILL)
Spawn = Callable[[int, int, Path, Path, bool], subprocess.Popen]


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tails(logs: list[Path], lines: int = 15) -> str:
    """The last ``lines`` lines of every log, for an assertion's message."""
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-lines:]) for p in logs if p.exists())


def python_module(module: str, args: list[str], log: Path, **env: str) -> subprocess.Popen:
    """``python -m module args`` from the repository's root, one thread, stdout and stderr appended to ``log``."""
    environ = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=environ, stdout=log.open("a"),
                            stderr=subprocess.STDOUT)


@dataclass
class Job:
    """A running job: its coordinator's port, the workers' processes, logs and outputs, who was restarted."""

    port: int
    coordinator: subprocess.Popen
    outs: list[Path]
    logs: list[Path]
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    restarted: list[int] = field(default_factory=list)

    def tails(self) -> str:
        """The workers' logs' tails."""
        return tails(self.logs)


def run_job(tmp_path: Path, workers: int, spawn: Spawn, *, restart: bool = True,
            on_poll: Optional[Callable[[Job], None]] = None, timeout_s: float = 150.0,
            check: bool = True) -> tuple[list[dict], dict[int, Optional[int]], Job]:
    """Run a job of ``workers`` processes to its end; see the module docstring.

    With ``check`` every worker must exit 0 and its saved output is loaded (``torch.load``, weights only) with its
    log under ``"log"``; without, each result holds the log only.
    """
    port = free_port()
    job = Job(port, start_coordinator("127.0.0.1", port), [tmp_path / f"w{i}.pt" for i in range(workers)],
              [tmp_path / f"w{i}.log" for i in range(workers)])
    start = time.monotonic()
    try:
        job.procs = {i: spawn(i, port, job.outs[i], job.logs[i], False) for i in range(workers)}
        while any(p.poll() is None for p in job.procs.values()):
            for i, p in list(job.procs.items()):
                if restart and p.poll() == -signal.SIGKILL and i not in job.restarted:
                    job.restarted.append(i)
                    job.procs[i] = spawn(i, port, job.outs[i], job.logs[i], True)
            if on_poll is not None:
                on_poll(job)
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"the job did not end within {timeout_s} s: " + job.tails())
            time.sleep(0.05)
    finally:
        for p in job.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        job.coordinator.kill()
        job.coordinator.wait()
    codes = {i: p.returncode for i, p in job.procs.items()}
    if not check:
        return [{"log": log.read_text()} for log in job.logs], codes, job
    assert all(c == 0 for c in codes.values()), f"exit codes {codes}: " + job.tails()
    results = [dict(torch.load(out, weights_only=True), log=job.logs[i].read_text()) for i, out in enumerate(job.outs)]
    return results, codes, job
