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
import statistics
import sys
import tempfile
import time
from typing import Optional, Sequence

from benchmarks import network
from benchmarks.common import netns
from benchmarks.common import report as bench_report
from benchmarks.common.job import Job

__all__ = ["STEPS", "IDLE_COMPUTE_S", "parse_system", "time_system", "combine", "report", "main"]


_P = "diloco:sync_every=10:hierarchical=False:compression=uint4:outer_lr=1.0:outer_momentum=0.0"
_W = "diloco:sync_every=10:hierarchical=False:compression=uint4:outer_lr=1.0:outer_momentum=0.5:outer_lr_warmup=10"
#: (hosts, system) -> steps to val loss 2.40 per seed, measured on unshaped links (docs/log/results/...)
STEPS: dict[tuple[int, str], tuple[list[int], str]] = {
    (2, "ddp"): ([480, 520, 500], "to-target-gpt-2hosts.json"),
    (2, _P): ([600, 440, 520], "to-target-gpt-2hosts.json"),
    (2, _P.replace("sync_every=10", "sync_every=20")): ([520, 480, 600], "diloco-gpt-h20-seeds.json"),
    (2, _P + ":fragments=2:overlap_steps=3"): ([620, 460, 500], "to-target-gpt-2hosts.json"),
    (2, _P + ":fragments=2:overlap_steps=4"): ([520, 500], "diloco-gpt-2hosts-overlap4.json (seeds 0-1)"),
    (4, "ddp"): ([320, 320, 380], "to-target-gpt-4hosts-outer.json"),
    (4, _W): ([200, 280, 240], "to-target-gpt-4hosts-outer.json"),
    (4, _W.replace("compression=uint4", "compression=nf2:block_size=256")): ([220, 300, 240],
                                                                           "to-target-gpt-4hosts-nf2.json"),
    (4, _W.replace("sync_every=10", "sync_every=20")): ([280], "to-target-gpt-4hosts-outer.json (seed 0)"),
    (4, _P): ([500, 380, 380], "to-target-gpt-4hosts.json"),
    (4, _P + ":fragments=2:overlap_steps=3"): ([540, 440, 420], "to-target-gpt-4hosts.json"),
}
#: the compute step of an idle machine: DDP's compute_s in the blocks the 10 Mbit/s figures come from
IDLE_COMPUTE_S = {2: 0.703, 4: 1.483}


def report(rows: list[dict]) -> list[dict]:
    """Combine timed rows with :data:`STEPS` per host count (:func:`combine`); the plain ``_P`` run of the same
    host count gives the fragment exchange the overlapped settings' projection re-hides."""
    out = []
    for hosts in sorted({r["hosts"] for r in rows}):
        mine = {r["system"]: r for r in rows if r["hosts"] == hosts and r.get("status") == "ok"}
        ddp = mine.get("ddp")
        if ddp is None:
            continue
        plain = mine.get(_P) or mine.get(_W)
        fragment = None
        if plain is not None:
            every = int(dict(kv.split("=", 1) for kv in plain["system"].split(":")[1:])["sync_every"])
            fragment = (plain["mean_step_s"] - statistics.median(plain["step_times_s"])) * every / 2
        for system, row in mine.items():
            if (hosts, system) not in STEPS:
                continue
            steps, source = STEPS[(hosts, system)]
            entry = combine(row, steps, ddp, STEPS[(hosts, "ddp")][0], IDLE_COMPUTE_S[hosts], fragment)
            entry.update(hosts=hosts, steps_from=source, load=[row.get("load_start"), row.get("load_end")])
            out.append(entry)
    return out


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
    row.update(bench_report.summarize_ranks(ranks, job.rate, True))
    return row


