"""The network stages of :mod:`benchmarks.gpu.gpu_check`: every system over emulated hosts within the call's time
budget, and a latency axis where the kernel has sch_netem.

``network``: ``--network-hosts`` (2,4) x ``--network-models`` (mlp,gpt) x ``--network-rates`` (1gbit,100mbit) x
every system of ``bagua-bench`` (DDP, DDP + fp16, DDP + PowerSGD, every registered algorithm), each run as
:func:`benchmarks.network.run_job` runs it: one process per emulated host, tbf on both ends of every link.
The hosts train on CPU over gloo, with CUDA hidden from them (:func:`_hosts_without_cuda`).

``latency``: DDP and the systems meant to tolerate latency (:data:`LATENCY_SYSTEMS`: decentralized, async,
DiLoCo) at ``--latency-ms`` (0,1,5,20) of one-way delay between any two hosts: netem on each host's own end of its
link, under its tbf (a round trip is twice the delay). It runs where ``tc qdisc add dev lo root netem delay 5ms``
works in a probe namespace; elsewhere one line says why not.

Runs go in *lanes*: a lane is one emulated cluster (namespaces, so links, of its own) for one host count, model and
rate, which runs its systems one after another (DDP first). Lanes run side by side, one thread each, a lane
starting whenever its hosts fit ``--lane-cores`` (default: the cores less two; 4-host lanes and slow links first),
so 16 cores run about 14 single-threaded ranks at a time. Lanes side by side share the memory bus and the kernel:
the numbers check every path and give rough speedups; they are not numbers to publish (docs/benchmarks.md gives the
method for those). Before each run a lane compares the time left with its slowest run so far, and records a run
that would not fit as ``skipped``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["LATENCY_SYSTEMS", "Lane", "add_arguments", "netem_available", "add_delay", "next_lane", "order_systems",
           "run_lanes", "stage_network", "stage_latency"]

#: Systems of the latency axis (those not registered in this checkout are left out).
LATENCY_SYSTEMS = ("ddp", "decentralized", "decentralized:peer_selection_mode=shift_one",
                   "low_precision_decentralized", "async", "diloco")
PRIOR_S = 30.0  # what a run is expected to take before any run of its model has been timed
_NETEM_LIMIT = "100000"  # packets netem may hold: 20 ms at 1 Gbit/s is ~1700 full-size packets in flight
_clusters = 0


@dataclass
class Lane:
    """One emulated cluster of ``hosts`` and the jobs it runs in order, with ``delay_ms`` of one-way latency."""

    name: str
    hosts: int
    jobs: list = field(default_factory=list)
    delay_ms: float = 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The network and latency options of the ``gpu_check`` command line."""
    p.add_argument("--network-hosts", default="2,4", help="host counts of the network stage")
    p.add_argument("--network-models", default="mlp,gpt", help="models of the network stage")
    p.add_argument("--network-rates", default="1gbit,100mbit", help="link rates of the network stage")
    p.add_argument("--network-systems", default="all", help="'all' or a comma list of bagua-bench systems")
    p.add_argument("--network-warmup", type=int, default=1, help="untimed steps per run")
    p.add_argument("--network-steps", type=int, default=2, help="timed steps per run")
    p.add_argument("--job-timeout", type=float, default=300.0, help="seconds before one run is stopped")
    p.add_argument("--lane-cores", type=int, default=max((os.cpu_count() or 1) - 2, 1),
                   help="ranks that may run at once (lanes run side by side while their hosts fit)")
    p.add_argument("--latency-ms", default="0,1,5,20", help="one-way delays of the latency stage")
    p.add_argument("--latency-systems", default=",".join(LATENCY_SYSTEMS), help="systems of the latency stage")
    p.add_argument("--latency-hosts", type=int, default=2, help="hosts of the latency stage")
    p.add_argument("--latency-model", default="mlp", help="model of the latency stage")
    p.add_argument("--latency-rate", default="1gbit", help="link rate of the latency stage")


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _tc(namespace: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True, timeout=20)


