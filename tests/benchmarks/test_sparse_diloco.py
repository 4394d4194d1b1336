"""The sparse DiLoCo table (benchmarks.to_target.sparse_diloco) on hand-made runs and timed rows, its figures
worked out here by hand."""

from __future__ import annotations

import json

import pytest

from benchmarks.to_target import overlap_remedy, sparse_diloco


def _timed(system, mean_s, compute_s, times):
    return {"system": system, "hosts": 4, "bandwidth": "10mbit", "status": "ok", "mean_step_s": mean_s,
            "compute_s": compute_s, "step_times_s": times, "bytes_per_step": 1000.0, "load_start": "1 1 1",
            "load_end": "2 2 2"}


def test_steps_from_runs_and_the_table_against_the_pick(tmp_path):
    runs = [{"system": sparse_diloco.W_TOPK, "hosts": 4, "phase": "convergence", "seed": s, "steps_to_target": n,
             "steps_run": 400 if n is None else n} for s, n in ((2, 260), (0, 240), (1, None))]
    runs.append({"system": "x", "phase": "step_time", "hosts": 4})
    assert sparse_diloco.steps_from(runs) == {
        (4, sparse_diloco.W_TOPK): ([240, 400, 260], "seeds 0, 1, 2; seed 1 missed at 400, counted as 400")}
    times = [_timed(overlap_remedy.W_NF2, 2.5, 2.0, [2.0] * 9 + [7.0]),
             _timed(sparse_diloco.W_TOPK, 2.2, 2.0, [2.0] * 9 + [4.0])]
    runs[1]["steps_to_target"] = 300  # seed 0 now 300, seed 1 dropped: seeds 0, 2 with 300, 260 steps
    del runs[2]
    (tmp_path / "t.json").write_text(json.dumps({"results": times}))
    (tmp_path / "s.json").write_text(json.dumps({"results": runs}))
    out = tmp_path / "out.json"
    table = sparse_diloco.main(["--report", str(tmp_path / "t.json"), "--steps", str(tmp_path / "s.json"),
                                "--out", str(out)])
    by = {t["system"]: t for t in table}
    topk = by[sparse_diloco.W_TOPK]
    assert topk["steps"] == [300, 260] and topk["time_s"] == pytest.approx(280 * 2.2)  # median of 660, 572
    assert topk["efficiency"] == pytest.approx(2.0 / 2.2, abs=1e-3)
    assert topk["exposed_s"] == pytest.approx(0.2) and topk["inner_efficiency"] == pytest.approx(2.0 / 2.2, abs=1e-3)
    # the nf2 pick: 220 / 300 / 240 steps x 2.5 s, median 600 s; its limit 240 x 2.0 = 480 s
    assert topk["vs_pick"] == pytest.approx(600 / 616, abs=1e-3)
    assert topk["vs_pick_limit"] == pytest.approx(480 / 616, abs=1e-3)
    assert json.loads(out.read_text())["table"][0]["bytes_per_step"] == 1000.0
    # a second block of the same link is its own block, against its own pick
    (tmp_path / "t2.json").write_text(json.dumps({"results": [_timed(overlap_remedy.W_NF2, 3.0, 2.0, [3.0])]}))
    two = sparse_diloco.main(["--report", str(tmp_path / "t.json"), str(tmp_path / "t2.json"), "--steps",
                              str(tmp_path / "s.json"), "--out", str(out)])
    assert [(t["block"][-7:], t["time_s"]) for t in two if t["system"] == overlap_remedy.W_NF2] == [
        ("/t.json", 600.0), ("t2.json", 720.0)]
