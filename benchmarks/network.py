"""``python -m benchmarks.network`` (``bagua-bench``): training speed over emulated networks.

For each number of hosts, the suite builds a :class:`~benchmarks.common.netns.NetnsCluster` (one network
namespace per host, veth pairs into a bridge), shapes every link with tbf to each requested bandwidth, and runs
the same training job (:mod:`benchmarks.common.workload`, one process per host) with torch DDP, DDP + fp16
compress hook, DDP + PowerSGD hook and every registered Bagua algorithm. It reports the median step time,
samples/s, speedup over DDP, bytes sent per step, the fraction of line rate reached, test accuracy (digits) and
a per-phase breakdown, as a table, JSON, CSV and a PNG plot (:mod:`benchmarks.common.report`).

It needs root and iproute2; without them it says so and falls back to loopback processes with no shaping.
Namespaces are deleted on exit, on Ctrl-C, on SIGTERM and on error. Latency cannot be emulated: this kernel has
no netem.

With ``--to-target`` the suite measures time to a validation target per network instead: steps to the target
once per seed on unshaped links, step times per bandwidth, their product (real runs where the trajectory
depends on timing); :mod:`benchmarks.to_target.to_target_plan` lists the runs, :mod:`benchmarks.to_target.to_target_table`
combines them.

Example::

    sudo python -m benchmarks.network --hosts 2 --bandwidths unshaped,1gbit,100mbit \\
        --systems ddp,gradient_allreduce,bytegrad --models mlp --out-dir docs/log/results --name network-2hosts
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from typing import Optional, Sequence
from benchmarks.common import netns, report
from benchmarks.to_target import to_target, to_target_plan
from benchmarks.common.job import Job
from benchmarks.common.workload import MODELS, available_systems, split_system
from bagua.torch_api import env

__all__ = ["Job", "parse_args", "check_optional_imports", "resolve_systems", "run_job", "run_suite", "main"]

#: models that need an optional package: model -> (module, pip name); the ``bench`` extra installs them all.
_MODEL_IMPORTS = {m: ("sklearn", "scikit-learn") for m in ("digits", "resnet", "resnet_tiny")}
_STEP_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
              "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID")


def resolve_systems(spec: str) -> list[str]:
    """Expand ``--systems`` ("all" or a comma list) against the systems available now; unknown names raise."""
    available = available_systems()
    if spec.strip() == "all":
        return available
    from benchmarks.to_target import torchft_peer
    available += [torchft_peer.NAME] if torchft_peer.available() else []  # optional peers: named, never in "all"
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in names if split_system(s)[0] not in available]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; available now: {', '.join(available)}")
    return names


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env(host: netns.Host, master: netns.Host, port: int, world: int) -> dict[str, str]:
    child = {k: v for k, v in env.environ_snapshot().items() if k not in _STEP_VARS}
    child.update({
        "MASTER_ADDR": master.address, "MASTER_PORT": str(port), "RANK": str(host.index),
        "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "GLOO_SOCKET_IFNAME": host.iface, "OMP_NUM_THREADS": "1",
    })
    # benchmarks/ is not installed: the workload imports it from the clone
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, child.get("PYTHONPATH", "")]))
    child.update(env.ALLOCATOR_ENV)
    return child


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _wait_all(procs: list, deadline: float, row: dict) -> None:
    """Wait for every process; stop early when one fails (its peers would only hang) or at ``deadline``."""
    while any(p.poll() is None for p in procs):
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            row.update(status="failed", error=f"rank {failed[0]} exited with code {procs[failed[0]].returncode}")
            return
        if time.monotonic() > deadline:
            row.update(status="timeout", error="the run did not finish within --job-timeout")
            return
        time.sleep(0.1)
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        row.update(status="failed", error=f"rank {failed[0]} exited with code {procs[failed[0]].returncode}")


def run_job(cluster, job: Job, workdir: str, port: int, timeout_s: float) -> dict:
    """Run ``job`` on ``cluster`` (one workload process per host); return its result row (never raises for a
    failed or timed-out job: the row says ``status`` and ``error``)."""
    hosts = cluster.hosts[: job.hosts]
    out = os.path.join(workdir, f"job{port}")
    procs, logs = [], []
    row: dict = {"model": job.model, "system": job.system, "hosts": job.hosts, "bandwidth": job.bandwidth,
                 "rate_bps": job.rate, "emulated": cluster.emulated, "warmup": job.warmup}
    if job.phase is not None:
        row.update(phase=job.phase, seed=job.seed, qadam_warmup=job.qadam_warmup)
    start = time.monotonic()
    try:
        for host in hosts:
            argv = host.exec_prefix() + [sys.executable, "-m", "benchmarks.common.workload", *job.workload_args(),
                                         "--iface", host.iface, "--out", out]
            log = f"{out}.rank{host.index}.log"
            logs.append(log)
            with open(log, "w") as f:
                procs.append(netns.popen(argv, _child_env(host, hosts[0], port, job.hosts), f, f))
        _wait_all(procs, start + timeout_s, row)
    except OSError as exc:  # a failed start becomes a failed row
        row.update(status="failed", error=str(exc)[-500:])
    finally:
        for proc in procs:  # no-op for finished ones; kills the rest of this job (and only this job)
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    row["wall_s"] = time.monotonic() - start
    if "status" in row:
        rank = int(row["error"].split()[1]) if row["error"].startswith("rank ") else 0
        row["error"] += "\n" + _tail(logs[rank]) if rank < len(logs) else ""
        return row
    ranks = []
    for host, log in zip(hosts, logs):
        try:
            with open(f"{out}.rank{host.index}.json") as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            row.update(status="failed", error=f"rank {host.index} gave no result:\n{_tail(log)}")
            return row
    row["status"] = "ok"
    row.update(report.summarize_ranks(ranks, job.rate, cluster.emulated))
    if "to_target" in ranks[0]:
        row.update(to_target.summarize(ranks))
    return row


def _plan(args: argparse.Namespace, systems: list[str], rates: list[Optional[int]]) -> list[Job]:
    if args.to_target:
        return to_target_plan.plan(args, systems, rates)
    jobs = []
    for hosts in args.hosts:
        for rate in rates:
            warmup, steps = args.steps_at.get(rate, (args.warmup, args.steps))
            for model in args.models:
                for system in systems:
                    jobs.append(Job(model, system, hosts, rate, warmup, steps, args.epochs, args.batch_size))
    return jobs


def run_suite(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Run every job of ``args``; return the result rows and the run's metadata."""
    from tqdm import tqdm

    systems = resolve_systems(args.systems)
    rates = [netns.parse_rate(b) for b in args.bandwidths]
    emulate, reason = (False, "--loopback was given") if args.loopback else netns.netns_available()
    if not emulate:
        print(f"bagua-bench: no network emulation ({reason}); falling back to loopback with no shaping, "
              "unshaped bandwidth only", file=sys.stderr)
        rates = [None]
    meta = {"command": " ".join(["python -m benchmarks.network", *args.argv]), "emulated": emulate,
            "fallback_reason": None if emulate else reason, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": report.machine_info(), "systems": systems}
    jobs = _plan(args, systems, rates)
    rates = list(dict.fromkeys(job.rate for job in jobs))  # in the plan's order (to-target: unshaped first)
    rows: list[dict] = []
    meta["repeats"] = args.repeats
    netns.install_signal_handlers()
    with tempfile.TemporaryDirectory(prefix="bagua-bench-") as workdir, \
            tqdm(total=len(jobs) * args.repeats, desc="bagua-bench", unit="run", file=sys.stderr) as bar:
        for hosts in args.hosts:
            cluster = netns.NetnsCluster(hosts) if emulate else netns.LoopbackCluster(hosts)
            with cluster:
                for rate in rates:
                    cluster.shape(netns.format_rate(rate))
                    # repeats are interleaved (all systems, then all again) so load drift hits every system
                    for repeat, job in [(k, j) for k in range(args.repeats) for j in jobs
                                        if j.hosts == hosts and j.rate == rate]:
                        bar.set_postfix_str(job.describe() + (f" #{repeat + 1}" if args.repeats > 1 else ""))
                        port = (env.find_free_network_port() if not emulate else 20000 + len(rows) % 20000)
                        job = to_target_plan.with_budget(job, rows, args.budget_factor)
                        rows.append(run_job(cluster, job, workdir, port, args.job_timeout))
                        rows[-1].update(run=meta["started"], repeat=repeat)
                        if rows[-1]["status"] != "ok":
                            tqdm.write(f"{job.describe()}: {rows[-1]['status']}: {rows[-1].get('error', '')[-300:]}",
                                       file=sys.stderr)
                        if args.out_dir:
                            report.write_results(args.out_dir, args.name, rows, meta, make_plot=False)
                        bar.update()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return rows, meta


def _parse_steps_at(items: Sequence[str]) -> dict[Optional[int], tuple[int, int]]:
    out: dict[Optional[int], tuple[int, int]] = {}
    for item in items:
        rate, _, counts = item.partition("=")
        warmup, _, steps = counts.partition(":")
        if not (warmup.isdigit() and steps.isdigit()):
            raise ValueError(f"--steps-at {item!r}: write RATE=WARMUP:STEPS, e.g. 100mbit=1:3")
        out[netns.parse_rate(rate)] = (int(warmup), int(steps))
    return out


def _parse_targets(items: Sequence[str], models: Sequence[str]) -> dict[str, float]:
    """``MODEL=VALUE`` items as a dict; every model of a to-target run must have a default or a given target."""
    out: dict[str, float] = {}
    for item in items:
        model, _, value = item.partition("=")
        try:
            out[model] = float(value)
        except ValueError:
            raise ValueError(f"--target {item!r}: write MODEL=VALUE, e.g. gpt=2.4 or resnet=0.97") from None
    missing = [m for m in models if m not in to_target.DEFAULTS]
    if missing:
        raise ValueError(f"--to-target needs models with validation data; {missing} have none: use "
                         f"{', '.join(to_target.DEFAULTS)}")
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the suite's command line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="bagua-bench", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="2", help="comma list of host counts, e.g. 2,4")
    p.add_argument("--bandwidths", default="unshaped,10gbit,1gbit,100mbit", help="comma list of tc rates")
    p.add_argument("--systems", default="all", help="'all' or a comma list (ddp, ddp_fp16, ddp_bf16, ddp_powersgd, "
                                                     "Bagua algorithm names, with arguments as "
                                                     "name:key=value, e.g. decentralized:peer_selection_mode=shift_one)")
    p.add_argument("--models", default="mlp,digits", help=f"comma list of {', '.join(MODELS)} (gpt: byte-level "
                                                           "GPT on stdlib text; resnet: BatchNorm ResNet on digits)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (synthetic models)")
    p.add_argument("--steps-at", action="append", default=[], metavar="RATE=WARMUP:STEPS",
                   help="other step counts at one rate, e.g. 100mbit=1:3 (repeatable)")
    p.add_argument("--repeats", type=int, default=1, help="run every configuration this many times "
                                                          "(interleaved) and report medians")
    p.add_argument("--epochs", type=int, default=8, help="epochs of the digits model")
    p.add_argument("--batch-size", type=int, default=None, help="per-host batch size (default: the model's; 32, "
                                                                  "gpt: 8 sequences of 128 bytes)")
    p.add_argument("--to-target", action="store_true", help="time to accuracy: train each system to a validation "
                                                            "target (models gpt, resnet, digits; see to_target)")
    p.add_argument("--target", action="append", default=[], metavar="MODEL=VALUE",
                   help="with --to-target: the target of one model, e.g. gpt=2.4 (validation loss) or resnet=0.97 "
                        "(test accuracy); default: to_target.DEFAULTS (repeatable)")
    p.add_argument("--eval-every", type=int, default=None, help="with --to-target: steps between evaluations "
                                                                 "(default: the model's)")
    p.add_argument("--eval-samples", type=int, default=None, help="with --to-target: validation windows (gpt) or "
                                                                   "test images (0: all) per evaluation")
    p.add_argument("--max-steps", type=int, default=None, help="with --to-target: DDP's step budget; the others "
                                                                "get 3x DDP's steps to the target")
    p.add_argument("--seeds", type=int, default=3, help="with --to-target: seeds per convergence run (median "
                                                         "and spread are reported)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="with --to-target: the first seed (seeds are FIRST, FIRST+1, ...: add seeds to a campaign)")
    p.add_argument("--step-times-only", action="store_true",
                   help="with --to-target: skip the convergence runs of the synchronous systems and time their steps "
                        "only (merge with a run that has them: python -m benchmarks.common.report A.json B.json)")
    p.add_argument("--qadam-warmup", type=int, default=None,
                   help="with --to-target: QAdam's full-precision steps when the run has no DDP convergence row to "
                        "take 20 %% of (default then: max-steps / 15)")
    p.add_argument("--budget-factor", type=float, default=3.0,
                   help="with --to-target: the other systems' step budget in DDP's steps to the target (default 3)")
    p.add_argument("--seeds-of", action="append", default=[], metavar="SYSTEM=N",
                   help="with --to-target: another seed count for one system, e.g. ddp_fp16=1 (repeatable)")
    p.add_argument("--validate", action="append", default=[], metavar="SYSTEM@RATE",
                   help="with --to-target: also train SYSTEM to the target for real at RATE and compare with steps "
                        "x step time, e.g. ddp@1gbit (repeatable)")
    p.add_argument("--gpu-step", action="append", default=[], metavar="MODEL=SECONDS",
                   help="with --to-target: a model's per-GPU H100 step for the GPU-mapping column (default: "
                        "gpu_mapping.GPU_STEP_S, measured on an H100)")
    p.add_argument("--job-timeout", type=float, default=900.0, help="seconds before a run is killed")
    p.add_argument("--loopback", action="store_true", help="do not emulate a network even as root")
    p.add_argument("--out-dir", default="bagua-bench-results", help="where JSON/CSV/PNG go ('' for none)")
    p.add_argument("--name", default="network", help="file name stem of the results")
    args = p.parse_args(argv)
    args.argv = argv
    args.hosts = [int(h) for h in args.hosts.split(",")]
    args.bandwidths = [b.strip() for b in args.bandwidths.split(",") if b.strip()]
    for b in args.bandwidths:
        netns.parse_rate(b)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown models {unknown}; available: {', '.join(MODELS)}")
    if any(h < 2 for h in args.hosts):
        raise ValueError(f"--hosts {args.hosts}: every host count must be at least 2")
    args.steps_at = _parse_steps_at(args.steps_at)
    given = [flag for flag, value in (("--target", args.target), ("--eval-every", args.eval_every),
                                      ("--seeds-of", args.seeds_of),
                                      ("--eval-samples", args.eval_samples), ("--max-steps", args.max_steps),
                                      ("--validate", args.validate), ("--gpu-step", args.gpu_step))
             if value not in (None, [])]
    if given and not args.to_target:
        raise ValueError(f"{', '.join(given)} only apply to time to accuracy: add --to-target")
    args.targets = _parse_targets(args.target, args.models if args.to_target else [])
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.to_target and args.repeats > 1 and not args.step_times_only:
        raise ValueError("--to-target repeats by seed: use --seeds N, not --repeats (only --step-times-only runs "
                         "repeat their timed runs)")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    if args.budget_factor < 1:
        raise ValueError(f"--budget-factor must be at least 1, got {args.budget_factor}")
    args.seeds_of = to_target_plan.parse_seeds_of(args.seeds_of)
    args.validate = to_target_plan.parse_validate(args.validate)
    try:
        args.gpu_step = {m: float(v) for m, _, v in (item.partition("=") for item in args.gpu_step)}
    except ValueError:
        raise ValueError(f"--gpu-step {args.gpu_step}: write MODEL=SECONDS, e.g. gpt=0.0075") from None
    return args


def check_optional_imports(models: Sequence[str], want_plot: bool) -> bool:
    """Check, before any work, the optional packages the run needs; return whether the plot can be drawn.

    Args:
        models: the models to run; one that needs a missing package (digits: scikit-learn) is an error.
        want_plot: whether a PNG plot was asked for (``--out-dir``); without matplotlib a note is printed and
            only the JSON and CSV are written.

    Returns:
        True when matplotlib is importable and a plot was asked for.

    Example:
        >>> check_optional_imports(["mlp"], want_plot=False)
        False
    """
    for model in models:
        module, package = _MODEL_IMPORTS.get(model, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise SystemExit(f"bagua-bench: the {model} model needs {package}, which is not installed: "
                             f"pip install 'bagua[bench]' (or leave the model out, e.g. --models mlp)")
    if want_plot and importlib.util.find_spec("matplotlib") is None:
        print("bagua-bench: matplotlib is not installed, so no PNG plot will be drawn (the JSON and CSV are "
              "written); pip install 'bagua[bench]' for the plot", file=sys.stderr)
        return False
    return want_plot


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``bagua-bench`` and ``python -m benchmarks.network``."""
    args = parse_args(argv)
    make_plot = check_optional_imports(args.models, want_plot=bool(args.out_dir))
    rows, meta = run_suite(args)
    meta["gpu_step"] = args.gpu_step
    rows = report.add_speedups(report.combine_repeats(rows))
    print(report.format_table(report.speed_rows(rows)))
    if args.to_target:
        print()
        print(to_target.format_table(to_target.add_time_speedups([r for r in rows if r.get("phase") != "step_time"])))
        print()
        print(report.format_time_to_target(rows, meta))
    goals = report.check_goals(rows)
    if goals:
        print()
        print(report.format_goals(goals))
    if args.out_dir:
        paths = report.write_results(args.out_dir, args.name, rows, meta, make_plot=make_plot, goals=goals)
        print("\nwrote " + ", ".join(paths))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
