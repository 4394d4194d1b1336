"""The one place that reads the process environment.

Launchers (``torchrun``, ``python -m bagua.distributed.launch`` / ``run``) describe a process through environment
variables; everything in Bagua asks this module instead of reading ``os.environ`` itself, so the set of variables
that changes Bagua's behaviour is listed here and nowhere else.

Example:
    >>> from bagua.torch_api import env
    >>> env.get_default_bucket_size()
    10485760
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Mapping, MutableMapping, Optional, TypeVar

__all__ = [
    "get_world_size", "get_rank", "get_local_rank", "get_local_size", "get_node_rank", "get_default_bucket_size",
    "get_master_addr", "get_master_port", "node_address", "get_bagua_service_port", "is_report_metrics_switch_on",
    "get_autotune_level", "get_autotune_max_samples", "get_autotune_sampling_confidence_time_s",
    "get_autotune_warmup_time_s", "get_is_output_autotune_log", "get_autotune_server_wait_time",
    "get_comm_timeout_s", "get_cache_dir", "is_launched", "find_free_network_port", "get_str", "get_int",
    "get_float", "get_bool", "environ_snapshot", "set_default", "is_slurm_job", "slurm_first_host",
    "slurm_master_port", "slurm_tasks_on_node", "slurm_process_env", "get_ssh_port", "get_node_domain_names",
]

_T = TypeVar("_T")

#: Allocator settings that make large, short-lived CPU tensors cheap on Linux: without them every fresh 100 MB
#: tensor costs a fresh mmap and its page faults (measured 50 ms vs 7 ms per 25M-float ``zeros``).
ALLOCATOR_ENV: dict[str, str] = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "100000000000",
    "MALLOC_TOP_PAD_": "536870912",
}


def get_str(name: str, default: str = "") -> str:
    """Return the environment variable ``name`` as a string, or ``default`` when it is unset or empty."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def _parse(name: str, default: _T, convert: Callable[[str], _T], kind: str) -> _T:
    value = get_str(name)
    if value == "":
        return default
    try:
        return convert(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be {kind}") from None


def get_int(name: str, default: int) -> int:
    """Return ``name`` as an int; raise ``ValueError`` naming the variable when it is not an integer."""
    return _parse(name, default, int, "an integer")


def get_float(name: str, default: float) -> float:
    """Return ``name`` as a float; raise ``ValueError`` naming the variable when it is not a number."""
    return _parse(name, default, float, "a number")


def get_bool(name: str, default: bool = False) -> bool:
    """Return ``name`` as a bool (``1/true/yes/on`` are true, ``0/false/no/off`` false)."""
    value = get_str(name).strip().lower()
    if value == "":
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={value!r} must be a boolean (1/0, true/false)")


def environ_snapshot() -> dict[str, str]:
    """Return a copy of the whole environment, for launchers that build a child's environment from it."""
    return dict(os.environ)


def set_default(environ: MutableMapping[str, str], values: Mapping[str, str]) -> None:
    """Set each of ``values`` in ``environ`` unless the user already set it."""
    for key, value in values.items():
        environ.setdefault(key, value)


def _variable(read: Callable[[str, _T], _T], variable: str, default: _T, what: str) -> Callable[[], _T]:
    """Make the getter of one variable, ``read(variable, default)``; the plain getters below are a table of them
    (their ``__name__`` is set at the end of the module)."""

    def getter() -> _T:
        return read(variable, default)

    getter.__doc__ = f"Return the {what} (``{variable}``, default {default!r})."
    getter.__annotations__ = {"return": type(default).__name__}
    getter._env_variable = variable  # type: ignore[attr-defined]
    return getter


get_world_size = _variable(get_int, "WORLD_SIZE", 1, "number of processes in the job")
get_rank = _variable(get_int, "RANK", 0, "global rank of this process")
get_local_rank = _variable(get_int, "LOCAL_RANK", 0, "rank of this process on its node")
get_local_size = _variable(get_int, "LOCAL_WORLD_SIZE", 1, "number of processes on this node")
get_master_addr = _variable(get_str, "MASTER_ADDR", "127.0.0.1", "address of the rendezvous host")
get_master_port = _variable(get_int, "MASTER_PORT", 29500, "port of the rendezvous store")
get_bagua_service_port = _variable(get_int, "BAGUA_SERVICE_PORT", -1,
                                   "original's service port, kept for its launcher flags (Bagua runs no service)")
get_autotune_level = _variable(get_int, "BAGUA_AUTOTUNE", 0, "autotune level (0: off)")
get_autotune_max_samples = _variable(get_int, "BAGUA_AUTOTUNE_MAX_SAMPLES", 60, "number of trials the tuner may run")
get_autotune_sampling_confidence_time_s = _variable(get_float, "BAGUA_AUTOTUNE_SAMPLING_CONFIDENCE_TIME_S", 5.0,
                                                    "seconds of training measured per trial")
get_autotune_warmup_time_s = _variable(get_float, "BAGUA_AUTOTUNE_WARMUP_TIME_S", 30.0,
                                       "seconds of training before tuning starts")
get_is_output_autotune_log = _variable(get_bool, "BAGUA_IS_OUTPUT_AUTOTUNE_LOG", False,
                                       "switch that writes the autotune CSV log")


def get_node_rank() -> int:
    """Rank of this node: ``GROUP_RANK`` under elastic launch, else ``NODE_RANK``, else derived from the ranks."""
    elastic = all(get_str(k) != "" for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if elastic:
        return get_int("GROUP_RANK", 0)
    if get_str("NODE_RANK") != "":
        return get_int("NODE_RANK", 0)
    return get_rank() // max(get_local_size(), 1)


def get_default_bucket_size() -> int:
    """Bucket size in bytes (``BAGUA_DEFAULT_BUCKET_SIZE``, default 10 MiB); must be positive."""
    size = get_int("BAGUA_DEFAULT_BUCKET_SIZE", 10 * 1024**2)
    if size <= 0:
        raise ValueError(f"BAGUA_DEFAULT_BUCKET_SIZE={size} must be a positive number of bytes, e.g. 10485760")
    return size


def node_address() -> str:
    """The address on which peers reach this node's servers: loopback for a single-node job or a loopback master,
    else the local address that routes to ``MASTER_ADDR`` (a UDP ``connect`` sends nothing; it picks the route)."""
    import ipaddress

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or get_local_size() >= dist.get_world_size():
        return "127.0.0.1"
    master = socket.gethostbyname(get_master_addr())
    if ipaddress.ip_address(master).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, get_master_port()))
        return probe.getsockname()[0]


