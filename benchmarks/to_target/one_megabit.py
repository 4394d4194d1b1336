"""Step times on a slow link without paying the start-up on it: ``python -m benchmarks.to_target.one_megabit``.

At 1 Mbit/s the GPT's initial broadcast (43 MB from rank 0) alone takes 6 minutes or more, longer than the
steps being timed. This driver runs each system on emulated hosts (:class:`~benchmarks.common.netns.NetnsCluster`,
its own namespace prefix ``omb<pid>`` and subnet, so it can run beside other emulations) with the link
*unshaped* through start-up and warm-up, then shapes every link to ``--rate`` while the ranks wait (the
workload's ``--go-file``) and times the steps there. The rows are those of ``benchmarks.network``
(``phase="step_time"``, ``compute_s`` included), so :mod:`benchmarks.common.report` and
:mod:`benchmarks.to_target.limit` read them.

Example::

    sudo .venv/bin/python -m benchmarks.to_target.one_megabit --hosts 2 --rate 1mbit \\
        --system ddp=1:1 --system "diloco:sync_every=20:hierarchical=False:compression=uint4=2:40" \\
        --out docs/log/results/one-megabit-times.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Optional, Sequence

from benchmarks import network
from benchmarks.common import netns, report
from benchmarks.common.job import Job

__all__ = ["parse_system", "time_system", "main"]


def parse_system(item: str) -> tuple[str, int, int]:
    """``SYSTEM=WARMUP:STEPS`` as ``(system, warmup, steps)``.

    Example:
        >>> parse_system("diloco:sync_every=20=2:40")
        ('diloco:sync_every=20', 2, 40)
    """
    system, _, counts = item.rpartition("=")
    warmup, _, steps = counts.partition(":")
    if not system or not (warmup.isdigit() and steps.isdigit()):
        raise ValueError(f"--system {item!r}: write SYSTEM=WARMUP:STEPS, e.g. ddp=1:1")
    return system, int(warmup), int(steps)


def _uptime() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def time_system(cluster: netns.NetnsCluster, job: Job, workdir: str, port: int, timeout_s: float) -> dict:
    """Run ``job`` with the link unshaped until every rank finished its warm-up, then at ``job.rate``."""
    hosts = cluster.hosts[: job.hosts]
    out = os.path.join(workdir, f"job{port}")
    go = f"{out}.go"
    row: dict = {"model": job.model, "system": job.system, "hosts": job.hosts, "bandwidth": job.bandwidth,
                 "rate_bps": job.rate, "emulated": True, "warmup": job.warmup, "phase": "step_time", "seed": 0,
                 "load_start": _uptime()}
    cluster.shape(None)
    procs, logs = [], []
    start = time.monotonic()
    try:
        for host in hosts:
            argv = host.exec_prefix() + [sys.executable, "-m", "benchmarks.common.workload", *job.workload_args(),
                                         "--iface", host.iface, "--out", out, "--go-file", go]
            logs.append(f"{out}.rank{host.index}.log")
            with open(logs[-1], "w") as f:
                procs.append(netns.popen(argv, network._child_env(host, hosts[0], port, job.hosts), f, f))
        while not all(os.path.exists(f"{go}.ready{h.index}") for h in hosts):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > start + timeout_s:
                row.update(status="failed", error="a rank died or timed out before its warm-up ended")
                return row
            time.sleep(0.05)
        cluster.shape(netns.format_rate(job.rate))
        row["shaped_after_s"] = time.monotonic() - start
        with open(go, "w"):
            pass
        network._wait_all(procs, start + timeout_s, row)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        row["wall_s"] = time.monotonic() - start
        row["load_end"] = _uptime()
    if "status" in row:
        row["error"] += "\n" + network._tail(logs[0])
        return row
    ranks = []
    for host in hosts:
        with open(f"{out}.rank{host.index}.json") as f:
            ranks.append(json.load(f))
    row["status"] = "ok"
    row.update(report.summarize_ranks(ranks, job.rate, True))
    return row


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    """Time every ``--system`` at ``--rate`` on each host count; append the rows to ``--out`` as they finish."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.one_megabit", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="2", help="comma list of host counts")
    p.add_argument("--rate", default="1mbit", help="the link while timing (tc spelling)")
    p.add_argument("--system", action="append", required=True, metavar="SYSTEM=WARMUP:STEPS")
    p.add_argument("--model", default="gpt")
    p.add_argument("--job-timeout", type=float, default=1800.0)
    p.add_argument("--out", required=True, help="JSON file; existing rows are kept and new ones appended")
    args = p.parse_args(argv)
    systems = [parse_system(s) for s in args.system]
    rows: list[dict] = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)["results"]
    meta = {"command": " ".join(["python -m benchmarks.to_target.one_megabit", *(argv or sys.argv[1:])]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": report.machine_info()}
    netns.install_signal_handlers()
    prefix = f"omb{os.getpid() % 100000}"
    with tempfile.TemporaryDirectory(prefix="one-megabit-") as workdir:
        for hosts in [int(h) for h in args.hosts.split(",")]:
            with netns.NetnsCluster(hosts, prefix=prefix, subnet="10.233.0") as cluster:
                for system, warmup, steps in systems:
                    job = Job(args.model, system, hosts, netns.parse_rate(args.rate), warmup, steps, 1)
                    port = 21000 + len(rows) % 1000
                    rows.append(time_system(cluster, job, workdir, port, args.job_timeout))
                    rows[-1]["run"] = meta["started"]
                    print(f"{job.describe()}: {rows[-1]['status']} mean step {rows[-1].get('mean_step_s')} "
                          f"compute {rows[-1].get('compute_s')} load {rows[-1]['load_end']}", flush=True)
                    with open(args.out, "w") as f:
                        json.dump({"meta": meta, "results": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
