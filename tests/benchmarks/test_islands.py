"""Smoke test of the islands benchmark: the topology shapes the link between the islands and nothing inside one,
and every system but ``bagua-hsdp`` trains the sharded tiny GPT for 2 steps on it (``bagua-hsdp`` is native HSDP's
maths bit for bit, tests/sharded/test_sharded_replicas.py; its job would add ~20 s to the suite and check nothing new).

Marked ``netns``: needs root and iproute2, skipped otherwise (as tests/benchmarks/test_netns.py).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from benchmarks.common import netns
from benchmarks.sharded.islands import SYSTEMS, IslandsCluster, add_ratios, run_islands_job

_AVAILABLE, _WHY = netns.netns_available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _AVAILABLE, reason=_WHY)]

_MB = 2_000_000
_SYSTEMS = [s for s in SYSTEMS if s != "bagua-hsdp"]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_islands_shape_only_the_link_between_them_and_every_system_trains(tmp_path):
    prefix = f"bgi{os.getpid()}"
    with IslandsCluster(prefix=prefix) as cluster:
        cluster.shape("20mbit")
        assert [cluster.island_of(h.index) for h in cluster.hosts] == [0, 0, 1, 1]
        # inside an island: fast, and nothing crosses the link
        before = sum(cluster.link_bytes().values())
        inside = cluster.transfer_seconds(0, 1, _MB, port=29691)
        assert sum(cluster.link_bytes().values()) - before < 0.05 * _MB
        # between the islands, either way: at 20 Mbit/s less tbf's 256 KiB bucket, ~0.7 s, all of it over the link
        for src, dst, port in ((0, 2, 29692), (3, 1, 29693)):
            before = cluster.link_bytes()
            between = cluster.transfer_seconds(src, dst, _MB, port=port)
            sent = {e: n - before[e] for e, n in cluster.link_bytes().items()}
            assert sent["x0" if src < 2 else "x1"] >= _MB
            assert 0.5 < between < 3.0 and inside < between / 5, (inside, between)
        rows = [run_islands_job(cluster, system, ["--model", "gpt_tiny", "--max-steps", "2", "--eval-samples", "4"],
                                str(tmp_path), 29694 + i, timeout_s=240) for i, system in enumerate(_SYSTEMS)]
        created = set(cluster.namespaces())
        assert created <= _namespaces()
    assert not created & _namespaces(), "namespaces left behind"
    for row in add_ratios(rows):
        assert row["status"] == "ok", row.get("error")
        assert row["steps_run"] == 2 and len(row["step_times_s"]) == 2 and row["step_speedup"] > 0
        assert row["final_metric"] < 6.0 and row["link_bytes_run"] > 0
    by_system = {r["system"]: r for r in rows}
    assert list(by_system) == _SYSTEMS
    assert by_system["diloco-hsdp"]["settings"][1]["compression"] == "uint4"
