"""Time to target with workers killed: fault-tolerant DiLoCo on the GPT at 4 emulated hosts, against restarting.

The real model and link of the time-to-accuracy benchmark: the GPT (:mod:`benchmarks.common.gpt`, Adam lr 1e-3, batch 8 x
128 bytes per worker) trained until the global weights' validation loss reaches ``--target`` (2.40, 64 windows,
evaluated every ``--eval-every`` steps right after a synchronization), each worker in a network namespace of its
own, every link shaped to ``--rate`` (:class:`benchmarks.common.netns.NetnsCluster`). Every run trains DiLoCo through
``with_bagua`` with the 4-host pick of the advisor: H = 10, uint4 pseudo-gradients with error feedback, outer lr 1.0,
Nesterov 0.5, the lr warmed up over 10 rounds.

- ``ft``: ``DiLoCoAlgorithm(fault_tolerance=FaultTolerance(...))``, each worker a one-process job, the coordinator
  on a fifth host. ``ft:N``: one worker (w1, w2, w3 in turn) is SIGKILLed every N job steps (``--kill-offset``
  later) and restarted at once (what a launcher with ``--max-restarts`` does); it heals from a live peer.
  ``ft+inner:N`` / ``ft+fresh:N``: the same, the healed worker taking the peer's inner optimizer state or not.
- ``restart:N``, the baseline: the same DiLoCo in one 4-rank job under ``python -m bagua.distributed.run
  --max-restarts`` (one agent; each rank enters its host's namespace), every rank checkpointing every
  ``--checkpoint-every`` steps (``bagua.torch_api.checkpoint``); at each kill the agent restarts all ranks, which
  load the last checkpoint.

Time to target: from the launch to the evaluation that reached the target, less w0's (rank 0's) evaluation time;
start-up is in it, once for a run without failures, again at every restart. Needs root (namespaces).

    .venv/bin/python -m benchmarks.fault.fault_gpt --seeds 0,1,2 --runs ft,ft:100,restart,restart:100 --json /tmp/f.json
    .venv/bin/python -m benchmarks.fault.fault_gpt --report /tmp/f.json,/tmp/g.json   # the table of saved runs
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.fault import gpt_runs
from benchmarks.fault.kills import WORKERS, say

__all__ = ["parse_args", "worker", "run_ft", "run_restart", "main"]

#: the advisor's 4-host pick (bagua/advise/table.py, WARM_DILOCO)
DILOCO = dict(sync_every=10, hierarchical=False, compression="uint4", outer_lr=1.0, outer_momentum=0.5,
              outer_lr_warmup=10)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="ft,ft:100,restart:100",
                   help="comma-separated: ft (no failure), ft:N (a kill every N steps), restart:N; ft+inner:N "
                        "heals with the peer's inner optimizer state (FaultTolerance(inner_state=True))")
    p.add_argument("--seeds", default="0")
    p.add_argument("--rate", default="100mbit", help="every host's link (tbf); 'unshaped' for none")
    p.add_argument("--target", type=float, default=2.40)
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (restart)")
    p.add_argument("--kill-offset", type=int, default=0,
                   help="kill at N + offset, 2N + offset, ...: 0 lands each kill right after a synchronization and a "
                        "checkpoint (no step redone); 25 with N = 100 mid-round and half a checkpoint interval late")
    p.add_argument("--model", default="gpt", help="gpt, or gpt_tiny for a smoke run")
    p.add_argument("--timeout", type=float, default=2400.0, help="seconds per run")
    p.add_argument("--json", default=None)
    p.add_argument("--report", default=None, help="comma-separated JSON files of earlier runs: print their table")
    for hidden in ("--worker", "--index", "--coordinator", "--ckpt-dir", "--seed", "--inner-state"):  # worker mode
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [r for r in args.runs.split(",") if r.partition(":")[0] not in ("ft", "ft+inner", "ft+fresh", "restart")]
    if bad:
        p.error(f"--runs: unknown {bad}; use ft, ft+inner, ft+fresh or restart, each with an optional :N")
    if args.eval_every % DILOCO["sync_every"]:
        p.error(f"--eval-every must be a multiple of H = {DILOCO['sync_every']}: the global weights are evaluated")
    names = ("target", "max_steps", "eval_every", "checkpoint_every", "model", "timeout")
    args.shared = [x for n in names for x in ("--" + n.replace("_", "-"), str(getattr(args, n)))]
    return args


# -- a worker -------------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One worker: ``ft`` a one-process job of its own; ``ckpt`` a rank of the 4-rank job, resuming."""
    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api import env
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm
    from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint
    from bagua.torch_api.fault import FaultTolerance, driver_heal_state
    from benchmarks.common.gpt import TextBatches, lm_loss, validation_windows
    from benchmarks.common.models import MODELS, _text, build_model
    from benchmarks.common.systems import _make_optimizer

    torch.set_num_threads(1)
    spec, seed, attempt = MODELS[args.model], int(args.seed), env.get_int("TORCHELASTIC_RESTART_COUNT", 0)
    ft = None
    if args.worker == "ft":  # library defaults: heartbeat 0.5 s, stale after 3 s, adaptive deadline, min_quorum 1
        ft = FaultTolerance(args.coordinator, worker=f"w{args.index}", workers=WORKERS, timeout_s=args.timeout,
                            **({"inner_state": args.inner_state == "1"} if args.inner_state else {}))
    bagua.init_process_group()  # ft: no launcher variables, a job of one process
    rank = int(args.index) if ft is not None else bagua.get_rank()
    train, val = _text(args.model)
    batches = TextBatches(train, spec.batch_size, spec.in_shape[0], seed, rank)
    val_x, val_y = validation_windows(val, 64, spec.in_shape[0])
    model = build_model(args.model, seed)
    replica = copy.deepcopy(model)  # evaluated on a copy, as benchmarks.to_target.to_target does
    inner = _make_optimizer(spec.optimizer, model.parameters(), spec.lr)
    model = model.with_bagua([inner], DiLoCoAlgorithm(**DILOCO, fault_tolerance=ft))  # ft: joins or heals here
    driver = model.bagua_ddp.impl.driver
    if ft is None:
        load_checkpoint(args.ckpt_dir, model, inner)  # 0 at the first attempt
    heal = ft is not None and ft.heals > 0
    state = list(driver_heal_state(driver).values()) if heal else []
    state += [t for s in inner.state_dict()["state"].values() for t in s.values()
              if torch.is_tensor(t) and t.dim()] if heal and ft.inner_state else []  # Adam's moments, not step
    heal_bytes = sum(t.numel() * t.element_size() for t in state)
    say("joined", rank=rank, pid=os.getpid(), attempt=attempt, step=driver.steps,
         heal_s=f"{ft.heal_seconds[-1]:.4f}" if heal else 0, heal_bytes=heal_bytes)
    done = ft.rounds if ft is not None else driver.syncs
    while driver.steps < args.max_steps:
        x, y = batches.batch(driver.steps)
        inner.zero_grad()
        lm_loss(model(x), y).backward()
        inner.step()
        now = ft.rounds if ft is not None else driver.syncs
        fields: dict[str, Any] = {}
        if now != done and driver.steps % args.eval_every == 0:  # the model holds the global weights
            t0 = time.perf_counter()
            replica.load_state_dict(model.state_dict())
            replica.eval()
            with torch.no_grad():
                loss = float(lm_loss(replica(val_x), val_y))
            fields = {"loss": f"{loss:.5f}", "eval_s": f"{time.perf_counter() - t0:.3f}"}
        if ft is None and driver.steps % args.checkpoint_every == 0:
            save_checkpoint(driver.steps, args.ckpt_dir, model, inner)
        say("step", rank=rank, step=driver.steps, sync=int(now != done), attempt=attempt, **fields)
        done = now
        if fields and float(fields["loss"]) <= args.target:
            break
    if ft is not None:
        ft.close()


