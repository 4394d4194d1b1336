"""Autotune on emulated hosts: TPE in at most 20 trials against an exhaustive bucket-size sweep.

Two hosts (network namespaces joined by a bridge, benchmarks/common/netns.py), one rank each, gloo, Bagua's
gradient allreduce. Three runs on the same shaped link:

1. ``sweep``: autotune with ``strategy="grid"`` measures every bucket size 2**p of the space once;
2. ``tpe``: autotune with Optuna TPE, ``--trials`` trials (20), starting from the 10 MiB default;
3. ``compare``: the default, the sweep's best and TPE's best, re-measured in turn for ``--rounds`` rounds (so
   that drift on the shared machine hits all three alike); throughput = global samples/s from the median step.

The goal: TPE's best within 5 % of the sweep's best, and the gain over the default. Run as root:

    .venv/bin/python benchmarks/micro/autotune.py --rate 1gbit --out docs/log/results/autotune.json

The CSV logs and plots of both tunes are written next to ``--out``; ``--replot docs/log/results/autotune.json``
re-renders the plots from them without measuring anything. ``--streams 4`` also enables the
multistream allreduce and lets autotune choose 1, 2 or 4 streams; with a per-connection cap (``--rate
10gbit@2gbit``, see benchmarks/micro/tcp_tuning.py) that is where streams pay.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit",
                   help="link rate (tc spelling), 'unshaped', or LINK@CAP to also cap each TCP connection")
    p.add_argument("--model", default="deep", choices=["deep", "mlp"])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--min-2p", type=int, default=16, help="smallest bucket size of the space, log2 bytes")
    p.add_argument("--window", type=float, default=3.0, help="seconds measured per trial")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of training before tuning")
    p.add_argument("--rounds", type=int, default=5, help="compare: rounds over the three settings")
    p.add_argument("--compare-steps", type=int, default=5, help="compare: timed steps per setting and round")
    p.add_argument("--streams", type=int, default=1, help="also tune 1..N multistream streams (N > 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    p.add_argument("--out", default=None, help="write the results as JSON here (logs and plots beside it)")
    p.add_argument("--replot", nargs="+", metavar="JSON", default=None,
                   help="only re-render the plots of finished runs (their --out JSON) from the CSV logs beside them")
    p.add_argument("--worker", default=None, choices=["sweep", "tpe", "compare"], help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker: runs on one emulated host ----------------------------------------------------------------------


def build_model(name: str):
    import torch

    torch.manual_seed(0)
    if name == "mlp":  # 25.2 M parameters in 3 large matrices
        from benchmarks.common.workload import build_model as build

        return build("mlp"), 1024, 1024
    layers = [torch.nn.Linear(256, 1024)]  # 12 blocks of 1024x1024 + LayerNorm: 12.9 M parameters, 38 tensors
    for _ in range(12):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(1024, 256))
    return torch.nn.Sequential(*layers), 256, 256


def _warm_and_wait(args, rank: int) -> None:
    """Open every connection, then (with a per-connection cap) wait until the driver has capped them."""
    import torch

    from bagua.torch_api import multistream
    from tcp_tuning import _wait_for_driver

    msg = multistream.get(None)
    if msg is not None:
        streams, msg.num_streams = msg.num_streams, msg.max_streams
        msg.allreduce_(torch.ones(4 << 20))
        msg.num_streams = streams
    if "@" in args.rate:
        _wait_for_driver(os.path.join(args.workdir, args.worker), rank)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import bagua.autotune as autotune
    import bagua.torch_api as bagua
    from bagua.torch_api import multistream
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = dist.get_rank()
    if args.streams > 1:
        multistream.enable(None, num_streams=args.streams, calibrate_streams=False).num_streams = 1  # autotune picks
    model, d_in, d_out = build_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, d_in, generator=g), torch.randn(32, d_out, generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    total = sum(t.numel() * 4 for t in model.bagua_ddp.bagua_tensors)
    space = autotune.TuneSpace.for_model(total, False, args.streams, min_bucket_2p=args.min_2p)
    if args.worker in ("sweep", "tpe"):
        ctl = autotune.attach(
            model, max_samples=len(space.grid()) if args.worker == "sweep" else args.trials,
            warmup_time_s=args.warmup, sampling_confidence_time_s=args.window, settle_steps=2, min_window_steps=3,
            strategy="grid" if args.worker == "sweep" else "tpe", space=space, seed=args.seed, reload=False,
            log_path=os.path.join(args.workdir, f"{args.worker}.csv"),
            tune_file=os.path.join(args.workdir, f"{args.worker}.json"))
        _warm_and_wait(args, rank)
        while not ctl.finished:
            step()
        return

    # compare: the default, the sweep's best and TPE's best, in turn
    with open(os.path.join(args.workdir, "sweep.json")) as f:
        sweep = json.load(f)
    with open(os.path.join(args.workdir, "tpe.json")) as f:
        tpe = json.load(f)
    order = tpe["tensor_order"] or sweep["tensor_order"] or None
    settings = {
        "default": (bagua.env.get_default_bucket_size(), None, 1),
        "sweep_best": (sweep["best"]["bucket_size"], order, sweep["best"]["num_streams"]),
        "tpe_best": (tpe["best"]["bucket_size"], order if tpe["tensor_order"] else None, tpe["best"]["num_streams"]),
    }
    msg = multistream.get(None)
    _warm_and_wait(args, rank)
    for _ in range(5):
        step()
    times: dict[str, list[float]] = {k: [] for k in settings}
    for _ in range(args.rounds):
        for name, (size, plan_order, streams) in settings.items():
            if msg is not None:
                msg.num_streams = streams
            model.bagua_ddp.rebucket(autotune.bucket_plan(model.bagua_ddp.bagua_tensors, plan_order, size))
            step()
            step()
            durations = []
            for _ in range(args.compare_steps):
                t0 = time.perf_counter()
                step()
                durations.append(time.perf_counter() - t0)
            times[name].append(statistics.median(durations))
    stats = torch.tensor([statistics.median(v) for v in times.values()], dtype=torch.float64)
    dist.all_reduce(stats)  # mean over ranks
    stats /= dist.get_world_size()
    if rank == 0:
        result = {name: {"step_s": float(s), "samples_per_s": 32 * dist.get_world_size() / float(s),
                         "bucket_size": settings[name][0], "ordered": settings[name][1] is not None,
                         "num_streams": settings[name][2],
                         "rounds_step_s": times[name]} for name, s in zip(settings, stats.tolist())}
        with open(os.path.join(args.workdir, "compare.json"), "w") as f:
            json.dump(result, f)


# -- driver -------------------------------------------------------------------------------------------------


def run(cluster, mode: str, args, workdir: str) -> None:
    from benchmarks.common import netns
    from bagua.torch_api import env

    port = env.find_free_network_port()
    link, _, cap = args.rate.partition("@")
    cluster.shape(link)
    procs = []
    for host in cluster.hosts:
        child = env.environ_snapshot()
        child.update({"MASTER_ADDR": cluster.hosts[0].address, "MASTER_PORT": str(port), "RANK": str(host.index),
                      "WORLD_SIZE": str(len(cluster.hosts)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                      "NODE_RANK": str(host.index), "GLOO_SOCKET_IFNAME": host.iface, "OMP_NUM_THREADS": "1",
                      "BAGUA_DEFAULT_BUCKET_SIZE": str(10 * 2**20)})
        child.update(env.ALLOCATOR_ENV)
        argv = host.exec_prefix() + [sys.executable, os.path.abspath(__file__), "--worker", mode,
                                     "--workdir", workdir] + _forwarded(args)
        log = open(os.path.join(workdir, f"{mode}.rank{host.index}.log"), "w")
        procs.append(netns.popen(argv, child, log, subprocess.STDOUT))
    deadline = time.monotonic() + args.timeout
    if cap:  # wait until the workers have connected, cap every connection, let them go
        from tcp_tuning import _cap_flows

        marker = os.path.join(workdir, mode)
        while not os.path.exists(marker + ".ready"):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        _cap_flows(cluster, link, cap)
        open(marker + ".go", "w").close()
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            netns.kill_tracked_processes()
            raise RuntimeError(f"{mode}: the workers did not finish within {args.timeout:.0f} s")
    if any(p.returncode != 0 for p in procs):
        with open(os.path.join(workdir, f"{mode}.rank0.log")) as f:
            raise RuntimeError(f"{mode}: a worker failed:\n{f.read()[-3000:]}")


def _forwarded(args) -> list[str]:
    return ["--model", args.model, "--trials", str(args.trials), "--min-2p", str(args.min_2p),
            "--window", str(args.window), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--compare-steps", str(args.compare_steps), "--streams", str(args.streams), "--seed", str(args.seed),
            "--rate", args.rate]


def plot_logs(base: str, args: dict) -> list[str]:
    """Draw ``<base>-sweep.png`` and ``<base>-tpe.png`` from the CSV logs beside them; return the paths."""
    from bagua.autotune import plot

    what = {"sweep": "exhaustive sweep", "tpe": f"TPE, {args['trials']} trials"}
    return [plot(f"{base}-{mode}.csv", f"{base}-{mode}.png",
                 title=f"Autotune ({what[mode]}): {args['model']} model, 2 hosts, {args['rate']} link")
            for mode in ("sweep", "tpe")]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:  # re-render the plots of finished runs, measuring nothing
        for path in args.replot:
            with open(path) as f:
                run_args = json.load(f)["args"]
            print("wrote " + ", ".join(plot_logs(os.path.splitext(path)[0], run_args)))
        return 0
    if args.worker:
        worker(args)
        return 0
    from bagua.autotune import read_log
    from benchmarks.common import netns
    ok, why = netns.netns_available()
    if not ok and args.rate != "unshaped":
        print(f"no network emulation ({why}); running on loopback, unshaped")
        args.rate = "unshaped"
    netns.install_signal_handlers()
    with tempfile.TemporaryDirectory(prefix="bagua-autotune-") as workdir:
        cluster = netns.NetnsCluster(2) if ok else netns.LoopbackCluster(2)
        with cluster:
            for mode in ("sweep", "tpe", "compare"):
                t0 = time.monotonic()
                run(cluster, mode, args, workdir)
                print(f"{mode}: done in {time.monotonic() - t0:.0f} s", flush=True)
        sweep, tpe = read_log(os.path.join(workdir, "sweep.csv")), read_log(os.path.join(workdir, "tpe.csv"))
        with open(os.path.join(workdir, "compare.json")) as f:
            compare = json.load(f)
        if args.out:
            base = os.path.splitext(args.out)[0]
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            for mode in ("sweep", "tpe"):
                shutil.copy(os.path.join(workdir, f"{mode}.csv"), f"{base}-{mode}.csv")
            plot_logs(base, vars(args))

    print(f"\nsweep ({args.rate}, {args.model}): log2(bucket) -> samples/s")
    for r in sweep:
        print(f"  {r['kind']:>7} {r['bucket_size_2p']:6.2f} streams={r['num_streams']} {r['score']:9.1f}")
    trials = [r for r in tpe if r["kind"] == "trial"]
    print(f"tpe: {len(trials)} trials; chose 2^{[r for r in tpe if r['kind'] == 'best'][0]['bucket_size_2p']:.0f}")
    d, s, t = (compare[k]["samples_per_s"] for k in ("default", "sweep_best", "tpe_best"))
    print("compare (median step, re-measured in turn):")
    for k, v in compare.items():
        print(f"  {k:>10}: bucket {v['bucket_size'] / 2**20:8.3f} MiB ordered={v['ordered']!s:5} "
              f"streams={v['num_streams']} "
              f"{v['step_s'] * 1e3:8.1f} ms  {v['samples_per_s']:8.1f} samples/s")
    print(f"tpe_best / sweep_best = {t / s:.3f} (goal >= 0.95); tpe_best / default = {t / d:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "emulated": ok, "sweep": sweep, "tpe": tpe, "compare": compare,
                       "tpe_over_sweep": t / s, "tpe_over_default": t / d}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
