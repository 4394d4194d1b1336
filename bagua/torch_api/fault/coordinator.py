"""The coordinator of fault-tolerant workers: torch's ``TCPStore``, served by a process of its own.

Workers that may fail alone agree on each round's members through one ``TCPStore`` (see
:mod:`~bagua.torch_api.fault.quorum`). It holds small JSON values and counters only; the weights travel between
the workers. Run it on a machine that outlives the workers (the head node, a small VM)::

    python -m bagua.torch_api.fault.coordinator --host 10.0.0.1 --port 29600

It listens on ``--host`` only (give the address the workers reach, not ``0.0.0.0``) and keeps nothing on disk. When
it dies, every worker's next store call fails and raises an error naming it; the workers' states are intact, so
restart the coordinator and then the workers, which start from their checkpoints (the coordinator has no
failover).

Give the job a secret (only its workers take part; see :mod:`~bagua.torch_api.fault.secret`): create it once,
then hand the file to every worker (``BAGUA_JOB_SECRET_FILE=PATH`` or ``FaultTolerance(..., secret_file=PATH)``)::

    python -m bagua.torch_api.fault.coordinator --new-secret /path/job.secret

The coordinator itself needs no secret: it stores what the workers seal, and each worker checks what it reads.

Example:
    >>> proc = start_coordinator("127.0.0.1", 29600)  # a child process; proc.terminate() stops it  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import datetime
import signal
import socket
import select
import subprocess
import sys
import threading
from typing import Optional

import torch.distributed as dist

from bagua.torch_api.fault.secret import new_secret

__all__ = ["serve", "start_coordinator", "main"]


def serve(host: str, port: int) -> None:
    """Serve the store at ``host:port`` until SIGTERM or SIGINT."""
    # torch's store listens on every address unless handed a socket: bind one to ``host`` alone
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    # the store owns the listening socket from here on and closes it when it goes: detach it from Python's object,
    # which would close the same descriptor a second time (EBADF at a clean stop)
    fd = sock.detach()
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                              timeout=datetime.timedelta(seconds=60))
    except BaseException:
        socket.close(fd)
        raise
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"bagua fault-tolerance coordinator listening on {host}:{port}", flush=True)
    while not stop.wait(0.5):
        pass
    del store  # closes the listening socket


def start_coordinator(host: str, port: int, timeout_s: float = 30.0) -> subprocess.Popen:
    """Start the coordinator as a child process and return once it listens (``terminate()`` stops it)."""
    proc = subprocess.Popen([sys.executable, "-m", "bagua.torch_api.fault.coordinator", "--host", host,
                             "--port", str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)  # readline alone would wait for ever
    line = proc.stdout.readline() if ready else ""
    if "listening" not in line:
        proc.kill()
        raise RuntimeError(f"the coordinator did not start on {host}:{port} (port taken?): {line!r}")
    return proc


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m bagua.torch_api.fault.coordinator --host H --port P``, or ``--new-secret PATH``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", help="the address the workers reach (bound to it alone)")
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--new-secret", metavar="PATH",
                        help="write a new job secret to PATH (a new file, mode 0600) and exit; give it to every "
                             "worker with BAGUA_JOB_SECRET_FILE=PATH")
    args = parser.parse_args(argv)
    if args.new_secret:
        try:
            new_secret(args.new_secret)
        except FileExistsError:
            parser.error(f"{args.new_secret} exists; a secret is never overwritten: remove it, or pick another path")
        print(f"wrote a new job secret to {args.new_secret} (mode 0600); start every worker with "
              f"BAGUA_JOB_SECRET_FILE={args.new_secret}", flush=True)
        return
    if not args.host:
        parser.error("--host is required (the address the workers reach), e.g. --host 10.0.0.1")
    serve(args.host, args.port)


if __name__ == "__main__":
    main()
