"""``baguarun``: start a Bagua job on every host of ``--host_list`` over ssh, as the original ``baguarun`` did.

``baguarun --host_list node0,node1 --nproc_per_node 8 -x NCCL_SOCKET_IFNAME=eth0 train.py --lr 0.1`` runs, on
every host ``i`` of the list, over ``ssh -tt -o BatchMode=yes`` (see :mod:`bagua.distributed.ssh`)::

    cd $PWD && exec env NCCL_SOCKET_IFNAME=eth0 <this python> -m bagua.distributed.run --nproc_per_node 8 \\
        --nnodes=2 --node_rank=i --master_addr=node0 --master_port=29500 train.py --lr 0.1

so every host needs the same Python at the same path and the script at the same place (a shared file system or
identical images), and key authentication from this machine. Output comes back prefixed by host; stopping
``baguarun`` (Ctrl-C, SIGTERM, even SIGKILL) stops every remote process. ``-x VAR`` forwards this machine's
value of ``VAR``, ``-x VAR=value`` a given one (repeatable); the values travel on the remote command line, where ``ps`` on the
hosts shows them, so pass no secrets with ``-x``.

With ``--no_ssh``, ``baguarun`` opens no ssh connection: run the same command on every host yourself (scheduler,
``pdsh``); the hosts then meet in a c10d rendezvous on the first host. Without ``--host_list`` (and without
``BAGUA_NODE_DOMAIN_NAMES``) it is ``python -m bagua.distributed.run`` on this host.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import sys
from typing import Optional, Sequence

from bagua.distributed import ssh
from bagua.distributed.run import launch, make_parser
from bagua.torch_api import env

__all__ = ["build_parser", "parse_args", "remote_command", "main"]

_PROG = "baguarun"
_DESCRIPTION = ("baguarun: start a Bagua training job on several hosts. With --host_list it runs "
                "bagua.distributed.run on every host of the list over ssh (key authentication, batch mode), "
                "forwards -x variables, prefixes output by host and stops every host when it stops; with "
                "--no_ssh, run it on every host yourself. Every torchrun and Bagua flag works.")
#: baguarun's own options, not forwarded to the hosts: option -> whether it takes a value.
_OWN_OPTIONS = {"--host_list": True, "--host-list": True, "--ssh_port": True, "--ssh-port": True,
                "--ssh_option": True, "--ssh-option": True, "--remote_python": True, "--remote-python": True,
                "-x": True, "--no_ssh": False, "--no-ssh": False}


def _parse_exports(items: Sequence[str]) -> dict[str, str]:
    exports = {}
    for item in items:
        name, has_value, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SystemExit(f"{_PROG}: -x {item!r}: write -x NAME or -x NAME=value")
        if not has_value:
            value = env.get_str(name, "\0")
            if value == "\0":
                raise SystemExit(f"{_PROG}: -x {name}: {name} is not set here; give its value with -x {name}=value")
        exports[name] = value
    return exports


def _launcher_argv(argv: list[str], script_argv: list[str]) -> list[str]:
    """The options before the training script, without baguarun's own."""
    head = argv[: len(argv) - len(script_argv)]
    if head + script_argv != argv:
        raise SystemExit(f"{_PROG}: put every option before the training script")
    kept, skip = [], False
    for token in head:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in _OWN_OPTIONS:
            skip = _OWN_OPTIONS[name] and "=" not in token
        elif token.startswith("-x") and not token.startswith("--"):
            continue  # -xNAME
        else:
            kept.append(token)
    return kept


