"""Islands of fast links joined by a slow one: 2 islands x 2 hosts, the sharded GPT with HSDP, ByteGrad or DiLoCo
between the islands (``python -m benchmarks.sharded.islands``).

An :class:`IslandsCluster` is a :class:`~benchmarks.common.netns.NetnsCluster` rewired: the switch namespace holds one
bridge per island, hosts of island ``i`` are ports of bridge ``br<i>``, and the bridges are joined by one veth
pair (``x0`` on ``br0``, ``x1`` on ``br1``)::

    h0, h1 --- br0 --x0==========x1-- br1 --- h2, h3        (all in <prefix>s; == is the shaped link)

:meth:`IslandsCluster.shape` puts tbf on *both* ends of that pair (a full-duplex link of the rate between the
islands); the hosts' own links stay unshaped. Every host keeps its address on the one /24, so the islands are one
L2 segment and nothing else changes for the processes; namespaces, cleanup and signals are netns.py's.

The driver runs :mod:`benchmarks.sharded.sharded_gpt` on the 4 hosts, once per (rate, repeat, system), the systems
alternated inside each repeat so that the load of this shared machine falls on all of them alike, and writes
``<out-dir>/<name>.json``: one row per run (median step time, its ratio to plain HSDP's in the same repeat,
validation loss against steps, bytes sent per step).

Example::

    sudo python -m benchmarks.sharded.islands --rates 100mbit,10mbit --model gpt --warmup 1 --steps 3 \\
        --out-dir docs/log/results --name islands-steptime
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from benchmarks.common import netns
from benchmarks.network import _child_env, _tail, _wait_all

__all__ = ["IslandsCluster", "SYSTEMS", "SYNC_SYSTEMS", "run_islands_job", "add_ratios", "parse_args", "main"]

#: the systems between islands, as :mod:`benchmarks.sharded.sharded_gpt` names them; the first is the baseline
SYSTEMS = ("hsdp", "bagua-hsdp", "bytegrad-hsdp", "diloco-hsdp")
#: run only when ``--systems`` names them: Bagua's exchanges inside FSDP2's hook, what the overlap hides
SYNC_SYSTEMS = ("bagua-hsdp-sync", "bytegrad-hsdp-sync")

# the two ends of IslandsCluster.transfer_seconds, run with ``python -c`` in the hosts' namespaces
_RECEIVE = """import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("", int(sys.argv[1])))
s.listen(1); c, _ = s.accept(); first = c.recv(1 << 16); t0 = time.perf_counter()
while c.recv(1 << 16): pass
print(time.perf_counter() - t0)"""
_SEND = """import socket, sys, time
for _ in range(200):
    try: c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
