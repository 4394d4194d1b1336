"""``baguarun``: ``python -m bagua.distributed.run`` with a ``--host_list`` shortcut for multi-node jobs.

``baguarun --host_list node0,node1 --nproc_per_node 2 train.py`` sets ``--nnodes=2``, a c10d rendezvous on
``node0:--master_port`` and a job id, and must be run on every host of the list (with your cluster's scheduler,
``pdsh`` or ssh): Bagua starts processes through torch's launcher only and opens no ssh connections itself.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from torch.distributed import run as torch_run

from bagua.distributed.run import add_bagua_arguments, set_bagua_env

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the ``baguarun`` console script."""
    parser = add_bagua_arguments(torch_run.get_args_parser())
    parser.prog = "baguarun"
    parser.add_argument("--host_list", "--host-list", default="",
                        help="comma-separated hosts (host or host:port); the first hosts the rendezvous")
    parser.add_argument("--ssh_port", "--ssh-port", type=int, default=None, help="accepted for compatibility")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.host_list:
        hosts = [h.strip() for h in args.host_list.split(",") if h.strip()]
        if not hosts:
            raise SystemExit("baguarun: --host_list is empty; give hosts as 'node0,node1'")
        first = hosts[0].split(":")[0]
        port = args.master_port or 29500
        args.nnodes = str(len(hosts))
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = f"{first}:{port}"
        if args.rdzv_id == "none":
            args.rdzv_id = f"baguarun-{first}-{port}"
    set_bagua_env(args, os.environ)
    torch_run.run(args)


if __name__ == "__main__":
    main()
