"""Time to target with a replica killed: fault-tolerant gradient allreduce and ByteGrad on the GPT at 4 hosts.

The GPT of :mod:`benchmarks.fault.fault_gpt` at the size ``--n-layer``/``--n-embd``/``--block`` (default 4 x 192,
64 bytes of context, 1.84 M parameters: the 10.8 M one runs 1.8 s a step on this 2-core machine, too slow for the
matrix), Adam lr 1e-3, batch ``--batch-size`` x ``--block`` bytes per worker, trained until the validation loss on
64 windows (every ``--eval-every`` steps, by every worker, rank 0's counted) reaches ``--target``; each worker in a
network namespace of its own, every link shaped to ``--rate`` (:class:`benchmarks.common.netns.NetnsCluster`).
``--algorithms``: ``allreduce`` (``GradientAllReduceAlgorithm``) and/or ``bytegrad``
(``ByteGradAlgorithm(codec="uint8")``, no error feedback), each run as (``--runs``)

- ``ft``: ``fault_tolerance=FaultTolerance(...)``, each worker a one-process job, the coordinator on a fifth host;
  ``ft:N``: one worker (w1, w2, w3 in turn) SIGKILLed every N job steps (``--kill-offset`` later) and restarted at
  once (what a launcher with ``--max-restarts`` does); it heals from a live peer (weights, step, Adam's state);
- ``restart:N``, the baseline: the plain algorithm in one 4-rank job under ``python -m bagua.distributed.run
  --max-restarts``, every rank checkpointing every ``--checkpoint-every`` steps; at each kill the agent restarts
  all ranks, which load the last checkpoint;
- ``plain``: the plain algorithm in the same 4-rank job, no kill, no checkpoint: what the per-step quorum costs.

Time to target and the supervisor: :mod:`benchmarks.fault.gpt_runs`. Needs root (namespaces).

    .venv/bin/python -m benchmarks.fault.sync_gpt --algorithms allreduce,bytegrad --runs plain,ft,ft:100,restart:100 \\
        --seeds 0 --json /tmp/s.json
    .venv/bin/python -m benchmarks.fault.sync_gpt --report /tmp/s.json,/tmp/t.json   # the table of saved runs
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

__all__ = ["ALGORITHMS", "parse_args", "worker", "print_table", "main"]

#: name -> the algorithm's settings (the codec of ByteGrad's fault-tolerant all-gather, the same in the plain run)
ALGORITHMS = {"allreduce": "GradientAllReduceAlgorithm()", "bytegrad": 'ByteGradAlgorithm(codec="uint8")'}
_MODES = ("ft", "restart", "plain")
_MODULE = "benchmarks.fault.sync_gpt"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", default="allreduce,bytegrad", help=f"comma-separated: {', '.join(ALGORITHMS)}")
    p.add_argument("--runs", default="plain,ft,ft:100,restart:100",
                   help="comma-separated: plain, ft (no failure), ft:N (a kill every N steps), restart:N")
    p.add_argument("--seeds", default="0")
    p.add_argument("--rate", default="1gbit", help="every host's link (tbf); 'unshaped' for none")
    p.add_argument("--target", type=float, default=2.25)
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (restart)")
    p.add_argument("--kill-offset", type=int, default=5, help="kill at N + offset, 2N + offset, ...: half a "
                   "checkpoint interval after a checkpoint, what a kill at a random time loses on average")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    p.add_argument("--json", default=None)
    p.add_argument("--report", default=None, help="comma-separated JSON files of earlier runs: print their table")
    for hidden in ("--worker", "--index", "--coordinator", "--ckpt-dir", "--seed", "--algorithm"):  # worker mode
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [r for r in args.runs.split(",") if r.partition(":")[0] not in _MODES]
    bad += [a for a in args.algorithms.split(",") if a not in ALGORITHMS]
    if bad:
        p.error(f"unknown {bad}; --runs takes {', '.join(_MODES)} (ft and restart with an optional :N), "
                f"--algorithms {', '.join(ALGORITHMS)}")
    names = ("target", "max_steps", "eval_every", "checkpoint_every", "n_layer", "n_embd", "block", "batch_size",
             "timeout")
    args.shared = [x for n in names for x in ("--" + n.replace("_", "-"), str(getattr(args, n)))]
    return args


# -- a worker -------------------------------------------------------------------------------------------------------


def _algorithm(name: str, ft: Any) -> Any:
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    if name == "allreduce":
        return GradientAllReduceAlgorithm(fault_tolerance=ft)
    return ByteGradAlgorithm(fault_tolerance=ft, codec="uint8", hierarchical=False)


def worker(args: argparse.Namespace) -> None:
    """One worker: ``ft`` a one-process job of its own; ``ckpt`` a rank of the 4-rank job, resuming."""
    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api import env
    from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint
    from bagua.torch_api.fault import FaultTolerance, JobEnded
    from benchmarks.common.gpt import GPT, GPTConfig, TextBatches, lm_loss, load_text, validation_windows

    torch.set_num_threads(1)
    seed, attempt, every = int(args.seed), env.get_int("TORCHELASTIC_RESTART_COUNT", 0), int(args.checkpoint_every)
    ft = None
    if args.worker == "ft":  # library defaults: heartbeat, stale time, adaptive deadline, min_quorum 1
        ft = FaultTolerance(args.coordinator, worker=f"w{args.index}", workers=WORKERS, timeout_s=float(args.timeout))
    bagua.init_process_group()  # ft: no launcher variables, a job of one process
    rank = int(args.index) if ft is not None else bagua.get_rank()
    block = int(args.block)
    train, val = load_text()
    batches = TextBatches(train, int(args.batch_size), block, seed, rank)
    val_x, val_y = validation_windows(val, 64, block)
    torch.manual_seed(seed)
    n_embd = int(args.n_embd)
    model = GPT(GPTConfig(block_size=block, n_layer=int(args.n_layer), n_head=max(1, n_embd // 64), n_embd=n_embd))
    replica = copy.deepcopy(model)  # evaluated on a copy, as fault_gpt does
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model = model.with_bagua([opt], _algorithm(args.algorithm, ft))
    sync = model.bagua_ddp.impl.steps if ft is not None else None  # SyncSteps: the job's committed steps
    step = load_checkpoint(args.ckpt_dir, model, opt) if ft is None and every else 0  # 0 at the first attempt
    joined = ft is None
    if ft is None:
        say("joined", rank=rank, pid=os.getpid(), attempt=attempt, step=step, heal_s=0, heal_bytes=0)
    try:
        while step < int(args.max_steps):
            x, y = batches.batch(step)  # a joiner's first batch is dropped: it applies the step it joined in
            opt.zero_grad()
            lm_loss(model(x), y).backward()
            opt.step()
            if sync is not None:
                if not joined:  # its first step: it joined at the job's start, or healed from a peer
                    heal, joined = ft.heals > 0, True
                    size = sum(t.numel() * t.element_size() for t in sync.heal_state_dict().values()) if heal else 0
                    say("joined", rank=rank, pid=os.getpid(), attempt=attempt, step=sync.steps - 1,
                        heal_s=f"{ft.heal_seconds[-1]:.4f}" if heal else 0, heal_bytes=size)
                step = sync.steps
            else:
                step += 1
            fields: dict[str, Any] = {}
            if step % int(args.eval_every) == 0:
                t0 = time.perf_counter()
                replica.load_state_dict(model.state_dict())
                replica.eval()
                with torch.no_grad():
                    loss = float(lm_loss(replica(val_x), val_y))
                fields = {"loss": f"{loss:.5f}", "eval_s": f"{time.perf_counter() - t0:.3f}"}
                if sync is not None and sync.wait_seconds:  # the quorum so far; its cost not hidden
                    fields |= {"heals": ft.heals, "left_out": ft.left_out, "retries": ft.retries,
                               "wait_ms": f"{1e3 * statistics.median(sync.wait_seconds[-50:]):.2f}",
                               "agree_ms": f"{1e3 * statistics.median(sync.agree_seconds[-50:]):.2f}"}
            if ft is None and every and step % every == 0:
                save_checkpoint(step, args.ckpt_dir, model, opt)
            say("step", rank=rank, step=step, sync=1, attempt=attempt, **fields)
            if fields and float(fields["loss"]) <= float(args.target):
                break
    except JobEnded:  # restarted after the job's last step: nothing left to do
        pass
    if ft is not None:
        ft.close()


# -- the table ------------------------------------------------------------------------------------------------------


def _name(r: dict[str, Any]) -> str:
    return r["mode"] + (f":{r['kill_every']}" if r["kill_every"] else "")


def print_table(rows: list[dict[str, Any]]) -> None:
    """Per algorithm and seed: each run's time to target against the fault-tolerant failure-free run (``ft``) and
    the plain one (``plain``); the medians of the ratios the goals name."""
    key = {(r["algorithm"], _name(r), r["seed"]): r for r in rows}
    print(f"\n{'algorithm':<10} {'run':<12} {'seed':>4} {'steps':>6} {'time s':>8} {'s/step':>7} {'/ ft':>6} "
          f"{'/ plain':>7} {'kills':>5} {'load':>5}")
    for r in rows:
        t, a = r["time_to_target_s"], r["algorithm"]
        ft, plain = (key.get((a, n, r["seed"]), {}).get("time_to_target_s") for n in ("ft", "plain"))
        cells = [f"{t:8.1f}" if t else "       -", f"{t / r['steps_to_target']:7.3f}" if t else "      -",
                 f"{t / ft:6.3f}" if t and ft else "     -", f"{t / plain:7.3f}" if t and plain else "      -"]
        print(f"{a:<10} {_name(r):<12} {r['seed']:>4} {str(r['steps_to_target'] or '-'):>6} {' '.join(cells)} "
              f"{len(r['kills']):>5} {r.get('load', 0):5.1f}")
        for k in r["kills"]:
            if r["mode"] == "restart":
                print(f"    {k['victim']} at step {k['step']}: all ranks stepping again after "
                      f"{k.get('back_after_s', float('nan')):.1f} s, from step {k.get('resumed_step', '-')}")
            elif k.get("healed_after_s") is not None:
                print(f"    {k['victim']} at step {k['step']}: back in the job {k['healed_after_s']:.1f} s after "
                      f"the kill (heal {float(k['heal_s']):.2f} s, {(k.get('heal_bytes') or 0) / 1e6:.1f} MB)")
            else:
                print(f"    {k['victim']} at step {k['step']}: not back before the target")
    for a in sorted({r["algorithm"] for r in rows}):
        for num, den in (("ft:100", "ft"), ("restart:100", "ft"), ("ft", "plain"), ("restart:100", "ft:100")):
            ratios = [key[(a, num, s)]["time_to_target_s"] / key[(a, den, s)]["time_to_target_s"]
                      for (b, n, s) in key if b == a and n == num and (a, den, s) in key
                      and key[(a, num, s)]["time_to_target_s"] and key[(a, den, s)]["time_to_target_s"]]
            if ratios:
                print(f"{a}: {num} / {den}: median {statistics.median(ratios):.3f} over {len(ratios)} seed(s) "
                      f"({', '.join(f'{x:.3f}' for x in ratios)})")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if gpt_runs.worker_or_report(args, worker, print_table):
        return 0
    runs = [(a, mode, n) for a in args.algorithms.split(",") for mode, n in gpt_runs.parse_runs(args.runs)]

    def run_one(cluster: Any, seed: int, run: tuple[str, str, int], workdir: Path) -> dict[str, Any]:
        algorithm, mode, n = run
        extra = ["--algorithm", algorithm]
        if mode == "ft":
            row = gpt_runs.run_ft(args, cluster, seed, n, workdir, _MODULE, extra, f"ft-{algorithm}")
        else:
            extra += ["--checkpoint-every", "0"] if mode == "plain" else []
            row = gpt_runs.run_restart(args, cluster, seed, n, workdir, _MODULE, extra, f"{mode}-{algorithm}")
        return row | {"mode": mode, "algorithm": algorithm}

    def describe(run: tuple[str, str, int], r: dict[str, Any]) -> str:
        return (f"{r['algorithm']} {_name(r)} seed {r['seed']}: steps {r['steps_to_target']}, "
                f"time {r['time_to_target_s']} (load {r['load']:.1f})")

    print(f"{WORKERS} workers, GPT {args.n_layer} x {args.n_embd} to val loss {args.target}, each link {args.rate}; "
          f"{', '.join(ALGORITHMS[a] for a in args.algorithms.split(','))}")
    print_table(gpt_runs.run_campaign(args, runs, run_one, describe, "bagua-sync-gpt-", f"sgk{os.getpid() % 10000}",
                                      load="mean"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
