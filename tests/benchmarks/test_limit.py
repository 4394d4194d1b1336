"""The free-exchange limit beside a time to target (benchmarks.to_target.limit), on a hand-made merged result whose
figures are worked out here by hand, and the slow-link driver's argument parsing (benchmarks.to_target.one_megabit)."""

from __future__ import annotations

import pytest

from benchmarks.to_target import limit, one_megabit


def _entry(system, band, steps, median_s, vs_ddp, method="steps x step"):
    return {"hosts": 4, "system": system, "bandwidth": band, "method": method, "steps": steps,
            "time_spread": {"median": median_s}, "vs_ddp": vs_ddp}


def _step(system, band, compute_s):
    return {"hosts": 4, "system": system, "bandwidth": band, "phase": "step_time", "compute_s": compute_s}


DATA = {
    "time_to_target": {"table": [
        _entry("ddp", "unshaped", [320, 320, 380], 480.0, 1.0),
        _entry("ddp", "10mbit", [320, 320, 380], 19_200.0, 1.0),
        _entry("diloco", "unshaped", [200, 280, 240], 384.0, 1.25),
        _entry("diloco", "10mbit", [200, 280, 240], 480.0, 40.0),
        _entry("async", "unshaped", [400, 380, None], 600.0, 0.8, "real run"),
        _entry("async", "10mbit", [800, 900, 700], 1600.0, 12.0, "real run"),
    ]},
    "results": [_step("ddp", "unshaped", 1.4), _step("ddp", "10mbit", 1.6), _step("ddp", "1gbit", 1.5),
                _step("diloco", "unshaped", 1.6), _step("diloco", "10mbit", 1.0), _step("diloco", "1gbit", 1.2)],
}


def test_limit_is_median_steps_times_the_median_compute_step_against_ddp():
    rows = {(r["system"], r["bandwidth"]): r for r in limit.limits(DATA)}
    # diloco: compute = median(1.6, 1.0, 1.2) = 1.2 s; limit = median(240, 336, 288) = 288 s
    d = rows[("diloco", "10mbit")]
    assert d["compute_s"] == pytest.approx(1.2) and d["limit_s"] == pytest.approx(288.0)
    assert d["limit_vs_ddp"] == pytest.approx(19_200 / 288, abs=1e-3)
    assert d["efficiency"] == pytest.approx(40.0 / (19_200 / 288), abs=1e-3)  # = 288 / 480 = 0.6
    assert d["efficiency"] == pytest.approx(0.6, abs=1e-3)
    # ddp: compute 1.5 s, limit 320 x 1.5 = 480 s: unshaped it runs at its limit
    assert rows[("ddp", "unshaped")]["efficiency"] == pytest.approx(1.0)
    assert rows[("ddp", "10mbit")]["limit_vs_ddp"] == pytest.approx(40.0)


def test_a_real_run_system_takes_its_unshaped_steps_and_ddps_compute():
    rows = {(r["system"], r["bandwidth"]): r for r in limit.limits(DATA)}
    a = rows[("async", "10mbit")]
    assert a["steps"] == [400, 380, None] and a["compute_from"] == "ddp"
    # seeds 600, 570, inf: median 600 s
    assert a["limit_s"] == pytest.approx(600.0)
    assert a["limit_vs_ddp"] == pytest.approx(32.0) and a["efficiency"] == pytest.approx(12 / 32, abs=1e-3)


def test_no_limit_when_most_seeds_missed():
    assert limit.limit_row([None, None, 300], 1.0, 100.0, None)["limit_s"] is None


def test_markdown_has_measured_limit_and_efficiency():
    text = limit.format_markdown(limit.limits(DATA))
    assert "40.00x / 66.7x (0.60)" in text and "| 4 | async | 1.500 s (ddp) |" in text


def test_one_megabit_parses_system_warmup_steps():
    assert one_megabit.parse_system("diloco:sync_every=20:compression=nf2:block_size=256=2:40") == (
        "diloco:sync_every=20:compression=nf2:block_size=256", 2, 40)
    with pytest.raises(ValueError, match="SYSTEM=WARMUP:STEPS"):
        one_megabit.parse_system("ddp")