def is_report_metrics_switch_on() -> bool:
    """Whether ``BAGUA_REPORT_METRICS=1``."""
    return get_int("BAGUA_REPORT_METRICS", 0) == 1


def get_autotune_server_wait_time() -> int:
    """Kept for compatibility (``BAGUA_AUTOTUNE_SERVER_WAIT_TIME``, at least 30 s); no server exists."""
    return max(get_int("BAGUA_AUTOTUNE_SERVER_WAIT_TIME", 300), 30)


def get_comm_timeout_s() -> float:
    """Seconds any blocking collective may take before it fails (``BAGUA_COMM_TIMEOUT_S``, default 300)."""
    timeout = get_float("BAGUA_COMM_TIMEOUT_S", 300.0)
    if timeout <= 0:
        raise ValueError(f"BAGUA_COMM_TIMEOUT_S={timeout} must be a positive number of seconds")
    return timeout


def get_cache_dir() -> str:
    """Directory for node-local files such as the embedded dataset cache (``BAGUA_CACHE_DIR``).

    The default is per user: ``$XDG_CACHE_HOME/bagua``, else ``~/.cache/bagua`` (a shared temporary directory
    would let other users plant samples, and let two users' jobs read each other's).
    """
    xdg = get_str("XDG_CACHE_HOME")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return get_str("BAGUA_CACHE_DIR", os.path.join(base, "bagua"))


def is_launched() -> bool:
    """Whether a launcher described this process (``RANK`` and ``WORLD_SIZE`` are both set)."""
    return get_str("RANK") != "" and get_str("WORLD_SIZE") != ""


