"""The autotune log: one CSV row per measured window, and a plot of the score per trial.

Columns: the original Bagua's ``bucket_size_2p, is_hierarchical_reduce, score, train_iter``, then
``trial, kind, bucket_size, num_streams, steps, window_s`` (``kind`` is ``default``, ``trial`` or ``best``;
``score`` is samples/s).

Example:
    >>> log = AutotuneLog("/tmp/bagua_autotune.csv")  # doctest: +SKIP
    >>> plot("/tmp/bagua_autotune.csv", "/tmp/bagua_autotune.png")  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import os
import tempfile
from typing import Optional

from bagua.autotune.tuner import Hyperparameters

__all__ = ["AutotuneLog", "COLUMNS", "read_log", "plot", "figure", "describe", "default_log_path"]

COLUMNS = ["bucket_size_2p", "is_hierarchical_reduce", "score", "train_iter",
           "trial", "kind", "bucket_size", "num_streams", "steps", "window_s"]


class AutotuneLog:
    """Append rows to a CSV file (header written when the file is created); each row is flushed at once.

    Args:
        path: the CSV file; its folder is created.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow(COLUMNS)

    def write(self, hp: Hyperparameters, score: float, train_iter: int, trial: int, kind: str,
              steps: int = 0, window_s: float = 0.0) -> None:
        """Append one measurement."""
        row = [f"{hp.bucket_size_2p:.3f}", int(hp.is_hierarchical_reduce), f"{score:.4f}", train_iter,
               trial, kind, hp.bucket_size, hp.num_streams, steps, f"{window_s:.3f}"]
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow(row)


def read_log(path: str) -> list[dict]:
    """The rows of a log as dicts with numbers parsed."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append({
                "bucket_size_2p": float(row["bucket_size_2p"]),
                "is_hierarchical_reduce": bool(int(row["is_hierarchical_reduce"])),
                "score": float(row["score"]),
                "train_iter": int(row["train_iter"]),
                "trial": int(row["trial"]),
                "kind": row["kind"],
                "bucket_size": int(row["bucket_size"]),
                "num_streams": int(row["num_streams"]),
                "steps": int(row["steps"]),
                "window_s": float(row["window_s"]),
            })
    return rows


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _setting(row: dict) -> tuple:
    return row["bucket_size"], row["is_hierarchical_reduce"], row["num_streams"]


def _label(row: dict, streams: bool, hierarchical: bool) -> str:
    parts = [_size(row["bucket_size"])]
    if hierarchical:
        parts.append("hier." if row["is_hierarchical_reduce"] else "flat")
    if streams:
        parts.append(f"{row['num_streams']} str.")
    return ", ".join(parts)


def plot(path: str, out: Optional[str] = None, title: str = "Bagua autotune") -> str:
    """Plot one tune: each trial's throughput (points labelled with their setting), the default (dashed line),
    the chosen setting (ringed, named in the title) and its re-measurement (star); return the PNG path.

    The legend sits outside the data, below the axes. Needs matplotlib (``pip install matplotlib``).

    Args:
        path: the CSV log written by :class:`AutotuneLog`.
        out: the PNG to write (default: ``path`` with ``.png``).
        title: what was tuned, e.g. ``"autotune sweep, deep, 1gbit"``; the choice is appended.

    Returns:
        The PNG path.
    """
    import matplotlib.pyplot as plt

    out = out or os.path.splitext(path)[0] + ".png"
    fig = figure(path, title)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def figure(path: str, title: str = "Bagua autotune"):
    """The matplotlib figure :func:`plot` saves (for tests and notebooks); the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = read_log(path)
    trials = [r for r in rows if r["kind"] == "trial"]
    default = next((r for r in rows if r["kind"] == "default"), None)
    best = next((r for r in rows if r["kind"] == "best"), None)
    streams = len({r["num_streams"] for r in rows}) > 1
    hierarchical = len({r["is_hierarchical_reduce"] for r in rows}) > 1
    fig, ax = plt.subplots(figsize=(8, 4.8))
    if default is not None:
        ax.axhline(default["score"], linestyle="--", color="grey", linewidth=1.2,
                   label=f"default ({_label(default, streams, hierarchical)}): {default['score']:.1f}")
    if trials:
        xs, ys = [r["trial"] for r in trials], [r["score"] for r in trials]
        ax.plot(xs, ys, marker="o", linestyle="none", color="C0", markersize=6, label="trial")
        for r in trials:
            ax.annotate(_label(r, streams, hierarchical), (r["trial"], r["score"]), fontsize=7,
                        xytext=(0, 6), textcoords="offset points", ha="center")
    caption = ""
    if best is not None:
        chosen = [r for r in trials if _setting(r) == _setting(best)]
        if chosen:
            ax.plot([r["trial"] for r in chosen], [r["score"] for r in chosen], marker="o", markersize=15,
                    markerfacecolor="none", markeredgecolor="red", markeredgewidth=2, linestyle="none",
                    label="chosen setting")
        x = (trials[-1]["trial"] + 1) if trials else 1
        ax.plot([x], [best["score"]], marker="*", markersize=15, color="red", linestyle="none",
                label=f"chosen, re-measured: {best['score']:.1f}")
        gain = (f"; re-measured: {best['score'] / default['score']:.2f}x the default"
                if default and default["score"] > 0 else "")
        caption = f"\nchose {_label(best, streams, hierarchical)}{gain}"
    ax.set_xlabel("trial")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(title + caption, fontsize=11)
    ax.margins(x=0.06, y=0.15)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def describe(hp: Hyperparameters) -> str:
    """``hp`` in words, as the log prints it, e.g. ``bucket 4 MiB, hierarchical off, 1 stream``."""
    size = hp.bucket_size
    unit = next((u for u, b in (("MiB", 1 << 20), ("KiB", 1 << 10)) if size >= b), "B")
    scaled = size / {"MiB": 1 << 20, "KiB": 1 << 10, "B": 1}[unit]
    streams = f"{hp.num_streams} stream{'s' if hp.num_streams != 1 else ''}"
    return f"bucket {scaled:g} {unit}, hierarchical {'on' if hp.is_hierarchical_reduce else 'off'}, {streams}"


def default_log_path(model_signature: str) -> str:
    """Where ``--is_output_autotune_log`` writes the CSV log (the temp folder, as in the original)."""
    return os.path.join(tempfile.gettempdir(), f"bagua_autotune_{model_signature}.csv")
