"""The overlap remedy's table (benchmarks.to_target.overlap_remedy) on hand-made timed rows, its figures worked
out here by hand."""

from __future__ import annotations

import pytest

from benchmarks.to_target import overlap_remedy


def _row(system, mean_s, compute_s, times, hosts=4, band="10mbit"):
    return {"system": system, "hosts": hosts, "bandwidth": band, "status": "ok", "mean_step_s": mean_s,
            "compute_s": compute_s, "step_times_s": times, "load_start": "1.0 1.0 1.0", "load_end": "2.0 2.0 2.0"}


STEPS = {(4, "ddp"): ([320, 320, 380], "f"), (4, "pick"): ([220, 300, 240], "f"), (4, "new"): ([240, 260, 260], "f")}
ROWS = [_row("ddp", 60.0, 1.5, [60.0]), _row("pick", 2.5, 1.5, [1.5] * 9 + [11.5]),
        _row("new", 1.6, 1.5, [1.5] * 9 + [2.5]), _row("failed", 1.0, 1.0, [1.0]),
        _row("pick", 40.0, 1.5, [1.5], band="1mbit")]


def test_time_limit_and_efficiency_against_ddp_and_the_pick():
    table = {(t["bandwidth"], t["system"]): t for t in overlap_remedy.report(ROWS, STEPS, {4: "pick"})}
    ddp_time = 320 * 60.0  # median of 320, 320, 380 steps x 60 s
    new = table[("10mbit", "new")]
    assert new["time_s"] == pytest.approx(260 * 1.6)
    assert new["vs_ddp"] == pytest.approx(ddp_time / (260 * 1.6), abs=1e-3)
    assert new["limit_vs_ddp"] == pytest.approx(ddp_time / (260 * 1.5), abs=1e-3)
    assert new["efficiency"] == pytest.approx(1.5 / 1.6, abs=1e-3)
    assert new["inner_step_s"] == pytest.approx(1.5) and new["exposed_s"] == pytest.approx(0.1)
    # the pick: 240 steps x 2.5 s = 600 s; its own limit 240 x 1.5 = 360 s
    assert new["vs_pick"] == pytest.approx(600 / 416, abs=1e-3)
    assert new["vs_pick_limit"] == pytest.approx(360 / 416, abs=1e-3)
    assert table[("10mbit", "pick")]["vs_pick"] == pytest.approx(1.0)
    # a system without steps is left out; a block without DDP has no ratio against it
    assert ("10mbit", "failed") not in table
    assert table[("1mbit", "pick")]["vs_ddp"] is None and table[("1mbit", "pick")]["efficiency"] == pytest.approx(
        1.5 / 40.0, abs=1e-3)