def combine(row: dict, steps: Sequence[int], ddp: dict, ddp_steps: Sequence[int], idle_compute_s: float,
            fragment_exchange_s: Optional[float] = None) -> dict:
    """Time to target as steps x mean step for one timed ``row``, against DDP's ``ddp`` row of the same block, its
    free-exchange limit (steps x ``compute_s``) and a projection at an idle machine's compute step.

    The inner step is the median timed step (most DiLoCo steps do not communicate; DDP's: its ``compute_s``), the
    exposed exchange ``mean - inner`` per step. The projection keeps that exposed exchange (the link's, not the
    CPU's) and puts ``idle_compute_s`` under it; with ``overlap_steps`` it re-hides ``fragment_exchange_s`` (one
    fragment's exchange, measured without overlap) behind ``overlap_steps x idle_compute_s``.

    Example:
        >>> ddp = {"mean_step_s": 400.0, "compute_s": 5.0, "system": "ddp"}
        >>> r = combine({"mean_step_s": 8.0, "step_times_s": [5.0] * 9 + [35.0], "compute_s": 5.0,
        ...              "system": "diloco:sync_every=10"}, [500], ddp, [500], 1.0)
        >>> round(r["vs_ddp"], 1), r["efficiency"], round(r["idle_vs_ddp"], 1)
        (50.0, 0.625, 99.0)
    """
    def time_of(steps_: Sequence[int], step_s: float) -> float:
        return statistics.median(s * step_s for s in steps_)

    inner = ddp["compute_s"] if row is ddp else statistics.median(row["step_times_s"])
    exposed = max(row["mean_step_s"] - inner, 0.0)
    ddp_time = time_of(ddp_steps, ddp["mean_step_s"])
    ddp_idle = time_of(ddp_steps, idle_compute_s + ddp["mean_step_s"] - ddp["compute_s"])
    options = dict(kv.split("=", 1) for kv in row["system"].split(":")[1:] if "=" in kv)
    overlap = int(options.get("overlap_steps", 0))
    if overlap and fragment_exchange_s is not None:
        every = int(options.get("sync_every", 10)) / int(options.get("fragments", 1))
        idle_step = idle_compute_s + max(fragment_exchange_s - overlap * idle_compute_s, 0.0) / every
    else:
        idle_step = idle_compute_s + exposed
    time_s = time_of(steps, row["mean_step_s"])
    limit_s = time_of(steps, row["compute_s"])
    idle_s = time_of(steps, idle_step)
    return {"system": row["system"], "steps": list(steps), "mean_step_s": row["mean_step_s"], "inner_step_s": inner,
            "compute_s": row["compute_s"], "exposed_s": exposed, "time_s": time_s, "vs_ddp": ddp_time / time_s,
            "limit_vs_ddp": ddp_time / limit_s, "efficiency": limit_s / time_s,
            "idle_step_s": idle_step, "idle_vs_ddp": ddp_idle / idle_s,
            "idle_limit_vs_ddp": ddp_idle / time_of(steps, idle_compute_s),
            "idle_efficiency": time_of(steps, idle_compute_s) / idle_s}


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    """Time every ``--system`` at ``--rate`` on each host count; append the rows to ``--out`` as they finish."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.one_megabit", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="2", help="comma list of host counts")
    p.add_argument("--rate", default="1mbit", help="the link while timing (tc spelling)")
    p.add_argument("--system", action="append", default=[], metavar="SYSTEM=WARMUP:STEPS")
    p.add_argument("--report", nargs="+", default=None, metavar="TIMES.json",
                   help="time nothing: combine these files' rows with STEPS and write the table to --out")
    p.add_argument("--model", default="gpt")
    p.add_argument("--job-timeout", type=float, default=1800.0)
    p.add_argument("--out", required=True, help="JSON file; existing rows are kept and new ones appended")
    args = p.parse_args(argv)
    if args.report:
        rows = [r for path in args.report for r in json.load(open(path))["results"]]
        table = report(rows)
        with open(args.out, "w") as f:
            json.dump({"table": table, "results": rows}, f, indent=1)
        for t in table:
            print(f"{t['hosts']} {t['system'][-45:]:45s} step {t['mean_step_s']:7.2f} inner {t['inner_step_s']:5.2f} "
                  f"compute {t['compute_s']:5.2f} | {t['vs_ddp']:6.1f}x / {t['limit_vs_ddp']:6.1f}x "
                  f"({t['efficiency']:.2f}) | idle {t['idle_vs_ddp']:6.1f}x / {t['idle_limit_vs_ddp']:6.1f}x "
                  f"({t['idle_efficiency']:.2f})")
        return table
    if not args.system:
        p.error("give --system SYSTEM=WARMUP:STEPS (one or more) or --report")
    systems = [parse_system(s) for s in args.system]
    rows: list[dict] = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)["results"]
    meta = {"command": " ".join(["python -m benchmarks.to_target.one_megabit", *(argv or sys.argv[1:])]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": bench_report.machine_info()}
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
