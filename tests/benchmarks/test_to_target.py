"""Time to accuracy (``bagua-bench --to-target``) at tiny sizes on loopback: with an easy target a synchronous
system's steps are measured once per seed and multiplied by its timed step, a timing-dependent one is run to the
target for real, and the report has steps, time, metric and the combination; with an impossible one DDP stops at
``--max-steps`` and every other system at 3x DDP's steps, all reported as "not reached"."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from benchmarks.common import report
from benchmarks.to_target import to_target, to_target_plan
def _suite(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, list[dict], list[dict]]:
    cmd = [sys.executable, "-m", "benchmarks.network", "--loopback", "--hosts", "2", "--to-target",
           "--out-dir", str(tmp_path), "--name", "tt", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    rows = json.loads((tmp_path / "tt.json").read_text())["results"] if (tmp_path / "tt.json").exists() else []
    with open(tmp_path / "tt.csv") as f:
        csv_rows = list(csv.DictReader(f))
    return done, rows, csv_rows


def test_easy_target_convergence_once_step_time_per_network_and_seeds(tmp_path):
    # DDP (synchronous: steps to target once per seed on unshaped links, then a timed run) and async averaging
    # (timing-dependent: trained to the target for real), 2 seeds each
    done, rows, csv_rows = _suite(tmp_path, "--models", "gpt_tiny", "--systems", "ddp,async", "--seeds", "2",
                                  "--target", "gpt_tiny=5.3", "--warmup", "1", "--steps", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [(r["system"], r["phase"], r.get("seed")) for r in rows]
    assert runs == [("ddp", "convergence", 0), ("ddp", "convergence", 1), ("async", "real", 0), ("async", "real", 1),
                    ("ddp", "step_time", 0)]  # DDP first: it sets the others' budgets
    for r in rows:
        assert r["status"] == "ok", r.get("error")
    ddp = {r["seed"]: r for r in rows if r["phase"] == "convergence"}
    for r in rows:
        if r["phase"] == "step_time":
            assert "target_status" not in r and r["mean_step_s"] > 0 and r["timed_steps"] == 3
            continue
        assert r["target_status"] == "reached", r
        assert r["metric"] == "val_loss" and r["target"] == 5.3 and r["final_metric"] <= 5.3
        assert 0 < r["steps_to_target"] <= r["step_budget"] and r["steps_to_target"] % r["eval_every"] == 0
        assert 0 < r["time_to_target_s"] <= r["wall_to_target_s"]
        assert r["eval_s"] > 0 and r["curve"][0][0] == 0 and r["curve"][-1][0] == r["steps_to_target"]
        assert r["curve"][-1][3] == r["final_metric"]
        if r["system"] == "async":
            assert r["step_budget"] == to_target.BUDGET_FACTOR * ddp[r["seed"]]["steps_to_target"]
    # the two seeds train different models (different initialization and batches)
    assert ddp[0]["curve"][0][3] != ddp[1]["curve"][0][3]
    # the combination: DDP's time = its steps (per seed) x its mean step; async's from its real runs
    table = {c["system"]: c for c in json.loads((tmp_path / "tt.json").read_text())["time_to_target"]["table"]}
    step = next(r["mean_step_s"] for r in rows if r["phase"] == "step_time")
    assert table["ddp"]["method"] == "steps x step" and table["async"]["method"] == "real run"
    assert table["ddp"]["times_s"] == pytest.approx([ddp[s]["steps_to_target"] * step for s in (0, 1)])
    assert table["async"]["times_s"] == [r["time_to_target_s"] for r in rows if r["system"] == "async"]
    assert table["ddp"]["time_spread"]["n"] == 2 and table["ddp"]["verdict"] == "reference"
    assert {"target_status", "steps_to_target", "time_to_target_s", "final_metric"} <= set(csv_rows[0])
    assert "reached" in done.stdout and "val_loss <= 5.3" in done.stdout
    assert "DDP comm / compute" in done.stdout and "steps x step" in done.stdout
    for png in ("tt-to-target.png", "tt-vs-bandwidth.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    table_md = (tmp_path / "tt-table.md").read_text()
    assert "| ddp |" in table_md
    # re-rendered from the stored JSON alone (no --name): the same table, the JSON untouched
    stored = (tmp_path / "tt.json").read_text()
    (tmp_path / "tt-table.md").unlink()
    assert report.main([str(tmp_path / "tt.json")]) == 0
    assert (tmp_path / "tt-table.md").read_text() == table_md and (tmp_path / "tt.json").read_text() == stored


def test_impossible_target_is_not_reached(tmp_path):
    # DDP stops at --max-steps; the others' budget of 3x DDP's steps when DDP missed is test_step_budget_and_summary's
    done, rows, csv_rows = _suite(tmp_path, "--models", "resnet_tiny", "--systems", "ddp", "--seeds", "1",
                                  "--target", "resnet_tiny=1.01", "--max-steps", "4", "--epochs", "1",
                                  "--warmup", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["phase"] for r in rows] == ["convergence", "step_time"]
    r = rows[0]
    assert r["status"] == "ok", r.get("error")
    assert r["steps_run"] == 4 and r["step_budget"] == 4 and r["target_status"] == "not reached"
    assert r["steps_to_target"] is None and r["time_to_target_s"] is None
    assert r["metric"] == "accuracy" and 0.0 <= r["final_metric"] <= 1.0
    assert [c["target_status"] for c in csv_rows if c["target_status"]] == ["not reached"]
    assert "not reached" in done.stdout and "no system reached the target" in done.stdout
    assert not (tmp_path / "tt-vs-bandwidth.png").exists()  # nothing to draw
    # re-rendered from the stored JSON (a calibration curve's file): the same table, still no plot against bandwidth
    table_md = (tmp_path / "tt-table.md").read_text()
    (tmp_path / "tt-table.md").unlink()
    assert report.main([str(tmp_path / "tt.json")]) == 0
    assert (tmp_path / "tt-table.md").read_text() == table_md and not (tmp_path / "tt-vs-bandwidth.png").exists()


def test_step_budget_and_summary():
    assert to_target.step_budget(None, 500) == (500, None)
    assert to_target.step_budget({"status": "failed"}, 500) == (500, None)
    assert to_target.step_budget({"status": "ok", "steps_to_target": 40, "steps_run": 40}, 500) == (120, 8)
    assert to_target.step_budget({"status": "ok", "steps_to_target": None, "steps_run": 500}, 500) == (1500, 100)
    assert to_target.step_budget({"status": "ok", "steps_to_target": 40, "steps_run": 40}, 500, 1.5) == (60, 8)
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
    from benchmarks.network import parse_args

    with pytest.raises(ValueError, match="add --to-target"):
        parse_args(["--models", "gpt", "--target", "gpt=2.5"])
    with pytest.raises(ValueError, match="validation data"):
        parse_args(["--to-target", "--models", "mlp"])
    with pytest.raises(ValueError, match="MODEL=VALUE"):
        parse_args(["--to-target", "--models", "gpt", "--target", "gpt:2.5"])
    with pytest.raises(ValueError, match="--seeds"):
        parse_args(["--to-target", "--models", "gpt", "--repeats", "3"])
    with pytest.raises(ValueError, match="SYSTEM@RATE"):
        parse_args(["--to-target", "--models", "gpt", "--validate", "ddp"])
    with pytest.raises(ValueError, match="add --to-target"):
        parse_args(["--models", "gpt", "--validate", "ddp@1gbit"])
    with pytest.raises(ValueError, match="SYSTEM=N"):
        parse_args(["--to-target", "--models", "gpt", "--seeds-of", "ddp_fp16"])
    with pytest.raises(ValueError, match="SYSTEM=N"):
        parse_args(["--to-target", "--models", "gpt", "--seeds-of", "ddp_fp16=0"])
    args = parse_args(["--to-target", "--models", "gpt,resnet", "--target", "gpt=2.4", "--validate", "ddp@1gbit",
                       "--gpu-step", "gpt=0.01", "--bandwidths", "unshaped,10mbit"])
    assert args.targets == {"gpt": 2.4} and args.seeds == 3 and args.validate == [("ddp", "1gbit")]
    assert args.gpu_step == {"gpt": 0.01} and args.bandwidths == ["unshaped", "10mbit"]


def test_plan_measures_convergence_once_and_step_time_per_network():
    from benchmarks.network import _plan, parse_args

    args = parse_args(["--to-target", "--models", "gpt", "--hosts", "2", "--bandwidths", "unshaped,1gbit,10mbit",
                       "--seeds", "2", "--validate", "ddp_fp16@1gbit", "--steps", "5"])
    jobs = _plan(args, ["async", "ddp_fp16", "ddp_post_local_sgd:period=4", "ddp"], [None, 10**9, 10**7])
    got = [(j.phase, j.system, j.bandwidth, j.seed) for j in jobs]
    # first every to-target run on unshaped links, DDP's seeds first (they set the others' budgets)
    assert got[:2] == [("convergence", "ddp", "unshaped", 0), ("convergence", "ddp", "unshaped", 1)]
    assert set(got[2:8]) == {(phase, s, "unshaped", k) for k in (0, 1) for phase, s in (
        ("real", "async"), ("convergence", "ddp_fp16"), ("convergence", "ddp_post_local_sgd:period=4"))}
    steps = [g for g in got if g[0] == "step_time"]
    assert [(s, b) for _, s, b, _ in steps] == [(s, b) for b in ("unshaped", "1gbit", "10mbit")
                                               for s in ("ddp", "ddp_fp16", "ddp_post_local_sgd:period=4")]
    assert got[8:17] == steps  # then the timed runs, then the real runs at the shaped rates
    assert [g for g in got if g[0] == "real"][2:] == [("real", "async", b, k) for b in ("1gbit", "10mbit")
                                                      for k in (0, 1)]
    assert got[-1] == ("validation", "ddp_fp16", "1gbit", 0)
    # step-time runs cover whole local-update rounds; to-target runs carry the target, timed runs do not
    by = {(j.phase, j.system, j.bandwidth): j for j in jobs}
    assert by[("step_time", "ddp_post_local_sgd:period=4", "1gbit")].steps == 8
    assert by[("step_time", "ddp", "1gbit")].steps == 5 and by[("step_time", "ddp", "1gbit")].target is None
    assert by[("convergence", "ddp", "unshaped")].target == to_target.DEFAULTS["gpt"].target
    assert [j.workload_args()[-2:] for j in jobs if j.phase == "convergence"][1] == ["--seed", "1"]


def test_step_times_only_skips_the_convergence_runs_and_the_qadam_warmup_is_kept():
    from benchmarks.network import _plan, parse_args

    with pytest.raises(ValueError, match="not --repeats"):
        parse_args(["--to-target", "--models", "gpt", "--repeats", "3"])
    args = parse_args(["--to-target", "--models", "gpt", "--bandwidths", "1gbit,100mbit", "--step-times-only",
                       "--systems", "ddp,qadam,async", "--qadam-warmup", "60", "--repeats", "3"])
    assert args.repeats == 3  # timed runs may repeat
    jobs = _plan(args, ["ddp", "qadam", "async"], [10**9, 10**8])
    got = [(j.phase, j.system, j.bandwidth) for j in jobs]
    assert not [g for g in got if g[0] == "convergence"]
    assert {g for g in got if g[0] == "step_time"} == {("step_time", s, b) for s in ("ddp", "qadam")
                                                        for b in ("1gbit", "100mbit")}
    # timing-dependent: still real runs, on the links asked for only (no unshaped run that was not asked for)
    assert {g for g in got if g[0] == "real"} == {("real", "async", "1gbit"), ("real", "async", "100mbit")}
    # without a DDP convergence row in the run, a to-target job keeps --qadam-warmup and --max-steps
    job = next(j for j in jobs if j.phase == "real")
    assert to_target_plan.with_budget(job, []).qadam_warmup == 60


def test_a_timing_dependent_system_alone_runs_on_the_one_link_asked_for():
    from benchmarks.network import _plan, parse_args

    args = parse_args(["--to-target", "--models", "gpt", "--hosts", "4", "--bandwidths", "10mbit", "--systems",
                       "async", "--seeds", "1", "--first-seed", "2"])
    jobs = _plan(args, ["async"], [10**7])
    assert [(j.phase, j.system, j.bandwidth, j.seed, j.hosts) for j in jobs] == [("real", "async", "10mbit", 2, 4)]


def test_seeds_of_gives_one_system_its_own_seed_count():
    from benchmarks.network import _plan, parse_args

    args = parse_args(["--to-target", "--models", "gpt", "--bandwidths", "unshaped,1gbit", "--seeds", "3",
                       "--seeds-of", "ddp_fp16=1", "--seeds-of", "diloco:sync_every=10=2"])
    assert args.seeds_of == {"ddp_fp16": 1, "diloco:sync_every=10": 2}
    jobs = _plan(args, ["ddp", "ddp_fp16", "diloco:sync_every=10"], [None, 10**9])
    seeds = {}
    for j in jobs:
        if j.phase == "convergence":
            seeds.setdefault(j.system, []).append(j.seed)
    assert seeds == {"ddp": [0, 1, 2], "ddp_fp16": [0], "diloco:sync_every=10": [0, 1]}
    args.first_seed = 3  # --first-seed 3: more seeds for a campaign
    assert sorted({j.seed for j in _plan(args, ["ddp", "ddp_fp16", "diloco:sync_every=10"], [None])
                   if j.system == "ddp" and j.phase == "convergence"}) == [3, 4, 5]
    with pytest.raises(ValueError, match="not in --systems"):
        _plan(args, ["ddp", "ddp_fp16"], [None])