# -- the supervisor -------------------------------------------------------------------------------------------------


def run_ft(args: argparse.Namespace, cluster: Any, seed: int, kill_every: int, workdir: Path,
           inner_state: Optional[bool] = None) -> dict[str, Any]:
    """Four fault-tolerant workers to the target; with ``kill_every``, SIGKILL and restart one on the schedule;
    ``inner_state``: what a healed worker takes (``None``: the library's default)."""
    extra = [] if inner_state is None else ["--inner-state", str(int(inner_state))]
    mode = "ft" if inner_state is None else f"ft+inner={int(inner_state)}"
    return gpt_runs.run_ft(args, cluster, seed, kill_every, workdir, "benchmarks.fault.fault_gpt", extra, mode)


def run_restart(args: argparse.Namespace, cluster: Any, seed: int, kill_every: int,
                workdir: Path) -> dict[str, Any]:
    """Plain DiLoCo under the elastic agent, checkpointing; SIGKILL a rank on the schedule, the agent restarts all."""
    return gpt_runs.run_restart(args, cluster, seed, kill_every, workdir, "benchmarks.fault.fault_gpt")


def _family(mode: str) -> str:
    """The failure-free run a run is compared with: ft (every fault-tolerant variant) or restart."""
    return "restart" if mode == "restart" else "ft"


