"""``python -m bagua.distributed.launch``: the original Bagua launcher's flags, on ``torch.distributed.run``.

Example::

    python -m bagua.distributed.launch --nproc_per_node=2 train.py --epochs 3

``--set_additional_flag`` passes ``--local_rank=N`` to the script, as the original did (a script with
``parser.add_argument("--local_rank")`` runs unchanged); otherwise the script reads ``LOCAL_RANK`` from its
environment. ``--nnodes``, ``--node_rank``, ``--master_addr`` and ``--master_port`` start a static multi-node job
(run the same command on every node with its ``--node_rank``, or let ``baguarun`` do it over ssh).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from torch.distributed.elastic.utils import macros

from bagua.distributed.run import launch, make_parser

__all__ = ["build_parser", "parse_args", "main"]

_PROG = "bagua.distributed.launch"
_DESCRIPTION = ("bagua.distributed.launch: start a Bagua training job with the original Bagua launcher's flags "
                "(--nproc_per_node, --nnodes, --node_rank, --master_addr, --set_additional_flag...), on "
                "torch.distributed.run; every torchrun flag works too.")


def build_parser() -> argparse.ArgumentParser:
    """Return the launcher's parser: torchrun's flags, Bagua's, and the original launcher's own."""
    parser = make_parser(_PROG, _DESCRIPTION)
    parser.add_argument("--set_additional_flag", "--set-additional-flag", action="store_true",
                        help="pass --local_rank=N to the training script, as the original launcher did")
    parser.add_argument("--logdir", dest="log_dir", default=None, help="alias of --log_dir")
    parser.add_argument("--host_list", "--host-list", default="",
                        help="accepted for compatibility and ignored here; use baguarun --host_list")
    parser.add_argument("--ssh_port", "--ssh-port", type=int, default=None,
                        help="accepted for compatibility and ignored here; use baguarun --ssh_port")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the original launcher's arguments.

    Args:
        argv: the command line without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The namespace ``torch.distributed.run.run`` takes, with ``--local_rank=N`` prepended to the script's
        arguments when ``--set_additional_flag`` was given.

    Example:
        >>> parse_args(["--set_additional_flag", "train.py", "--lr", "0.1"]).training_script_args
        ['--local_rank=${local_rank}', '--lr', '0.1']
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.set_additional_flag:
        # torch.distributed.run would pass the dashed --local-rank (PyTorch 2.0 style); the original Bagua launcher
        # passed --local_rank, which is what its users' scripts parse. torch's agent fills in the macro per worker.
        args.training_script_args = [f"--local_rank={macros.local_rank}", *args.training_script_args]
    args.use_env = True  # torch must not add its own --local-rank
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m bagua.distributed.launch``."""
    launch(parse_args(argv), _PROG)


if __name__ == "__main__":
    main(sys.argv[1:])
