"""Quick tests of the benchmark suite's pure pieces: rates, counters, interval union, report maths."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from benchmarks.common import netns, report
from benchmarks.common.systems import _IntervalTimer


def test_parse_and_format_rate():
    assert netns.parse_rate("100mbit") == 100_000_000
    assert netns.parse_rate("1gbit") == 10**9
    assert netns.parse_rate("2.5gbit") == 2_500_000_000
    assert netns.parse_rate("unshaped") is None
    for bits in (10**8, 10**9, 10**10):
        assert netns.parse_rate(netns.format_rate(bits)) == bits
    with pytest.raises(ValueError, match="e.g. 100mbit"):
        netns.parse_rate("1 gigabit")


def test_tbf_burst_matches_the_measured_settings():
    # machine.md: burst 1mb at 1gbit and 256kb at 100mbit reached 96 % of line rate
    assert netns.tbf_burst_bytes(10**9) == 1_000_000
    assert netns.tbf_burst_bytes(10**8) == 256 * 1024


def test_read_tx_bytes_parses_proc_net_dev(tmp_path):
    text = (
        "Inter-|   Receive                                                |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls"
        " carrier compressed\n"
        "    lo:  123456     100    0    0    0     0          0         0   654321     100    0    0    0     0"
        "       0          0\n"
        " veth0: 1 2 0 0 0 0 0 0 777 3 0 0 0 0 0 0\n"
    )
    path = tmp_path / "dev"
    path.write_text(text)
    assert netns.read_tx_bytes("lo", str(path)) == 654321
    assert netns.read_tx_bytes("veth0", str(path)) == 777
    with pytest.raises(ValueError, match="eth9"):
        netns.read_tx_bytes("eth9", str(path))


def test_interval_timer_returns_the_length_of_the_union():
    timer = _IntervalTimer()
    for start, end in [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.5, 3.6)]:
        timer.add(start, end)
    assert timer.take() == pytest.approx(3.0)
    assert timer.take() == 0.0


def _row(system, bandwidth, step, hosts=2, model="mlp"):
    return {"model": model, "hosts": hosts, "bandwidth": bandwidth, "system": system, "status": "ok",
            "step_s": step, "samples_per_s": hosts * 32 / step}


def test_speedups_and_goals():
    rows = report.add_speedups([
        _row("ddp", "1gbit", 1.0), _row("bytegrad", "1gbit", 0.4),
        _row("ddp", "unshaped", 0.2), _row("gradient_allreduce", "unshaped", 0.205),
        {"model": "mlp", "hosts": 2, "bandwidth": "100mbit", "system": "bytegrad", "status": "failed"},
    ])
    assert rows[1]["speedup"] == pytest.approx(2.5)
    assert rows[3]["step_ratio"] == pytest.approx(1.025)
    assert rows[4]["speedup"] is None
    goals = {g["goal"]: g for g in report.check_goals(rows)}
    assert not goals["ByteGrad >= 3x DDP at 1 Gbit/s (2 hosts)"]["met"]
    assert goals["gradient allreduce <= 1.05x DDP step, unshaped (2 hosts)"]["met"]
    assert len(goals) == 2  # goals that were not run are left out
    table = report.format_table(rows)
    assert "bytegrad" in table and "2.50" in table


def test_summarize_ranks_line_rate_and_phases():
    ranks = [{"median_step_s": 0.5 + 0.1 * r, "step_times_s": [0.5 + 0.1 * r] * 4, "timed_steps": 4,
              "batch_size": 32, "warmup": 3,
              "tx_bytes": 4 * 50_000_000, "compute_step_s": 0.1, "comm_busy_s": 0.4, "codec_s": 0.05,
              "accuracy": None, "final_loss": 1.0, "params": 10} for r in range(2)]
    s = report.summarize_ranks(ranks, 10**9, emulated=True)
    assert s["step_s"] == pytest.approx(0.6)  # the slowest host
    assert s["bytes_per_step"] == 50_000_000
    assert s["line_rate"] == pytest.approx((50e6 * 8 / 0.5 + 50e6 * 8 / 0.6) / 2 / 1e9)
    assert s["communicate_s"] == pytest.approx(0.35)
    assert s["wait_s"] == pytest.approx(0.5)
    loop = report.summarize_ranks(ranks, None, emulated=False)
    assert loop["bytes_per_step"] == 25_000_000 and loop["line_rate"] is None


def test_write_results_json_csv_png(tmp_path):
    rows = [_row("ddp", "1gbit", 1.0), _row("gradient_allreduce", "1gbit", 0.9),
            _row("ddp", "100mbit", 9.0), _row("gradient_allreduce", "100mbit", 8.0)]
    paths = report.write_results(str(tmp_path), "t", rows, {"command": "test"})
    assert [p.rsplit(".", 1)[1] for p in paths] == ["json", "csv", "png"]
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["results"][1]["speedup"] == pytest.approx(1 / 0.9)
    with open(tmp_path / "t.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_combine_repeats_takes_medians_per_configuration():
    rows = [dict(_row("ddp", "1gbit", s), run="r", repeat=k, mean_step_s=s + 0.1)
            for k, s in enumerate([1.0, 3.0, 2.0])]
    rows += [dict(_row("bytegrad", "1gbit", 0.5), run="r", repeat=0),
             {"model": "mlp", "hosts": 2, "bandwidth": "1gbit", "system": "bytegrad", "status": "failed",
              "run": "r", "repeat": 1}]
    combined = report.add_speedups(report.combine_repeats(rows))
    ddp, bytegrad = combined
    assert ddp["step_s"] == 2.0 and ddp["step_s_repeats"] == [1.0, 3.0, 2.0] and ddp["repeats"] == 3
    assert ddp["mean_step_s"] == pytest.approx(2.1)  # the to-target table's step: the median too
    assert bytegrad["repeats"] == 1 and bytegrad["failed_repeats"] == 1
    assert bytegrad["speedup"] == pytest.approx(4.0)


def test_split_system_reads_algorithm_arguments():
    from benchmarks.common.workload import split_system

    assert split_system("bytegrad") == ("bytegrad", {})
    assert split_system("decentralized:peer_selection_mode=shift_one:communication_interval=2") == (
        "decentralized", {"peer_selection_mode": "shift_one", "communication_interval": 2})
    with pytest.raises(ValueError, match="name:key=value"):
        split_system("decentralized:shift_one")


def test_muon_cost_float32_iteration_orthogonalizes_like_the_svd():
    from benchmarks.to_target.muon_cost import newton_schulz_float32

    g = torch.randn(96, 24, generator=torch.Generator().manual_seed(0)) @ torch.diag(torch.logspace(0, 2, 24))
    x = newton_schulz_float32(g)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh  # the exact orthogonal factor the quintic iteration approximates
    s = torch.linalg.svdvals(x)
    assert x.shape == g.shape and 0.6 < float(s.min()) and float(s.max()) < 1.25, s
    assert float((x * polar).sum() / (x.norm() * polar.norm())) > 0.95
