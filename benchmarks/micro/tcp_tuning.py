"""Multistream allreduce (the gloo "Bagua-Net") on emulated hosts: allreduce GB/s and DDP step time.

Two hosts (network namespaces joined by a bridge, benchmarks/common/netns.py), one rank each, gloo. For every
link rate (unshaped, 10gbit, 1gbit by default) it measures, interleaving the settings so that drift on the
shared machine hits all of them alike:

1. allreduce of fp32 tensors of several sizes with 1, 2, 4 (... ) streams: median time, algbw GB/s;
2. end-to-end training step of torch DDP on the 25 M-parameter MLP, without and with
   ``multistream.enable(ddp)``, and (``--bagua``) Bagua's gradient allreduce without and with streams.

A rate written ``LINK@CAP`` (e.g. ``10gbit@2gbit``) also caps every TCP connection at ``CAP``, the way cloud
networks limit a single flow (the case Bagua-Net and Google's fastsocket were written for): once the workers
have connected, the driver lists each host's TCP connections (``ss``) and gives each its own htb class of rate
``CAP`` under the link's rate. This is where one stream leaves the link idle.

Run as root:

    .venv/bin/python benchmarks/micro/tcp_tuning.py --rates unshaped,10gbit,1gbit --out docs/log/results/tcp_tuning.json

Without root it runs the same on loopback, unshaped only (and says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="unshaped,10gbit,1gbit")
    p.add_argument("--streams", default="1,2,4")
    p.add_argument("--sizes-mb", default="4,25,100", help="allreduce sizes in MB (fp32)")
    p.add_argument("--repeats", type=int, default=5, help="allreduce repeats per size and stream count")
    p.add_argument("--rounds", type=int, default=4, help="end-to-end rounds; each times 2 steps per setting")
    p.add_argument("--e2e-streams", type=int, default=4)
    p.add_argument("--bagua", action="store_true", help="also time Bagua's gradient allreduce with/without")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per rate")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    # worker mode (started by the driver inside a namespace)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker: runs on one emulated host ----------------------------------------------------------------------


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _wait_for_driver(result: str, rank: int, timeout_s: float = 120.0) -> None:
    """Rank 0 says every connection is open; both wait until the driver has shaped them."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        open(result + ".ready", "w").close()
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(result + ".go"):
        if time.monotonic() > deadline:
            raise RuntimeError("the driver never said go")
        time.sleep(0.05)
    dist.barrier()


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.common.workload import build_model
    from bagua.torch_api import multistream

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    streams = [int(s) for s in args.streams.split(",")]
    k_e2e = args.e2e_streams

    # every group (= TCP connection) is created before the driver shapes the links
    msg = multistream.MultiStreamGroup(max_streams=max(streams))
    systems = {}  # name -> (model, optimizer, MultiStreamGroup or None, streams)
    for name, k in (("ddp", 1), (f"ddp+multistream{k_e2e}", k_e2e), ("ddp+multistream(auto)", 0)):
        ddp = torch.nn.parallel.DistributedDataParallel(build_model("mlp", seed=0))
        group = None
        if k != 1:  # k == 0: enable()'s default, which chooses on the first training iterations
            group = multistream.enable(ddp, num_streams=k or multistream.DEFAULT_NUM_STREAMS, calibrate_streams=k == 0)
        systems[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), group, k)
    if args.bagua:
        import bagua.torch_api as bagua
        from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

        bagua.init_process_group()
        bagua_msg = multistream.enable(None, num_streams=k_e2e, calibrate_streams=False)  # streams set per system
        for name, k in (("bagua", 1), (f"bagua+multistream{k_e2e}", k_e2e), ("bagua+multistream(auto)", 0)):
            model = build_model("mlp", seed=0)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            model.with_bagua([opt], GradientAllReduceAlgorithm())
            systems[name] = (model, opt, bagua_msg, k)
    for group in [msg] + [s[2] for s in systems.values() if s[2] is not None]:
        streams_now, group.num_streams = group.num_streams, group.max_streams
        group.allreduce_(torch.ones(4 << 20))  # opens every connection
        group.num_streams = streams_now
    _wait_for_driver(args.result, rank)
    result = {"allreduce": {}, "e2e": {}, "calibration": {}}
    g = torch.Generator().manual_seed(rank)
    xb, yb = torch.randn(32, 1024, generator=g), torch.randn(32, 1024, generator=g)

    def step(model, opt):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()

    # 0. the "auto" systems choose their streams first, alone (their choice is timed on real iterations)
    for name in [n for n in systems if n.endswith("(auto)")]:
        model, opt, group, _ = systems[name]
        t0, iters = time.perf_counter(), 0
        if name.startswith("bagua"):
            import bagua.autotune as autotune

            group.num_streams = 1
            ctl = autotune.choose_streams(model, warmup_time_s=1.0, sampling_confidence_time_s=2.0)
            while not ctl.finished:
                step(model, opt)
                iters += 1
        else:
            while group.chooser.chosen is None:
                step(model, opt)
                iters += 1
        result["calibration"][name] = {"chosen_streams": group.num_streams, "iterations": iters,
                                       "seconds": time.perf_counter() - t0}
        systems[name] = (model, opt, group, group.num_streams)

    # 1. allreduce bandwidth, settings interleaved
    for size_mb in [float(s) for s in args.sizes_mb.split(",")]:
        numel = int(size_mb * 1e6 / 4)
        x = torch.ones(numel)
        times: dict[int, list[float]] = {k: [] for k in streams}
        for rep in range(args.repeats + 1):
            for k in streams:
                msg.num_streams = k
                t = _timed(lambda: msg.allreduce_(x), dist.barrier)
                if rep > 0:  # the first round warms the allocator
                    times[k].append(t)
        result["allreduce"][str(size_mb)] = {
            str(k): {"median_s": statistics.median(v), "gbps": numel * 4 / statistics.median(v) / 1e9,
                     "times_s": v} for k, v in times.items()}

    # 2. end-to-end training step, settings interleaved round by round (2 steps each, the second timed)
    step_times: dict[str, list[float]] = {name: [] for name in systems}
    for rnd in range(args.rounds + 1):
        for name, (model, opt, group, k) in systems.items():
            if group is not None:
                group.num_streams = k
            for i in range(2):
                dist.barrier()
                t0 = time.perf_counter()
                step(model, opt)
                if rnd > 0 and i == 1:
                    step_times[name].append(time.perf_counter() - t0)
    result["e2e"] = {name: {"median_s": statistics.median(v), "times_s": v} for name, v in step_times.items()}
    result["split_calls"] = {name: s[2].split_calls for name, s in systems.items() if s[2] is not None}
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


