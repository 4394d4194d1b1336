"""The supervisor's runs of the GPT fault benchmarks (:mod:`benchmarks.fault.fault_gpt`, :mod:`.sync_gpt`).

Both benchmarks train the GPT at 4 emulated hosts (:class:`benchmarks.common.netns.NetnsCluster`) until rank 0's
validation loss reaches ``args.target``; their workers print :func:`benchmarks.fault.kills.say` lines (``joined``,
``step`` with ``loss``/``eval_s`` on an evaluation). What differs is the worker module (``module``), run as

- :func:`run_ft`: four fault-tolerant one-process jobs (``--worker ft --index I``) and a coordinator on a fifth host;
  with ``kill_every``, one worker (w1, w2, w3 in turn) is SIGKILLed every ``kill_every`` job steps
  (``args.kill_offset`` later) and restarted at once; it heals from a live peer;
- :func:`run_restart`: one 4-rank job (``--worker ckpt``) under ``python -m bagua.distributed.run --max-restarts``,
  each rank entering its host's namespace; with ``kill_every``, a rank is SIGKILLed on the same schedule and the
  agent restarts all ranks, which resume from their checkpoint.

:func:`run_campaign` runs a benchmark's matrix (seeds x runs) in one emulated cluster, a row a run, the JSON
rewritten after each; :func:`saved_rows` reads such files back for ``--report``.

Time to target (:func:`outcome`): from the launch to the evaluation that reached the target, less rank 0's
evaluation time; start-up is in it, once for a run without failures, again at every restart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from benchmarks.fault.kills import WORKERS, Life, RestartKills, fail, rejoin_times, supervise, supervise_agent

__all__ = ["evals", "outcome", "start_coordinator", "run_ft", "run_restart", "parse_runs", "worker_or_report",
           "saved_rows", "run_campaign"]


def evals(lines: list[dict[str, Any]], rank: int) -> list[dict[str, Any]]:
    """``rank``'s evaluation lines, in order (all attempts)."""
    return [x for x in lines if x["kind"] == "step" and int(x["rank"]) == rank and "loss" in x]


def outcome(evaluations: list[dict[str, Any]], start: float, target: float) -> dict[str, Any]:
    """Time and steps to the target from rank 0's evaluations (all attempts), its evaluation time taken out."""
    hit = next((e for e in evaluations if e["loss"] <= target), None)
    upto = [e for e in evaluations if hit is None or e["t"] <= hit["t"]]
    eval_s = sum(e["eval_s"] for e in upto)
    return {"reached": hit is not None, "steps_to_target": int(hit["step"]) if hit else None,
            "time_to_target_s": hit["t"] - start - eval_s if hit else None, "eval_s": eval_s,
            "final_loss": evaluations[-1]["loss"] if evaluations else None,
            "curve": [[int(e["step"]), e["loss"]] for e in evaluations]}


def start_coordinator(host: Any, port: int, log: Path) -> subprocess.Popen:
    """The coordinator on its own emulated host, bound to that host's address."""
    proc = subprocess.Popen(host.exec_prefix() + [sys.executable, "-m", "bagua.torch_api.fault.coordinator",
                                                  "--host", host.address, "--port", str(port)],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 60
    while "listening" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"the coordinator did not start: {log.read_text(errors='replace')[-500:]}")
        time.sleep(0.1)
    return proc


def _plan(args: argparse.Namespace, kill_every: int) -> list[int]:
    return list(range(kill_every + args.kill_offset, args.max_steps, kill_every)) if kill_every else []


def run_ft(args: argparse.Namespace, cluster: Any, seed: int, kill_every: int, workdir: Path, module: str,
           extra: Sequence[str] = (), mode: str = "ft") -> dict[str, Any]:
    """Four fault-tolerant workers of ``module`` (each given ``extra``) to the target; with ``kill_every``, SIGKILL
    and restart one on the schedule. ``args`` needs ``shared`` (the workers' common flags), ``kill_offset``,
    ``max_steps``, ``target`` and ``timeout``."""
    port = 29600 + seed
    coordinator = start_coordinator(cluster.hosts[WORKERS], port, workdir / f"coord-{mode}-{kill_every}-{seed}.log")
    lives: list[Life] = []

    def spawn(i: int) -> Life:
        host = cluster.hosts[i]
        cmd = host.exec_prefix() + [sys.executable, "-m", module, "--worker", "ft", "--index", str(i), "--seed",
                                    str(seed), "--coordinator", f"{cluster.hosts[WORKERS].address}:{port}",
                                    *args.shared, *extra]
        lives.append(Life(cmd, workdir / f"{mode}{kill_every}-s{seed}-w{i}-{len(lives)}.log",
                          {"GLOO_SOCKET_IFNAME": host.iface}))
        return lives[-1]

    def done() -> bool:  # rank 0 reached the target, or ran out of steps
        return outcome(evals(current[0].lines, 0), start, args.target)["reached"] or current[0].poll() == 0

    start = time.time()
    current = {i: spawn(i) for i in range(WORKERS)}
    kills: list[dict[str, Any]] = []
    supervise(current, lives, spawn, _plan(args, kill_every), kills, done, mode, start + args.timeout, coordinator)
    rejoin_times(kills)
    useful = sum(life.last_sync - int(life.joined["step"]) for life in lives if life.joined)
    evaluations = evals(current[0].lines, 0)
    out = outcome(evaluations, start, args.target)
    return {"mode": mode, "kill_every": kill_every, "seed": seed, "kills": kills,
            "goodput": useful / (WORKERS * max(int(out["steps_to_target"] or 0), 1)),
            "last_eval": {k: v for k, v in evaluations[-1].items() if k != "kind"} if evaluations else None, **out}