def get_elastic_attempt() -> Optional[int]:
    """The restart number under torchrun's elastic agent when the workers share the agent's store
    (``TORCHELASTIC_USE_AGENT_STORE=True``, ``TORCHELASTIC_RESTART_COUNT``); ``None`` otherwise."""
    if get_str("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return get_int("TORCHELASTIC_RESTART_COUNT", 0)


def find_free_network_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (binds port 0 and closes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _export(values: Mapping[str, Optional[str]]) -> None:
    """Write ``values`` into this process's environment (``None`` removes a key); used by init_process_group."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# --- logging (read by bagua.torch_api._log) ---------------------------------------------------------------------

__all__ += ["get_log_level", "LOG_LEVELS"]

#: The values ``BAGUA_LOG_LEVEL`` accepts, as the :mod:`logging` level names.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def get_log_level() -> str:
    """Level of Bagua's log records (``BAGUA_LOG_LEVEL``: DEBUG, INFO, WARNING, ERROR or CRITICAL; default INFO).

    Example:
        >>> get_log_level()  # doctest: +SKIP
        'INFO'
    """
    level = get_str("BAGUA_LOG_LEVEL", "INFO").strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"BAGUA_LOG_LEVEL={level!r} is not a log level; use one of {', '.join(LOG_LEVELS)}")
    return level


# -- Slurm ---------------------------------------------------------------------------------------------------
# A job started by `srun python train.py` (no torchrun) is described by SLURM_* variables; they map onto the
# variables torchrun would have set, as Lightning's SLURMEnvironment maps them.


def is_slurm_job() -> bool:
    """Whether ``srun`` started this process as one task of a job (``SLURM_NTASKS`` and ``SLURM_PROCID`` set,
    and the job is not an interactive ``srun --pty bash`` shell, whose tasks are not training processes)."""
    interactive = get_str("SLURM_JOB_NAME") in ("bash", "interactive")
    return get_str("SLURM_NTASKS") != "" and get_str("SLURM_PROCID") != "" and not interactive


def slurm_first_host(nodelist: str) -> str:
    """Return the first host of a Slurm host list (``SLURM_JOB_NODELIST`` syntax).

    Args:
        nodelist: e.g. ``"gpu[003-005,9],cpu1"`` or ``"rack[1-2]-n[07-08]"``.

    Returns:
        The first host name, zero padding kept (``"gpu003"``, ``"rack1-n07"``).

    Example:
        >>> slurm_first_host("node[007-009,12],login1")
        'node007'
    """
    first, depth = "", 0
    for ch in nodelist.strip():  # the first item of the top-level comma list
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first += ch
    host = ""
    while "[" in first:  # each bracket group contributes its first element
        prefix, _, rest = first.partition("[")
        group, _, first = rest.partition("]")
        host += prefix + group.split(",")[0].split("-")[0]
    host += first
    if not host or depth != 0:
        raise ValueError(f"cannot read the Slurm host list {nodelist!r}; expected e.g. 'node[01-04],gpu7'")
    return host


def slurm_master_port(job_id: str) -> int:
    """Return a rendezvous port all tasks of job ``job_id`` agree on without talking: 15000 + the job id's last
    four digits (Lightning's rule), so two jobs sharing a node rarely collide.

    Example:
        >>> slurm_master_port("4812345")
        17345
    """
    digits = "".join(ch for ch in job_id if ch.isdigit())
    if not digits:
        raise ValueError(f"SLURM_JOB_ID={job_id!r} has no digits to derive a port from; set MASTER_PORT instead")
    return 15000 + int(digits[-4:])


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Return the number of tasks on node ``node_id`` from ``SLURM_TASKS_PER_NODE`` (``"4(x2),2"``: 4, 4, 2).

    Example:
        >>> slurm_tasks_on_node("4(x2),2", 2)
        2
    """
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        count, _, repeat = item.strip().partition("(x")
        try:
            counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
        except ValueError:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE={tasks_per_node!r}; expected e.g. '4(x2),2'") from None
    if not 0 <= node_id < len(counts):
        raise ValueError(f"SLURM_NODEID={node_id} is outside SLURM_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node_id]


def slurm_process_env() -> dict[str, str]:
    """Return the torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) of this Slurm task; ``MASTER_ADDR``/``MASTER_PORT`` set by
    the user are kept.

    Returns:
        The mapping, read from ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_TASKS_PER_NODE``,
        ``SLURM_NODEID``, ``SLURM_JOB_NODELIST`` (first host) and ``SLURM_JOB_ID`` (port).

    Example:
        >>> slurm_process_env()["RANK"]  # doctest: +SKIP
        '3'
    """
    rank, world = get_int("SLURM_PROCID", 0), get_int("SLURM_NTASKS", 1)
    if not 0 <= rank < world:
        raise ValueError(f"SLURM_PROCID={rank} must be in [0, SLURM_NTASKS={world})")
    node = get_int("SLURM_NODEID", 0)
    local = get_int("SLURM_LOCALID", 0)
    if get_str("SLURM_TASKS_PER_NODE") != "":
        local_world = slurm_tasks_on_node(get_str("SLURM_TASKS_PER_NODE"), node)
    else:
        local_world = get_int("SLURM_NTASKS_PER_NODE", world)
    nodelist = get_str("SLURM_JOB_NODELIST") or get_str("SLURM_NODELIST")
    if get_str("MASTER_ADDR") == "" and nodelist == "":
        raise ValueError("a Slurm task needs SLURM_JOB_NODELIST (or MASTER_ADDR) to find rank 0's host")
    if get_str("MASTER_PORT") == "" and get_str("SLURM_JOB_ID") == "":
        raise ValueError("a Slurm task needs SLURM_JOB_ID (or MASTER_PORT) to agree on a rendezvous port")
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(local_world),
        "NODE_RANK": str(node),
        "MASTER_ADDR": get_str("MASTER_ADDR") or slurm_first_host(nodelist),
        "MASTER_PORT": get_str("MASTER_PORT") or str(slurm_master_port(get_str("SLURM_JOB_ID"))),
    }


# -- baguarun over ssh ---------------------------------------------------------------------------------------


def get_ssh_port() -> Optional[int]:
    """ssh port of every host for ``baguarun`` (``BAGUA_SSH_PORT``, the original's variable); ``None``: ssh's own."""
    return get_int("BAGUA_SSH_PORT", 0) or None


def get_node_domain_names() -> str:
    """Comma-separated hosts for ``baguarun`` when ``--host_list`` is not given (``BAGUA_NODE_DOMAIN_NAMES``)."""
    return get_str("BAGUA_NODE_DOMAIN_NAMES")


# The table's getters take the names they are bound to, for help() and tracebacks.
for _name, _getter in list(globals().items()):
    if hasattr(_getter, "_env_variable"):
        _getter.__name__ = _getter.__qualname__ = _name
del _name, _getter
