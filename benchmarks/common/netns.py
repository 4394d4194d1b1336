"""Emulated test hosts: network namespaces joined through a bridge, links shaped with tbf, guaranteed cleanup.

A :class:`NetnsCluster` of ``N`` hosts is ``N + 1`` network namespaces, all named with one prefix unique to the
run (``bgb<pid>`` by default)::

    <prefix>h0  veth0 10.231.0.1/24 --+
    <prefix>h1  veth0 10.231.0.2/24 --+-- h0, h1, ... ports of bridge br0 in namespace <prefix>s
    ...                             --+

Every interface is created directly inside the namespaces (``ip -n NS link add ... peer ... netns NS2``), so the
root namespace is never touched, and deleting the namespaces removes everything. :meth:`NetnsCluster.shape`
puts a tbf qdisc on *both* ends of every host's veth: each host gets a full-duplex link of the requested rate to
the switch. Only rate can be emulated: this kernel has no netem (``CONFIG_NET_SCH_NETEM`` is not set), so there
is no added latency or loss.

Cleanup happens in ``__exit__`` (normal exit, errors, ``KeyboardInterrupt``), in an ``atexit`` handler and, once
:func:`install_signal_handlers` has run, on SIGTERM/SIGHUP (turned into ``SystemExit`` so ``finally`` blocks
run). Child processes registered with :func:`track_process` are killed (by their own process group, which
:func:`popen` starts) before their namespaces are deleted.

:class:`LoopbackCluster` is the fallback without root or ``ip``: N processes on 127.0.0.1, no shaping.

Example:
    >>> ok, reason = netns_available()  # doctest: +SKIP
    >>> with NetnsCluster(2) as cluster:  # doctest: +SKIP
    ...     cluster.shape("1gbit")
    ...     cluster.hosts[1].address
    '10.231.0.2'
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

__all__ = [
    "Host",
    "NetnsCluster",
    "LoopbackCluster",
    "netns_available",
    "parse_rate",
    "format_rate",
    "tbf_burst_bytes",
    "read_tx_bytes",
    "popen",
    "track_process",
    "kill_tracked_processes",
    "install_signal_handlers",
]

_IP_TIMEOUT_S = 20.0
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_UNSHAPED = ("unshaped", "none", "inf")


@dataclass(frozen=True)
class Host:
    """One emulated host.

    Args:
        index: host number, equal to the rank that runs on it.
        namespace: its network namespace, or ``None`` for the loopback fallback.
        iface: the interface its traffic leaves through (``GLOO_SOCKET_IFNAME``).
        address: its IPv4 address.
    """

    index: int
    namespace: Optional[str]
    iface: str
    address: str

    def exec_prefix(self) -> list[str]:
        """The argv prefix that runs a command on this host (``ip netns exec NS`` or nothing)."""
        return ["ip", "netns", "exec", self.namespace] if self.namespace else []


# -- rates ---------------------------------------------------------------------------------------------------


def parse_rate(rate: Optional[str]) -> Optional[int]:
    """Return ``rate`` ("100mbit", "1gbit", "10gbit", ...) in bits per second; ``None`` for "unshaped".

    Example:
        >>> parse_rate("1gbit"), parse_rate("unshaped")
        (1000000000, None)
    """
    if rate is None or rate.strip().lower() in _UNSHAPED:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*", rate.lower())
    if match is None:
        raise ValueError(
            f"cannot read the rate {rate!r}; write it as tc does, e.g. 100mbit, 1gbit, 10gbit, or 'unshaped'"
        )
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8kbit, too low for tbf; use at least 8kbit")
    return int(bits)


def format_rate(bits_per_s: Optional[int]) -> str:
    """The tc spelling of a rate ("1gbit"); "unshaped" for ``None``."""
    if bits_per_s is None:
        return "unshaped"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits_per_s % _RATE_UNITS[unit] == 0:
            return f"{bits_per_s // _RATE_UNITS[unit]}{unit}"
    return f"{bits_per_s}bit"


def tbf_burst_bytes(bits_per_s: int) -> int:
    """tbf bucket size: 8 ms worth of the rate, at least 256 KiB (these reached 96 % of line rate here)."""
    return max(int(bits_per_s / 8 * 0.008), 256 * 1024)


def read_tx_bytes(iface: str, proc_net_dev: str = "/proc/net/dev") -> int:
    """Bytes transmitted so far by ``iface`` in the calling process's network namespace.

    Example:
        >>> read_tx_bytes("lo") >= 0
        True
    """
    with open(proc_net_dev) as f:
        for line in f.readlines()[2:]:
            name, _, counters = line.partition(":")
            if name.strip() == iface:
                return int(counters.split()[8])
    raise ValueError(f"interface {iface!r} not found in {proc_net_dev}")


# -- child processes -----------------------------------------------------------------------------------------

_tracked: set[subprocess.Popen] = set()
_tracked_lock = threading.Lock()


def popen(argv: Sequence[str], env: Mapping[str, str], stdout, stderr) -> subprocess.Popen:
    """Start ``argv`` in its own process group (so it and its children can be killed together) and track it."""
    proc = subprocess.Popen(list(argv), env=dict(env), stdout=stdout, stderr=stderr, start_new_session=True)
    track_process(proc)
    return proc


def track_process(proc: subprocess.Popen) -> None:
    """Kill ``proc`` (by its process group) at cleanup time if it is still running."""
    with _tracked_lock:
        _tracked.add(proc)


def kill_tracked_processes() -> None:
    """Kill every tracked process that is still running, and reap it."""
    with _tracked_lock:
        procs = list(_tracked)
        _tracked.clear()
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


# -- availability --------------------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if check and out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed (rc={out.returncode}): {out.stderr.strip()}")
    return out


def _tc(namespace: str, *args: str) -> None:
    out = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True,
                         timeout=_IP_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"`tc {' '.join(args)}` in {namespace} failed (rc={out.returncode}): {out.stderr.strip()}")


def _existing_namespaces() -> set[str]:
    out = _ip("netns", "list", check=False)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def netns_available() -> tuple[bool, str]:
    """Whether this process can build namespaces; ``(False, why)`` otherwise.

    Checks root, the ``ip`` and ``tc`` binaries, then creates and deletes one probe namespace.
    """
    if os.geteuid() != 0:
        return False, "network emulation needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` was not found (apt-get install iproute2)"
    probe = f"bgb{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot create a network namespace: {exc}"
    _ip("netns", "del", probe, check=False)
    return True, "root and iproute2 available"


# -- clusters ------------------------------------------------------------------------------------------------

_live_clusters: set["NetnsCluster"] = set()
_atexit_installed = False


def _cleanup_everything() -> None:
    kill_tracked_processes()
    for cluster in list(_live_clusters):
        cluster.destroy()


class NetnsCluster:
    """``n_hosts`` hosts in network namespaces, joined through a bridge; a context manager.

    Args:
        n_hosts: number of hosts (2 or more).
        prefix: namespace name prefix, unique to this run (default ``bgb<pid>``); at most 10 characters.
        subnet: the first three octets of the private /24 used inside the namespaces.

    Example:
        >>> with NetnsCluster(4) as cluster:  # doctest: +SKIP
        ...     cluster.shape("100mbit")
    """

    def __init__(self, n_hosts: int, prefix: Optional[str] = None, subnet: str = "10.231.0") -> None:
        if n_hosts < 2:
            raise ValueError(f"a network emulation needs at least 2 hosts, got n_hosts={n_hosts}")
        if n_hosts > 250:
            raise ValueError(f"n_hosts={n_hosts} does not fit in one /24; use at most 250 hosts")
        prefix = prefix or f"bgb{os.getpid()}"
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", prefix):
            raise ValueError(f"prefix {prefix!r} must be 1-10 lowercase letters/digits starting with a letter")
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet {subnet!r} must be three octets of a 10.x.y.0/24 network, e.g. '10.231.0'")
        # settings
        self.n_hosts = n_hosts
        self.prefix = prefix
        self.subnet = subnet
        self.bridge_namespace = f"{prefix}s"
        self.hosts = [Host(i, f"{prefix}h{i}", "veth0", f"{subnet}.{i + 1}") for i in range(n_hosts)]
        # state
        self.rate: Optional[int] = None
        self._created: list[str] = []
        self._lock = threading.Lock()

    @property
    def emulated(self) -> bool:
        """True: the hosts are separate namespaces and links can be shaped."""
        return True

    def __enter__(self) -> "NetnsCluster":
        self.create()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.destroy()

    def create(self) -> None:
        """Create the namespaces, the bridge and the veth pairs; on any failure delete what was created."""
        global _atexit_installed
        clash = _existing_namespaces() & {self.bridge_namespace, *(h.namespace for h in self.hosts)}
        if clash:
            raise RuntimeError(f"namespaces {sorted(clash)} already exist; choose another prefix than {self.prefix!r}")
        if not _atexit_installed:
            atexit.register(_cleanup_everything)
            _atexit_installed = True
        _live_clusters.add(self)
        try:
            self._add_namespace(self.bridge_namespace)
            br = self.bridge_namespace
            _ip("-n", br, "link", "add", "br0", "type", "bridge")
            _ip("-n", br, "link", "set", "br0", "up")
            for host in self.hosts:
                ns, port = host.namespace, f"h{host.index}"
                assert ns is not None
                self._add_namespace(ns)
                _ip("-n", ns, "link", "add", host.iface, "type", "veth", "peer", "name", port, "netns", br)
                _ip("-n", br, "link", "set", port, "master", "br0")
                _ip("-n", br, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", host.iface)
                _ip("-n", ns, "link", "set", host.iface, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def shape(self, rate: Optional[str]) -> None:
        """Limit every host's link, in both directions, to ``rate`` ("1gbit"); ``None``/"unshaped" removes it."""
        bits = parse_rate(rate)
        br = self.bridge_namespace
        for host in self.hosts:
            assert host.namespace is not None
            for ns, dev in ((host.namespace, host.iface), (br, f"h{host.index}")):
                if bits is None:
                    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                                   capture_output=True, timeout=_IP_TIMEOUT_S)
                else:
                    _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                        "burst", str(tbf_burst_bytes(bits)), "latency", "100ms")
        self.rate = bits

    def destroy(self) -> None:
        """Kill tracked processes and delete every namespace this cluster created; safe to call twice.

        SIGINT/SIGTERM/SIGHUP are held back while it runs (a second Ctrl-C must not stop the cleanup halfway).
        """
        with self._lock, _signals_blocked():
            if self._created:
                kill_tracked_processes()
            for name in reversed(self._created):
                _ip("netns", "del", name, check=False)
            self._created = []
            _live_clusters.discard(self)

    def namespaces(self) -> list[str]:
        """The namespaces that exist now and were created by this cluster."""
        return list(self._created)


