"""How far one coordinator goes: the quorum protocol's own cost at 2 to 256 workers, no model.

Workers are threads of this process (one :class:`~bagua.torch_api.fault.quorum.Quorums` each, with its own store
connections and heartbeat), against a real coordinator process (``start_coordinator``). A round is what
``FaultTolerance`` does around an exchange: ``wait`` (the quorum closes) then ``report`` (the verdict), every worker
released at once by a barrier. Per size it measures:

- ``round_ms``: median time from the barrier to the last worker holding its verdict (the whole round, with the
  workers' own Python work, serialized in one process);
- ``close_ms``: median time from the last worker's arrival (its ``wait`` call) to the last verdict: what the
  protocol adds once everyone is there;
- ``ops_per_round``: store calls of the workers' main connections per round (counted by wrapping each client);
  ``hb_ops_per_s``: the heartbeat connections' calls per second (they run between rounds too);
- ``coordinator_cpu_ms_per_round``: the coordinator process's CPU time (user + system) per round: the store's
  work, heartbeats included;
- ``coordinator_rss_mib``: the coordinator's resident memory after the size's rounds; ``keys_per_round``: how
  many keys the store gains per round (every worker deletes its records a few quorums back: about 0, the memory
  flat), ``keys``: the store's keys after the size's rounds (and a heartbeat, when the last deletions run).

Ratios are printed against the 4-worker round of the same run. Example::

    python -m benchmarks.fault.quorum_load --sizes 2,4,16,64,256 --out docs/log/results/2026-12-05-quorum-load.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import secrets
import statistics
import threading
import time
from typing import Any

__all__ = ["CountingStore", "measure", "main"]


class CountingStore:
    """Wrap a ``TCPStore`` client and count its calls (every method call is one request to the coordinator)."""

    def __init__(self, store: Any, counter: list[int]) -> None:
        self._store, self._counter = store, counter

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counter[0] += 1
            return attr(*args, **kwargs)

        return counted


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s(pid: int) -> float:
    """The CPU time (user + system) the process ``pid`` used so far, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(address: str, coordinator_pid: int, n: int, rounds: int, heartbeat_s: float, stale_s: float) -> dict:
    """Run ``rounds`` rounds (after the job's first) of ``n`` workers as threads; return the figures of one size."""
    from bagua.torch_api.fault.quorum import Quorums, connect_store
    from bagua.torch_api.fault.records import Member

    ops, hb_ops = [0], [0]
    secret = secrets.token_hex(32).encode()  # a job with a secret: every record sealed and checked, as advised
    qs = [Quorums(address, f"w{i:03d}", n, deadline_s=60.0, heartbeat_s=heartbeat_s, stale_s=stale_s,
                  timeout_s=300.0, prefix=f"load-{n}-{rounds}", secret=secret) for i in range(n)]
    for q in qs:
        q.store = CountingStore(q.store, ops)
        q.heartbeat.store = CountingStore(q.heartbeat.store, hb_ops)
    keys = connect_store(address, 60.0, "the load test")  # counts the store's keys, outside the rounds
    barrier = threading.Barrier(n)
    starts = [[0.0] * n for _ in range(rounds + 1)]
    ends = [[0.0] * n for _ in range(rounds + 1)]
    marks: list[tuple[int, int, float, int]] = []  # (main ops, heartbeat ops, coordinator CPU s, keys) per round
    hb_clock: list[float] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        q = qs[i]
        try:
            for r in range(rounds + 1):
                if barrier.wait() == 0:
                    marks.append((ops[0], hb_ops[0], _cpu_s(coordinator_pid), keys.num_keys()))
                    hb_clock.append(time.perf_counter())
                starts[r][i] = time.perf_counter()
                me = Member(round=r, joining=r == 0, samples=1, part=0)
                quorum = q.wait(q.next_key or 1, me)
                assert q.report(quorum, True), "a round without failures was not ok"
                assert len(quorum.ids) == n, f"round {r} closed with {len(quorum.ids)} of {n}"
                ends[r][i] = time.perf_counter()
            barrier.wait()
            if i == 0:
                time.sleep(1.5 * heartbeat_s)  # the heartbeats delete what the last rounds handed them
                marks.append((ops[0], hb_ops[0], _cpu_s(coordinator_pid), keys.num_keys()))
                hb_clock.append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q in qs:
        q.close()
    if errors:
        raise errors[0]
    timed = range(1, rounds + 1)  # round 0 is the job's start (every worker joins)
    round_s = [max(ends[r]) - min(starts[r]) for r in timed]
    close_s = [max(ends[r]) - max(starts[r]) for r in timed]
    main_ops = (marks[-1][0] - marks[1][0]) / rounds
    hb = (marks[-1][1] - marks[1][1]) / (hb_clock[-1] - hb_clock[1])
    cpu_ms = 1e3 * (marks[-1][2] - marks[1][2]) / rounds  # heartbeats included: they run during the rounds too
    return {"workers": n, "rounds": rounds, "round_ms": 1e3 * statistics.median(round_s),
            "round_ms_min": 1e3 * min(round_s), "close_ms": 1e3 * statistics.median(close_s),
            "ops_per_round": main_ops, "ops_per_worker_round": main_ops / n, "hb_ops_per_s": hb,
            "coordinator_cpu_ms_per_round": cpu_ms,
            "coordinator_rss_mib": _rss_mib(coordinator_pid), "keys": marks[-1][3],
            "keys_per_round": (marks[-1][3] - marks[1][3]) / rounds}