def netem_available() -> tuple[bool, str]:
    """Whether netem qdiscs can be made here (root, iproute2 and the kernel's sch_netem); ``(False, why)``."""
    from benchmarks.common import netns
    ok, why = netns.netns_available()
    if not ok:
        return False, f"no network emulation: {why}"
    probe = f"bgq{os.getpid()}"
    subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=20, check=True)
    try:
        out = _tc(probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "5ms")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    if out.returncode != 0:
        return False, f"this kernel has no sch_netem (`tc qdisc add dev lo root netem delay 5ms`: {out.stderr.strip()})"
    return True, "sch_netem works"


def add_delay(cluster, delay_ms: float) -> None:
    """Delay every packet a host sends by ``delay_ms``: netem on the host's own end of its link, as the child of
    its tbf when the link is shaped (call it again after every ``cluster.shape``, which replaces the tbf)."""
    for host in cluster.hosts:
        shown = _tc(host.namespace, "qdisc", "show", "dev", host.iface).stdout
        tbf = re.search(r"qdisc tbf (\w+): root", shown)
        where = ["parent", f"{tbf.group(1)}:1"] if tbf else ["root"]
        out = _tc(host.namespace, "qdisc", "replace", "dev", host.iface, *where, "netem", "delay", f"{delay_ms:g}ms",
                  "limit", _NETEM_LIMIT)
        if out.returncode != 0:
            raise RuntimeError(f"netem delay {delay_ms:g}ms on {host.namespace}/{host.iface}: {out.stderr.strip()}")


def next_lane(pending: list[Lane], used: int, capacity: int) -> Optional[Lane]:
    """The first of ``pending`` whose hosts fit beside ``used`` running ranks within ``capacity`` (a lane larger
    than ``capacity`` runs alone); None when none fits now.

    Example:
        >>> pending = [Lane("a", 4), Lane("b", 4), Lane("c", 2)]
        >>> next_lane(pending, 0, 7).name, next_lane(pending, 4, 7).name, next_lane(pending, 6, 7)
        ('a', 'c', None)
    """
    return next((lane for lane in pending if used + lane.hosts <= capacity or used == 0), None)


def order_systems(systems: list[str]) -> list[str]:
    """DDP first (every speedup is against it), then Bagua's algorithms, then the other DDP variants: a lane cut
    short by the budget has run the systems that matter most.

    Example:
        >>> order_systems(["ddp_fp16", "bytegrad", "ddp", "async"])
        ['ddp', 'bytegrad', 'async', 'ddp_fp16']
    """
    from benchmarks.common.systems import DDP_SYSTEMS, split_system

    rank = lambda s: 0 if s == "ddp" else 2 if split_system(s)[0] in DDP_SYSTEMS else 1  # noqa: E731
    return sorted(systems, key=rank)


def _cluster(hosts: int, emulate: bool):
    from benchmarks.common import netns
    global _clusters
    _clusters += 1
    if not emulate:
        return netns.LoopbackCluster(hosts)
    return netns.NetnsCluster(hosts, prefix=f"gc{os.getpid() % 10000}x{_clusters}")


def _expected_s(seen: dict, job) -> float:
    """What ``job`` should take: the slowest run so far of its model, hosts and rate, else of its model, else
    :data:`PRIOR_S`."""
    same = seen.get((job.model, job.hosts, job.rate))
    model = [w for (m, _, _), walls in seen.items() if m == job.model for w in walls]
    return max(same or model or [PRIOR_S])


