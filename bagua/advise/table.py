"""The measured tables behind the advisor, read from the one picks file ``bagua/advise/picks.json``.

Each row is one emulated link of one host count of the time-to-target tables (the 10.8 M-parameter benchmark GPT
trained to validation loss 2.40, medians of 3 seeds, one rank per host, ``hierarchical=False``; docs/benchmarks.md)
with the pick that reached the target first there. A row carries DDP's **communication-to-compute ratio** at that
link (one uncompressed ring allreduce of the GPT's fp32 gradient, from the cost model, over its measured compute
step), which is what carries over from the emulated hosts to a user's cluster
(docs/benchmarks_method.md#the-gpu-mapping-column): a user whose measured ratio is nearest a row's sees what that
row saw.

The picks file is the one place the figures and settings strings are written; three readers use it: the README's
"Which algorithm for my link" table (rendered by this module), the advisor (:func:`bagua.advise.recommend`) and
its tests. Settings strings are written once, as ``presets``, and rows name them (``"{warm}"``). After editing
the file, render the README's table again::

    python -m bagua.advise.render --update README.md      # or --markdown to print it

Example:
    >>> [row.link for row in TABLES[2]]
    ['unshaped', '1 Gbit/s', '100 Mbit/s', '10 Mbit/s']
    >>> TABLES[4][2].algorithm, TABLES[4][2].vs_ddp
    ('diloco', 5.57)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Optional

__all__ = ["TableRow", "TABLES", "PRESETS", "GPT_PARAMS", "PICKS_FILE", "STREAMING_DILOCO", "PLAIN_DILOCO",
           "WARM_DILOCO", "WARM_DILOCO_NF2", "load_picks", "render_markdown", "update_readme",
           "TABLE_BEGIN", "TABLE_END"]

#: The picks file, package data of ``bagua.advise``.
PICKS_FILE = "picks.json"
#: The README's markers around the rendered table.
TABLE_BEGIN = ("<!-- picks table: rendered from bagua/advise/picks.json by "
               "`python -m bagua.advise.render --update README.md` -->")
TABLE_END = "<!-- end of picks table -->"


@dataclass(frozen=True)
class TableRow:
    """One emulated link of one host count, and what won there.

    Args:
        hosts: hosts of the table (2, 4 or 8).
        link: the emulated link, as the tables name it ("10 Mbit/s", "unshaped").
        rate_bps: its rate in bits per second; ``None`` for unshaped (the hosts' software stack alone).
        ddp_ratio: DDP's communication-to-compute ratio there (the tables' last row).
        gpu_setting: the GPU setting with the same ratio (nodes of 8 H100 and the per-node link).
        pick: the pick, as the README names it ("streaming diloco").
        algorithm: its registry name (``Algorithm.init(algorithm, ...)``).
        settings: its settings string ("defaults" when none).
        vs_ddp: its median time to target against DDP's (higher is better).
        why: why it won there, in one sentence from the tables' notes.
        alternatives: other rows of the same column worth knowing, with their ratios.
        evidence: the section with the runs, as a path from the repository's root.
    """

    hosts: int
    link: str
    rate_bps: Optional[int]
    ddp_ratio: float
    gpu_setting: str
    pick: str
    algorithm: str
    settings: str
    vs_ddp: float
    why: str
    alternatives: tuple[str, ...]
    evidence: str


def _read() -> str:
    return resources.files("bagua.advise").joinpath(PICKS_FILE).read_text(encoding="utf-8")


def load_picks(text: Optional[str] = None) -> tuple[dict[str, str], dict[int, tuple[TableRow, ...]]]:
    """Return the picks file's presets and its rows per host count (the packaged file unless ``text`` is given).

    Settings, reasons and alternatives name presets as ``{key}``; they are filled in here.
    """
    data = json.loads(_read() if text is None else text)
    presets = dict(data["presets"])
    tables: dict[int, list[TableRow]] = {}
    for row in data["rows"]:
        tables.setdefault(row["hosts"], []).append(TableRow(
            hosts=row["hosts"], link=row["link"], rate_bps=row["rate_bps"], ddp_ratio=row["ddp_ratio"],
            gpu_setting=row["gpu_setting"], pick=row["pick"], algorithm=row["algorithm"],
            settings=row["settings"].format(**presets), vs_ddp=row["vs_ddp"], why=row["why"].format(**presets),
            alternatives=tuple(alt.format(**presets) for alt in row["alternatives"]), evidence=row["evidence"]))
    for hosts, rows in tables.items():
        if [r.ddp_ratio for r in rows] != sorted(r.ddp_ratio for r in rows):
            raise ValueError(f"{PICKS_FILE}: list the {hosts}-host rows from the fastest link to the slowest")
    return presets, {hosts: tuple(rows) for hosts, rows in sorted(tables.items())}


PRESETS, TABLES = load_picks()
#: The rows of each measured host count, fastest link first.
TABLES: dict[int, tuple[TableRow, ...]]
#: Parameters of the benchmark GPT the tables were measured on (docs/log/results/to-target-gpt-*.json).
GPT_PARAMS: int = json.loads(_read())["model_params"]
STREAMING_DILOCO = PRESETS["streaming"]
PLAIN_DILOCO = PRESETS["plain"]
WARM_DILOCO = PRESETS["warm"]
WARM_DILOCO_NF2 = PRESETS["warm_nf2"]


def _pick_cell(row: TableRow) -> str:
    return row.pick.replace(row.algorithm, f"`{row.algorithm}`", 1)


def render_markdown(tables: Optional[dict[int, tuple[TableRow, ...]]] = None) -> str:
    """Return the README's which-algorithm table: one row per link and host count, the slowest link first.

    Example:
        >>> render_markdown().splitlines()[0]
        '| link (the GPU setting with the same ratio) | hosts | pick | settings | time to target vs DDP | evidence |'
    """
    tables = TABLES if tables is None else tables
    lines = ["| link (the GPU setting with the same ratio) | hosts | pick | settings | time to target vs DDP "
             "| evidence |", "|---|---|---|---|---|---|"]
    for link in [row.link for row in reversed(tables[min(tables)])]:
        for hosts in sorted(tables):
            for row in tables[hosts]:
                if row.link != link:
                    continue
                settings = "defaults" if row.settings == "defaults" else f"`{row.settings}`"
                lines.append(f"| {row.link} ({row.gpu_setting}) | {row.hosts} | {_pick_cell(row)} | {settings} | "
                             f"**{row.vs_ddp:g}x** | [runs]({row.evidence}) |")
    return "\n".join(lines) + "\n"


def update_readme(text: str, table: Optional[str] = None) -> str:
    """Return ``text`` with the part between :data:`TABLE_BEGIN` and :data:`TABLE_END` replaced by the table."""
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise ValueError(f"the README lacks the markers of the picks table; put\n{TABLE_BEGIN}\n{TABLE_END}\n"
                         "where the table belongs")
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{render_markdown() if table is None else table}{TABLE_END}{tail}"