c.sendall(bytes(int(sys.argv[3]))); c.close()"""


class IslandsCluster(netns.NetnsCluster):
    """``islands`` islands of ``per_island`` hosts; hosts of an island share a bridge, the bridges share one
    shaped veth pair. Host ``i`` is in island ``i // per_island`` (so rank order is island order).

    Args:
        islands: number of islands (2: one link joins them).
        per_island: hosts per island (2 or more).
        prefix, subnet: as :class:`~benchmarks.common.netns.NetnsCluster`'s.
    """

    def __init__(self, islands: int = 2, per_island: int = 2, prefix: Optional[str] = None,
                 subnet: str = "10.231.0") -> None:
        if islands != 2:
            raise ValueError(f"islands={islands}: only 2 islands (one link between them) are built")
        if per_island < 1:
            raise ValueError(f"per_island must be >= 1, got {per_island}")
        super().__init__(islands * per_island, prefix, subnet)
        self.islands, self.per_island = islands, per_island
        #: the ends of the link between the islands, in the switch namespace
        self.link_ends = ("x0", "x1")

    def island_of(self, host: int) -> int:
        """The island of host (rank) ``host``."""
        return host // self.per_island

    def create(self) -> None:
        """Build NetnsCluster's one bridge, then move island 1's hosts to a second bridge joined by the link."""
        super().create()
        br = self.bridge_namespace
        try:
            netns._ip("-n", br, "link", "add", "br1", "type", "bridge")
            netns._ip("-n", br, "link", "set", "br1", "up")
            for host in self.hosts:
                if self.island_of(host.index) == 1:
                    netns._ip("-n", br, "link", "set", f"h{host.index}", "master", "br1")
            a, b = self.link_ends
            netns._ip("-n", br, "link", "add", a, "type", "veth", "peer", "name", b)
            for end, bridge in ((a, "br0"), (b, "br1")):
                netns._ip("-n", br, "link", "set", end, "master", bridge)
                netns._ip("-n", br, "link", "set", end, "up")
        except BaseException:
            self.destroy()
            raise

    def shape(self, rate: Optional[str]) -> None:
        """Limit the link between the islands, both directions, to ``rate``; ``None``/"unshaped" removes it.
        Links inside an island are never shaped."""
        bits = netns.parse_rate(rate)
        for end in self.link_ends:
            if bits is None:
                subprocess.run(["ip", "netns", "exec", self.bridge_namespace, "tc", "qdisc", "del", "dev", end, "root"],
                               capture_output=True, timeout=20)  # no qdisc there yet is fine
            else:
                netns._tc(self.bridge_namespace, "qdisc", "replace", "dev", end, "root", "tbf", "rate", f"{bits}bit",
                          "burst", str(netns.tbf_burst_bytes(bits)), "latency", "100ms")
        self.rate = bits

    def link_bytes(self) -> dict[str, int]:
        """Bytes each end of the link between the islands has sent so far (its tbf's ``Sent`` counter)."""
        out = subprocess.run(["ip", "netns", "exec", self.bridge_namespace, "cat", "/proc/net/dev"],
                             capture_output=True, text=True, timeout=20).stdout
        sent = {}
        for line in out.splitlines()[2:]:
            name, _, counters = line.partition(":")
            if name.strip() in self.link_ends:
                sent[name.strip()] = int(counters.split()[8])
        return sent

    def transfer_seconds(self, src: int, dst: int, nbytes: int, port: int = 29699) -> float:
        """Send ``nbytes`` over TCP from host ``src`` to host ``dst``; return the receiver's seconds from the first
        byte to the last (a check of the link between them, not a benchmark)."""
        receiver = netns.popen(self.hosts[dst].exec_prefix() + [sys.executable, "-c", _RECEIVE, str(port)],
                               os.environ, subprocess.PIPE, subprocess.DEVNULL)
        try:
            sender = subprocess.run(self.hosts[src].exec_prefix() + [
                sys.executable, "-c", _SEND, self.hosts[dst].address, str(port), str(nbytes)],
                capture_output=True, text=True, timeout=120)
            if sender.returncode != 0:
                raise RuntimeError(f"the sender on host {src} failed: {sender.stderr[-1000:]}")
            out, _ = receiver.communicate(timeout=120)
        finally:
            if receiver.poll() is None:
                os.killpg(receiver.pid, 9)
                receiver.wait()
        return float(out)


# -- the driver ----------------------------------------------------------------------------------------------


def run_islands_job(cluster: IslandsCluster, system: str, job_args: Sequence[str], workdir: str, port: int,
                    timeout_s: float) -> dict:
    """Run :mod:`benchmarks.sharded.sharded_gpt` with ``system`` on every host of ``cluster``; return its row (``status``
    "ok", or "failed"/"timeout" with ``error``; never raises for a failed run)."""
    from benchmarks.to_target import to_target

    out = os.path.join(workdir, f"{system}-{port}")
    row: dict = {"system": system, "bandwidth": netns.format_rate(cluster.rate), "rate_bps": cluster.rate,
                 "hosts": cluster.n_hosts, "islands": cluster.islands}
    procs, logs = [], []
    link_start, start = cluster.link_bytes(), time.monotonic()
    try:
        for host in cluster.hosts:
            argv = host.exec_prefix() + [sys.executable, "-m", "benchmarks.sharded.sharded_gpt", "--system", system,
                                         "--shards", str(cluster.per_island), "--iface", host.iface, "--out", out,
                                         *job_args]
            logs.append(f"{out}.rank{host.index}.log")
            with open(logs[-1], "w") as f:
                procs.append(netns.popen(argv, _child_env(host, cluster.hosts[0], port, cluster.n_hosts), f, f))
        _wait_all(procs, start + timeout_s, row)
    finally:
        netns.kill_tracked_processes()  # what is left of this run: runs (and transfer checks) go one at a time
    row["wall_s"] = time.monotonic() - start
    if "status" in row:
        failed = int(row["error"].split()[1]) if row["error"].startswith("rank ") else 0
        return dict(row, error=row["error"] + "\n" + _tail(logs[failed]))
    ranks = []
    for i in range(cluster.n_hosts):
        with open(f"{out}.rank{i}.json") as f:
            ranks.append(json.load(f))
    warm = ranks[0]["warmup"]
    per_step = [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks))]  # the slowest rank's, step by step
    timed = per_step[warm:] or per_step
    link = cluster.link_bytes()
    row.update(status="ok", model=ranks[0]["model"], params=ranks[0]["params"], settings=ranks[0]["settings"],
               step_times_s=per_step, mean_step_s=statistics.mean(timed), median_step_s=statistics.median(timed),
               link_bytes_run=sum(link[e] - link_start.get(e, 0) for e in link),
               host_tx_bytes_per_step=[r["tx_bytes"] / max(len(r["step_times_s"]), 1) for r in ranks])
    if all("exchange_wait_s" in r for r in ranks):  # seconds the step waited for replica exchanges in flight
        row["exchange_wait_s"] = [max(ws) for ws in zip(*(r["exchange_wait_s"] for r in ranks))]
    row.update(to_target.summarize(ranks))
    return row


