"""The synchronous fault benchmark's bookkeeping (benchmarks/fault/sync_gpt.py, gpt_runs.py), without processes."""

from __future__ import annotations

import pytest

from benchmarks.fault import gpt_runs, sync_gpt


def test_outcome_takes_the_first_hit_less_the_evaluations_before_it():
    evals = [{"step": 10, "loss": 3.0, "t": 105.0, "eval_s": 0.5}, {"step": 20, "loss": 2.2, "t": 110.0,
                                                                        "eval_s": 0.5},
             {"step": 30, "loss": 2.1, "t": 115.0, "eval_s": 0.5}]
    out = gpt_runs.outcome(evals, 100.0, 2.25)
    assert out["reached"] and out["steps_to_target"] == 20
    assert out["time_to_target_s"] == pytest.approx(10.0 - 1.0)
    assert gpt_runs.outcome(evals, 100.0, 1.0)["time_to_target_s"] is None


def test_the_table_pairs_runs_by_algorithm_and_seed(capsys):
    def row(algorithm, mode, kill_every, seed, t):
        return {"algorithm": algorithm, "mode": mode, "kill_every": kill_every, "seed": seed, "kills": [],
                "time_to_target_s": t, "steps_to_target": 100, "final_loss": 2.2, "load": 1.0}

    rows = [row("allreduce", "ft", 0, 0, 100.0), row("allreduce", "ft", 100, 0, 110.0),
            row("allreduce", "ft", 0, 1, 200.0), row("allreduce", "ft", 100, 1, 260.0),
            row("allreduce", "plain", 0, 1, 190.0), row("bytegrad", "ft", 0, 0, 50.0),
            row("bytegrad", "restart", 100, 0, 75.0)]
    sync_gpt.print_table(rows)
    out = capsys.readouterr().out
    assert "allreduce: ft:100 / ft: median 1.200 over 2 seed(s) (1.100, 1.300)" in out
    assert "allreduce: ft / plain: median 1.053 over 1 seed(s)" in out
    assert "bytegrad: restart:100 / ft: median 1.500 over 1 seed(s)" in out
    assert "bytegrad: ft:100" not in out


@pytest.mark.parametrize("argv", [["--runs", "ft,kill:100"], ["--algorithms", "allreduce,bytgrad"]])
def test_unknown_runs_and_algorithms_are_refused(argv):
    with pytest.raises(SystemExit):
        sync_gpt.parse_args(argv)


class _Cluster:  # stands in for benchmarks.common.netns.NetnsCluster: no namespaces
    def __init__(self, n_hosts, prefix=None):
        self.rates = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def shape(self, rate):
        self.rates.append(rate)


def test_a_campaign_runs_seeds_by_runs_and_rewrites_the_json_after_each(tmp_path, monkeypatch, capsys):
    import argparse
    import json

    from benchmarks.common import netns

    monkeypatch.setattr(netns, "NetnsCluster", _Cluster)
    monkeypatch.setattr(netns, "install_signal_handlers", lambda: None)
    args = argparse.Namespace(seeds="0,1", rate="1gbit", json=str(tmp_path / "r.json"))
    seen = []

    def run_one(cluster, seed, run, workdir):
        assert cluster.rates == ["1gbit"] and workdir.is_dir()
        seen.append(json.loads((tmp_path / "r.json").read_text())["rows"] if seen else [])
        return {"seed": seed, "run": run}

    rows = gpt_runs.run_campaign(args, ["a", "b"], run_one, lambda run, r: f"{run} {r['seed']}", "bagua-test-",
                                 load="mean")
    assert [(r["seed"], r["run"]) for r in rows] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert [len(s) for s in seen] == [0, 1, 2, 3]  # the file holds every earlier row when the next run starts
    assert all(set(r) == {"seed", "run", "started", "load"} for r in rows)
    assert gpt_runs.saved_rows(args.json) == rows
    assert [line.split("] ")[1] for line in capsys.readouterr().out.splitlines()] == ["a 0", "b 0", "a 1", "b 1"]


class _Life:  # a worker that prints steps 1, 2, ... one a poll, and exits with ``code`` after ``steps``
    def __init__(self, log, steps=100, code=0):
        self.step, self.steps, self.code, self.killed, self.log = 0, steps, code, False, log

    def read(self):
        self.step += 1

    def poll(self):
        return self.code if self.step >= self.steps else None

    def kill(self):
        self.killed = True


def test_the_supervisor_restarts_victims_on_the_plan_and_kills_all_at_the_end(tmp_path):
    from benchmarks.fault import kills as kill_mod

    log = tmp_path / "w.log"
    log.write_text("a worker's last words\n")
    lives = [_Life(log) for _ in range(kill_mod.WORKERS)]
    current = dict(enumerate(lives))

    def spawn(i):
        lives.append(_Life(log))
        return lives[-1]

    record = []
    kill_mod.supervise(current, lives, spawn, [3, 6], record, lambda: current[0].step >= 10, "t", float("inf"))
    assert [k["victim"] for k in record] == ["w1", "w2"] and len(lives) == kill_mod.WORKERS + 2
    assert all(life.killed for life in lives)  # the victims at their kill, the others at the end
    failing = [_Life(log), _Life(log, steps=2, code=1)]
    with pytest.raises(RuntimeError, match="(?s)a worker failed.*last words"):
        kill_mod.supervise(dict(enumerate(failing)), failing, spawn, [], [], lambda: False, "t", float("inf"))
    assert all(life.killed for life in failing)