def _run_lane(run, stage: str, lane: Lane, cluster, workdir: str, end: float, job_timeout: float, rows: list,
              seen: dict, lock: threading.Lock, stamp: str) -> None:
    from benchmarks.common import netns
    from benchmarks import network
    from bagua.torch_api import env

    shaped = "unset"
    for k, job in enumerate(lane.jobs):
        left = end - time.monotonic()
        with lock:
            expect = _expected_s(seen, job)
        row: dict = {"model": job.model, "system": job.system, "hosts": job.hosts, "bandwidth": job.bandwidth,
                     "rate_bps": job.rate, "emulated": cluster.emulated}
        try:
            if left < expect:
                row.update(status="skipped", error=f"not run: {left:.0f} s left, such a run took {expect:.0f} s")
            else:
                if job.rate != shaped:
                    cluster.shape(netns.format_rate(job.rate))
                    if lane.delay_ms:
                        add_delay(cluster, lane.delay_ms)
                    shaped = job.rate
                port = 20000 + k if cluster.emulated else env.find_free_network_port()
                row = network.run_job(cluster, job, workdir, port, min(job_timeout, left))
                if row["status"] == "timeout" and left < job_timeout:
                    row["error"] = f"stopped at the end of the time budget, after {left:.0f} s"
                with lock:
                    seen.setdefault((job.model, job.hosts, job.rate), []).append(row["wall_s"])
        except Exception as exc:  # noqa: BLE001 - a broken lane reports its runs and stops; the others go on
            row.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        row.update(run=stamp, lane=lane.name, latency_ms=lane.delay_ms)
        if lane.delay_ms:
            row["bandwidth"] = f"{row['bandwidth']}+{lane.delay_ms:g}ms"
        with lock:
            rows.append(row)
        step = f", step {row['step_s'] * 1e3:.0f} ms" if row.get("step_s") else ""
        why = f" ({row['error'].splitlines()[0][:200]})" if row["status"] != "ok" and row.get("error") else ""
        run.say(f"{stage}: {job.hosts} hosts {row['bandwidth']} {job.model} {job.system}: {row['status']}{step}{why}")


def run_lanes(run, stage: str, lanes: list[Lane], emulate: bool, capacity: int, end: float,
              job_timeout: float) -> list[dict]:
    """Run ``lanes`` side by side, in the given order, each in a thread on a cluster of its own, starting a lane
    whenever its hosts fit the ``capacity`` (:func:`next_lane`), until ``end`` (``time.monotonic()``); return every
    run's row, the skipped ones included."""
    from benchmarks.common import netns
    netns.install_signal_handlers()
    rows: list[dict] = []
    seen: dict = {}  # (model, hosts, rate) -> wall seconds of its runs so far, for every lane's estimates
    lock = threading.Lock()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    pending, running = list(lanes), []
    # every cluster stays until the last lane ends: destroying one kills every tracked process, other lanes' too
    with tempfile.TemporaryDirectory(prefix="bagua-gpu-check-") as workdir, contextlib.ExitStack() as clusters:
        while pending or running:
            running = [(t, lane) for t, lane in running if t.is_alive()]
            lane = next_lane(pending, sum(lane.hosts for _, lane in running), capacity)
            if lane is None:
                time.sleep(0.5)
                continue
            pending.remove(lane)
            cluster = clusters.enter_context(_cluster(lane.hosts, emulate))
            folder = os.path.join(workdir, lane.name)
            os.makedirs(folder)
            thread = threading.Thread(target=_run_lane, daemon=True, args=(
                run, stage, lane, cluster, folder, end, job_timeout, rows, seen, lock, stamp))
            thread.start()
            running.append((thread, lane))
    return rows


@contextlib.contextmanager
def _hosts_without_cuda():
    """Hide CUDA from the emulated hosts while a stage runs: they train on CPU over gloo, as bagua-bench does on a
    machine without a GPU, and with CUDA visible ``bagua.init_process_group`` would choose NCCL (every host's rank
    on the one GPU, with CPU tensors)."""
    from bagua.torch_api import env

    before = env.environ_snapshot().get("CUDA_VISIBLE_DEVICES")
    env._export({"CUDA_VISIBLE_DEVICES": ""})  # read by the hosts' processes when they start
    try:
        yield
    finally:
        env._export({"CUDA_VISIBLE_DEVICES": before})


