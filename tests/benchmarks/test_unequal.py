"""The unequal-speeds benchmark (benchmarks/to_target/unequal.py): its pure pieces against numbers written here, and
a tiny 2-process run on loopback where the slow worker's pad equals (1/s - 1) x its measured compute."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.to_target import unequal, unequal_report, unequal_worker


def test_speed_follows_the_profile_and_the_window():
    speeds = [1.0, 1.0, 1.0, 0.5]
    assert unequal_worker.speed_at(3, 0, speeds, None) == 0.5
    assert [unequal_worker.speed_at(3, s, [1.0] * 4, "3:0.3:100:200") for s in (99, 100, 199, 200)] == [1.0, 0.3, 0.3,
                                                                                                      1.0]
    assert unequal_worker.speed_at(2, 150, [1.0] * 4, "3:0.3:100:200") == 1.0  # another rank: unaffected


def test_pad_makes_a_step_take_compute_over_speed():
    for compute, speed in ((0.2, 1.0), (0.2, 0.5), (0.3, 0.4), (0.1, 0.3)):
        assert compute + unequal_worker.pad_seconds(compute, speed) == pytest.approx(compute / speed)
    # a device of fixed step T: every step takes T / s, whatever the compute took (none when it took longer)
    for compute, speed in ((0.3, 1.0), (0.3, 0.5), (0.1, 0.4)):
        assert compute + unequal_worker.pad_seconds(compute, speed, 0.4) == pytest.approx(0.4 / speed)
    assert unequal_worker.pad_seconds(0.5, 1.0, 0.4) == 0.0
    with pytest.raises(ValueError, match="speed"):
        unequal_worker.pad_seconds(0.1, 0.0)


def test_tokens_by_reads_the_timeline():
    timeline = [[0.5, 1], [1.0, 2], [2.5, 3]]
    assert [unequal.tokens_by(timeline, t, 10) for t in (0.1, 0.5, 2.4, 9.0)] == [0, 10, 20, 30]


def test_system_specs_take_the_pick_and_add_the_mode():
    pick = unequal.pick_settings("100mbit")
    assert ":sync_every=10" in pick and ":compression=uint4" in pick
    assert unequal.pick_settings("drop") == pick  # the drop runs the 100 Mbit/s pick
    assert ":compression=nf2" in unequal.pick_settings("10mbit")
    assert unequal.system_spec("ddp", "10mbit") == "ddp"
    assert unequal.system_spec("diloco", "100mbit") == "diloco" + pick + ":hierarchical=False"
    assert unequal.system_spec("diloco_time:sync_every_max=40", "100mbit").endswith(":rounds=time:sync_every_max=40")
    with pytest.raises(ValueError, match="unknown system"):
        unequal.system_spec("fedavg", "100mbit")


def test_ideal_and_ratios_against_plain_arithmetic():
    assert unequal_report.ideal_time([1, 1, 1, 0.5], 70.0) == pytest.approx(70.0 * 4 / 3.5)
    # 100 steps at 0.3 on one of 4 workers, 0.5 s a step: it loses 100 * 0.5 * (1/0.3 - 1) worker-seconds
    assert unequal_report.ideal_time([1] * 4, 100.0, 200, {"steps": 100, "speed": 0.3}) == pytest.approx(
        100.0 + 100 * 0.5 * (1 / 0.3 - 1) / 4)
    rows = []
    for system, profile, t, tokens in (("diloco", "equal", 60.0, 1000), ("diloco", "graded", 150.0, 1000),
                                       ("diloco_time", "graded", 90.0, 1100)):
        for seed, dt in enumerate((0.0, -5.0, 5.0)):
            rows.append({"link": "100mbit", "profile": profile, "system": system, "seed": seed, "status": "reached",
                         "speeds": list(unequal.PROFILES[profile]), "time_to_target_s": t + dt,
                         "steps_to_target": 200, "tokens_to_target": tokens, "worker_steps_to_target": [1, 1, 1, 1],
                         "workers": []})
    table = {(e["profile"], e["system"]): e for e in unequal_report.summarize(rows)}
    graded = table[("graded", "diloco_time")]
    assert graded["time_s"] == 90.0 and graded["ideal_s"] == pytest.approx(60.0 * 4 / 2.8)
    assert graded["vs_ideal"] == pytest.approx(90.0 / (60.0 * 4 / 2.8))
    assert graded["vs_sync"] == pytest.approx(150.0 / 90.0) and graded["tokens_vs_equal"] == pytest.approx(1.1)
    assert "| 100mbit | graded (1,0.8,0.6,0.4) | diloco_time | 3/3 | 90.0 [85, 90, 95]" in \
        unequal_report.format_table(list(table.values()))


def test_two_workers_on_loopback_pad_the_slow_one(tmp_path):
    # an impossible target: both workers run their 20 steps; the slow one's pad is its compute (speed 0.5)
    cmd = [sys.executable, "-m", "benchmarks.to_target.unequal", "--loopback", "--hosts", "2", "--speeds", "1,0.5",
           "--systems", "diloco", "--profiles", "equal", "--seeds", "0", "--target", "0.5", "--max-steps", "20",
           "--n-layer", "1", "--n-embd", "16", "--block", "8", "--eval-samples", "4", "--out-dir", str(tmp_path),
           "--name", "u"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "u.json").read_text())["rows"]
    assert row["status"] == "not reached" and row["speeds"] == [1.0, 0.5]
    fast, slow = row["workers"]
    assert fast["steps"] == slow["steps"] == 20 and fast["syncs"] == slow["syncs"] == 2
    assert fast["pad_s"] == 0.0 and slow["pad_s"] == pytest.approx(slow["compute_s"], rel=1e-6)
    assert row["curve"] and {c[0] for c in row["curve"]} <= {0, 10, 20}  # snapshots at the start and outer steps


def test_plot_has_a_bar_per_system_and_the_ideal(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.common import plots

    table = [{"link": "100mbit", "profile": p, "system": s, "time_s": t, "ideal_s": i}
             for p, s, t, i in (("equal", "diloco", 60.0, 60.0), ("graded", "diloco", 150.0, 85.7),
                                ("graded", "diloco_time", 90.0, 85.7))]
    path = plots.plot_unequal(table, str(tmp_path / "u.png"))
    assert (tmp_path / "u.png").stat().st_size > 0 and path.endswith("u.png")
    with pytest.raises(ValueError, match="nothing to plot"):
        plots.plot_unequal([{"link": "100mbit", "profile": "equal", "system": "diloco", "time_s": None}], path)


class _FakeEvaluator:
    def __init__(self, losses: dict) -> None:
        self.losses, self.calls = losses, []

    def loss(self, path: str, screen: bool = False) -> tuple[float, dict]:
        self.calls.append((path, screen))
        return self.losses[path], {"steps": int(path[1:]), "time_s": float(path[1:])}


def test_first_hit_screens_the_newest_and_walks_back_to_the_first_that_reached():
    losses = {"s0": 5.0, "s10": 3.0, "s20": 2.5, "s30": 2.25, "s40": 2.2}
    ev, curve = _FakeEvaluator(losses), []
    assert unequal._first_hit(ev, ["s0", "s10"], 2.3, curve) is None
    assert ev.calls == [("s10", True)]  # far from the target: only the newest, screened
    ev.calls.clear()
    hit = unequal._first_hit(ev, ["s20", "s30", "s40"], 2.3, curve)
    assert hit["steps"] == 30  # s40 reached it, and so did s30 before it; s20 did not
    assert ev.calls == [("s40", True), ("s40", False), ("s30", False), ("s20", False)]
    assert [c[0] for c in curve] == [10, 40, 30, 20]
