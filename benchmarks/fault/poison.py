"""One worker of four that lies every round: steps to a target loss, with and without robust aggregation.

The real fault-tolerant DiLoCo stack: a coordinator process (``python -m bagua.torch_api.fault.coordinator``), a job
secret, and 4 worker processes on loopback, each a one-process Bagua job training a small GPT
(:mod:`benchmarks.common.gpt`: 2 layers, width 64, context 64, 0.12 M parameters; AdamW lr 3e-3 (LR), batch 8 x 64
bytes of Python's standard library per worker) through ``with_bagua`` and
``DiLoCoAlgorithm(fault_tolerance=FaultTolerance(...))`` with ``sync_every=10``, float32 pseudo-gradients
(``compression="none"``: robust aggregation works on the float32 average; a compressed exchange is screened only),
outer SGD lr 0.7, Nesterov momentum 0.9.

Runs (``--runs``), each ``POISON/AGGREGATION``:

- ``POISON``: ``clean`` (four honest workers); ``x1e6`` (worker w3 multiplies its own pseudo-gradient by 1e6 before
  every exchange); ``flip`` (w3 negates it). The lie is installed in the worker process of this benchmark only, by
  wrapping :meth:`bagua.torch_api.ops.diloco.Fragment.pseudo_gradient` (what the driver hands to the exchange); no
  library switch exists for it.
- ``AGGREGATION``: ``plain`` (the weighted average, after the screen of :mod:`bagua.torch_api.fault.screen`, which
  leaves a contribution above 10x the round's median norm out), ``median`` or ``trimmed_mean``
  (``FaultTolerance(robust=...)``, :mod:`bagua.torch_api.fault.robust`). At 4 members a trimmed mean (trim 1) and
  the median are both the mean of the two middle values.

Every worker evaluates the global weights (the same on every worker) on 64 validation windows every ``--eval-every``
steps, right after a synchronization, and stops at the first evaluation at or below ``--target`` (so all stop at
the same round). Steps, not wall time, are compared: the machine is shared. Every round waits for all four workers
(``min_quorum=4``), so no worker is left out for being late and the run depends on its seed only. Output: one JSON object with each run's
steps to the target (``null``: not reached within ``--max-steps``) and its loss curve.

    .venv/bin/python -m benchmarks.fault.poison --seeds 0,1,2 --json docs/log/results/2026-12-05-poison.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["parse_args", "worker", "run", "main"]

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 4
LIAR = 3  # the worker that lies (w3)
H = 10
LR = 3e-3
DILOCO = dict(sync_every=H, compression="none", outer_lr=0.7, outer_momentum=0.9, nesterov=True)
RUNS = "clean/plain,x1e6/plain,x1e6/median,flip/plain,flip/median"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=RUNS, help="comma-separated POISON/AGGREGATION (clean|x1e6|flip / "
                                                "plain|median|trimmed_mean)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--target", type=float, default=2.92)
    p.add_argument("--max-steps", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--json", default=None)
    p.add_argument("--merge", default=None, help="comma-separated JSON files of earlier runs: write their runs and "
                                                 "summary together to --json")
    for hidden in ("--worker", "--coordinator", "--seed", "--poison", "--robust", "--prefix"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for r in args.runs.split(","):
        poison, _, agg = r.partition("/")
        if poison not in ("clean", "x1e6", "flip") or agg not in ("plain", "median", "trimmed_mean"):
            p.error(f"--runs: {r!r} is not POISON/AGGREGATION (clean|x1e6|flip / plain|median|trimmed_mean)")
    if args.eval_every % H:
        p.error(f"--eval-every must be a multiple of sync_every = {H}: the global weights are evaluated")
    return args


# -- a worker -------------------------------------------------------------------------------------------------------


def lie(kind: str) -> None:
    """Make this process's every pseudo-gradient ``x1e6`` (a million times its own) or ``flip`` (negated), before
    the exchange sees it: a benchmark-only wrapper of ``Fragment.pseudo_gradient``."""
    from bagua.torch_api.ops.diloco import Fragment

    honest = Fragment.pseudo_gradient

    def lying(self: Any) -> Any:
        delta = honest(self)
        return delta.mul_(1e6) if kind == "x1e6" else delta.neg_()

    Fragment.pseudo_gradient = lying  # type: ignore[method-assign]


def worker(args: argparse.Namespace) -> None:
    """One worker of the job: train until the global weights' validation loss reaches the target."""
    import logging

    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm
    from bagua.torch_api.fault import FaultTolerance
    from benchmarks.common.gpt import GPT, GPTConfig, TextBatches, load_text, lm_loss, validation_windows

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    index, seed = int(args.worker), int(args.seed)
    if args.poison != "clean" and index == LIAR:
        lie(args.poison)
    cfg = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)
    # min_quorum=WORKERS: every round waits for all four (none is left out for being late on the loaded machine),
    # so the trajectory depends on the steps, not on the machine's timing, and the liar is in every round
    ft = FaultTolerance(args.coordinator, worker=f"w{index}", workers=WORKERS, min_quorum=WORKERS,
                        timeout_s=args.timeout, prefix=args.prefix,
                        robust=None if args.robust == "plain" else args.robust)
    bagua.init_process_group()  # no launcher: a job of one process
    torch.manual_seed(seed)
    model = GPT(cfg)
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    model = model.with_bagua([inner], DiLoCoAlgorithm(**DILOCO, fault_tolerance=ft))
    driver = model.bagua_ddp.impl.driver
    train, val = load_text(1 << 20, 256 << 10)
    batches = TextBatches(train, 8, cfg.block_size, seed, index)
    val_x, val_y = validation_windows(val, 64, cfg.block_size)
    done = ft.rounds
    while driver.steps < args.max_steps:
        x, y = batches.batch(driver.steps)
        inner.zero_grad()
        lm_loss(model(x), y).backward()
        inner.step()
        now = ft.rounds
        if now != done and driver.steps % args.eval_every == 0:  # the model holds the global weights
            with torch.no_grad():
                loss = float(lm_loss(model(val_x), val_y))
            if index == 0:
                print(json.dumps({"step": driver.steps, "loss": loss, "dropped": len(ft.dropped), "rounds": ft.rounds,
                                  "retries": ft.retries, "left_out": ft.left_out}), flush=True)
            if loss <= args.target:  # the same global weights on every worker: all stop at this round
                break
        done = now
    ft.close()