def add_ratios(rows: list[dict], base: str = SYSTEMS[0]) -> list[dict]:
    """Add ``step_speedup``: ``base``'s mean step time over the system's, within one (bandwidth, repeat, seed).
    The mean, not the median: DiLoCo's rare synchronizing steps are its whole communication cost."""
    key = (lambda r: (r["bandwidth"], r.get("repeat"), r.get("seed")))
    ref = {key(r): r["mean_step_s"] for r in rows if r["system"] == base and r.get("status") == "ok"}
    for r in rows:
        mine, theirs = r.get("mean_step_s"), ref.get(key(r))
        r["step_speedup"] = theirs / mine if mine and theirs else None
    return rows


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the driver's arguments; the job's own (``--max-steps``, ``--target``, ...) pass through."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.sharded.islands", description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="100mbit,10mbit", help="link between the islands, tc spelling, comma list")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list of {', '.join(SYSTEMS + SYNC_SYSTEMS)}")
    p.add_argument("--per-island", type=int, default=2, help="hosts per island (the shard dimension)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of all systems per rate (order rotated)")
    p.add_argument("--seeds", default="0", help="comma list; each seed is one round of all systems per rate")
    p.add_argument("--steps-for", default="", help="per-system --max-steps, e.g. hsdp=4,bagua-hsdp=4 (a "
                   "synchronous system's steps all cost alike; DiLoCo needs whole sync periods)")
    p.add_argument("--job-timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--port", type=int, default=29700, help="first rendezvous port (one per run)")
    p.add_argument("--out-dir", default="docs/log/results")
    p.add_argument("--name", default="islands")
    args, job = p.parse_known_args(argv)
    args.job_args = job
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS + SYNC_SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; available: {', '.join(SYSTEMS + SYNC_SYSTEMS)}")
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in args.rates:
        netns.parse_rate(rate)  # a misspelt rate fails now, not after the first runs
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.steps_for = {k.strip(): int(v) for k, v in (i.split("=") for i in args.steps_for.split(",") if i.strip())}
    return args


def _rounds(args: argparse.Namespace) -> list[tuple[int, int, list[str]]]:
    """(seed, repeat, systems in this round's order): each round starts one system later, so no system always
    runs first (or right after the same neighbour) while the machine's load drifts."""
    rounds, n = [], 0
    for seed in args.seeds:
        for repeat in range(args.repeats):
            k = n % len(args.systems)
            rounds.append((seed, repeat, args.systems[k:] + args.systems[:k]))
            n += 1
    return rounds


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Build the islands, run every (rate, round, system), write ``<out-dir>/<name>.json`` after each run."""
    args = parse_args(argv)
    ok, why = netns.netns_available()
    if not ok:
        print(f"benchmarks.sharded.islands needs network namespaces: {why}", file=sys.stderr)
        return 2
    netns.install_signal_handlers()
    os.makedirs(args.out_dir or ".", exist_ok=True)
    path = os.path.join(args.out_dir, f"{args.name}.json")
    meta = {"command": "python -m benchmarks.sharded.islands " + " ".join(argv if argv is not None else sys.argv[1:]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
            "topology": f"2 islands x {args.per_island} hosts, unshaped inside, one tbf-shaped link between"}
    rows: list[dict] = []
    port = args.port
    with tempfile.TemporaryDirectory(prefix="islands") as workdir, IslandsCluster(per_island=args.per_island) as cl:
        for rate in args.rates:
            cl.shape(rate)
            for seed, repeat, systems in _rounds(args):
                for system in systems:
                    port += 1
                    steps = ["--max-steps", str(args.steps_for[system])] if system in args.steps_for else []
                    row = run_islands_job(cl, system, [*args.job_args, *steps, "--seed", str(seed)], workdir, port,
                                          args.job_timeout)
                    row.update(repeat=repeat, seed=seed)
                    rows.append(row)
                    with open(path, "w") as f:
                        json.dump({"meta": meta, "results": add_ratios(rows)}, f, indent=1)
                    print(_describe(row), file=sys.stderr, flush=True)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def _describe(row: dict) -> str:
    """One line of progress for a finished run."""
    if row.get("status") != "ok":
        return f"{row['bandwidth']} {row['system']}: {row.get('status')}: {row.get('error', '')[-800:]}"
    return (f"{row['bandwidth']} seed {row.get('seed')} {row['system']}: mean step {row['mean_step_s']:.3f} s "
            f"({row.get('step_speedup') or 0:.2f}x hsdp), {row['link_bytes_run'] / 1e6:.1f} MB over the link in "
            f"the run, val loss {row['final_metric']:.3f} after {row['steps_run']} steps ({row['target_status']})")


if __name__ == "__main__":
    sys.exit(main())
