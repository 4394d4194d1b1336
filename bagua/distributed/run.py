"""``python -m bagua.distributed.run``: ``torchrun`` plus Bagua's flags (elastic launch included).

Every ``torch.distributed.run`` argument works unchanged (``--nnodes=MIN:MAX``, ``--max_restarts``,
``--rdzv_backend=c10d``, ``--standalone``...). Bagua's own flags become environment variables of the workers,
and the allocator variables that make large CPU tensors cheap are set unless the user set them.

Example::

    python -m bagua.distributed.run --nnodes=1:2 --nproc_per_node=2 --max_restarts=3 \\
        --rdzv_backend=c10d --rdzv_endpoint=node0:29400 --rdzv_id=job1 train.py
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import MutableMapping, Optional, Sequence

from torch.distributed import run as torch_run
from torch.distributed.elastic import metrics

from bagua.torch_api import env

__all__ = ["add_bagua_arguments", "make_parser", "build_parser", "set_bagua_env", "launch", "parse_args", "main"]


def _parse_size(text: str) -> int:
    """Parse a byte size such as ``10485760``, ``10MiB``, ``25MB`` or ``1GiB``."""
    units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "b": 1}
    t = text.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            number = float(t[: -len(unit)])
            break
    else:
        number, scale = float(t), 1
    value = int(number * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bucket size must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def add_bagua_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the original Bagua launcher flags (and torch's old ``--use_env``) to ``parser``; return it."""
    group = parser.add_argument_group("Bagua")
    group.add_argument("--bagua_service_port", "--bagua-service-port", type=int, default=29501,
                       help="accepted for compatibility with the original launcher; Bagua runs no service")
    group.add_argument("--default_bucket_size", "--default-bucket-size", type=_parse_size, default=10 * 1024**2,
                       help="bucket size in bytes (accepts 10MiB, 25MB, ...); default 10MiB")
    group.add_argument("--autotune_level", "--autotune-level", type=int, default=0, choices=[0, 1],
                       help="1 tunes bucket size and order while training runs (docs/autotune.md); default 0")
    group.add_argument("--autotune_max_samples", "--autotune-max-samples", type=_positive_int, default=60,
                       help="most configurations the tuner tries; default 60")
    group.add_argument("--autotune_sampling_confidence_time", "--autotune-sampling-confidence-time",
                       type=_non_negative_float, default=5.0, help="seconds of training measured per trial")
    group.add_argument("--autotune_warmup_time", "--autotune-warmup-time", type=_non_negative_float, default=30.0,
                       help="seconds of training before tuning starts")
    group.add_argument("--is_output_autotune_log", "--is-output-autotune-log", action="store_true",
                       help="write every autotune trial to a CSV log")
    group.add_argument("--report_metrics", "--report-metrics", action="store_true",
                       help="print the launcher's metrics when they happen (rendezvous and worker start times, "
                            "restarts left, run success or failure) as 'PROG: metric NAME=VALUE' on stderr")
    group.add_argument("--enable_bagua_net", "--enable-bagua-net", action="store_true",
                       help="spread communication over several TCP streams (see docs/tcp_tuning.md)")
    group.add_argument("--use_env", "--use-env", dest="legacy_use_env", action="store_true",
                       help="torch.distributed.launch's flag, accepted and ignored: workers always find "
                            "LOCAL_RANK in their environment")
    return parser


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """Return torchrun's parser plus Bagua's flags, named ``prog`` and described by ``description``."""
    parser = add_bagua_arguments(torch_run.get_args_parser())
    parser.prog = prog
    parser.description = description
    parser.usage = f"{prog} [options] training_script [training_script_args ...]"
    return parser


def set_bagua_env(args: argparse.Namespace, environ: MutableMapping[str, str]) -> None:
    """Export Bagua's flags as the workers' environment variables."""
    environ["BAGUA_SERVICE_PORT"] = str(args.bagua_service_port)
    environ["BAGUA_DEFAULT_BUCKET_SIZE"] = str(args.default_bucket_size)
    environ["BAGUA_AUTOTUNE"] = str(args.autotune_level)
    environ["BAGUA_AUTOTUNE_MAX_SAMPLES"] = str(args.autotune_max_samples)
    environ["BAGUA_AUTOTUNE_SAMPLING_CONFIDENCE_TIME_S"] = str(args.autotune_sampling_confidence_time)
    environ["BAGUA_AUTOTUNE_WARMUP_TIME_S"] = str(args.autotune_warmup_time)
    environ["BAGUA_IS_OUTPUT_AUTOTUNE_LOG"] = "1" if args.is_output_autotune_log else "0"
    environ["BAGUA_REPORT_METRICS"] = "1" if args.report_metrics else "0"
    if args.enable_bagua_net:
        from bagua.torch_api import multistream

        environ["BAGUA_NET"] = "1"
        multistream.apply_nccl_socket_env(environ)  # NCCL reads its socket settings once, before it starts
    env.set_default(environ, env.ALLOCATOR_ENV)


class _MetricPrinter(metrics.MetricHandler):
    """Print the metrics torch's elastic agent records (to a null handler by default), each time one changes;
    the agent's health poll every ``--monitor_interval`` is left out."""

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.last: dict[str, int] = {}

    def emit(self, metric_data: metrics.MetricData) -> None:
        name = metric_data.name
        if "_monitor_workers" in name or self.last.get(name) == metric_data.value:
            return
        self.last[name] = metric_data.value
        print(f"{self.prog}: metric {name}={metric_data.value}", file=sys.stderr, flush=True)


def launch(args: argparse.Namespace, prog: str) -> None:
    """Apply Bagua's flags to this process and its workers, then start them with ``torch.distributed.run``.

    Args:
        args: the parsed command line (from :func:`make_parser`).
        prog: the launcher's name, used in its notes.
    """
    if args.legacy_use_env:
        print(f"{prog}: note: --use_env is accepted and ignored; workers always find LOCAL_RANK in their "
              "environment", file=sys.stderr)
    if args.report_metrics:
        metrics.configure(_MetricPrinter(prog))
    set_bagua_env(args, os.environ)
    torch_run.run(args)


_DESCRIPTION = ("bagua.distributed.run: start a Bagua training job. Every torchrun flag works (elastic launch "
                "with --nnodes=MIN:MAX, --max_restarts, --rdzv_backend=c10d, --standalone...); Bagua's flags "
                "become the workers' environment variables.")


def build_parser() -> argparse.ArgumentParser:
    """Return ``bagua.distributed.run``'s parser: torchrun's flags plus Bagua's."""
    return make_parser("bagua.distributed.run", _DESCRIPTION)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse torchrun's arguments plus Bagua's."""
    return build_parser().parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m bagua.distributed.run``."""
    launch(parse_args(argv), "bagua.distributed.run")


if __name__ == "__main__":
    main(sys.argv[1:])