def _report(run, stage: str, rows: list[dict], meta: dict) -> dict:
    from benchmarks.common import report
    rows = report.add_speedups(rows)
    run.say(report.format_table(rows))
    report.write_results(run.out_dir, stage, rows, meta, make_plot=False)
    statuses = {r["status"] for r in rows}
    status = "failed" if "failed" in statuses else "partial" if statuses - {"ok"} else "ok"
    counts = {s: sum(r["status"] == s for r in rows) for s in sorted(statuses)}
    run.say(f"{stage}: {', '.join(f'{n} {s}' for s, n in counts.items())}; wrote {stage}.json and {stage}.csv")
    return {"status": status, "counts": counts, "meta": meta, "rows": rows}


def _emulation(run, stage: str) -> tuple[bool, str]:
    from benchmarks.common import netns
    emulate, why = netns.netns_available()
    if not emulate:
        run.say(f"{stage}: no network emulation ({why}): loopback processes, unshaped links only")
    return emulate, why


def stage_network(run, args: argparse.Namespace) -> dict:
    """Every system, host count, model and rate of the network stage; see the module docstring."""
    from benchmarks.common import netns
    from benchmarks import network
    emulate, why = _emulation(run, "network")
    rates = [netns.parse_rate(r) for r in _split(args.network_rates)] if emulate else [None]
    systems = order_systems(network.resolve_systems(args.network_systems))
    # one lane per host count, model and rate: the largest and the slowest links start first
    lanes = [Lane(f"{hosts}h-{model}-{netns.format_rate(rate)}", hosts, [
        network.Job(model=model, system=system, hosts=hosts, rate=rate, warmup=args.network_warmup,
                    steps=args.network_steps, epochs=1) for system in systems])
        for hosts in sorted((int(h) for h in _split(args.network_hosts)), reverse=True)
        for rate in sorted(rates, key=lambda r: float("inf") if r is None else r)
        for model in _split(args.network_models)]
    end = time.monotonic() + run.left_s("network")
    with _hosts_without_cuda():
        rows = run_lanes(run, "network", lanes, emulate, args.lane_cores, end, args.job_timeout)
    meta = {"emulated": emulate, "fallback_reason": None if emulate else why, "systems": systems,
            "lanes": [lane.name for lane in lanes]}
    return _report(run, "network", rows, meta)


def stage_latency(run, args: argparse.Namespace) -> dict:
    """DDP against the latency-tolerant systems at each one-way delay, where netem works; see the docstring."""
    from benchmarks.common import netns
    from benchmarks import network
    from benchmarks.common.systems import available_systems, split_system

    ok, why = netem_available()
    if not ok:
        run.say(f"latency: SKIP: {why}")
        return {"status": "ok", "skipped": why}
    known = available_systems()
    systems = [s for s in _split(args.latency_systems) if split_system(s)[0] in known]
    rate = netns.parse_rate(args.latency_rate)
    lanes = [Lane(f"{delay:g}ms", args.latency_hosts, [
        network.Job(model=args.latency_model, system=system, hosts=args.latency_hosts, rate=rate,
                    warmup=args.network_warmup, steps=args.network_steps, epochs=1)
        for system in order_systems(systems)], delay_ms=delay)
        for delay in (float(d) for d in _split(args.latency_ms))]
    end = time.monotonic() + run.left_s("latency")
    with _hosts_without_cuda():
        rows = run_lanes(run, "latency", lanes, True, args.lane_cores, end, args.job_timeout)
    return _report(run, "latency", rows, {"emulated": True, "systems": systems, "delays_ms": _split(args.latency_ms),
                                          "delay": "one way, netem on each host's own end of its link"})