def test_workload_waits_at_the_go_file_before_its_timed_steps(tmp_path):
    import json
    import os
    import subprocess
    import sys
    import time

    from bagua.torch_api import env

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    go, out = str(tmp_path / "go"), str(tmp_path / "r")
    child = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(env.find_free_network_port()), OMP_NUM_THREADS="1",
                 PYTHONPATH=root)
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.common.workload", "--system", "ddp", "--model",
                             "gpt_tiny", "--warmup", "1", "--steps", "2", "--compute-steps", "0", "--out", out,
                             "--go-file", go], env=child, cwd=root)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(go + ".ready0"):
            assert proc.poll() is None and time.monotonic() < deadline, "no ready file after the warm-up"
            time.sleep(0.05)
        time.sleep(1.0)
        assert proc.poll() is None and not os.path.exists(out + ".rank0.json"), "it did not wait for the go file"
        open(go, "w").close()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    with open(out + ".rank0.json") as f:
        result = json.load(f)
    assert result["timed_steps"] == 2 and result["warmup"] == 1


def test_one_megabit_combines_steps_with_the_mean_step_and_projects_the_idle_compute():
    ddp = {"system": "ddp", "mean_step_s": 440.0, "compute_s": 6.0, "step_times_s": [440.0]}
    plain = {"system": "diloco:sync_every=10", "mean_step_s": 9.0, "compute_s": 5.0,
             "step_times_s": [3.0] * 9 + [63.0]}  # mean 9.0, inner (median) 3.0: 6 s exposed a step
    r = one_megabit.combine(plain, [600, 440, 520], ddp, [480, 520, 500], 0.5)
    assert r["time_s"] == pytest.approx(520 * 9.0) and r["vs_ddp"] == pytest.approx(500 * 440 / (520 * 9))
    assert r["limit_vs_ddp"] == pytest.approx(500 * 440 / (520 * 5.0)) and r["efficiency"] == pytest.approx(5 / 9)
    # idle: DDP 0.5 + 434 s a step, DiLoCo 0.5 + 6 s
    assert r["idle_vs_ddp"] == pytest.approx(500 * 434.5 / (520 * 6.5))
    assert r["idle_efficiency"] == pytest.approx(0.5 / 6.5)
    # overlapped: one fragment's exchange (30 s) behind 4 inner steps of 0.5 s, a fragment every 5 steps
    stream = {"system": "diloco:sync_every=10:fragments=2:overlap_steps=4", "mean_step_s": 6.0, "compute_s": 5.5,
              "step_times_s": [5.5] * 20}
    s = one_megabit.combine(stream, [500], ddp, [500], 0.5, fragment_exchange_s=30.0)
    assert s["idle_step_s"] == pytest.approx(0.5 + (30.0 - 2.0) / 5)


def test_one_megabit_report_joins_the_timed_rows_with_the_recorded_steps(tmp_path):
    import json

    w = one_megabit._W
    rows = [{"hosts": 4, "system": "ddp", "status": "ok", "mean_step_s": 600.0, "compute_s": 6.0,
             "step_times_s": [600.0]},
            {"hosts": 4, "system": w, "status": "ok", "mean_step_s": 12.0, "compute_s": 6.0,
             "step_times_s": [6.0] * 9 + [66.0]},
            {"hosts": 4, "system": "not-in-steps", "status": "ok", "mean_step_s": 1.0, "compute_s": 1.0,
             "step_times_s": [1.0]}]
    (tmp_path / "t.json").write_text(json.dumps({"results": rows}))
    table = one_megabit.main(["--report", str(tmp_path / "t.json"), "--out", str(tmp_path / "o.json")])
    assert [t["system"] for t in table] == ["ddp", w]
    # DDP 320 / 320 / 380 steps x 600 s; $W 200 / 280 / 240 x 12 s
    assert table[1]["vs_ddp"] == pytest.approx(320 * 600 / (240 * 12))
    assert json.loads((tmp_path / "o.json").read_text())["table"][1]["steps"] == [200, 280, 240]
