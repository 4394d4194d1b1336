"""The job secret: only the job's workers take part, and every record they read from the store is theirs.

A fault-tolerant job may share one secret among its workers. Create it once, as a file only its owner reads::

    python -m bagua.torch_api.fault.coordinator --new-secret /path/job.secret

and give it to every worker through a file (``FaultTolerance(..., secret_file=PATH)`` or ``BAGUA_JOB_SECRET_FILE``)
or the environment (``BAGUA_JOB_SECRET``), never the command line (other users of the machine read it in ``ps``).

With a secret, every record the protocol writes to the coordinator's store (a member's slot, a closed quorum, a
report, a verdict, the latest quorum, the admitted workers, a registration) is sealed as
``bagua-hmac1:<tag>:<payload>``: ``tag`` is HMAC-SHA256 over the record's full key name and its payload, keyed by a
key derived from the secret and the job's prefix (:func:`derive`). A record moved to another key (another slot,
quorum or job) or changed fails; so does one sealed with another secret. A record that fails is ignored (one
warning, rate-limited, with a count) and the protocol goes on as if it were absent: a process without the secret
is never a member of a quorum, so no state is ever sent to it. A healing state's digest is an HMAC too (keyed per
quorum, sender and receiver: see :mod:`~bagua.torch_api.fault.transfer`).

Without a secret (none configured), records are plain JSON, as before, and the job is open: one warning says so.

Example:
    >>> records = Records(b"0123456789abcdef0123456789abcdef", prefix="job")
    >>> sealed = records.seal("job/q/1/slot/1", '{"id": "w0"}')
    >>> records.open("job/q/1/slot/1", sealed)
    '{"id": "w0"}'
    >>> records.open("job/q/2/slot/1", sealed) is None  # replayed under another key: refused
    True
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from typing import Optional

from bagua.torch_api import env

__all__ = ["MARK", "NotAdmitted", "Records", "derive", "load_secret", "new_secret"]

_log = logging.getLogger(__name__)
#: what starts a sealed record
MARK = "bagua-hmac1:"
_MIN_SECRET = 16  # characters of the secret's text (new_secret writes 64 hex digits: 256 bits)
_WARN_EVERY_S = 30.0  # at most one warning about refused records per this many seconds


class NotAdmitted(RuntimeError):
    """This worker may not take part in the job: it lacks the job's secret, or the job already has its workers."""


def new_secret(path: str) -> str:
    """Write a new random secret (256 bits, as 64 hex digits) to a new file at ``path`` that only its owner may read
    (mode 0600); return ``path``. An existing file is never overwritten.

    Example:
        >>> new_secret("/etc/bagua/job.secret")  # doctest: +SKIP
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def load_secret(secret_file: Optional[str] = None) -> Optional[bytes]:
    """The job's secret: from ``secret_file``, else the file ``BAGUA_JOB_SECRET_FILE`` names, else
    ``BAGUA_JOB_SECRET``; ``None`` when none is configured (the job is open)."""
    path = secret_file or env.get_str("BAGUA_JOB_SECRET_FILE")
    if path:
        try:
            mode = os.stat(path).st_mode
            with open(path) as f:
                text = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the job secret file {path!r} ({exc}); create one with `python -m "
                             "bagua.torch_api.fault.coordinator --new-secret PATH` and copy it to every worker") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            _log.warning("the job secret file %s can be read by other users (mode %o): chmod 600 it", path,
                         stat.S_IMODE(mode))
        what = f"the job secret file {path!r}"
    else:
        text, what = env.get_str("BAGUA_JOB_SECRET").strip(), "BAGUA_JOB_SECRET"
        if not text:
            return None
    if len(text) < _MIN_SECRET:
        raise ValueError(f"{what} holds {len(text)} characters; a job secret needs at least {_MIN_SECRET}: create "
                         "one with `python -m bagua.torch_api.fault.coordinator --new-secret PATH`")
    return text.encode()


def derive(secret: bytes, purpose: str) -> bytes:
    """A key for one ``purpose`` (the job's records, one healing transfer), derived from the job's ``secret``."""
    return hmac.new(secret, b"bagua-ft/1\0" + purpose.encode(), hashlib.sha256).digest()


class Records:
    """Seal and open the records of one job (``prefix``) with its ``secret`` (``None``: an open job, plain records).

    Attributes: ``refused`` (records that failed and were ignored, counted), ``secret`` (``None`` when open).
    """

    def __init__(self, secret: Optional[bytes], prefix: str) -> None:
        self.secret, self.prefix = secret, prefix
        self._key = derive(secret, f"records/{prefix}") if secret is not None else None
        self.refused = 0
        self._unwarned, self._warned_at = 0, -_WARN_EVERY_S

    @property
    def sealed(self) -> bool:
        """Whether this job's records carry a tag (a secret is configured)."""
        return self._key is not None

    def _tag(self, key: str, payload: str) -> str:
        assert self._key is not None
        return hmac.new(self._key, key.encode() + b"\0" + payload.encode(), hashlib.sha256).hexdigest()

    def seal(self, key: str, payload: str) -> str:
        """The value to store under the full ``key``: ``payload`` with its tag (or as is, in an open job)."""
        return f"{MARK}{self._tag(key, payload)}:{payload}" if self._key is not None else payload

    def open(self, key: str, raw: Optional[str]) -> Optional[str]:
        """The payload of the value ``raw`` read under the full ``key``; ``None`` when absent, or when it fails
        (counted and warned about, at most once per 30 s). An open job reading a sealed record raises
        :class:`NotAdmitted`: the other workers hold a secret this one lacks."""
        if raw is None:
            return None
        if self._key is None:
            if raw.startswith(MARK):
                raise NotAdmitted(f"the job's records under {self.prefix!r} are sealed with a job secret that this "
                                  "worker does not have: give it the job's secret file (secret_file= or "
                                  "BAGUA_JOB_SECRET_FILE)")
            return raw
        tag, sep, payload = raw[len(MARK):].partition(":")
        if raw.startswith(MARK) and sep and hmac.compare_digest(tag, self._tag(key, payload)):
            return payload
        self.refuse(key, "its HMAC does not match: written without the job's secret, with another secret, "
                         "changed, or moved from another key")
        return None

    def refuse(self, key: str, why: str) -> None:
        """Count a record under ``key`` that is ignored because of ``why``, and warn (rate-limited)."""
        self.refused += 1
        self._unwarned += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            _log.warning("ignored %d record(s) in the coordinator's store that failed the job's checks, the latest "
                         "%s: %s; training goes on without them (next warning in %g s at the earliest)",
                         self._unwarned, key, why, _WARN_EVERY_S)
            self._unwarned, self._warned_at = 0, now
