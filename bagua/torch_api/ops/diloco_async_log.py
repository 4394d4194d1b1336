"""Asynchronous DiLoCo's log of arrivals in the coordinator's store: ordered, sealed, read by every worker.

Under fault tolerance (:mod:`~bagua.torch_api.ops.diloco_async_ft`) the workers share no torch world and no server:
the coordinator's ``TCPStore`` orders their pseudo-gradients. Keys, under ``<prefix>/async/``:

- ``data/<worker>/<incarnation>/<i>``: an arrival's bytes (float32, or a block codec's wire bytes), written first;
- ``n``: the counter a finishing round takes its *sequence number* ``k`` from (``add``), then
  ``slot/<k>``: the arrival's record, JSON ``{"w", "tokens", "base", "data", "sha", "bytes"}``, claimed with
  ``compare_set`` on an empty key, so exactly one value ever fills a slot. A slot left empty (its writer died
  between the two calls) is filled with ``{"void": 1}`` by a reader after ``hole_s``; a writer that loses its slot
  so takes another number;
- ``deleted``: slots up to this one were deleted (every live worker had applied them); it only moves forward;
- ``at/<worker>``: how far each worker applied (``cursor``) and its rounds (``exchanges``);
- ``start``, ``heal/state/<nonce>``: a state (the global weights, the outer momentum, counters) as a sealed JSON
  header line and float32 bytes; ``heal/req/<worker>`` and the ``heal/n`` counter ask a live peer for one,
  ``heal/by/<nonce>`` says which peer serves it;
- ``done/<worker>`` (a worker posts no more) and ``final`` (the last slot of the job, claimed once every worker
  is done or dead).

Every JSON record and header is sealed with the job's secret (:class:`~bagua.torch_api.fault.secret.Records`, an
HMAC bound to the record's full key), and an arrival's or state's bytes by the SHA-256 the sealed record carries.
A record that fails, or does not parse, reads as junk: counted and warned about, and every worker makes the same
decision on the same bytes. Nothing is unpickled.

Example:
    >>> log = ArrivalLog(store, records, "bagua-ft", worker="w0", incarnation="ab12", hole_s=3.0)  # doctest: +SKIP
    >>> seq, key = log.post(b"...", tokens=40, base=7)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, NamedTuple, Optional

import torch

from bagua.torch_api.fault.secret import Records
from bagua.torch_api.fault.store import SealedKeys

__all__ = ["ArrivalLog", "Slot", "pack_state", "unpack_state"]

_POLL_S = 0.005
_CLAIMS = 8  # a writer whose slot was voided takes another number at most this many times


class Slot(NamedTuple):
    """One slot of the log as read: ``kind`` is ``"arrival"``, ``"void"`` (an empty slot filled by a reader),
    ``"junk"`` (a record that failed its checks: ``why``) or ``"gone"`` (deleted: this worker is behind)."""

    kind: str
    worker: str = ""
    tokens: int = 0
    base: int = 0
    data: bytes = b""
    why: str = ""
    key: str = ""


def pack_state(records: Records, key: str, meta: dict[str, Any], tensors: list[torch.Tensor]) -> bytes:
    """The value to store under the full ``key`` for ``meta`` (JSON) and float32 ``tensors``: a sealed header line
    (``meta``, the tensors' sizes and the SHA-256 of their bytes) and the bytes."""
    payload = b"".join(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes() for t in tensors)
    header = json.dumps({"meta": meta, "numel": [t.numel() for t in tensors],
                         "sha": hashlib.sha256(payload).hexdigest()})
    return records.seal(key, header).encode() + b"\n" + payload


def unpack_state(records: Records, key: str, raw: bytes) -> Optional[tuple[dict[str, Any], list[torch.Tensor]]]:
    """``(meta, tensors)`` of what :func:`pack_state` stored under ``key``; ``None`` (counted as refused) when it
    fails its seal, its digest or its sizes."""
    head, _, payload = raw.partition(b"\n")
    text = records.open(key, head.decode(errors="replace"))
    if text is None:
        return None
    try:
        header = json.loads(text)
        numel = [int(n) for n in header["numel"]]
        meta = dict(header["meta"])
        ok = header["sha"] == hashlib.sha256(payload).hexdigest() and len(payload) == 4 * sum(numel)
    except (ValueError, KeyError, TypeError) as exc:
        records.refuse(key, f"malformed state ({type(exc).__name__}: {exc})")
        return None
    if not ok:
        records.refuse(key, "its bytes do not match its digest or sizes")
        return None
    tensors, offset = [], 0
    for n in numel:
        tensors.append(torch.frombuffer(bytearray(payload[offset : offset + 4 * n]), dtype=torch.float32)
                       if n else torch.zeros(0))
        offset += 4 * n
    return meta, tensors


class ArrivalLog(SealedKeys):
    """This worker's view of the job's log of arrivals (see the module docstring).

    Args:
        store: the coordinator's ``TCPStore`` client (used from one thread).
        records: the job's :class:`~bagua.torch_api.fault.secret.Records` (its secret, or none).
        prefix: the job's prefix; the log lives under ``<prefix>/async``.
        worker, incarnation: who writes (a restarted worker keeps its id, not its incarnation).
        hole_s: how long a slot may stay empty after its number was taken before a reader voids it.

    Example:
        >>> log.slot(3, wait=True).kind  # doctest: +SKIP
        'arrival'
    """

    def __init__(self, store: Any, records: Records, prefix: str, worker: str, incarnation: str,
                 hole_s: float) -> None:
        self.store, self.records, self.prefix = store, records, f"{prefix}/async"
        self.worker, self.incarnation, self.hole_s = worker, incarnation, hole_s
        self._written = 0  # data keys this incarnation wrote

    # -- arrivals ----------------------------------------------------------------------------------------------

    def taken(self) -> int:
        """The last sequence number taken (0: none)."""
        return int(self.store.add(self._k("n"), 0))

    def post(self, data: bytes, tokens: int, base: int) -> tuple[int, str]:
        """Write an arrival's bytes and take the next slot for it; return its sequence number and data key."""
        self._written += 1
        data_key = self._k(f"data/{self.worker}/{self.incarnation}/{self._written}")
        self.store.set(data_key, data)
        payload = json.dumps({"w": self.worker, "tokens": int(tokens), "base": int(base), "data": data_key,
                              "sha": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
        for _ in range(_CLAIMS):
            seq = int(self.store.add(self._k("n"), 1))
            full = self._k(f"slot/{seq}")
            sealed = self.records.seal(full, payload)
            if self.store.compare_set(full, "", sealed).decode(errors="replace") == sealed:
                return seq, data_key
            # a reader voided the slot while this worker was slow: take another
        self.store.delete_key(data_key)
        raise RuntimeError(f"worker {self.worker!r}: {_CLAIMS} slots of the asynchronous log were voided before "
                           f"this worker wrote them (more than hole_s={self.hole_s:g} s between two store calls): "
                           "the coordinator is overloaded; raise stale_s")

    def slot(self, seq: int, wait: bool) -> Optional[Slot]:
        """Slot ``seq`` (at most :meth:`taken`): ``None`` when it is still empty and ``wait`` is False; with
        ``wait``, an empty slot is waited for and voided after ``hole_s``."""
        full = self._k(f"slot/{seq}")
        since = time.monotonic()
        while not self.store.check([full]):
            if self.deleted() >= seq:
                return Slot("gone")
            if not wait:
                return None
            if time.monotonic() - since >= self.hole_s:
                self.store.compare_set(full, "", self.records.seal(full, json.dumps({"void": 1})))
                break
            time.sleep(_POLL_S)
        raw = self.store.get(full).decode(errors="replace")
        return self._slot(full, raw)

    def _slot(self, full: str, raw: str) -> Slot:
        text = self.records.open(full, raw)
        if text is None:  # counted and warned about
            return Slot("junk", why="its seal failed")
        try:
            record = json.loads(text)
            if record.get("void") == 1:
                return Slot("void")
            worker, tokens, base = str(record["w"]), int(record["tokens"]), int(record["base"])
            data_key, sha, size = str(record["data"]), str(record["sha"]), int(record["bytes"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return self._junk(full, f"malformed ({type(exc).__name__}: {exc})")
        if not data_key.startswith(self._k("data/")) or not self.store.check([data_key]):
            seq = int(full.rsplit("/", 1)[1])
            return Slot("gone") if self.deleted() >= seq else self._junk(full, "its bytes are missing")
        data = self.store.get(data_key)
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            return self._junk(full, "its bytes do not match its digest")
        return Slot("arrival", worker, tokens, base, data, key=data_key)

    def _junk(self, full: str, why: str) -> Slot:
        self.records.refuse(full, f"an asynchronous arrival skipped by every worker: {why}")
        return Slot("junk", why=why)

    def refuse(self, seq: int, why: str) -> None:
        """Count slot ``seq`` as junk and warn (rate-limited): it is skipped by every worker."""
        self.records.refuse(self._k(f"slot/{seq}"), why)

    # -- how far the workers are -------------------------------------------------------------------------------

    def publish(self, cursor: int, exchanges: int) -> None:
        """Say this worker applied slots up to ``cursor`` and finished ``exchanges`` rounds."""
        self._set(f"at/{self.worker}", json.dumps({"cursor": int(cursor), "exchanges": int(exchanges)}))

    def progress(self, workers: list[str]) -> dict[str, dict[str, int]]:
        """Each of ``workers``' last :meth:`publish` (absent ones left out)."""
        raws = self._read([self._k(f"at/{w}") for w in workers])
        out = {}
        for w, raw in zip(workers, raws):
            value = self._parse_json(f"at/{w}", raw)
            if isinstance(value, dict) and isinstance(value.get("cursor"), int):
                out[w] = value
        return out

    def deleted(self) -> int:
        """Slots up to this one were deleted."""
        value = self._parse("deleted", self._get("deleted"), int)
        return value if value is not None else 0

    def delete(self, upto: int, data_keys: list[str], first: int) -> None:
        """Mark slots up to ``upto`` deleted, then delete slots ``first..upto`` and ``data_keys``."""
        self._claim("deleted", str(upto), forward=True)
        for key in data_keys:
            self.store.delete_key(key)
        for seq in range(first, upto + 1):
            self.store.delete_key(self._k(f"slot/{seq}"))

    # -- states: the start, heals ------------------------------------------------------------------------------

    def claim_state(self, name: str, value: bytes) -> bytes:
        """Store ``value`` under ``name`` unless a value is there; return the one that stays."""
        return self.store.compare_set(self._k(name), "", value)

    def state(self, name: str) -> Optional[bytes]:
        """The raw value under ``name``, or ``None``."""
        full = self._k(name)
        return self.store.get(full) if self.store.check([full]) else None

    def full(self, name: str) -> str:
        """The full key of ``name``."""
        return self._k(name)

    def request_heal(self, nonce: str) -> None:
        """Ask a live peer for its state, to be stored under ``heal/state/<nonce>``."""
        self._set(f"heal/req/{self.worker}", nonce)
        self.store.add(self._k("heal/n"), 1)

    def heal_requests(self, workers: list[str]) -> dict[str, str]:
        """The open heal request of each of ``workers`` that asked (worker -> nonce)."""
        raws = self._read([self._k(f"heal/req/{w}") for w in workers])
        return {w: r for w, r in zip(workers, raws) if r and r.startswith(f"{w}.") and "/" not in r}

    def requests_made(self) -> int:
        """How many heal requests the job made (a counter: a change means new ones to read)."""
        return int(self.store.add(self._k("heal/n"), 0))

    def claim_heal(self, nonce: str) -> Optional[str]:
        """Claim serving ``nonce``; return who serves it (this worker when it won)."""
        return self._parse(f"heal/by/{nonce}", self._claim(f"heal/by/{nonce}", self.worker), str)

    def server_of(self, nonce: str) -> Optional[str]:
        """Who claimed serving ``nonce``, if anyone."""
        return self._get(f"heal/by/{nonce}")

    def drop_heal(self, nonce: str) -> None:
        """Delete this worker's request and the state served for it."""
        for key in (f"heal/req/{self.worker}", f"heal/state/{nonce}", f"heal/by/{nonce}"):
            self.store.delete_key(self._k(key))

    # -- the end -----------------------------------------------------------------------------------------------

    def set_done(self, done: bool) -> None:
        """Say this worker posts no more arrivals (``False``: a restarted worker takes part again)."""
        if done:
            self._set(f"done/{self.worker}", self.incarnation)
        else:
            self.store.delete_key(self._k(f"done/{self.worker}"))

    def done(self, workers: list[str]) -> set[str]:
        """Those of ``workers`` that said they are done."""
        return {w for w, r in zip(workers, self._read([self._k(f"done/{w}") for w in workers])) if r}

    def final(self) -> Optional[int]:
        """The job's last slot, once claimed."""
        return self._parse("final", self._get("final"), int)

    def claim_final(self) -> int:
        """Claim the job's last slot as the last number taken; return the one that stays."""
        return int(self._claim("final", str(self.taken())))

    def _parse_json(self, key: str, payload: Optional[str]) -> Any:
        return self._parse(key, payload, json.loads)