def run_restart(args: argparse.Namespace, cluster: Any, seed: int, kill_every: int, workdir: Path, module: str,
                extra: Sequence[str] = (), mode: str = "restart") -> dict[str, Any]:
    """One 4-rank job of ``module`` under the elastic agent, its ranks checkpointing (``--ckpt-dir``); SIGKILL a rank
    on the schedule, the agent restarts all."""
    from bagua.torch_api import env

    ckpt = workdir / f"ckpt-{mode}-{kill_every}-{seed}"
    schedule = RestartKills(_plan(args, kill_every))
    prefix, master = cluster.hosts[0].namespace[:-1], cluster.hosts[0].address  # "<prefix>h0" -> "<prefix>h"
    # each rank enters the namespace of its host; the ranks' own store (not the agent's) is on host 0
    script = workdir / "enter_host.sh"
    script.write_text(f'exec ip netns exec {prefix}"$LOCAL_RANK" env MASTER_ADDR={master} LOCAL_RANK=0 '
                      f'LOCAL_WORLD_SIZE=1 GLOO_SOCKET_IFNAME={cluster.hosts[0].iface} "$@"\n')
    agent = Life([sys.executable, "-m", "bagua.distributed.run", "--nproc-per-node", str(WORKERS),
                  "--max-restarts", str(len(schedule.plan) + 1), "--monitor-interval", "0.1", "--rdzv-backend",
                  "c10d", "--rdzv-endpoint", f"127.0.0.1:{env.find_free_network_port()}", "--no-python", "sh",
                  str(script), sys.executable, "-m", module, "--worker", "ckpt", "--seed", str(seed), "--ckpt-dir",
                  str(ckpt), *args.shared, *extra],
                 workdir / f"{mode}{kill_every}-s{seed}.log", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    start = time.time()
    supervise_agent(agent, schedule, lambda: outcome(evals(agent.lines, 0), start, args.target)["reached"], mode,
                    start + args.timeout, str(ckpt))
    agent.read()
    out = outcome(evals(agent.lines, 0), start, args.target)
    if not out["curve"]:
        raise fail(f"{mode}: rank 0 never evaluated (agent exit {agent.proc.returncode})", [agent])
    return {"mode": mode, "kill_every": kill_every, "seed": seed, "kills": schedule.kills, **out}


def parse_runs(runs: str) -> list[tuple[str, int]]:
    """``"ft,ft:100"`` -> ``[("ft", 0), ("ft", 100)]``: each run's mode and its kill interval (0: no kill)."""
    return [(mode, int(n or 0)) for mode, _, n in (r.partition(":") for r in runs.split(","))]


def worker_or_report(args: argparse.Namespace, worker: Callable[[argparse.Namespace], None],
                     print_table: Callable[[list[dict[str, Any]]], None]) -> bool:
    """Do what a benchmark's command line asks that is not a campaign: run ``worker(args)`` (``--worker``, how the
    supervisor starts each worker) or print the table of ``--report``'s saved rows; False if neither was asked."""
    if args.worker:
        worker(args)
    elif args.report:
        print_table(saved_rows(args.report))
    return bool(args.worker or args.report)


def saved_rows(report: str) -> list[dict[str, Any]]:
    """The rows of the comma-separated JSON files ``report`` that :func:`run_campaign` wrote, in order."""
    return [r for f in report.split(",") for r in json.loads(Path(f).read_text())["rows"]]


def run_campaign(args: argparse.Namespace, runs: Sequence[Any], run_one: Callable[..., dict[str, Any]],
                 describe: Callable[[Any, dict[str, Any]], str], tmp_prefix: str, cluster_prefix: Optional[str] = None,
                 load: str = "end") -> list[dict[str, Any]]:
    """Run every seed of ``args.seeds`` (comma-separated) x every one of ``runs`` at ``WORKERS + 1`` emulated hosts,
    each link shaped to ``args.rate``; return the rows.

    ``run_one(cluster, seed, run, workdir)`` runs one and returns its row, to which ``started`` (the wall clock) and
    ``load`` (the 1-minute load average at its end, or with ``load="mean"`` the mean of its start's and its end's)
    are added; a line ``[started] describe(run, row)`` is printed after each, and ``args.json`` (if set) rewritten with
    ``{"settings": vars(args), "rows": [...]}``. ``cluster_prefix``: the namespaces' (default the cluster's own).

    Example::

        rows = run_campaign(args, [("ft", 0), ("ft", 100)], lambda c, s, r, w: run_ft(args, c, s, r[1], w, MODULE),
                            lambda run, row: f"{run} seed {row['seed']}: {row['time_to_target_s']}", "bagua-x-")
    """
    from benchmarks.common import netns

    if load not in ("end", "mean"):
        raise ValueError(f"load={load!r}: use 'end' or 'mean'")
    netns.install_signal_handlers()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp, \
            netns.NetnsCluster(WORKERS + 1, prefix=cluster_prefix) as cluster:
        cluster.shape(args.rate)
        for seed in (int(s) for s in args.seeds.split(",")):
            for run in runs:
                started, before = time.strftime("%H:%M:%S"), os.getloadavg()[0]
                row = run_one(cluster, seed, run, Path(tmp))
                after = os.getloadavg()[0]
                rows.append(row | {"started": started, "load": (before + after) / 2 if load == "mean" else after})
                print(f"[{started}] {describe(run, rows[-1])}", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1))
    return rows