def build_parser() -> argparse.ArgumentParser:
    """Return ``baguarun``'s parser: torchrun's flags, Bagua's, and baguarun's own."""
    parser = make_parser(_PROG, _DESCRIPTION)
    parser.allow_abbrev = False  # an abbreviated baguarun option would otherwise be forwarded to the hosts
    group = parser.add_argument_group("baguarun")
    group.add_argument("--host_list", "--host-list", default=env.get_node_domain_names(),
                       help="comma-separated hosts ([user@]host[:ssh_port]); the first hosts the rendezvous "
                            "(default: $BAGUA_NODE_DOMAIN_NAMES)")
    group.add_argument("--ssh_port", "--ssh-port", type=int, default=env.get_ssh_port(),
                       help="ssh port of every host (default: $BAGUA_SSH_PORT, else ssh's own)")
    group.add_argument("--ssh_option", "--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                       help="an ssh -o option, e.g. IdentityFile=~/.ssh/cluster (repeatable)")
    group.add_argument("-x", dest="export", action="append", default=[], metavar="VAR[=value]",
                       help="export VAR (this machine's value, or the given one) to the workers on every host "
                            "(repeatable)")
    group.add_argument("--remote_python", "--remote-python", default=sys.executable,
                       help="the Python that runs on every host (default: this one, %(default)s)")
    group.add_argument("--no_ssh", "--no-ssh", action="store_true",
                       help="open no ssh connection: run this same command on every host yourself; the hosts "
                            "meet in a c10d rendezvous on the first host")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse ``baguarun``'s command line.

    Args:
        argv: the command line without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The namespace for ``torch.distributed.run``, plus ``hosts`` (``[(destination, address, port)]``),
        ``exports`` (``-x``), ``launcher_argv`` (the options to forward) and ``script_argv``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.exports = _parse_exports(args.export)
    args.hosts = [ssh.split_host(h) for h in args.host_list.split(",") if h.strip()]
    if args.host_list.strip() and not args.hosts:
        raise SystemExit(f"{_PROG}: --host_list is empty; give hosts as 'node0,node1'")
    args.script_argv = [args.training_script, *args.training_script_args]
    args.launcher_argv = _launcher_argv(argv, args.script_argv)
    args.host_port = args.master_port or 29500  # the rendezvous port on the first host (torchrun's default)
    return args


def remote_command(args: argparse.Namespace, node_rank: int) -> str:
    """The shell command that starts host ``node_rank``'s part of the job.

    Example:
        >>> a = parse_args(["--host_list", "n0,n1", "-x", "A=1", "--nproc_per_node", "2", "t.py", "--lr", "1"])
        >>> remote_command(a, 1).split(" -m ")[1]
        'bagua.distributed.run --nproc_per_node 2 --nnodes=2 --node_rank=1 --master_addr=n0 --master_port=29500 t.py --lr 1'
    """
    forwarded = [*args.launcher_argv, f"--nnodes={len(args.hosts)}", f"--node_rank={node_rank}",
                 f"--master_addr={args.hosts[0][1]}", f"--master_port={args.host_port}"]
    exports = [f"{name}={value}" for name, value in args.exports.items()]
    words = ["env", *exports, args.remote_python, "-m", "bagua.distributed.run", *forwarded, *args.script_argv]
    return f"cd {shlex.quote(os.getcwd())} && exec " + " ".join(shlex.quote(w) for w in words)


def _check_no_layout_flags(args: argparse.Namespace) -> None:
    defaults = {"nnodes": "1:1", "node_rank": 0, "master_addr": "127.0.0.1", "rdzv_backend": "static",
                "rdzv_endpoint": "", "standalone": False}
    given = [f"--{name}" for name, default in defaults.items() if getattr(args, name) != default]
    if given:
        raise SystemExit(f"{_PROG}: --host_list sets {', '.join(given)} on every host; remove it (or use --no_ssh "
                         "and start each host yourself)")


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the ``baguarun`` console script."""
    args = parse_args(argv)
    if not args.hosts or args.no_ssh:
        if args.hosts:  # --no_ssh: this host joins an elastic rendezvous on the first host
            args.nnodes = str(len(args.hosts))
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = f"{args.hosts[0][1]}:{args.host_port}"
            if args.rdzv_id == "none":
                args.rdzv_id = f"baguarun-{args.hosts[0][1]}-{args.host_port}"
        os.environ.update(args.exports)
        launch(args, _PROG)
        return
    _check_no_layout_flags(args)
    if shutil.which("ssh") is None:
        raise SystemExit(f"{_PROG}: no ssh client found: install OpenSSH (e.g. apt-get install openssh-client), or "
                         "use --no_ssh and start each host yourself")
    commands = [(address, ssh.ssh_argv(destination, remote_command(args, i), port or args.ssh_port,
                                       args.ssh_option)) for i, (destination, address, port) in enumerate(args.hosts)]
    signal.signal(signal.SIGTERM, _raise_system_exit)  # so run_on_hosts' cleanup stops every host
    signal.signal(signal.SIGHUP, _raise_system_exit)
    try:
        code = ssh.run_on_hosts(commands)
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