# -- driver -------------------------------------------------------------------------------------------------


def _cap_flows(cluster, link: str, cap: str) -> int:
    """Give every TCP connection of every host its own htb class of rate ``cap`` under ``link``; return how
    many connections were capped. Deleting the namespaces removes it all."""
    from benchmarks.common import netns
    link_bits, cap_bits = netns.parse_rate(link), netns.parse_rate(cap)
    n = 0
    for host in cluster.hosts:
        ns = ["ip", "netns", "exec", host.namespace]
        out = subprocess.run(ns + ["ss", "-tnH", "state", "established"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
        ports = sorted({int(line.split()[2].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()})
        tc = ns + ["tc"]
        dev = ["dev", host.iface]
        subprocess.run(tc + ["qdisc", "replace"] + dev + ["root", "handle", "1:", "htb", "default", "1"],
                       check=True, timeout=20)
        burst = str(netns.tbf_burst_bytes(link_bits))
        subprocess.run(tc + ["class", "add"] + dev + ["parent", "1:", "classid", "1:1", "htb", "rate",
                       f"{link_bits}bit", "ceil", f"{link_bits}bit", "burst", burst, "quantum", "65536"],
                       check=True, timeout=20)
        for j, port in enumerate(ports):
            cid = f"1:{100 + j}"
            subprocess.run(tc + ["class", "add"] + dev + ["parent", "1:1", "classid", cid, "htb", "rate",
                           f"{cap_bits}bit", "ceil", f"{cap_bits}bit", "burst", str(netns.tbf_burst_bytes(cap_bits)),
                           "quantum", "65536"],
                           check=True, timeout=20)
            subprocess.run(tc + ["filter", "add"] + dev + ["parent", "1:", "protocol", "ip", "prio", "1", "u32",
                           "match", "ip", "sport", str(port), "0xffff", "flowid", cid], check=True, timeout=20)
            n += 1
    return n


def run_rate(cluster, rate: str, args, workdir: str, port: int) -> dict:
    link, _, cap = rate.partition("@")
    cluster.shape(link)
    out = os.path.join(workdir, f"{rate}.json")
    procs = []
    from benchmarks.common import netns
    from bagua.torch_api import env

    for host in cluster.hosts:
        child = env.environ_snapshot()
        child.update({"MASTER_ADDR": cluster.hosts[0].address, "MASTER_PORT": str(port), "RANK": str(host.index),
                      "WORLD_SIZE": str(len(cluster.hosts)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                      "GLOO_SOCKET_IFNAME": host.iface, "OMP_NUM_THREADS": "1",
                      "BAGUA_CACHE_DIR": os.path.join(workdir, f"cache-{rate}")})  # no saved choice across rates
        child.update(env.ALLOCATOR_ENV)
        argv = host.exec_prefix() + [sys.executable, os.path.abspath(__file__), "--worker", "--result", out,
                                     "--streams", args.streams, "--sizes-mb", args.sizes_mb,
                                     "--repeats", str(args.repeats), "--rounds", str(args.rounds),
                                     "--e2e-streams", str(args.e2e_streams)] + (["--bagua"] if args.bagua else [])
        log = open(os.path.join(workdir, f"{rate}.rank{host.index}.log"), "w")
        procs.append(netns.popen(argv, child, log, subprocess.STDOUT))
    deadline = time.monotonic() + args.timeout
    while not os.path.exists(out + ".ready"):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    capped = _cap_flows(cluster, link, cap) if cap else 0
    open(out + ".go", "w").close()
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            netns.kill_tracked_processes()
            raise RuntimeError(f"{rate}: the workers did not finish within {args.timeout:.0f} s")
    if any(p.returncode != 0 for p in procs):
        with open(os.path.join(workdir, f"{rate}.rank0.log")) as f:
            raise RuntimeError(f"{rate}: a worker failed:\n{f.read()[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    result["capped_connections"] = capped
    return result


def print_report(results: dict, args) -> None:
    streams = args.streams.split(",")
    print("\nallreduce, 2 hosts, gloo: median time (algbw GB/s)")
    print(f"{'rate':>13} {'size MB':>8} " + " ".join(f"{k + ' stream(s)':>22}" for k in streams) + "  best/1")
    for rate, res in results.items():
        for size, by_k in res["allreduce"].items():
            cells = [f"{by_k[k]['median_s'] * 1e3:9.1f} ms ({by_k[k]['gbps']:5.2f})" for k in streams]
            best = min(by_k[k]["median_s"] for k in streams)
            print(f"{rate:>13} {float(size):8.0f} " + " ".join(f"{c:>22}" for c in cells)
                  + f"  {by_k[streams[0]]['median_s'] / best:5.2f}x")
    print("\nend-to-end training step (MLP 25.2 M params), median")
    for rate, res in results.items():
        base = {"ddp": res["e2e"]["ddp"]["median_s"], "bagua": res["e2e"].get("bagua", {}).get("median_s")}
        for name, v in res["e2e"].items():
            ref = base["bagua" if name.startswith("bagua") else "ddp"]  # each against its own 1-stream system
            print(f"{rate:>13} {name:>22} {v['median_s'] * 1e3:8.1f} ms  speedup {ref / v['median_s']:5.2f}x")
        for name, cal in res["calibration"].items():
            print(f"{rate:>13} {name} chose {cal['chosen_streams']} stream(s) in {cal['iterations']} iterations "
                  f"({cal['seconds']:.1f} s)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from benchmarks.common import netns
    from bagua.torch_api import env

    ok, why = netns.netns_available()
    rates = [r.strip() for r in args.rates.split(",")]
    if not ok:
        print(f"no network emulation ({why}); running on loopback, unshaped only")
        rates = ["unshaped"]
    netns.install_signal_handlers()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bagua-tcp-") as workdir:
        cluster = netns.NetnsCluster(2) if ok else netns.LoopbackCluster(2)
        with cluster:
            for rate in rates:
                port = env.find_free_network_port()
                t0 = time.monotonic()
                results[rate] = run_rate(cluster, rate, args, workdir, port)
                print(f"{rate}: done in {time.monotonic() - t0:.0f} s", flush=True)
    print_report(results, args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "emulated": ok, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