class LoopbackCluster:
    """The fallback: ``n_hosts`` processes on 127.0.0.1, one shared loopback interface, no shaping.

    Args:
        n_hosts: number of processes (1 or more).
    """

    def __init__(self, n_hosts: int) -> None:
        if n_hosts < 1:
            raise ValueError(f"n_hosts must be >= 1, got {n_hosts}")
        self.n_hosts = n_hosts
        self.hosts = [Host(i, None, "lo", "127.0.0.1") for i in range(n_hosts)]
        self.rate: Optional[int] = None

    @property
    def emulated(self) -> bool:
        """False: every host shares the loopback interface; links cannot be shaped."""
        return False

    def __enter__(self) -> "LoopbackCluster":
        return self

    def __exit__(self, *exc_info: object) -> None:
        kill_tracked_processes()

    def shape(self, rate: Optional[str]) -> None:
        """Accept only "unshaped": loopback cannot be shaped without root."""
        if parse_rate(rate) is not None:
            raise ValueError(f"cannot shape loopback to {rate!r}: shaping needs root and iproute2 (network namespaces)")

    def destroy(self) -> None:
        """Kill tracked processes (there is nothing else to delete)."""
        kill_tracked_processes()


# -- signals -------------------------------------------------------------------------------------------------

_CLEANUP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold back the cleanup-interrupting signals in this thread; they are delivered on exit."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _CLEANUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)



def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def install_signal_handlers() -> None:
    """Make SIGTERM and SIGHUP raise ``SystemExit`` (SIGINT already raises ``KeyboardInterrupt``), so every
    ``finally`` and ``__exit__`` runs and namespaces are deleted. Call from the main thread."""
    signal.signal(signal.SIGTERM, _raise_system_exit)
    signal.signal(signal.SIGHUP, _raise_system_exit)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
