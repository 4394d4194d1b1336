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

Time to target (:func:`outcome`): from the launch to the evaluation that reached the target, less rank 0's
evaluation time; start-up is in it, once for a run without failures, again at every restart.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks.fault.kills import WORKERS, Life, RestartKills, fail, kill_by_cmdline, kill_due, rejoin_times

__all__ = ["evals", "outcome", "start_coordinator", "run_ft", "run_restart"]


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

    start = time.time()
    current = {i: spawn(i) for i in range(WORKERS)}
    plan, kills = _plan(args, kill_every), []  # type: list[int], list[dict[str, Any]]
    try:
        while True:
            for life in current.values():
                life.read()
            if outcome(evals(current[0].lines, 0), start, args.target)["reached"] or current[0].poll() == 0:
                break
            plan = kill_due(current, kills, plan, spawn)
            codes = {i: life.poll() for i, life in current.items()}
            if any(c not in (None, 0) for c in codes.values()):
                raise fail(f"{mode}: a worker failed, exit codes {codes}", current.values())
            if time.time() - start > args.timeout:
                raise fail(f"{mode}: no result within {args.timeout:.0f} s (--timeout)", current.values())
            time.sleep(0.05)
    finally:
        for life in lives:
            life.kill()
        coordinator.kill()
        coordinator.wait()
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
    try:
        while agent.poll() is None:
            schedule.see(agent.read())
            if outcome(evals(agent.lines, 0), start, args.target)["reached"]:
                break
            schedule.kill_due()
            if time.time() - start > args.timeout:
                raise fail(f"{mode}: no result within {args.timeout:.0f} s (--timeout)", [agent])
            time.sleep(0.05)
    finally:
        agent.kill()
        kill_by_cmdline(str(ckpt))
    agent.read()
    out = outcome(evals(agent.lines, 0), start, args.target)
    if not out["curve"]:
        raise fail(f"{mode}: rank 0 never evaluated (agent exit {agent.proc.returncode})", [agent])
    return {"mode": mode, "kill_every": kill_every, "seed": seed, "kills": schedule.kills, **out}
