"""The plots re-rendered from stored results: the file appears, titles are readable, legends sit outside the
data, a one-bandwidth panel is a bar chart, lines carry markers, and an autotune plot marks the chosen setting."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest

from bagua.autotune import AutotuneLog, Hyperparameters
from bagua.autotune import log as autotune_log
from benchmarks.common import plots, report
SYSTEMS = {"ddp": (1.0, 1.0), "ddp_fp16": (1.2, 1.9), "bytegrad": (1.1, 3.4), "decentralized": (0.9, 2.2)}


def _results(tmp_path):
    rows = []
    for system, (fast, slow) in SYSTEMS.items():
        for band, speedup in (("unshaped", fast), ("1gbit", slow)):
            rows.append({"model": "mlp", "hosts": 2, "bandwidth": band, "system": system, "status": "ok",
                         "step_s": 0.1 / speedup})
        rows.append({"model": "mlp", "hosts": 4, "bandwidth": "1gbit", "system": system, "status": "ok",
                     "step_s": 0.2 / slow})
    meta = {"command": "python -m benchmarks.network --hosts 2 " + "--a-very-long-flag x " * 20,
            "emulated": True, "started": "2026-11-22 10:50:39"}
    path = tmp_path / "suite.json"
    path.write_text(json.dumps({"meta": meta, "goals": [], "results": rows}))
    return path, rows, meta


def _right_of_axes(fig, legend) -> bool:
    renderer = fig.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    return all(box.x0 >= ax.get_window_extent(renderer).x1 for ax in fig.axes)


def test_network_plot_rerendered_from_json(tmp_path):
    path, rows, meta = _results(tmp_path)
    stored = path.read_text()
    assert report.main([str(path)]) == 0
    assert (tmp_path / "suite.png").stat().st_size > 10_000
    assert path.read_text() == stored and sorted(p.name for p in tmp_path.iterdir()) == ["suite.json", "suite.png"]

    fig = plots.figure(report.add_speedups(rows), caption=plots.caption_for(meta))
    try:
        title = fig.get_suptitle()
        assert title.startswith(plots.TITLE) and "measured 2026-11-22" in title and "python -m" not in title
        assert all(len(line) < 100 for line in title.splitlines())
        lines_ax, bars_ax = fig.axes
        assert lines_ax.get_title() == "mlp, 2 hosts" and bars_ax.get_title() == "mlp, 4 hosts, 1gbit"
        assert all(line.get_marker() not in (None, "", "None") for line in lines_ax.get_lines()[:len(SYSTEMS)])
        # the one-bandwidth panel: one labelled bar per system, best on top
        assert len(bars_ax.patches) == len(SYSTEMS)
        assert [t.get_text() for t in bars_ax.get_yticklabels()][-1] == "bytegrad"
        assert [t.get_text() for t in bars_ax.texts][-1] == "3.40x"
        legend = fig.legends[0]
        assert [t.get_text() for t in legend.get_texts()] == plots.system_order(list(SYSTEMS))
        assert _right_of_axes(fig, legend)
    finally:
        plt.close(fig)


def test_merging_a_merged_file_keeps_every_run_date(tmp_path):
    path, rows, meta = _results(tmp_path)
    later = tmp_path / "later.json"
    later.write_text(json.dumps({"meta": {**meta, "started": "2026-11-27 01:00:00"}, "goals": [], "results": rows}))
    _, merged_meta = report.merge([str(path), str(later)])
    again = tmp_path / "merged.json"
    again.write_text(json.dumps({"meta": merged_meta, "goals": [], "results": rows}))
    newest = tmp_path / "newest.json"
    newest.write_text(json.dumps({"meta": {**meta, "started": "2026-11-28 02:00:00"}, "goals": [], "results": rows}))
    _, meta_again = report.merge([str(again), str(newest)])
    assert [run["started"][:10] for run in meta_again["runs"]] == ["2026-11-22", "2026-11-27", "2026-11-28"]
    assert plots.caption_for(meta_again).endswith("measured 2026-11-22, 2026-11-27, 2026-11-28")
    # a file merged before merging flattened (its runs still nested) is read the same way
    nested = {"command": "", "runs": [merged_meta, {**meta, "started": "2026-11-28 02:00:00"}]}
    assert plots.caption_for(nested) == plots.caption_for(meta_again)


def test_network_plot_refuses_rows_without_speedups(tmp_path):
    with pytest.raises(ValueError, match="add_speedups"):
        plots.plot([{"model": "mlp", "hosts": 2, "bandwidth": "1gbit", "system": "bytegrad", "status": "ok"}],
                   str(tmp_path / "x.png"))


def test_autotune_plot_marks_the_chosen_setting(tmp_path):
    log = AutotuneLog(str(tmp_path / "tune.csv"))
    log.write(Hyperparameters(10 << 20), 100.0, 10, 0, "default")
    for trial, (size, score) in enumerate([(1 << 16, 104.0), (1 << 18, 131.0), (1 << 22, 99.0)], start=1):
        log.write(Hyperparameters(size), score, 10 + 5 * trial, trial, "trial")
    log.write(Hyperparameters(1 << 18), 125.0, 40, 3, "best")
    png = autotune_log.plot(log.path, title="Autotune (test)")
    assert png.endswith("tune.png") and (tmp_path / "tune.png").stat().st_size > 10_000

    fig = autotune_log.figure(log.path, title="Autotune (test)")
    try:
        (ax,) = fig.axes
        assert ax.get_title() == "Autotune (test)\nchose 256 KiB; re-measured: 1.25x the default"
        chosen = next(line for line in ax.get_lines() if line.get_label() == "chosen setting")
        assert list(chosen.get_xdata()) == [2] and list(chosen.get_ydata()) == [131.0]
        assert {t.get_text() for t in ax.texts} == {"64 KiB", "256 KiB", "4 MiB"}
        renderer = fig.canvas.get_renderer()
        legend = ax.get_legend()
        assert legend.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0  # below the data
    finally:
        plt.close(fig)


def test_to_target_plot_one_panel_per_bandwidth(tmp_path):
    rows = []
    for band, slow in (("unshaped", 1.0), ("100mbit", 4.0)):
        for system, factor, hit in (("ddp", slow, True), ("bytegrad", 1.2, True), ("async", 1.0, False)):
            curve = [[s, s * factor, s * factor + 1, 5.5 - 0.1 * s] for s in range(0, 30, 10)]
            rows.append({"model": "gpt", "hosts": 2, "bandwidth": band, "system": system, "status": "ok",
                         "metric": "val_loss", "target": 3.6, "curve": curve,
                         "target_status": "reached" if hit else "not reached"})
    rows.append({"model": "gpt", "hosts": 2, "bandwidth": "1gbit", "system": "ddp", "status": "failed"})
    assert plots.plot_to_target(rows, str(tmp_path / "tt.png")).endswith("tt.png")
    fig = plots.figure_to_target(rows, caption="test")
    try:
        assert [ax.get_title() for ax in fig.axes] == ["gpt, 2 hosts, unshaped", "gpt, 2 hosts, 100mbit"]
        ax = fig.axes[0]
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert lines["ddp"].get_linestyle() == "--" and lines["bytegrad"].get_linestyle() == "-"
        assert lines["ddp"].get_color() == "#444444"
        assert any(line.get_marker() == "x" for line in ax.get_lines())  # async: not reached
        assert any(list(line.get_ydata()) == [3.6, 3.6] for line in ax.get_lines())  # the target
        legend = fig.legends[0]
        assert [t.get_text() for t in legend.get_texts()] == ["ddp", "async", "bytegrad"]
        assert _right_of_axes(fig, legend)
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match="--to-target"):
        plots.figure_to_target([{"status": "ok", "model": "gpt"}])