def print_table(rows: list[dict[str, Any]]) -> None:
    """Each run against the same mode's run without failures on its seed (ft:N against ft, restart:N against
    restart), and the failure-free restart against the failure-free ft."""
    base = {(r["mode"], r["seed"]): r["time_to_target_s"] for r in rows if not r["kill_every"]}
    print(f"\n{'run':<12} {'seed':>4} {'steps':>6} {'time s':>8} {'s/step':>7} {'/ no kill':>9} {'/ ft':>6} "
          f"{'kills':>5} {'final':>7}")
    for r in rows:
        name, t = r["mode"] + (f":{r['kill_every']}" if r["kill_every"] else ""), r["time_to_target_s"]
        own, ft = base.get((_family(r["mode"]), r["seed"])), base.get(("ft", r["seed"]))
        cells = [f"{t:8.1f}" if t else "       -", f"{t / r['steps_to_target']:7.3f}" if t else "      -",
                 f"{t / own:9.3f}" if t and own else "        -", f"{t / ft:6.3f}" if t and ft else "     -"]
        print(f"{name:<12} {r['seed']:>4} {str(r['steps_to_target'] or '-'):>6} {' '.join(cells)} "
              f"{len(r['kills']):>5} {r['final_loss'] or 0:7.3f}")
        for k in r["kills"]:
            if r["mode"] == "restart":
                print(f"    {k['victim']} at step {k['step']}: all ranks stepping again after "
                      f"{k.get('back_after_s', float('nan')):.1f} s, from step {k.get('resumed_step', '-')}")
            elif k["healed_after_s"] is not None:
                sync = k["first_sync_after_s"]
                print(f"    {k['victim']} at step {k['step']}: healed after {k['healed_after_s']:.1f} s (heal "
                      f"{float(k['heal_s']):.2f} s, {(k.get('heal_bytes') or 0) / 1e6:.1f} MB), first own "
                      "synchronization " + (f"after {sync:.1f} s" if sync else "none"))
            else:
                print(f"    {k['victim']} at step {k['step']}: not back before the target")
    for mode in sorted({(r["mode"], r["kill_every"]) for r in rows if r["kill_every"]}):
        ratios = [r["time_to_target_s"] / base[(_family(r["mode"]), r["seed"])] for r in rows
                  if (r["mode"], r["kill_every"]) == mode and r["time_to_target_s"]
                  and base.get((_family(r["mode"]), r["seed"]))]
        if ratios:
            print(f"median time to target / the same mode without failures, {mode[0]}:{mode[1]}: "
                  f"{statistics.median(ratios):.3f} over {len(ratios)} seed(s)")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if gpt_runs.worker_or_report(args, worker, print_table):
        return 0
    runs = gpt_runs.parse_runs(args.runs)

    def run_one(cluster: Any, seed: int, run: tuple[str, int], workdir: Path) -> dict[str, Any]:
        mode, n = run
        if mode == "restart":
            return run_restart(args, cluster, seed, n, workdir)
        inner = None if mode == "ft" else mode == "ft+inner"  # ft+inner / ft+fresh: set explicitly
        return run_ft(args, cluster, seed, n, workdir, inner)

    def describe(run: tuple[str, int], r: dict[str, Any]) -> str:
        return f"{run[0]}:{run[1]} seed {r['seed']}: steps {r['steps_to_target']}, time {r['time_to_target_s']}"

    print(f"{WORKERS} workers, GPT ({args.model}) to val loss {args.target}, each link {args.rate}; DiLoCo {DILOCO}")
    print_table(gpt_runs.run_campaign(args, runs, run_one, describe, "bagua-fault-gpt-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
