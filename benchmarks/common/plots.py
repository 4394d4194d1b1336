"""The network suite's plot: speedup over torch DDP, one panel per (model, hosts).

One message per figure: how much faster than DDP each system's training step is (higher is better). A panel
measured at several link bandwidths draws one line with markers per system against the bandwidth; a panel
measured at a single bandwidth is a bar chart, one labelled bar per system, sorted. Baselines (DDP and its comm
hooks) are grey and dashed, Bagua's systems coloured, each system in the same colour in every panel; the legend
sits outside the data, to the right. Step times, accuracy and the command line stay in the tables and JSON.

Example:
    >>> rows = [{"model": "mlp", "hosts": 2, "bandwidth": "1gbit", "system": s, "status": "ok", "speedup": v}
    ...         for s, v in (("ddp", 1.0), ("bytegrad", 3.2))]
    >>> plot(rows, "/tmp/speedup.png", caption="2 emulated hosts")  # doctest: +SKIP
    '/tmp/speedup.png'
"""

from __future__ import annotations

from typing import Optional

__all__ = ["plot", "figure", "plot_to_target", "figure_to_target", "plot_time_vs_bandwidth",
           "figure_time_vs_bandwidth", "caption_for", "runs_of", "system_order", "TITLE", "TITLE_TO_TARGET",
           "TITLE_VS_BANDWIDTH", "plot_unequal", "TITLE_UNEQUAL"]

TITLE = "Training step speedup over torch DDP (higher is better)"
TITLE_TO_TARGET = "Validation metric against training time (time to accuracy)"
TITLE_VS_BANDWIDTH = "Time to target against link bandwidth (lower is better)"
TITLE_UNEQUAL = "Time to target per speed profile (lower is better; black line: the ideal)"
BANDWIDTH_ORDER = ["unshaped", "10gbit", "1gbit", "100mbit", "10mbit"]
_MARKERS = "os^vD<>pP*hX"


def _is_baseline(system: str) -> bool:
    return system.startswith("ddp")


def system_order(systems: list[str]) -> list[str]:
    """Baselines (``ddp...``) first, then the others by name; each name once."""
    return sorted(dict.fromkeys(systems), key=lambda s: (not _is_baseline(s), s))


def _styles(systems: list[str]) -> dict[str, dict]:
    """One colour, marker and line style per system, the same in every panel."""
    greys = ["#444444", "#888888", "#bbbbbb"]
    styles, baseline, other = {}, 0, 0
    for i, system in enumerate(systems):
        if _is_baseline(system):
            color, baseline = greys[baseline % len(greys)], baseline + 1
        else:
            color, other = f"C{other % 10}", other + 1
        styles[system] = {"color": color, "marker": _MARKERS[i % len(_MARKERS)],
                          "linestyle": "--" if _is_baseline(system) else "-"}
    return styles


def _bandwidth_key(band: str) -> int:
    return BANDWIDTH_ORDER.index(band) if band in BANDWIDTH_ORDER else len(BANDWIDTH_ORDER)


def _lines(ax, sub: list[dict], systems: list[str], styles: dict[str, dict], bands: list[str]) -> None:
    import matplotlib.ticker

    for system in systems:
        pts = {r["bandwidth"]: r["speedup"] for r in sub if r["system"] == system}
        xs = [j for j, b in enumerate(bands) if b in pts]
        if xs:
            ax.plot(xs, [pts[bands[j]] for j in xs], label=system, markersize=6, linewidth=1.6, **styles[system])
    ax.set_xticks(range(len(bands)))
    ax.set_xticklabels(bands)
    ax.set_xlim(-0.3, len(bands) - 0.7)
    ax.set_xlabel("link bandwidth")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.grid(True, alpha=0.3)


def _bars(ax, sub: list[dict], styles: dict[str, dict]) -> None:
    ranked = sorted(sub, key=lambda r: r["speedup"])
    ys = range(len(ranked))
    ax.barh(ys, [r["speedup"] for r in ranked], color=[styles[r["system"]]["color"] for r in ranked], height=0.6)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r["system"] for r in ranked], fontsize=9)
    top = max(r["speedup"] for r in ranked)
    for y, r in zip(ys, ranked):
        ax.text(r["speedup"] + 0.01 * top, y, f"{r['speedup']:.2f}x", va="center", fontsize=9)
    ax.set_xlim(0, top * 1.18)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speedup over DDP (x)")
    ax.grid(True, axis="x", alpha=0.3)


