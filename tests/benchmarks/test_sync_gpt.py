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
