"""Refuse cache directories that another user can write, as ssh refuses a group-writable key.

Whoever can write the dataset cache chooses the samples a training job reads (the checksum of an entry guards
against accidents, not against a writer; see ``serialization``). So the cache lives in a directory, and in files,
that belong to the user running the job and that neither the group nor others may write. A directory this module
creates is created with mode 0700.

Example:
    >>> import tempfile, os
    >>> path = ensure_private_dir(os.path.join(tempfile.mkdtemp(), "cache"))
    >>> oct(os.stat(path).st_mode & 0o777)
    '0o700'
"""

from __future__ import annotations

import os
import stat
from typing import Sequence

__all__ = ["ensure_private_dir", "check_private"]


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_private(path: str, what: str = "cache directory") -> None:
    """Raise ``PermissionError`` unless ``path`` belongs to this user and no group or other user can write it.

    Args:
        path: an existing file or directory (symbolic links are followed).
        what: how the message names it.

    Raises:
        PermissionError: the message names the owner or the mode and the command that fixes it.

    Example:
        >>> import tempfile
        >>> check_private(tempfile.mkdtemp())
    """
    if not hasattr(os, "geteuid"):
        return  # Windows: no POSIX owner and mode bits to check
    info = os.stat(path)
    me = os.geteuid()
    if info.st_uid != me:
        raise PermissionError(
            f"{what} {path} belongs to {_owner(info.st_uid)}, not to you ({_owner(me)}): another user could plant "
            f"the samples your training reads. Use a directory of your own (set BAGUA_CACHE_DIR, or pass path=), "
            f"or take it over: chown -R {me} {path}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{what} {path} is writable by group or others (mode {stat.filemode(info.st_mode)}): anyone who can "
            f"write it can plant the samples your training reads. Run: chmod go-w {path} (or use another "
            "directory: set BAGUA_CACHE_DIR, or pass path=)")


def ensure_private_dir(path: str, files: Sequence[str] = ()) -> str:
    """Create ``path`` (mode 0700) if missing, then check it and the ``files`` in it that exist.

    Args:
        path: the directory.
        files: names inside ``path`` to check as well when they exist (e.g. a database's files).

    Returns:
        The absolute path.

    Raises:
        PermissionError: see :func:`check_private`.
        NotADirectoryError: ``path`` exists and is not a directory.

    Example:
        See the module docstring.
    """
    path = os.path.abspath(path)
    os.makedirs(path, mode=0o700, exist_ok=True)
    if not os.path.isdir(path):
        raise NotADirectoryError(f"cache path {path} exists and is not a directory; pass another path=")
    check_private(path)
    for name in files:
        inner = os.path.join(path, name)
        if os.path.exists(inner):
            check_private(inner, "cache file")
    return path
