"""What a fault-tolerant round is made of, as typed records: a member, a quorum, and this worker's round.

:class:`Member` is what a worker writes to its slot of a quorum, :class:`Quorum` what the winning worker writes when
it closes one (both travel as JSON through the coordinator's store, never pickled); :class:`Round` is what
:meth:`~bagua.torch_api.fault.replica.FaultTolerance.start_round` hands the algorithm: the quorum, this worker's
place in it, the part of the algorithm's state the round synchronizes and the weight of every member.

A *part* is the algorithm's unit of synchronization (DiLoCo's fragment); ``-1`` means none (a round that only
heals a joining worker). A *round* counter is the algorithm's own (DiLoCo's outer steps taken): the members with
the highest are the round's *sources*; the others *heal* from them and contribute nothing to its collectives.

Example:
    >>> m = Member(round=3, joining=False, samples=8, part=0, settings="H=4", id="w0")
    >>> Member.from_json(m.to_json()) == m
    True
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Member", "Quorum", "Round", "roles"]


@dataclass(frozen=True)
class Member:
    """One worker's slot in a quorum.

    Args:
        round: the rounds its state has completed (the algorithm's counter; ``-1`` while joining).
        joining: it is new, restarted or was left out: it takes a live peer's state before it contributes.
        samples: the samples it contributes to the part (the weight of its tensor in the average).
        part: the part of the algorithm's state it synchronizes (``-1``: none).
        settings: what every member of a job must share (the algorithm's settings, as text).
        id: the worker's id; ``incarnation``: its process (a restarted worker keeps its id, not this). Both are
            filled in by :meth:`~bagua.torch_api.fault.quorum.Quorums.wait`.
    """

    round: int
    joining: bool
    samples: int
    part: int
    settings: str = ""
    id: str = ""
    incarnation: str = ""

    def to_json(self) -> str:
        """The member as one JSON object (what its slot in the store holds)."""
        return json.dumps(self._fields())

    def _fields(self) -> dict[str, Any]:
        """``dataclasses.asdict(self)``, written out (asdict copies recursively: slow at hundreds of members)."""
        return {"round": self.round, "joining": self.joining, "samples": self.samples, "part": self.part,
                "settings": self.settings, "id": self.id, "incarnation": self.incarnation}

    @classmethod
    def from_json(cls, raw: Any) -> "Member":
        """Read a member from :meth:`to_json`'s text (or its parsed dict)."""
        d = json.loads(raw) if isinstance(raw, str) else raw
        return cls(round=int(d["round"]), joining=bool(d["joining"]), samples=int(d["samples"]),
                   part=int(d["part"]), settings=str(d.get("settings", "")), id=str(d["id"]),
                   incarnation=str(d.get("incarnation", "")))


@dataclass(frozen=True)
class Quorum:
    """A closed quorum: its number ``key``, its ``members`` (ordered by id, which fixes their ranks), the
    ``epoch`` of its group (the key of the quorum whose group it reuses: the same processes as the last ok round)
    and whether it is the job's ``first`` (every worker takes the first member's state)."""

    key: int
    members: tuple[Member, ...]
    epoch: int
    first: bool

    @property
    def ids(self) -> list[str]:
        """The members' ids, in rank order."""
        return [m.id for m in self.members]

    def to_json(self) -> str:
        """The quorum as one JSON object (what the store's ``q/<key>/closed`` holds)."""
        return json.dumps({"key": self.key, "members": [m._fields() for m in self.members],
                           "epoch": self.epoch, "first": self.first})

    @classmethod
    def from_json(cls, raw: str) -> "Quorum":
        """Read a quorum from :meth:`to_json`'s text."""
        d = json.loads(raw)
        return cls(key=int(d["key"]), members=tuple(Member.from_json(m) for m in d["members"]),
                   epoch=int(d["epoch"]), first=bool(d["first"]))


@dataclass(frozen=True)
class Round:
    """This worker's view of one round: the ``quorum``, its ``rank`` among the members, the ``part`` the round
    synchronizes (``-1``: none), whether this worker ``healed`` in it (it took a source's state and contributes
    nothing: zeros, weight 0) and the ``weights`` of the members in its average (each source's samples, 0 for a
    healed member)."""

    quorum: Quorum
    rank: int
    part: int
    healed: bool
    weights: tuple[int, ...]

    @property
    def size(self) -> int:
        """The number of members."""
        return len(self.weights)

    def equal_weights(self) -> bool:
        """Whether every member weighs the same (the average is then a plain mean)."""
        return all(w == self.weights[0] for w in self.weights)


def roles(quorum: Quorum) -> tuple[list[Member], list[Member], int]:
    """The members who heal, those who serve (the sources), and the part the round synchronizes (-1: none)."""
    members = list(quorum.members)
    if quorum.first:
        return members[1:], members[:1], -1
    current = [m for m in members if not m.joining]
    top = max(m.round for m in current)
    sources = [m for m in current if m.round == top]
    healed = [m for m in members if m not in sources]
    return healed, sources, sources[0].part