def plot(rows: list[dict], path: str, caption: str = "", title: str = TITLE) -> str:
    """Draw the speedup of every successful row (after ``add_speedups``) and save a PNG; return ``path``.

    Args:
        rows: result rows with ``model``, ``hosts``, ``bandwidth``, ``system``, ``status`` and ``speedup``.
        path: the PNG to write.
        caption: a short second title line (what was measured where), e.g. ``"2 emulated hosts, tbf links"``.
        title: the first title line.

    Returns:
        ``path``.
    """
    return _save(figure(rows, caption, title), path)


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def figure(rows: list[dict], caption: str = "", title: str = TITLE):
    """The matplotlib figure :func:`plot` saves (for tests and notebooks); the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("speedup") is not None]
    if not ok:
        raise ValueError("no successful row with a speedup to plot; run add_speedups() on rows with a DDP baseline")
    panels = sorted({(r["model"], r["hosts"]) for r in ok}, key=lambda p: (p[0] != "mlp", p[0], p[1]))
    systems = system_order([r["system"] for r in ok])
    styles = _styles(systems)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 2.4, 4.6), squeeze=False)
    line_panels = 0
    for ax, (model, hosts) in zip(axes[0], panels):
        sub = [r for r in ok if (r["model"], r["hosts"]) == (model, hosts)]
        bands = sorted({r["bandwidth"] for r in sub}, key=_bandwidth_key)
        if len(bands) > 1:
            _lines(ax, sub, systems, styles, bands)
            ax.set_title(f"{model}, {hosts} hosts", fontsize=11)
            line_panels += 1
        else:
            _bars(ax, sub, styles)
            ax.set_title(f"{model}, {hosts} hosts, {bands[0]}", fontsize=11)
    axes[0][0].set_ylabel("speedup over DDP (log scale)" if len(_bands_of(ok, panels[0])) > 1 else "")
    if line_panels:
        _legend_outside(fig, axes[0], "system")
    fig.suptitle(title + (f"\n{caption}" if caption else ""), fontsize=12)
    fig.tight_layout()
    return fig


def _legend_outside(fig, axes: list, title: str) -> None:
    """One legend for the panels ``axes``, each label once, right of the figure (outside the data)."""
    handles, labels = [], []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):  # labels starting with "_" are left out by matplotlib
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=9,
               title=title, title_fontsize=9)


def _bands_of(rows: list[dict], panel: tuple) -> set:
    return {r["bandwidth"] for r in rows if (r["model"], r["hosts"]) == panel}


def runs_of(meta: dict) -> list[dict]:
    """The single runs behind a results file's ``meta``: itself, or a merged file's runs, flattened (a merged file
    merged again nests them)."""
    return [run for inner in meta["runs"] for run in runs_of(inner)] if meta.get("runs") else [meta]


def caption_for(meta: dict, rows: Optional[list[dict]] = None, what: str = "median step time") -> str:
    """A one-line caption from a results file's ``meta``: emulated or loopback links, and when it was measured."""
    runs = runs_of(meta)
    emulated = all(run.get("emulated", True) for run in runs)
    dates = sorted({str(run.get("started", ""))[:10] for run in runs if run.get("started")})
    where = "hosts emulated in network namespaces, tbf-shaped links" if emulated else "loopback, unshaped"
    when = f"; measured {', '.join(dates)}" if dates else ""
    return f"{what}; {where}{when}"


def plot_to_target(rows: list[dict], path: str, caption: str = "", title: str = TITLE_TO_TARGET) -> str:
    """Draw each time-to-accuracy run's validation curve and save a PNG; return ``path``.

    Args:
        rows: result rows with ``curve`` (``[step, training seconds, wall seconds, metric]`` per evaluation),
            ``metric``, ``target``, ``target_status``, ``model``, ``hosts``, ``bandwidth`` and ``system``.
        path: the PNG to write.
        caption: a short second title line.
        title: the first title line.

    Returns:
        ``path``.
    """
    return _save(figure_to_target(rows, caption, title), path)


