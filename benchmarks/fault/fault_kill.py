"""Workers that fail alone against restarting the job: fault-tolerant DiLoCo under SIGKILL, on this machine.

Four workers, each a process, over loopback (gloo), train a teacher-student MLP regression (AdamW inner steps,
DiLoCo's outer SGD, H = ``--sync-every``), each on its own batches, deterministic per (worker, step). The real compute
is tiny, so each step also sleeps ``--step-s`` s (default 0.1): the step time is EMULATED; all times are relative.

1. ``overhead``, no failures: ``DiLoCoOptimizer(fault_tolerance=FaultTolerance(...))`` (4 one-process jobs, a
   coordinator) against plain ``DiLoCoOptimizer`` in a 4-rank gloo world. Step time = median over the rounds after
   the first of (round wall time / H), so a step carries its share of the synchronization; FT / plain is the
   quorum's cost (goal: <= 1.02). ``--repeats`` pairs, the order alternating.
2. ``kill``: FT; every ``--kill-every`` job steps one worker (w1, w2, w3, w1, ...) is SIGKILLed and restarted at once;
   it heals from a live peer. Against a failure-free FT run: wall time, final evaluation loss of the global weights,
   goodput (worker-steps that reached a synchronization / (workers x wall time)); per kill the seconds until the
   restarted worker healed and until its first own synchronization, the heal's seconds and bytes.
3. ``restart``, the baseline: plain DiLoCo under ``python -m bagua.distributed.run --max-restarts``, every rank
   checkpointing every ``--checkpoint-every`` steps; at each kill the agent restarts all ranks, which resume from the
   last checkpoint all ranks completed. Wall time against the failure-free FT run.

    .venv/bin/python -m benchmarks.fault.fault_kill --part all --json /tmp/fault_kill.json
    .venv/bin/python -m benchmarks.fault.fault_kill --part kill --steps 60 --sync-every 10 --kill-every 25 --step-s 0.05
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.fault.kills import WORKERS, Life, RestartKills, fail, rejoin_times, say, supervise, supervise_agent

_DIM, _HIDDEN = 32, 256

__all__ = ["parse_args", "worker", "run_job", "run_restart", "main"]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["all", "overhead", "kill", "restart"], default="all")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--sync-every", type=int, default=20, help="H, inner steps between synchronizations")
    p.add_argument("--kill-every", type=int, default=100, help="job steps between two SIGKILLs")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (part restart)")
    p.add_argument("--step-s", type=float, default=0.1, help="emulated compute per step: a sleep")
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs (part overhead)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default: from the settings)")
    p.add_argument("--json", default=None, help="also write the results here")
    for hidden in ("--worker", "--index", "--coordinator", "--ckpt-dir"):  # worker mode, set by the supervisor
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps % args.sync_every:
        p.error(f"--steps {args.steps} must be a multiple of --sync-every {args.sync_every}: the loss reported is "
                "the global weights', which the model holds right after a synchronization")
    args.kills = list(range(args.kill_every, args.steps, args.kill_every))  # the job steps at which to kill
    args.timeout = args.timeout or 180.0 + 8 * args.steps * args.step_s + 90.0 * len(args.kills)
    names = ("steps", "sync_every", "step_s", "seed", "timeout", "checkpoint_every")  # what workers take
    args.shared = [x for n in names for x in ("--" + n.replace("_", "-"), str(getattr(args, n)))]
    return args


# -- a worker -------------------------------------------------------------------------------------------------------


def _task(seed: int) -> tuple[Callable, Any]:
    """``batch(worker, step)`` of a teacher-student regression (teacher: tanh MLP 32-64-1), and a held-out set."""
    import torch

    g = torch.Generator().manual_seed(1000 + seed)
    w1, w2 = torch.randn(_DIM, 64, generator=g) / _DIM**0.5, torch.randn(64, 1, generator=g) / 8
    x_eval = torch.randn(2048, _DIM, generator=g)

    def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gb = torch.Generator().manual_seed(seed * 100_003 + worker * 7919 + step)
        x = torch.randn(64, _DIM, generator=gb)
        return x, torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(64, 1, generator=gb)

    return batch, (x_eval, torch.tanh(x_eval @ w1) @ w2)


def _resume(ckpt_dir: Path, rank: int, model: Any, opt: Any) -> None:
    """Load the last step that every rank saved (no rank can save a newer one before all have looked here)."""
    import torch

    done = [d for d in sorted(ckpt_dir.glob("step*")) if all((d / f"rank{r}.pt").exists() for r in range(WORKERS))]
    if done:
        state = torch.load(done[-1] / f"rank{rank}.pt", weights_only=True)  # tensors, numbers, strings: never unpickled
        model.load_state_dict(state["model"])  # after DiLoCoOptimizer broadcast rank 0's weights
        opt.load_state_dict(state["optimizer"])  # the inner optimizer's state and DiLoCo's (steps, global, momentum)


def worker(args: argparse.Namespace) -> None:
    """One worker: ``ft`` a job of its own; ``plain`` and ``ckpt`` a rank of a 4-rank gloo world."""
    import torch
    import torch.distributed as dist

    from bagua.torch_api import env
    from bagua.torch_api.contrib.diloco_optimizer import DiLoCoOptimizer
    from bagua.torch_api.fault import FaultTolerance, driver_heal_state

    torch.set_num_threads(1)
    batch, (x_eval, y_eval) = _task(args.seed)
    ft, attempt, ckpt = None, env.get_int("TORCHELASTIC_RESTART_COUNT", 0), Path(args.ckpt_dir or ".")
    if args.worker == "ft":  # library defaults: heartbeat 0.5 s, stale after 3 s, adaptive deadline, min_quorum 1
        rank = int(args.index)
        ft = FaultTolerance(args.coordinator, worker=f"w{rank}", workers=WORKERS, timeout_s=args.timeout)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=min(60.0, args.timeout)))
        rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(_DIM, _HIDDEN), torch.nn.ReLU(), torch.nn.Linear(_HIDDEN, 1))
    opt = DiLoCoOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), sync_every=args.sync_every,
                          fault_tolerance=ft)  # FT: joins the job; a restarted worker heals from a peer here
    if args.worker == "ckpt":
        _resume(ckpt, rank, model, opt)
    heal = ft is not None and ft.heals > 0  # a restarted worker healed from a live peer (the start is no heal)
    heal_bytes = sum(t.numel() * t.element_size() for t in driver_heal_state(opt.driver).values()) if heal else 0
    say("joined", rank=rank, pid=os.getpid(), attempt=attempt, step=opt.steps,
         heal_s=f"{ft.heal_seconds[-1]:.4f}" if heal else 0, heal_bytes=heal_bytes)
    done, sync_t = (ft.rounds if ft else opt.syncs), []
    while opt.steps < args.steps:
        x, y = batch(rank, opt.steps + 1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        time.sleep(args.step_s)  # the emulated rest of a step's compute
        opt.step()
        if args.worker == "ckpt" and opt.steps % args.checkpoint_every == 0:
            d = ckpt / f"step{opt.steps:08d}"
            d.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, d / f"rank{rank}.tmp")
            os.replace(d / f"rank{rank}.tmp", d / f"rank{rank}.pt")  # a file present is a file complete
        now = ft.rounds if ft else opt.syncs
        sync_t += [time.perf_counter()] if now != done else []
        say("step", rank=rank, step=opt.steps, sync=int(now != done), attempt=attempt)
        done = now
    with torch.no_grad():  # right after the last synchronization the weights are the global weights
        loss = float(torch.nn.functional.mse_loss(model(x_eval), y_eval))
    result = {"rank": rank, "loss": loss, "round_s": [b - a for a, b in zip(sync_t, sync_t[1:])]}
    if ft is not None:
        result |= {"retries": ft.retries, "left_out": ft.left_out, "exchange_s": ft.median_exchange_s()}
    sys.stdout.write("result " + json.dumps(result) + "\n")
    sys.stdout.flush()
    ft.close() if ft is not None else dist.destroy_process_group()


# -- the supervisor -------------------------------------------------------------------------------------------------


def run_job(args: argparse.Namespace, mode: str, workdir: Path, kill: bool = False) -> dict[str, Any]:
    """Run 4 workers to ``--steps`` (``ft``: 4 jobs and a coordinator; ``plain``: a 4-rank gloo world); with
    ``kill``, SIGKILL one on the schedule and restart it at once. Return wall time, loss, goodput and the kills."""
    from bagua.torch_api import env
    from bagua.torch_api.fault.coordinator import start_coordinator

    port = env.find_free_network_port()
    coordinator = start_coordinator("127.0.0.1", port) if mode == "ft" else None
    world = {"WORLD_SIZE": str(WORKERS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # torch's env://
    lives: list[Life] = []

    def spawn(i: int) -> Life:
        lives.append(Life([sys.executable, "-m", "benchmarks.fault.fault_kill", "--worker", mode, "--index", str(i),
                            "--coordinator", f"127.0.0.1:{port}", *args.shared],
                           workdir / f"{mode}{'-kill' if kill else ''}-w{i}-{len(lives)}.log",
                           world | {"RANK": str(i)} if mode == "plain" else None))
        return lives[-1]

    def done() -> bool:
        """Every worker exited; or the ones left are restarted workers that never joined, 5 s after the others
        ended: they never will, no round is left."""
        running = [life for life in current.values() if life.end_t is None]
        ended = [life.end_t for life in current.values() if life.end_t is not None]
        return not running or bool(ended) and all(not life.joined for life in running) and time.time() > max(ended) + 5

    start = time.time()
    current = {i: spawn(i) for i in range(WORKERS)}
    kills: list[dict[str, Any]] = []
    supervise(current, lives, spawn, args.kills if kill else [], kills, done, mode, start + args.timeout, coordinator)
    for life in lives:
        life.read()
    wall = max(life.end_t for life in current.values() if life.proc.returncode == 0) - start
    rejoin_times(kills)
    results = [line for life in lives for line in life.lines if line["kind"] == "result"]
    useful = sum(life.last_sync - int(life.joined["step"]) for life in lives if life.joined)
    rounds = [s for r in results for s in r["round_s"]]
    return {"mode": mode, "kills": kills, "wall_s": wall, "loss": results[0]["loss"],
            "losses_agree": len({r["loss"] for r in results}) == 1, "goodput": useful / (WORKERS * wall),
            "step_s": statistics.median(rounds) / args.sync_every if rounds else None,
            "exchange_s": statistics.median([r.get("exchange_s", 0.0) for r in results]),
            "retries": sum(r.get("retries", 0) for r in results)}


def run_restart(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Plain DiLoCo under the elastic agent, checkpointing; SIGKILL a rank on the schedule, the agent restarts all."""
    from bagua.torch_api import env

    schedule = RestartKills(args.kills)
    # a store of each attempt's own (c10d, not shared): on the static rendezvous's one store the restarted ranks read
    # the killed attempt's gloo addresses and fail, "Connection refused" (torch 2.13; cf. pytorch/pytorch#167288)
    agent = Life([sys.executable, "-m", "bagua.distributed.run", "--nproc-per-node", str(WORKERS),
                   "--max-restarts", str(len(args.kills) + 1), "--monitor-interval", "0.1", "--rdzv-backend",
                   "c10d", "--rdzv-endpoint", f"127.0.0.1:{env.find_free_network_port()}",
                   "-m", "benchmarks.fault.fault_kill", "--worker", "ckpt", "--ckpt-dir", str(workdir / "ckpt"),
                   *args.shared],
                  workdir / "restart.log", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    start = time.time()
    supervise_agent(agent, schedule, lambda: False, "restart", start + args.timeout, str(workdir / "ckpt"))
    agent.read()
    if agent.proc.returncode != 0:
        raise fail(f"restart: the agent exited with {agent.proc.returncode}", [agent])
    wall, result = agent.end_t - start, [x for x in agent.lines if x["kind"] == "result" and x["rank"] == 0][-1]
    return {"mode": "restart", "kills": schedule.kills, "wall_s": wall, "goodput": args.steps / wall, "loss": result["loss"]}


def print_overhead(pairs: list[dict[str, Any]]) -> None:
    print("\noverhead, no failures: step time = median over rounds (after the first) of round wall time / H; goal: "
          "FT/plain <= 1.02")
    print(f"{'repeat':>6} {'order':>11} {'FT step s':>10} {'plain step s':>13} {'FT/plain':>9} {'FT exchange s':>14}")
    rows = [(str(i), p["order"], p["ft"]["step_s"], p["plain"]["step_s"], p["ratio"], p["ft"]["exchange_s"])
            for i, p in enumerate(pairs)]
    rows.append(("median", "", *(statistics.median(r[k] for r in rows) for k in (2, 3, 4, 5))))
    for r in rows:
        print(f"{r[0]:>6} {r[1]:>11} {r[2]:10.4f} {r[3]:13.4f} {r[4]:9.3f} {r[5]:14.4f}")


def print_runs(base: dict[str, Any], runs: list[tuple[str, dict[str, Any]]]) -> None:
    print(f"\n{'run':<28} {'wall s':>7} {'/ FT ok':>8} {'eval loss':>10} {'goodput':>8} {'/ FT ok':>8}")
    for name, r in [("FT, no failure", base)] + runs:
        print(f"{name:<28} {r['wall_s']:7.1f} {r['wall_s'] / base['wall_s']:8.3f} {r['loss']:10.5f} "
              f"{r['goodput']:8.3f} {r['goodput'] / base['goodput']:8.3f}")
    print("goodput: worker-steps that reached a synchronization / (workers x wall s); restart: steps / wall s")
    for name, r in runs:
        for k in r["kills"]:
            head = f"  {name}: {k['victim']} killed at step {k['step']}:"
            if r["mode"] == "restart":
                print(f"{head} all ranks stepping again after {k.get('back_after_s', float('nan')):.2f} s, from "
                      f"step {k.get('resumed_step', '-')}")
            elif k["healed_after_s"] is None:
                print(f"{head} never healed (the job ended first)")
            else:
                sync = k["first_sync_after_s"]
                print(f"{head} healed after {k['healed_after_s']:.2f} s (at step {k['joined_step']:.0f}; heal "
                      f"{k['heal_s']:.3f} s, {k['heal_bytes'] / 1e6:.3f} MB); first own synchronization "
                      + ("none (its heal was the last round)" if sync is None else f"after {sync:.2f} s"))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the cleanups in the finally blocks
    print(f"{WORKERS} workers as processes on this machine (loopback, gloo); H={args.sync_every}, {args.steps} steps; "
          f"EMULATED step: a {args.step_s} s sleep per step plus the MLP's real compute (tiny)")
    out: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if v is not None}}
    with tempfile.TemporaryDirectory(prefix="bagua-fault-kill-") as tmp:
        workdir = Path(tmp)
        if args.part in ("all", "overhead"):
            out["overhead"] = []
            for r in range(args.repeats):
                order = ("ft", "plain") if r % 2 == 0 else ("plain", "ft")
                pair: dict[str, Any] = {m: run_job(args, m, workdir) for m in order}
                pair |= {"order": ",".join(order), "ratio": pair["ft"]["step_s"] / pair["plain"]["step_s"]}
                out["overhead"].append(pair)
            print_overhead(out["overhead"])
        if args.part in ("all", "kill", "restart"):
            out["no_failure"], runs = run_job(args, "ft", workdir), []
            if args.part in ("all", "kill"):
                runs.append((f"FT, kill every {args.kill_every}", run_job(args, "ft", workdir, kill=True)))
            if args.part in ("all", "restart"):
                runs.append((f"restart, ckpt every {args.checkpoint_every}", run_restart(args, workdir)))
            print_runs(out["no_failure"], runs)
            out["runs"] = dict(runs)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
