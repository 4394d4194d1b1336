"""Time to accuracy (``bagua-bench --to-target``) at tiny sizes on loopback: with an easy target every system
reaches it and the report has steps, time and metric; with an impossible one DDP stops at ``--max-steps`` and
every other system at 3x DDP's steps, all reported as "not reached"."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from bagua.benchmarks import to_target


def _suite(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, list[dict], list[dict]]:
    cmd = [sys.executable, "-m", "bagua.benchmarks.network", "--loopback", "--hosts", "2", "--to-target",
           "--out-dir", str(tmp_path), "--name", "tt", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    rows = json.loads((tmp_path / "tt.json").read_text())["results"] if (tmp_path / "tt.json").exists() else []
    with open(tmp_path / "tt.csv") as f:
        csv_rows = list(csv.DictReader(f))
    return done, rows, csv_rows


def test_easy_target_is_reached_by_each_kind_of_system(tmp_path):
    # a baseline, compressed gradients, asynchronous weight averaging and QAdam (every system trains gpt_tiny in
    # test_workloads.py; the to-target loop itself does not depend on the system)
    systems = ["ddp", "bytegrad", "async", "qadam"]
    done, rows, csv_rows = _suite(tmp_path, "--models", "gpt_tiny", "--systems", ",".join(systems),
                                  "--target", "gpt_tiny=5.3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(r["system"] for r in rows) == sorted(systems)
    assert rows[0]["system"] == "ddp"  # DDP runs first: it sets the others' budgets
    for r in rows:
        assert r["status"] == "ok", r.get("error")
        assert r["target_status"] == "reached", r
        assert r["metric"] == "val_loss" and r["target"] == 5.3 and r["final_metric"] <= 5.3
        assert 0 < r["steps_to_target"] <= r["step_budget"] and r["steps_to_target"] % r["eval_every"] == 0
        assert 0 < r["time_to_target_s"] <= r["wall_to_target_s"]
        assert r["eval_s"] > 0 and r["curve"][0][0] == 0 and r["curve"][-1][0] == r["steps_to_target"]
        assert r["curve"][-1][3] == r["final_metric"]
    ddp = rows[0]
    for r in rows[1:]:
        assert r["step_budget"] == to_target.BUDGET_FACTOR * ddp["steps_to_target"]
    assert {"target_status", "steps_to_target", "time_to_target_s", "final_metric"} <= set(csv_rows[0])
    assert all(c["target_status"] == "reached" for c in csv_rows)
    assert "reached" in done.stdout and "val_loss <= 5.3" in done.stdout
    assert (tmp_path / "tt-to-target.png").read_bytes()[:4] == b"\x89PNG"


def test_impossible_target_is_not_reached_after_three_times_ddps_steps(tmp_path):
    done, rows, csv_rows = _suite(tmp_path, "--models", "resnet_tiny", "--systems", "ddp,gradient_allreduce,bytegrad",
                                  "--target", "resnet_tiny=1.01", "--max-steps", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    by_system = {r["system"]: r for r in rows}
    assert by_system["ddp"]["steps_run"] == 4 and by_system["ddp"]["step_budget"] == 4
    for system in ("gradient_allreduce", "bytegrad"):
        assert by_system[system]["steps_run"] == 12 and by_system[system]["step_budget"] == 12
    for r in rows:
        assert r["status"] == "ok", r.get("error")
        assert r["target_status"] == "not reached"
        assert r["steps_to_target"] is None and r["time_to_target_s"] is None
        assert r["metric"] == "accuracy" and 0.0 <= r["final_metric"] <= 1.0
    assert [c["target_status"] for c in csv_rows] == ["not reached"] * 3
    assert done.stdout.count("not reached") >= 3


def test_step_budget_and_summary():
    assert to_target.step_budget(None, 500) == (500, None)
    assert to_target.step_budget({"status": "failed"}, 500) == (500, None)
    assert to_target.step_budget({"status": "ok", "steps_to_target": 40, "steps_run": 40}, 500) == (120, 8)
    assert to_target.step_budget({"status": "ok", "steps_to_target": None, "steps_run": 500}, 500) == (1500, 100)
    assert to_target.reached(0.97, 0.97, higher_is_better=True) and not to_target.reached(2.6, 2.5, False)

    def rank(train_s, hit):
        return {"to_target": {"metric": "val_loss", "target": 2.5, "reached": hit, "steps_to_target": 40 if hit else None,
                              "time_to_target_s": train_s if hit else None, "wall_to_target_s": train_s + 3 if hit else None,
                              "final_metric": 2.4, "steps_run": 40, "step_budget": 120, "eval_every": 20,
                              "eval_s": 3.0, "train_s": train_s, "wall_s": train_s + 3, "curve": [[0, 0, 1, 5.5]]}}

    s = to_target.summarize([rank(10.0, True), rank(12.0, True)])
    assert s["target_status"] == "reached" and s["time_to_target_s"] == 12.0 and s["wall_to_target_s"] == 15.0
    assert to_target.summarize([rank(10.0, False)])["target_status"] == "not reached"
    rows = [dict(model="gpt", hosts=2, bandwidth="1gbit", system=name, status="ok", time_to_target_s=t,
                 target_status="reached" if t else "not reached") for name, t in (("ddp", 30.0), ("bytegrad", 10.0),
                                                                                  ("async", None))]
    to_target.add_time_speedups(rows)
    assert [r["time_speedup"] for r in rows] == [1.0, pytest.approx(3.0), None]
    table = to_target.format_table([dict(r, metric="val_loss", target=2.5, steps_to_target=40 if r["time_to_target_s"]
                                         else None, steps_run=120, wall_to_target_s=None, final_metric=2.6)
                                    for r in rows])
    assert "not reached" in table and ">120" in table and "3.00" in table


def test_suite_flags_are_checked():
    from bagua.benchmarks.network import parse_args

    with pytest.raises(ValueError, match="add --to-target"):
        parse_args(["--models", "gpt", "--target", "gpt=2.5"])
    with pytest.raises(ValueError, match="validation data"):
        parse_args(["--to-target", "--models", "mlp"])
    with pytest.raises(ValueError, match="MODEL=VALUE"):
        parse_args(["--to-target", "--models", "gpt", "--target", "gpt:2.5"])
    args = parse_args(["--to-target", "--models", "gpt,resnet", "--target", "gpt=2.4"])
    assert args.targets == {"gpt": 2.4}
