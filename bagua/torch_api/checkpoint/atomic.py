"""Files written atomically, and the temporary files of dead writers removed (checkpoints and experts).

A file is written to a temporary name in its directory (``.tmp-<host>-<pid>-<random>``), flushed to disk, then
renamed over the final name; before that, the temporary files whose writers are gone are removed: those named by a
dead process of this host, and any other once it is :data:`STALE_TMP_AGE_S` old. A file a live process is writing
is never removed.

Example:
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> _atomic_write(os.path.join(d, "x.txt"), lambda f: f.write(b"42"))
    >>> open(os.path.join(d, "x.txt")).read()
    '42'
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import time
from typing import Any, Optional

__all__ = ["STALE_TMP_AGE_S"]

#: A temporary file whose writer cannot be checked (another host, or an older name) is removed once it is this old.
STALE_TMP_AGE_S = 24 * 3600.0

_TMP_PREFIX = ".tmp-"
_TMP_NAME = re.compile(r"^\.tmp-(?P<host>[A-Za-z0-9_.-]+)-(?P<pid>\d+)-")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "localhost"


def _process_state(pid: int) -> tuple[Optional[str], Optional[float]]:
    """State letter and wall-clock start time of ``pid`` from ``/proc`` (Linux); ``None`` where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return fields[0].decode(), boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None, None


def _writer_alive(pid: int, file_mtime: float) -> bool:
    """Whether process ``pid`` of this host may still be writing a file last modified at ``file_mtime``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    state, started = _process_state(pid)
    if state in ("Z", "X"):
        return False  # killed, not yet reaped by its parent
    # a pid reused by a process that started after the file's last write is not its writer (2 s: /proc rounding)
    return started is None or started <= file_mtime + 2.0


def _remove_stale_tmp_files(directory: str, now: Optional[float] = None) -> list[str]:
    """Remove the temporary files in ``directory`` whose writers are gone; return their paths.

    A file named by a process of this host is removed when that process is dead; any other temporary file once
    it is :data:`STALE_TMP_AGE_S` old. A file a live process is writing is never removed.
    """
    now = time.time() if now is None else now
    removed = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(_TMP_PREFIX)]
    except OSError:
        return removed
    host = _host()
    for name in names:
        path = os.path.join(directory, name)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            continue  # renamed or removed meanwhile
        match = _TMP_NAME.match(name)
        if match and match["host"] == host and int(match["pid"]) != os.getpid():
            stale = not _writer_alive(int(match["pid"]), mtime)
        else:
            stale = now - mtime > STALE_TMP_AGE_S
        if stale:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass  # another cleaner was first
    return removed


def _atomic_write(path: str, write: Any) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    _remove_stale_tmp_files(directory)
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{_host()}-{os.getpid()}-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