def figure_to_target(rows: list[dict], caption: str = "", title: str = TITLE_TO_TARGET):
    """The figure :func:`plot_to_target` saves: one panel per (model, hosts, bandwidth), the metric against
    training time (evaluations excluded), one line per system, the target as a black dotted line; a run that
    did not reach the target ends in an ``x``. The caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("curve")]
    if not ok:
        raise ValueError("no successful time-to-accuracy row (with a 'curve') to plot; run bagua-bench --to-target")
    panels = sorted({(r["model"], r["hosts"], r["bandwidth"]) for r in ok},
                    key=lambda p: (p[0], p[1], _bandwidth_key(p[2])))
    systems = system_order([r["system"] for r in ok])
    styles = _styles(systems)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 2.4, 4.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        sub = [r for r in ok if (r["model"], r["hosts"], r["bandwidth"]) == panel]
        for system in systems:
            for r in [r for r in sub if r["system"] == system]:
                xs = [point[1] for point in r["curve"]]
                ys = [point[3] for point in r["curve"]]
                style = dict(styles[system], marker=None)
                ax.plot(xs, ys, label=system, linewidth=1.6, **style)
                if r.get("target_status") == "not reached":
                    ax.plot(xs[-1:], ys[-1:], marker="x", markersize=9, color=style["color"], linestyle="")
        metric, target = sub[0].get("metric", "metric"), sub[0].get("target")
        if target is not None:
            ax.axhline(target, color="black", linewidth=0.9, linestyle=":", label="_target")
        ax.set_title(f"{panel[0]}, {panel[1]} hosts, {panel[2]}", fontsize=11)
        ax.set_xlabel("training time (s, evaluations excluded)")
        ax.set_ylabel({"val_loss": "validation loss (nats/byte)", "accuracy": "test accuracy"}.get(metric, metric))
        ax.grid(True, alpha=0.3)
    _legend_outside(fig, axes[0], "system (x: target not reached; dotted: target)")
    fig.suptitle(title + (f"\n{caption}" if caption else ""), fontsize=12)
    fig.tight_layout()
    return fig


def plot_time_vs_bandwidth(table: list[dict], path: str, caption: str = "", title: str = TITLE_VS_BANDWIDTH) -> str:
    """Draw time to target against bandwidth from :func:`benchmarks.to_target.to_target_table.combine`'s rows and save
    a PNG; return ``path``."""
    return _save(figure_time_vs_bandwidth(table, caption, title), path)


def figure_time_vs_bandwidth(table: list[dict], caption: str = "", title: str = TITLE_VS_BANDWIDTH):
    """One panel per (model, hosts): the median time to target of each system (seeds' range as error bars)
    against the link bandwidth, both axes logarithmic, unshaped drawn right of the fastest link; DDP is the
    thick black reference line. A system that missed the target on the median seed has no point there. The
    caller closes the figure."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in table if math.isfinite(c["time_spread"].median)]
    if not cells:
        raise ValueError("no system reached the target: nothing to plot")
    panels = list(dict.fromkeys((c["model"], c["hosts"]) for c in cells))
    systems = system_order([c["system"] for c in cells])
    styles = _styles(systems)
    styles["ddp"] = dict(styles.get("ddp", {}), color="black", linestyle="-", linewidth=2.6)
    shaped = [c["rate_bps"] for c in cells if c["rate_bps"]]
    unshaped_x = 10 * max(shaped) if shaped else 1e10
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 2.4, 4.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        sub = [c for c in cells if (c["model"], c["hosts"]) == panel]
        for system in systems:
            mine = sorted((c for c in sub if c["system"] == system), key=lambda c: c["rate_bps"] or unshaped_x)
            if not mine:
                continue
            xs = [c["rate_bps"] or unshaped_x for c in mine]
            med = [c["time_spread"].median for c in mine]
            low = [m - c["time_spread"].low for m, c in zip(med, mine)]
            high = [(c["time_spread"].high if math.isfinite(c["time_spread"].high) else m) - m
                    for m, c in zip(med, mine)]
            style = dict(styles[system])
            ax.errorbar(xs, med, yerr=[low, high], label=system, capsize=3, markersize=6,
                        linewidth=style.pop("linewidth", 1.6), **style)
        ticks = sorted({c["rate_bps"] or unshaped_x for c in sub})
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels(["unshaped" if t == unshaped_x else _rate_label(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("link bandwidth per host (log scale)")
        ax.set_ylabel("time to target, s (log scale)")
        ax.set_title(f"{panel[0]}, {panel[1]} hosts", fontsize=11)
        ax.grid(True, alpha=0.3, which="both")
    _legend_outside(fig, axes[0], "system (DDP: black)")
    fig.suptitle(title + (f"\n{caption}" if caption else ""), fontsize=12)
    fig.tight_layout()
    return fig


def _rate_label(bits_per_s: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s:g} bit/s"


def plot_unequal(table: list[dict], path: str, caption: str = "", title: str = TITLE_UNEQUAL) -> str:
    """Time to target per speed profile, one panel per link: a bar per system (median over seeds), the ideal as a
    black line over each profile's bars. ``table``: :func:`benchmarks.to_target.unequal_report.summarize`'s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [e for e in table if e.get("time_s")]
    if not ok:
        raise ValueError("no (link, profile, system) reached the target; nothing to plot")
    links = sorted({e["link"] for e in ok})
    systems = system_order([e["system"] for e in ok])
    styles = _styles(systems)
    fig, axes = plt.subplots(1, len(links), figsize=(5.2 * len(links) + 2.4, 4.4), squeeze=False)
    for ax, link in zip(axes[0], links):
        sub = [e for e in ok if e["link"] == link]
        profiles = list(dict.fromkeys(e["profile"] for e in sub))
        here = [s for s in systems if any(e["system"] == s for e in sub)]  # no empty bars: their legend is wrong
        width = 0.8 / len(here)
        for j, system in enumerate(here):
            xs = [i + (j - (len(here) - 1) / 2) * width for i, p in enumerate(profiles)
                  if any(e["profile"] == p and e["system"] == system for e in sub)]
            ys = [e["time_s"] for p in profiles for e in sub if e["profile"] == p and e["system"] == system]
            ax.bar(xs, ys, width * 0.95, color=styles[system]["color"], label=system)
        for i, p in enumerate(profiles):
            ideal = next((e["ideal_s"] for e in sub if e["profile"] == p and e.get("ideal_s")), None)
            if ideal:
                ax.hlines(ideal, i - 0.45, i + 0.45, colors="black", linewidth=2)
        ax.set_xticks(range(len(profiles)))
        ax.set_xticklabels(profiles)
        ax.set_title(link, fontsize=11)
        ax.set_ylabel("time to target, s")
    _legend_outside(fig, axes[0], "system")
    fig.suptitle(title + (f"\n{caption}" if caption else ""), fontsize=12)
    fig.tight_layout()
    return _save(fig, path)
