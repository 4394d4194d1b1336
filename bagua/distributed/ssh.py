"""Run one command per host over ssh, print every line prefixed by its host, and stop them all together.

Used by ``baguarun --host_list``. Each host gets ``ssh -tt -o BatchMode=yes HOST COMMAND``:

- ``BatchMode=yes``: ssh never asks for a password or a host-key confirmation (a launcher has nobody to ask);
  set up key authentication and known hosts first.
- ``-tt``: the remote command runs on a pseudo-terminal, so when the ssh client goes away the remote kernel
  hangs up that terminal and sends SIGHUP to the remote launcher (torch's elastic agent stops its workers on
  SIGHUP). Without a terminal, remote processes outlive a killed ssh client.
- Each ssh client dies with the launcher (``PR_SET_PDEATHSIG``), even when the launcher is killed with SIGKILL
  and has no chance to stop them itself.

When one host's command fails, the others are stopped (their workers would otherwise wait for the missing
peers until a timeout).

Example:
    >>> ssh_argv("node1", "hostname", port=2222, options=["IdentityFile=/k"])[4:]
    ['-p', '2222', '-o', 'IdentityFile=/k', '-o', 'LogLevel=ERROR', 'node1', 'hostname']
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence, TextIO

__all__ = ["split_host", "ssh_argv", "run_on_hosts"]

_STOP_GRACE_S = 10.0
_CRLF = "\r\n"  # a pseudo-terminal ends lines with both
_PR_SET_PDEATHSIG = 1


def split_host(entry: str) -> tuple[str, str, Optional[int]]:
    """Split a host-list entry ``[user@]host[:port]``.

    Args:
        entry: one host as written in ``--host_list``.

    Returns:
        ``(ssh destination, address, ssh port or None)``: ``("me@node1", "node1", 2222)`` for ``me@node1:2222``.

    Example:
        >>> split_host("me@node1:2222")
        ('me@node1', 'node1', 2222)
    """
    destination, _, port = entry.strip().partition(":")
    if not destination or (port and not port.isdigit()):
        raise ValueError(f"cannot read the host {entry!r}; write host, user@host or host:ssh_port")
    return destination, destination.rpartition("@")[2], int(port) if port else None


def ssh_argv(destination: str, command: str, port: Optional[int] = None, options: Sequence[str] = ()) -> list[str]:
    """Return the ssh client command that runs ``command`` (one shell string) on ``destination``.

    Args:
        destination: ``host`` or ``user@host``.
        command: the remote shell command.
        port: ssh port, or ``None`` for ssh's own choice (``~/.ssh/config`` or 22).
        options: ssh ``-o`` options, e.g. ``["IdentityFile=~/.ssh/cluster"]``.

    Returns:
        The argv to execute.
    """
    argv = ["ssh", "-tt", "-o", "BatchMode=yes"]
    if port is not None:
        argv += ["-p", str(port)]
    for option in options:  # ssh keeps the first value given for an option: the user's come before our defaults
        argv += ["-o", option]
    return argv + ["-o", "LogLevel=ERROR", destination, command]  # no "Connection to ... closed." line


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` that asks the kernel to SIGTERM the child when its parent dies (Linux)."""

    def preexec() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still stops the child
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _pump(name: str, stream: TextIO, out: TextIO, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(f"[{name}] {line.rstrip(_CRLF)}\n")
            out.flush()


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every running ssh client (its remote side gets a hangup), then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_on_hosts(commands: Sequence[tuple[str, list[str]]], out: Optional[TextIO] = None) -> int:
    """Run each ``(name, argv)`` (an ssh client command) at once; return the first failure's exit code, or 0.

    Output lines are printed as ``[name] line``. When one command fails, or this function is interrupted
    (Ctrl-C, or SIGTERM turned into ``SystemExit``), every command still running is stopped.

    Args:
        commands: ``(host name, argv)`` pairs, e.g. from :func:`ssh_argv`.
        out: where the prefixed lines go (default ``sys.stdout``).

    Returns:
        0 when every command succeeded, else the exit code of the first one that failed.
    """
    out = out or sys.stdout
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    try:
        for _, argv in commands:  # every process first: preexec_fn is unsafe once other threads run
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, errors="replace",
                                          start_new_session=True, preexec_fn=_die_with_parent(os.getpid())))
        for (name, _), proc in zip(commands, procs):
            threads.append(threading.Thread(target=_pump, args=(name, proc.stdout, out, lock), daemon=True))
            threads[-1].start()
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(name, code) for (name, _), code in zip(commands, codes) if code not in (None, 0)]
            if failed:
                with lock:
                    out.write(f"baguarun: {failed[0][0]} exited with code {failed[0][1]}; stopping the other hosts\n")
                return failed[0][1]
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.2)
    finally:
        _stop(procs)
        for thread in threads:
            thread.join(timeout=5)
