"""The time-to-target combination without running anything: steps x step time (with a plain-DDP warmup), seeds
and their spread, the "faster only when the whole spread is" rule, not-reached seeds, the validation, the
GPU-mapping column from the cost model, the recommendations and the time-against-bandwidth plot."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pytest
from benchmarks.cost import gpu_mapping
from benchmarks.common import plots
from benchmarks.to_target import to_target_table
from benchmarks.cost.cost_equations import Fit
from benchmarks.to_target.to_target_table import Spread, combine, compare, spread, time_to_target

FIT = Fit(efficiency=0.95, stack_Bps=0.73e9, latency_s=1.9e-3, overlap=0.0)
PARAMS = 10_800_000


def _conv(system, steps, phase="convergence", band="unshaped", rate=None, times=None, qadam_warmup=None):
    return [dict(model="gpt", hosts=2, bandwidth=band, rate_bps=rate, system=system, phase=phase, seed=k,
                 status="ok", steps_to_target=n, time_to_target_s=None if times is None else times[k],
                 target_status="reached" if n else "not reached", qadam_warmup=qadam_warmup)
            for k, n in enumerate(steps)]


def _step(system, band, rate, mean_step_s, compute_s=0.75):
    return dict(model="gpt", hosts=2, bandwidth=band, rate_bps=rate, system=system, phase="step_time", seed=0,
                status="ok", mean_step_s=mean_step_s, step_s=mean_step_s, compute_s=compute_s, params=PARAMS)


def _rows():
    rows = _conv("ddp", [500, 480, 520]) + _conv("bytegrad", [560, 600, 540])
    rows += _conv("qadam", [500, None, 700], qadam_warmup=100) + _conv("ddp_powersgd", [600, 610, 620])
    for band, rate, ddp, bg, q, ps in (("unshaped", None, 0.8, 0.85, 0.9, 0.8), ("100mbit", 10**8, 4.2, 1.0, 1.7, 0.9),
                                       ("10mbit", 10**7, 36.0, 9.5, 9.6, 1.2)):
        rows += [_step("ddp", band, rate, ddp), _step("bytegrad", band, rate, bg), _step("qadam", band, rate, q),
                 _step("ddp_powersgd", band, rate, ps)]
    rows += _conv("async", [700, 650, 800], phase="real", times=[600.0, 560.0, 640.0])
    rows += _conv("async", [900, 800, 1000], phase="real", band="10mbit", rate=10**7, times=[1800.0, 1700.0, 1900.0])
    rows.append(dict(_conv("ddp", [500], phase="validation", band="100mbit", rate=10**8, times=[2205.0])[0]))
    rows.append(dict(_step("bytegrad", "1gbit", 10**9, 0.9), status="failed"))  # a failed run is left out
    return rows


def _cell(table, system, band):
    return next(c for c in table if (c["system"], c["bandwidth"]) == (system, band))


def test_spread_and_the_whole_spread_rule():
    s = spread([3.0, 1.0, 2.0])
    assert (s.median, s.low, s.high, s.n, s.missed) == (2.0, 1.0, 3.0, 3, 0)
    missed = spread([10.0, None, 12.0])
    assert missed.median == 12.0 and math.isinf(missed.high) and missed.missed == 1
    assert math.isinf(spread([None, None, 5.0]).median)  # the median seed missed: not reached
    assert compare(spread([1, 2, 3]), spread([4, 5, 6])) == "faster"
    assert compare(spread([4, 5, 6]), spread([1, 2, 3])) == "slower"
    # a better median is not enough: the spreads overlap
    assert compare(spread([1, 2, 4.5]), spread([4, 5, 6])) == "within spread"
    assert compare(spread([1, 2, None]), spread([4, 5, 6])) == "within spread"
    assert Spread(2.0, 1.0, 3.0, 3).cell(".1f") == "2.0 [1.0-3.0]" and spread([4.0]).cell() == "4"
    with pytest.raises(ValueError, match="at least one seed"):
        spread([])


def test_time_to_target_is_steps_times_step_with_a_warmup_at_ddps_step():
    assert time_to_target(500, 0.8) == pytest.approx(400.0)
    assert time_to_target(500, 1.3, warmup=100, warmup_step_s=4.2) == pytest.approx(100 * 4.2 + 400 * 1.3)
    assert time_to_target(50, 1.0, warmup=100, warmup_step_s=2.0) == pytest.approx(100.0)  # all warmup
    assert time_to_target(None, 0.8) is None
    assert to_target_table.warmup_steps("qadam", 40) == 40 and to_target_table.warmup_steps("ddp_powersgd", None) == 2
    assert to_target_table.warmup_steps("ddp_post_local_sgd:period=8:warmup=5", None) == 5
    assert to_target_table.warmup_steps("bytegrad", 40) == 0
    with pytest.raises(ValueError, match="positive"):
        time_to_target(10, 0.0)


def test_combine_steps_once_times_step_per_network_and_real_runs():
    table = combine(_rows(), FIT)
    bands = {c["bandwidth"] for c in table}
    assert bands == {"unshaped", "100mbit", "10mbit"}  # the failed 1gbit run is left out
    ddp = _cell(table, "ddp", "10mbit")
    assert ddp["method"] == "steps x step" and ddp["steps"] == [500, 480, 520]
    assert ddp["times_s"] == pytest.approx([500 * 36.0, 480 * 36.0, 520 * 36.0])
    assert ddp["time_spread"].median == pytest.approx(500 * 36.0) and ddp["verdict"] == "reference"
    # the same steps at every bandwidth; the step time changes
    bg = [_cell(table, "bytegrad", b) for b in ("unshaped", "100mbit", "10mbit")]
    assert all(c["steps"] == [560, 600, 540] for c in bg)
    assert bg[2]["time_spread"].median == pytest.approx(560 * 9.5)
    assert bg[0]["verdict"] == "slower" and bg[2]["verdict"] == "faster"
    assert bg[2]["vs_ddp"] == pytest.approx(500 * 36.0 / (560 * 9.5))
    # QAdam: its warmup at DDP's step; one seed missed, so its spread is open and it is not "faster"
    q = _cell(table, "qadam", "10mbit")
    assert q["times_s"][0] == pytest.approx(100 * 36.0 + 400 * 9.6) and q["times_s"][1] is None
    assert q["time_spread"].median == pytest.approx(100 * 36.0 + 600 * 9.6) and math.isinf(q["time_spread"].high)
    assert q["verdict"] == "within spread"
    # async: its own real runs at each bandwidth, nothing multiplied; none at 100mbit (not run there)
    a = _cell(table, "async", "10mbit")
    assert a["method"] == "real run" and a["times_s"] == [1800.0, 1700.0, 1900.0] and a["steps"] == [900, 800, 1000]
    assert _cell(table, "async", "unshaped")["times_s"] == [600.0, 560.0, 640.0]
    assert not [c for c in table if (c["system"], c["bandwidth"]) == ("async", "100mbit")]


def test_repeated_step_times_give_their_median():
    # three timed runs of DDP and ByteGrad at 100 Mbit/s (repeats, or suite runs merged): the median one counts
    rows = _conv("ddp", [500]) + _conv("bytegrad", [560])
    for ddp, bg in ((4.0, 1.2), (4.6, 0.9), (4.2, 1.0)):
        rows += [_step("ddp", "100mbit", 10**8, ddp), _step("bytegrad", "100mbit", 10**8, bg)]
    table = combine(rows)
    assert _cell(table, "ddp", "100mbit")["times_s"] == pytest.approx([500 * 4.2])
    assert _cell(table, "bytegrad", "100mbit")["times_s"] == pytest.approx([560 * 1.0])


def test_gpu_mapping_column_from_the_cost_model():
    table = combine(_rows(), FIT)
    by_band = {c["bandwidth"]: c for c in table if c["system"] == "ddp"}
    for band, rate in (("unshaped", None), ("100mbit", 10**8), ("10mbit", 10**7)):
        comm, ratio = gpu_mapping.ddp_comm_ratio(PARAMS, 2, rate, 0.75, FIT, cores=2)
        assert by_band[band]["ddp_comm_ratio"] == pytest.approx(ratio)
    # 100 Mbit/s: a 43 MB allreduce at 2 hosts is 43 MB on the wire at 95 % of 12.5 MB/s, 2 buckets of 2 rounds
    assert by_band["100mbit"]["ddp_comm_ratio"] == pytest.approx((4 * PARAMS / (0.95 * 12.5e6) + 4 * 1.9e-3) / 0.75,
                                                                 rel=1e-6)
    assert by_band["100mbit"]["ddp_comm_ratio_measured"] == pytest.approx((4.2 - 0.75) / 0.75)
    # a lower link: a higher ratio, and a slower GPU link with the same ratio; the GPU link reproduces the ratio
    r = [by_band[b]["ddp_comm_ratio"] for b in ("unshaped", "100mbit", "10mbit")]
    g = [by_band[b]["gpu_gbits"] for b in ("unshaped", "100mbit", "10mbit")]
    assert r[0] < r[1] < r[2] and g[1] > g[2] > 0
    assert g[0] is None  # unshaped: 0.09, below what latency alone costs 2 x 8 GPUs on a 7.5 ms step
    gpu_step = gpu_mapping.GPU_STEP_S["gpt"]
    p = 16  # 2 nodes of 8 GPUs
    wire = 2 * (p - 1) / p * 4 * PARAMS / (0.95 * g[1] * 1e9 / 8)
    assert (2 * (p - 1) * gpu_mapping.GPU_LATENCY_S * 2 + wire) / gpu_step == pytest.approx(r[1])
    assert "2 x 8 H100 at" in by_band["10mbit"]["gpu_setting"]
    # every system of a (model, hosts, bandwidth) carries DDP's column
    assert {c["gpu_gbits"] for c in table if c["bandwidth"] == "10mbit"} == {g[2]}
    # an override of the GPU step, and a ratio below the GPU nodes' latency floor
    fast = combine(_rows(), FIT, gpu_steps={"gpt": 0.075})
    assert next(c for c in fast if c["system"] == "ddp" and c["bandwidth"] == "10mbit")["gpu_gbits"] < g[2] / 5
    assert gpu_mapping.gpu_link_gbits(1e-4, PARAMS, 2, 1e-3, FIT) is None
    assert "latency floor" in gpu_mapping.describe(1e-4, None, 2)
    assert gpu_mapping.gpu_step_s("tiny_model", 0.5) == pytest.approx(0.005)
    assert combine(_rows(), None)[0]["gpu_setting"] is None  # no fit: no column


def test_validation_recommendations_and_markdown():
    rows = _rows()
    checks = to_target_table.validate(rows)
    val = next(c for c in checks if c["phase"] == "validation")
    assert val["combined_s"] == pytest.approx(500 * 4.2) and val["ratio"] == pytest.approx(1.05)
    assert val["agrees"] and val["steps"] == val["real_steps"] == 500
    bad = [dict(r, time_to_target_s=2600.0) if r["phase"] == "validation" else r for r in rows]
    assert not next(c for c in to_target_table.validate(bad) if c["phase"] == "validation")["agrees"]
    assert "DISAGREES" in to_target_table.format_validation(to_target_table.validate(bad))
    # a convergence run's own clock is a cross-check, never reported as the method's validation failing
    slow = [dict(r, time_to_target_s=r["steps_to_target"] * 0.8 * 3) if r["phase"] == "convergence"
            and r["system"] == "ddp" else r for r in rows]  # 3x DDP's unshaped 0.8 s step: a busy machine
    lines = to_target_table.format_validation(to_target_table.validate(slow)).splitlines()
    conv_lines = [line for line in lines if "(convergence)" in line]
    assert conv_lines and all("outside 10%; cross-check only" in line and "DISAGREES" not in line
                              for line in conv_lines)
    assert any("(validation)" in line and "agrees (tolerance 10%)" in line for line in lines)
    table = combine(rows, FIT)
    recs = to_target_table.recommend(table)
    assert len(recs) == 3
    assert recs[0].startswith("gpt, 2 hosts, unshaped: DDP")
    assert recs[2].startswith("gpt, 2 hosts, 10mbit: ddp_powersgd") and "every seed" in recs[2]
    assert "within its spread: none" in recs[2]
    # 100mbit: PowerSGD (about 610 steps x 0.9 s) and ByteGrad (560 x 1.0 s) overlap: both are named
    assert recs[1].startswith("gpt, 2 hosts, 100mbit: ddp_powersgd") and "within its spread: bytegrad" in recs[1]
    # the quickest median within DDP's spread is named, and the pick is the quickest of those faster on every seed
    edited = [dict(c) for c in table]
    quickest = min((c for c in edited if c["bandwidth"] == "100mbit" and c["system"] != "ddp"),
                   key=lambda c: c["time_spread"].median)
    assert quickest["system"] == "ddp_powersgd"
    quickest["verdict"] = "within"
    rec = to_target_table.recommend(edited)[1]
    assert rec.startswith("gpt, 2 hosts, 100mbit: bytegrad") and "faster than DDP on every seed" in rec
    assert rec.endswith("(ddp_powersgd is ahead on the median only, within DDP's spread).")
    # a system faster on fewer seeds than DDP's is named, not picked
    one_seed = combine(_conv("ddp", [500, 480, 520]) + _conv("ddp_fp16", [300])
                       + [_step(s, "unshaped", None, 1.0) for s in ("ddp", "ddp_fp16")], FIT)
    (rec,) = to_target_table.recommend(one_seed)
    assert rec.startswith("gpt, 2 hosts, unshaped: DDP; nothing is faster on every seed")
    assert "(ddp_fp16 is faster on its 1 seed(s), fewer than DDP's 3: not counted)" in rec
    # DDP missing the target on every seed while another system reaches it: named without a ratio
    missed = combine(_conv("ddp", [None, None]) + _conv("ddp_fp16", [300, 320])
                     + [_step(s, "unshaped", None, 1.0) for s in ("ddp", "ddp_fp16")], FIT)
    (rec,) = to_target_table.recommend(missed)
    assert rec.startswith("gpt, 2 hosts, unshaped: ddp_fp16, DDP did not reach the target, faster than DDP"), rec
    md = to_target_table.format_markdown(table)
    assert "| async | real runs |" in md and " *" in md and " +" in md and " -" in md
    assert "| DDP comm / compute = GPU setting |" in md and "H100" in md


def test_time_against_bandwidth_plot(tmp_path):
    table = combine(_rows(), FIT)
    fig = plots.figure_time_vs_bandwidth(table, caption="test")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["10 Mbit/s", "100 Mbit/s", "unshaped"]
    labels = fig.legends[0].get_texts()
    assert {t.get_text() for t in labels} == {"ddp", "ddp_powersgd", "bytegrad", "qadam", "async"}
    plt.close(fig)
    path = plots.plot_time_vs_bandwidth(table, str(tmp_path / "t.png"))
    assert open(path, "rb").read()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no system reached"):
        plots.figure_time_vs_bandwidth([dict(c, time_spread=spread([None])) for c in table])