def main(argv: list[str] | None = None) -> None:
    """Measure every size in ``--sizes`` on one coordinator and print the table; ``--out``: save it as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4,16,64,256")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-round-s", type=float, default=60.0,
                        help="fewer rounds for a size whose first round took more than this / rounds")
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--stale-s", type=float, default=3.0)
    parser.add_argument("--label", default="", help="a name for this run in the JSON (e.g. 'before', 'after')")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    logging.getLogger("bagua").setLevel(logging.ERROR)
    from bagua.torch_api.fault.coordinator import start_coordinator
    from tests.fault.test_quorum import _free_port

    port = _free_port()
    proc = start_coordinator("127.0.0.1", port)
    rows = []
    try:
        rss0 = _rss_mib(proc.pid)
        for n in [int(s) for s in args.sizes.split(",")]:
            probe = measure(f"127.0.0.1:{port}", proc.pid, n, 1, args.heartbeat_s, args.stale_s)
            rounds = max(3, min(args.rounds, int(args.max_round_s / max(probe["round_ms"] / 1e3, 1e-3))))
            row = measure(f"127.0.0.1:{port}", proc.pid, n, rounds, args.heartbeat_s, args.stale_s)
            rows.append(row)
            print(f"{n:4d} workers: round {row['round_ms']:8.1f} ms (close after the last arrival "
                  f"{row['close_ms']:7.1f} ms), {row['ops_per_round']:8.0f} store ops/round "
                  f"({row['ops_per_worker_round']:.1f}/worker), coordinator CPU "
                  f"{row['coordinator_cpu_ms_per_round']:.1f} ms/round, "
                  f"heartbeats {row['hb_ops_per_s']:.0f} ops/s, "
                  f"coordinator RSS {row['coordinator_rss_mib']:.1f} MiB, store keys {row['keys']} "
                  f"({row['keys_per_round']:+.1f}/round)", flush=True)
    finally:
        proc.terminate()
        proc.wait()
    base = next((r for r in rows if r["workers"] == 4), rows[0])
    for r in rows:
        r["round_vs_4"] = r["round_ms"] / base["round_ms"]
        r["close_vs_4"] = r["close_ms"] / base["close_ms"]
        r["ops_vs_4"] = r["ops_per_round"] / base["ops_per_round"]
        r["coordinator_cpu_vs_4"] = r["coordinator_cpu_ms_per_round"] / max(base["coordinator_cpu_ms_per_round"], 1e-3)
        print(f"{r['workers']:4d} workers: round x{r['round_vs_4']:.2f}, close x{r['close_vs_4']:.2f}, "
              f"ops x{r['ops_vs_4']:.1f}, coordinator CPU x{r['coordinator_cpu_vs_4']:.1f} of the "
              f"{base['workers']}-worker round")
    load = os.getloadavg()
    result = {"label": args.label, "command": "python -m benchmarks.fault.quorum_load " + " ".join(
        argv if argv is not None else os.sys.argv[1:]), "uptime_load": load, "cpus": os.cpu_count(),
        "coordinator_rss_mib_at_start": rss0, "rows": rows}
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    if args.out:
        existing = json.load(open(args.out)) if os.path.exists(args.out) else {}
        existing[args.label or "run"] = result
        with open(args.out, "w") as f:
            json.dump(existing, f, indent=1)


if __name__ == "__main__":
    main()
