"""Only ``max_workers`` distinct workers: the job's admitted ids, kept by the closers of its quorums.

The lead that closes a quorum (:mod:`~bagua.torch_api.fault.lead`) leaves out a new id past ``max_workers``
distinct workers and adds the members to the job's admitted ids (a sealed JSON list, merged by ``compare_set``);
a worker that a quorum closed without, and that is not admitted when the job is full, raises
:class:`~bagua.torch_api.fault.secret.NotAdmitted` saying so.

Example:
    >>> quorums._bounded(arrived, key=3)  # the arrived members without the ids past max_workers  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging

from bagua.torch_api.fault.lead import Leads
from bagua.torch_api.fault.records import Member
from bagua.torch_api.fault.secret import NotAdmitted

__all__ = ["Admission"]

_log = logging.getLogger(__name__)


class Admission(Leads):
    """Bound the job's distinct workers (the attributes a subclass sets: ``max_workers``, ``_known``, and
    :class:`~bagua.torch_api.fault.lead.Leads`' own).

    Example:
        >>> quorums._raise_if_refused(3)  # NotAdmitted when the job is full without this worker  # doctest: +SKIP
    """

    max_workers: int
    _known: set[str]

    def _raise_if_refused(self, key: int) -> None:
        """Raise :class:`NotAdmitted` when the job admitted ``max_workers`` distinct workers, this one not among
        them (a quorum closed without it)."""
        admitted = self._admitted()
        if self.worker not in admitted and len(admitted) >= self.max_workers:
            raise NotAdmitted(
                f"worker {self.worker!r}: the job already admitted max_workers={self.max_workers} distinct workers "
                f"({', '.join(sorted(admitted))}); quorum {key} closed without this one. Restart one of them under "
                "its own id, or start every worker with a larger max_workers= to allow more")

    def _admitted(self) -> set[str]:
        """The ids the job admitted to a quorum so far (a sealed JSON list)."""
        ids = self._parse("admitted", self._get("admitted"), json.loads)
        admitted = {str(w) for w in ids} if isinstance(ids, list) else set()
        self._known |= admitted
        return admitted

    def _admit(self, ids: list[str]) -> None:
        """Add ``ids`` to the job's admitted workers (a compare-and-set loop: concurrent closers merge)."""
        if set(ids) <= self._known:
            return
        full = self._k("admitted")
        for _ in range(16):
            raw = self._raw(full) if self.store.check([full]) else ""
            known = self._admitted() if raw else set()
            if set(ids) <= known:
                return
            merged = self.records.seal(full, json.dumps(sorted(known | set(ids))))
            if self.store.compare_set(full, raw, merged).decode(errors="replace") == merged:
                self._known |= known | set(ids)
                return

    def _bounded(self, arrived: list[Member], key: int) -> list[Member]:
        """``arrived`` without the new ids past ``max_workers`` distinct workers (in id order), named in a
        warning."""
        if all(m.id in self._known for m in arrived):
            return arrived
        admitted = self._admitted()
        room = self.max_workers - len(admitted)
        new = [m.id for m in arrived if m.id not in admitted]
        refused = set(new[max(0, room):])
        if refused:
            _log.warning("quorum %d leaves out worker(s) %s: the job already admitted max_workers=%d distinct workers "
                         "(%s); start every worker with a larger max_workers= to allow more", key,
                         ", ".join(sorted(refused)), self.max_workers, ", ".join(sorted(admitted)))
        return [m for m in arrived if m.id not in refused]