# -- the supervisor -------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace, poison: str, robust: str, seed: int, workdir: Path,
        secret: str) -> dict[str, Any]:
    """Four workers (w3 lying with ``poison``) and a coordinator, to the target; return the outcome of w0's
    evaluations."""
    from bagua.torch_api.fault.coordinator import start_coordinator

    port = _free_port()
    coordinator = start_coordinator("127.0.0.1", port, timeout_s=300.0)  # the loaded machine starts it slowly
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", BAGUA_JOB_SECRET_FILE=secret)
    name = f"{poison}-{robust}-s{seed}"
    logs = [workdir / f"{name}-w{i}.log" for i in range(WORKERS)]
    started = time.time()
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.fault.poison", "--worker", str(i), "--seed",
                               str(seed), "--coordinator", f"127.0.0.1:{port}", "--poison", poison, "--robust",
                               robust, "--prefix", name, "--target", str(args.target), "--max-steps",
                               str(args.max_steps), "--eval-every", str(args.eval_every), "--timeout",
                               str(args.timeout)],
                              cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT) for i, log in
             enumerate(logs)]
    try:
        codes = [p.wait(timeout=max(1.0, started + args.timeout - time.time())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        coordinator.terminate()
        coordinator.wait()
    evals = [json.loads(line) for line in logs[0].read_text().splitlines() if line.startswith("{")]
    hit = next((e for e in evals if e["loss"] <= args.target), None)
    w0_log = logs[0].read_text()
    return {"poison": poison, "aggregation": robust, "seed": seed, "exit_codes": codes,
            "steps_to_target": hit["step"] if hit else None, "final_loss": evals[-1]["loss"] if evals else None,
            "screened_out": evals[-1]["dropped"] if evals else None,
            "w0_rounds_retries_left_out": [evals[-1][k] for k in ("rounds", "retries", "left_out")] if evals else None,
            "w3_named_in_w0_log": w0_log.count("worker 'w3' is left out"),
            "wall_s": round(time.time() - started, 1), "curve": [[e["step"], e["loss"]] for e in evals]}


#: the steps at which the summary also gives each run's validation loss (the mean over seeds that got there)
LOSS_AT = (50, 100)


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: steps to the target by seed, their median, the ratio to the clean plain run's median, and the
    mean validation loss at the steps of :data:`LOSS_AT`."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        by.setdefault((r["poison"], r["aggregation"]), []).append(r)
    clean = [r["steps_to_target"] for r in by.get(("clean", "plain"), [])]
    base = statistics.median(clean) if clean and None not in clean else None
    out = []
    for (poison, agg), runs in by.items():
        steps = [r["steps_to_target"] for r in runs]
        med = statistics.median(steps) if None not in steps else None
        loss_at = {}
        for at in LOSS_AT:
            losses = [loss for r in runs for step, loss in r["curve"] if step == at]
            loss_at[str(at)] = round(statistics.mean(losses), 4) if losses else None
        out.append({"run": f"{poison}/{agg}", "steps_to_target": steps, "median": med,
                    "vs_clean": round(med / base, 3) if med is not None and base else None, "loss_at": loss_at})
    return out


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return
    if args.merge:
        saved = [json.loads(Path(f).read_text()) for f in args.merge.split(",")]
        runs = [r for d in saved for r in d["runs"]]
        settings = dict(saved[0]["settings"], seeds=",".join(d["settings"]["seeds"] for d in saved))
        Path(args.json).write_text(json.dumps({"settings": settings, "summary": summary(runs), "runs": runs},
                                              indent=1) + "\n")
        return
    from bagua.torch_api.fault.secret import new_secret

    results = []
    with tempfile.TemporaryDirectory(prefix="bagua-poison-") as tmp:
        workdir = Path(tmp)
        secret = new_secret(str(workdir / "job.secret"))
        for seed in map(int, args.seeds.split(",")):
            for r in args.runs.split(","):
                poison, _, robust = r.partition("/")
                results.append(run(args, poison, robust, seed, workdir, str(secret)))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "curve"}), flush=True)
                if any(c != 0 for c in results[-1]["exit_codes"]):
                    print((workdir / f"{poison}-{robust}-s{seed}-w0.log").read_text()[-3000:], file=sys.stderr)
    table = summary(results)
    for row in table:
        print(f"{row['run']:>20} steps {row['steps_to_target']} median {row['median']} vs clean {row['vs_clean']}")
    if args.json:
        settings = {k: getattr(args, k) for k in ("runs", "seeds", "target", "max_steps", "eval_every")}
        Path(args.json).write_text(json.dumps({"settings": dict(settings, diloco=DILOCO, workers=WORKERS,
                                                                liar=f"w{LIAR}"),
                                               "summary": table, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
