"""Show the workers of a running fault-tolerant DiLoCo job, live: one row per worker, read from the coordinator.

Each worker of a job with ``rounds="time"`` or ``sync_every_max`` publishes the record of its latest round (see
:mod:`~bagua.torch_api.ops.diloco_stats`) as JSON in the coordinator's store; this reads them (never unpickles)
and prints a table every ``--interval`` seconds until Ctrl-C, or once with ``--once``::

    python -m bagua.torch_api.fault.top --coordinator 10.0.0.1:29600
    worker  round  sync_every  steps/s  steps  tokens  wait s  exchange s  age s
    w0         41          10     52.1     10      10   0.012       0.210    0.4
    w1         41          10     25.3      5       5   0.020       0.208    0.4

Example:
    >>> print(format_table([]))
    no worker has published a round yet (rounds="time" or sync_every_max publish one per round)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional

from bagua.torch_api.fault.quorum import connect_store
from bagua.torch_api.ops.diloco_stats import read_rows

__all__ = ["format_table", "main"]

_COLUMNS = (("worker", "worker", "{}"), ("round", "round", "{:d}"), ("sync_every", "sync_every", "{:d}"),
            ("steps/s", "speed", "{:.3g}"), ("steps", "steps", "{:d}"), ("tokens", "tokens", "{:g}"),
            ("wait s", "wait_s", "{:.3f}"), ("exchange s", "exchange_s", "{:.3f}"))


def format_table(rows: list[dict[str, Any]], now: Optional[float] = None) -> str:
    """The workers' ``rows`` (:func:`~bagua.torch_api.ops.diloco_stats.read_rows`) as an aligned text table, with
    the age of each row in seconds."""
    if not rows:
        return 'no worker has published a round yet (rounds="time" or sync_every_max publish one per round)'
    now = time.time() if now is None else now
    header = [name for name, _, _ in _COLUMNS] + ["age s"]
    cells = [[fmt.format(row[field]) for _, field, fmt in _COLUMNS] + [f"{max(0.0, now - row['time']):.1f}"]
             for row in rows]
    widths = [max(len(c) for c in column) for column in zip(header, *cells)]
    lines = [header] + cells
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def main(argv: Optional[list[str]] = None) -> None:
    """Print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinator", required=True, help="host:port of the job's coordinator")
    parser.add_argument("--prefix", default="bagua-ft", help="the job's prefix (FaultTolerance(prefix=...))")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print the table once and exit")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the coordinator")
    args = parser.parse_args(argv)
    store = connect_store(args.coordinator, args.timeout, "bagua.torch_api.fault.top")
    prefix = args.prefix.rstrip("/")
    try:
        while True:
            table = format_table(read_rows(store, prefix))
            if args.once:
                sys.stdout.write(table + "\n")
                return
            sys.stdout.write("\x1b[2J\x1b[H" + time.strftime("%H:%M:%S ") + args.coordinator + "\n" + table + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
