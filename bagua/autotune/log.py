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
from typing import Optional

from bagua.autotune.tuner import Hyperparameters

__all__ = ["AutotuneLog", "COLUMNS", "read_log", "plot"]

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


def plot(path: str, out: Optional[str] = None, title: str = "Bagua autotune") -> str:
    """Plot score per trial (points), the best single score so far (line), the chosen setting re-measured
    (star) and the default (dashed); return the PNG path.

    Needs matplotlib (``pip install matplotlib``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_log(path)
    out = out or os.path.splitext(path)[0] + ".png"
    trials = [r for r in rows if r["kind"] == "trial"]
    defaults = [r for r in rows if r["kind"] == "default"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if trials:
        xs = [r["trial"] for r in trials]
        ys = [r["score"] for r in trials]
        ax.scatter(xs, ys, s=18, label="trial")
        best, running = [], float("-inf")
        for y in ys:
            running = max(running, y)
            best.append(running)
        ax.step(xs, best, where="post", label="best so far")
        for r in trials:
            ax.annotate(f"{r['bucket_size_2p']:.0f}", (r["trial"], r["score"]), fontsize=6,
                        xytext=(2, 2), textcoords="offset points")
    for r in [r for r in rows if r["kind"] == "best"]:
        x = (trials[-1]["trial"] + 1) if trials else 1
        ax.scatter([x], [r["score"]], marker="*", s=120, color="red", label="chosen, re-measured")
    for r in defaults:
        ax.axhline(r["score"], linestyle="--", color="grey", label=f"default ({r['bucket_size'] / 2**20:g} MiB)")
    ax.set_xlabel("trial (labels: log2 bucket size)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
