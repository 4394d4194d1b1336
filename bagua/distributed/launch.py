"""``python -m bagua.distributed.launch``: the original Bagua launcher's flags, on ``torch.distributed.run``.

Example::

    python -m bagua.distributed.launch --nproc_per_node=2 train.py --epochs 3

``--set_additional_flag`` passes ``--local-rank=N`` to the script, as the original did; otherwise the script reads
``LOCAL_RANK`` from its environment. ``--nnodes``, ``--node_rank``, ``--master_addr`` and ``--master_port`` start a
static multi-node job (run the same command on every node with its ``--node_rank``).
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from torch.distributed import run as torch_run

from bagua.distributed.run import add_bagua_arguments, set_bagua_env

__all__ = ["parse_args", "main"]


def parse_args(argv: Optional[Sequence[str]] = None):
    """Parse the original launcher's arguments."""
    parser = add_bagua_arguments(torch_run.get_args_parser())
    parser.prog = "bagua.distributed.launch"
    parser.add_argument("--set_additional_flag", "--set-additional-flag", action="store_true",
                        help="pass --local-rank=N to the training script")
    parser.add_argument("--logdir", dest="log_dir", default=None, help="alias of --log_dir")
    parser.add_argument("--host_list", "--host-list", default="", help="kept for compatibility; see baguarun")
    parser.add_argument("--ssh_port", "--ssh-port", type=int, default=None, help="kept for compatibility")
    args = parser.parse_args(argv)
    args.use_env = not args.set_additional_flag
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m bagua.distributed.launch``."""
    args = parse_args(argv)
    set_bagua_env(args, os.environ)
    torch_run.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
