"""What each DiLoCo round looked like, per worker: speed, inner steps, tokens, waiting and exchange time.

:class:`Rounds` turns the report tables of :class:`~bagua.torch_api.ops.diloco_pace.Pace` into one
:class:`RoundRecord` per round, keeps them (``records``, the latest :data:`KEEP`), logs one INFO line per round on
the logger ``bagua.torch_api.ops.diloco_stats`` and, under fault tolerance, publishes this worker's latest row as
JSON under ``<prefix>/pace/<worker>`` of the coordinator's store (what ``python -m bagua.torch_api.fault.top``
shows). A round's waiting and exchange times are known only once its exchange is over, so its record is written
at the next round's report: ``records[-1]`` is the round before the one running.

Example:
    >>> r = RoundRecord(3, 10, ["0", "1"], [50.0, 20.0], [10, 4], [10.0, 4.0], [0.5, 0.0], [0.1, 0.1])
    >>> r.row(1)["steps"]
    4
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["RoundRecord", "Rounds", "KEEP", "pace_key", "StoreRows", "read_rows"]

_log = logging.getLogger(__name__)

#: the records kept (the latest)
KEEP = 10000


def pace_key(prefix: str, worker: str) -> str:
    """The store key of a fault-tolerant worker's latest row."""
    return f"{prefix}/pace/{worker}"


class StoreRows:
    """Publish one worker's latest row in a store (torch ``Store``: ``add``, ``set``): the worker's id once under
    ``<prefix>/pace/names/<n>`` (``<prefix>/pace/n`` counts them), its row as JSON under :func:`pace_key`. A view
    for people (``python -m bagua.torch_api.fault.top``); no worker reads it to decide anything."""

    def __init__(self, store: Any, prefix: str, worker: str) -> None:
        self.store, self.prefix, self.worker = store, prefix, worker
        self._named = False

    def __call__(self, text: str) -> None:
        if not self._named:
            self.store.set(f"{self.prefix}/pace/names/{self.store.add(f'{self.prefix}/pace/n', 1)}", self.worker)
            self._named = True
        self.store.set(pace_key(self.prefix, self.worker), text)


#: a row's fields and their types, as :meth:`RoundRecord.row` writes them
_FIELDS = {"worker": str, "round": int, "sync_every": int, "speed": float, "steps": int, "tokens": float,
           "wait_s": float, "exchange_s": float, "time": float}


def read_rows(store: Any, prefix: str) -> list[dict[str, Any]]:
    """Every published worker's latest row (:class:`StoreRows`), by worker id; a malformed row is left out."""
    n = int(store.add(f"{prefix}/pace/n", 0))
    names = sorted({store.get(k).decode() for k in (f"{prefix}/pace/names/{i}" for i in range(1, n + 1))
                    if store.check([k])})
    rows = []
    for name in names:
        key = pace_key(prefix, name)
        if not store.check([key]):
            continue
        try:
            raw = json.loads(store.get(key).decode())
            rows.append({f: kind(raw[f]) for f, kind in _FIELDS.items()})
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            continue  # not a row we wrote: leave it out
    return rows


@dataclass
class RoundRecord:
    """One round, per worker (in the order of ``workers``: ranks, or a fault-tolerant round's members).

    Args:
        round: the round's number (from 0).
        sync_every: the fastest worker's inner steps that round (``sync_every``, or the link rule's).
        workers: the workers' names.
        speed: inner steps per second of compute (0: not measured).
        steps: inner steps taken.
        tokens: samples behind its pseudo-gradient (1 per step unless ``add_samples``; under fault tolerance the
            samples its last fragment's round weighed).
        wait_s: seconds spent waiting in the round's reports (for the slowest worker, the quorum).
        exchange_s: seconds of its exchanges (after the wait).
    """

    round: int
    sync_every: int
    workers: list[str]
    speed: list[float]
    steps: list[int]
    tokens: list[float]
    wait_s: list[float]
    exchange_s: list[float]

    def row(self, i: int) -> dict[str, Any]:
        """Worker ``i``'s row as a JSON-ready dict."""
        return {"worker": self.workers[i], "round": self.round, "sync_every": self.sync_every,
                "speed": self.speed[i], "steps": self.steps[i], "tokens": self.tokens[i], "wait_s": self.wait_s[i],
                "exchange_s": self.exchange_s[i]}

    def to_json(self) -> str:
        """The record as one JSON object."""
        return json.dumps(dataclasses.asdict(self))

    def line(self) -> str:
        """One line for the log."""
        cells = [f"{w}: {s} steps, {t:g} tokens, {v:.3g} steps/s, wait {a:.3f} s, exchange {e:.3f} s"
                 for w, v, s, t, a, e in zip(self.workers, self.speed, self.steps, self.tokens, self.wait_s,
                                             self.exchange_s)]
        return f"DiLoCo round {self.round} (sync_every {self.sync_every}): " + " | ".join(cells)


class Rounds:
    """The records of a driver's rounds (see the module docstring).

    Args:
        publish: called with this worker's latest row as JSON text (fault tolerance: a store's ``set``); None: not
            published.
        log: log each record (one INFO line).
    """

    def __init__(self, publish: Optional[Callable[[str], None]] = None, log: bool = True) -> None:
        self.records: list[RoundRecord] = []
        self.publish = publish
        self.log = log
        self._pending: Optional[tuple[int, int, list[str], torch.Tensor]] = None

    def report(self, round: int, sync_every: int, workers: list[str], table: torch.Tensor, me: int) -> None:
        """Take the report ``table`` of round ``round``'s end (rows of :data:`~bagua.torch_api.ops.diloco_pace.ROW`;
        ``me``: this worker's row): write the previous round's record, whose waiting and exchange times it
        carries, and keep this one's speeds, steps and tokens until the next."""
        if self._pending is not None:
            last_round, last_h, last_workers, last = self._pending
            if last_workers == workers and round == last_round + 1:  # else this worker missed rounds (healed)
                t = last[:, 1].tolist()
                record = RoundRecord(
                    last_round, last_h, list(last_workers), [1.0 / x if x > 0 else 0.0 for x in t],
                    [int(x) for x in last[:, 2].tolist()], last[:, 0].tolist(), table[:, 3].tolist(),
                    table[:, 4].tolist())
                self._add(record, me)
        self._pending = (round, sync_every, list(workers), table.clone())

    def _add(self, record: RoundRecord, me: int) -> None:
        self.records = (self.records + [record])[-KEEP:]
        if self.log:
            _log.info("%s", record.line())
        if self.publish is not None:
            row = record.row(me)
            row["time"] = time.time()
            try:
                self.publish(json.dumps(row))
            except (RuntimeError, OSError) as exc:  # the table is a view; the round goes on without it
                _log.debug("could not publish the round's row: %s", exc)
