"""The records of one job in the coordinator's store: read, written and claimed through the job's seal.

:class:`SealedKeys` is what :class:`~bagua.torch_api.fault.quorum.Quorums` reads and writes the store with: every
value goes through :class:`~bagua.torch_api.fault.secret.Records` (sealed with the job's secret, or plain in an
open job), and a value that fails its seal or does not parse reads as absent (counted and warned about).

Example:
    >>> class Job(SealedKeys):  # doctest: +SKIP
    ...     def __init__(self, store, records, prefix): self.store, self.records, self.prefix = store, records, prefix
    >>> Job(store, Records(None, "job"), "job")._claim("latest", "3", forward=True)  # doctest: +SKIP
    '3'
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch.distributed as dist

from bagua.torch_api.fault.secret import Records

__all__ = ["SealedKeys", "connect_store"]

_MALFORMED = (ValueError, KeyError, TypeError, AttributeError)  # what parsing a forged or junk record raises


def connect_store(address: str, timeout_s: float, what: str) -> dist.TCPStore:
    """A client of the coordinator's ``TCPStore`` at ``"host:port"``, with a clear error when it is not there."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{what}: coordinator={address!r} must be 'host:port', e.g. '10.0.0.1:29600'")
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, TimeoutError) as e:
        raise RuntimeError(f"{what}: no coordinator answers at {address} within {timeout_s:g} s; start one with "
                           f"`python -m bagua.torch_api.fault.coordinator --host {host} --port {port}` ({e})") from e


class SealedKeys:
    """Read and write a job's records under ``prefix`` in ``store``, sealed by ``records`` (the attributes a
    subclass sets)."""

    store: Any
    records: Records
    prefix: str

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def _get(self, key: str) -> Optional[str]:
        """The payload of the record under ``key`` (None: absent, or it failed its checks)."""
        full = self._k(key)
        return self.records.open(full, self._raw(full) if self.store.check([full]) else None)

    def _raw(self, full: str) -> str:
        return self.store.get(full).decode(errors="replace")

    def _set(self, key: str, payload: str) -> None:
        full = self._k(key)
        self.store.set(full, self.records.seal(full, payload))

    def _read(self, keys: list[str]) -> list[Optional[str]]:
        """The payloads of the records under full ``keys`` (None where absent or failing): two round trips when
        all are there, as usual."""
        if not keys:
            return []
        present = keys if self.store.check(keys) else [k for k in keys if self.store.check([k])]
        values = dict(zip(present, self.store.multi_get(present))) if present else {}
        return [self.records.open(k, values[k].decode(errors="replace")) if k in values else None for k in keys]

    def _parse(self, key: str, payload: Optional[str], parse: Any) -> Any:
        """``parse(payload)``, or None when absent or malformed (counted and warned about as refused)."""
        if payload is None:
            return None
        try:
            return parse(payload)
        except _MALFORMED as exc:
            self.records.refuse(self._k(key), f"malformed ({type(exc).__name__}: {exc})")
            return None

    def _claim(self, key: str, payload: str, forward: bool = False) -> str:
        """Set the record under ``key`` to ``payload`` unless it holds a valid one (``forward``: one holding an
        integer at least as large); a value that fails its checks is replaced. Return the payload that stays."""
        full = self._k(key)
        sealed = self.records.seal(full, payload)
        current = self.store.compare_set(full, "", sealed).decode(errors="replace")
        for _ in range(16):
            value = self.records.open(full, current)
            if value is not None and forward:
                value = value if self._parse(key, value, int) is not None and int(value) >= int(payload) else None
            if value is not None:
                return value
            current = self.store.compare_set(full, current, sealed).decode(errors="replace")
        return payload
