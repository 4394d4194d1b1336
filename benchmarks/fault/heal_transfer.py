"""Healing from a peer: how fast a state travels, and whether the inner optimizer's state is worth sending.

Part 1, ``transfer``: two processes, one rank each, gloo. Rank 0 sends a ``--mb`` MB state with
``bagua.torch_api.fault.send_state`` (manifest, buckets, SHA-256, two acknowledgements), rank 1 receives it; as the
floor, the same bytes as one plain ``dist.send``. Over loopback (unshaped), then, with root and iproute2, between
two emulated hosts (benchmarks/common/netns.py) whose links are shaped to each ``--rates`` value. It prints the median of
``--repeats`` transfers and, on a shaped link, the ratio ``time / (bytes / rate)`` (the goal: at most 1.2).

Part 2, ``inner``: two ranks train Streaming-free DiLoCo (AdamW inner steps) on a small teacher-student regression;
at a synchronization rank 1 loses everything and heals from rank 0, taking the peer's AdamW moments or starting
them fresh; the evaluation loss of the global weights then follows at every synchronization, for each choice, a
run without any failure as the reference, and ``--seeds`` seeds.

Run as root (for the shaped link):

    .venv/bin/python benchmarks/fault/heal_transfer.py --mb 100 --rates 100mbit --repeats 3

Without root, part 1 runs on loopback only (and says so).
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
    p.add_argument("--part", choices=["all", "transfer", "inner"], default="all")
    p.add_argument("--mb", type=float, default=100.0, help="state size in MB (10^6 bytes), float32")
    p.add_argument("--rates", default="100mbit", help="shaped link rates between two emulated hosts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per setting")
    # worker mode (started by the driver, on a host)
    p.add_argument("--worker", choices=["transfer", "inner"], help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- part 1: a state streamed from one rank to the other ------------------------------------------------------


def transfer_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from bagua.torch_api.fault import heal_group, receive_state, send_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), heal_group()
    state = {"0.global": torch.randn(int(args.mb * 1e6) // 4), "steps": torch.tensor(100)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    plain = torch.empty(nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {"send_state": [], "plain send": []}
    send_state(state, 1, group) if rank == 0 else receive_state(0, group)  # warm: connections open
    for _ in range(args.repeats):
        for name in times:  # interleaved, so drift on the shared machine hits both alike
            dist.barrier(group.group)
            t0 = time.perf_counter()
            if name == "send_state":
                send_state(state, 1, group) if rank == 0 else receive_state(0, group)
            else:
                dist.send(plain, 1, group.group) if rank == 0 else dist.recv(plain, 0, group.group)
            dist.barrier(group.group)  # the receiver's end is the end of the transfer
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"bytes": nbytes, "times": times}, f)
    dist.destroy_process_group()


def _launch(cluster, argv_tail: list[str], workdir: str, name: str, timeout: float) -> None:
    from bagua.torch_api import env
    from benchmarks.common import netns

    port, procs = env.find_free_network_port(), []
    for host in cluster.hosts:
        child = env.environ_snapshot()
        child.update({"MASTER_ADDR": cluster.hosts[0].address, "MASTER_PORT": str(port), "RANK": str(host.index),
                      "WORLD_SIZE": str(len(cluster.hosts)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                      "GLOO_SOCKET_IFNAME": host.iface, "OMP_NUM_THREADS": "1"})
        child.update(env.ALLOCATOR_ENV)
        log = open(os.path.join(workdir, f"{name}.rank{host.index}.log"), "w")
        argv = host.exec_prefix() + [sys.executable, os.path.abspath(__file__)] + argv_tail
        procs.append(netns.popen(argv, child, log, subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            netns.kill_tracked_processes()
            raise RuntimeError(f"{name}: the workers did not finish within {timeout:.0f} s") from None
    if any(p.returncode != 0 for p in procs):
        with open(os.path.join(workdir, f"{name}.rank{procs.index(next(p for p in procs if p.returncode))}.log")) as f:
            raise RuntimeError(f"{name}: a worker failed:\n{f.read()[-3000:]}")


def run_transfer(args, workdir: str) -> dict:
    from benchmarks.common import netns

    ok, why = netns.netns_available()
    settings = [("loopback", None)] + ([(r, r) for r in args.rates.split(",")] if ok else [])
    if not ok:
        print(f"no network emulation ({why}): loopback only")
    results = {}
    for name, rate in settings:
        cluster = netns.LoopbackCluster(2) if rate is None else netns.NetnsCluster(2)
        with cluster:
            cluster.shape(rate or "unshaped")
            out = os.path.join(workdir, f"transfer-{name}.json")
            _launch(cluster, ["--worker", "transfer", "--result", out, "--mb", str(args.mb), "--repeats",
                              str(args.repeats)], workdir, f"transfer-{name}", args.timeout)
            with open(out) as f:
                results[name] = json.load(f) | {"rate_bits": netns.parse_rate(rate) if rate else None}
    return results


def print_transfer(results: dict) -> None:
    print("\npart 1: one state from rank 0 to rank 1, gloo, median of the repeats")
    print(f"{'link':>10} {'MB':>7} {'send_state':>11} {'MB/s':>8} {'plain send':>11} {'vs plain':>9} "
          f"{'bytes/rate':>11} {'ratio':>6}")
    for name, r in results.items():
        t, t_plain = (statistics.median(r["times"][k]) for k in ("send_state", "plain send"))
        ideal = r["bytes"] * 8 / r["rate_bits"] if r["rate_bits"] else None
        print(f"{name:>10} {r['bytes'] / 1e6:7.1f} {t:10.3f}s {r['bytes'] / t / 1e6:8.1f} {t_plain:10.3f}s "
              f"{t / t_plain:8.2f}x " + (f"{ideal:10.3f}s {t / ideal:6.2f}" if ideal else f"{'-':>11} {'-':>6}"))


# -- part 2: the inner optimizer's state, taken or fresh ----------------------------------------------------

_DIM, _HIDDEN, _H, _ROUNDS_BEFORE, _ROUNDS_AFTER = 32, 256, 10, 5, 8


def _task(seed: int):
    import torch

    g = torch.Generator().manual_seed(1000 + seed)
    teacher = [torch.randn(_DIM, 64, generator=g) / _DIM**0.5, torch.randn(64, 1, generator=g) / 8]
    x_eval = torch.randn(2048, _DIM, generator=g)

    def target(x):
        return torch.tanh(x @ teacher[0]) @ teacher[1]

    def batch(rank: int, step: int):
        gb = torch.Generator().manual_seed(seed * 100_003 + rank * 7919 + step)
        x = torch.randn(64, _DIM, generator=gb)
        return x, target(x) + 0.01 * torch.randn(64, 1, generator=gb)

    return batch, (x_eval, target(x_eval))


def inner_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from bagua.torch_api.contrib.diloco_optimizer import DiLoCoOptimizer
    from bagua.torch_api.fault import heal_driver, heal_group, serve_driver

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), heal_group()
    batch, (x_eval, y_eval) = _task(args.seed)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(_DIM, _HIDDEN), torch.nn.ReLU(), torch.nn.Linear(_HIDDEN, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = DiLoCoOptimizer(inner, sync_every=_H)
    losses = []
    for step in range(1, (_ROUNDS_BEFORE + _ROUNDS_AFTER) * _H + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step % _H:
            continue
        with torch.no_grad():  # after an outer step the weights are the global weights
            losses.append(float(torch.nn.functional.mse_loss(model(x_eval), y_eval)))
        if step == _ROUNDS_BEFORE * _H and args.mode != "no-failure":
            if rank == 0:
                serve_driver(opt, 1, group, optimizer=inner, inner_state=args.mode == "peer")
            else:  # a restart: new weights and a new AdamW (its moments empty), then the heal
                with torch.no_grad():
                    for p in model.parameters():
                        p.normal_()
                inner.load_state_dict({"state": {}, "param_groups": inner.state_dict()["param_groups"]})
                heal_driver(opt, 0, group, optimizer=inner)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


def run_inner(args, workdir: str) -> dict:
    from benchmarks.common import netns

    results: dict = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for mode in ("no-failure", "peer", "fresh"):
            out = os.path.join(workdir, f"inner-{mode}-{seed}.json")
            with netns.LoopbackCluster(2) as cluster:
                _launch(cluster, ["--worker", "inner", "--result", out, "--mode", mode, "--seed", str(seed)],
                        workdir, f"inner-{mode}-{seed}", args.timeout)
            with open(out) as f:
                results.setdefault(mode, {})[seed] = json.load(f)
    return results


def print_inner(results: dict) -> None:
    print(f"\npart 2: evaluation loss of the global weights at each synchronization after the heal (rank 1 healed "
          f"after round {_ROUNDS_BEFORE}; H={_H}, AdamW lr 3e-3, 2 ranks)")
    for mode, by_seed in results.items():
        for seed, losses in by_seed.items():
            after = losses[_ROUNDS_BEFORE:]
            print(f"{mode:>11} seed {seed}: " + " ".join(f"{v:.5f}" for v in after))
    for mode in ("peer", "fresh"):  # the last 3 synchronizations: one alone is noisy
        ratios = [statistics.mean(results[mode][s][-3:]) / statistics.mean(results["no-failure"][s][-3:])
                  for s in results[mode]]
        print(f"{mode:>11}: loss / no-failure loss (mean of the last 3 synchronizations), by seed: "
              + ", ".join(f"{r:.3f}" for r in ratios))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "transfer":
        transfer_worker(args)
        return 0
    if args.worker == "inner":
        inner_worker(args)
        return 0
    from benchmarks.common import netns

    netns.install_signal_handlers()
    with tempfile.TemporaryDirectory(prefix="bagua-heal-") as workdir:
        if args.part in ("all", "transfer"):
            print_transfer(run_transfer(args, workdir))
        if args.part in ("all", "inner"):
            print_inner(run_inner(args, workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
