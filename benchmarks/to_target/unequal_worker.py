"""One worker of the unequal-speeds benchmark (:mod:`benchmarks.to_target.unequal`), run once per emulated host.

It trains the benchmark GPT (:mod:`benchmarks.common.gpt`, a size given on the command line) with a system of
:func:`benchmarks.common.systems.make_system` and makes this worker slow as the profile says:

- **Slowness.** With ``--step-s T`` a worker of speed ``s`` pads each inner step to ``T / s`` (a device whose
  step takes ``T``; on a CPU shared by more workers than cores a step's compute depends on what the others do,
  so the measured rule below gives speeds that drift with contention). Without it, a worker of speed ``s`` pads
  each inner step by ``(1/s - 1)`` times that step's own measured compute. Either way a forward pre-hook notes
  when the step's forward starts, and an optimizer step *pre*-hook (inside ``optimizer.step()``, before the
  update and before the system's end-of-step exchange) measures forward + backward and sleeps for the pad.
  The system under test therefore sees a slow step, measures it as it would a slow device, and takes its own
  decisions (inner steps per round, order of arrivals). DDP's backward holds its allreduce, so a DDP worker
  takes its median compute step measured on an unwrapped copy before training as its compute instead.
- **Progress.** After every outer step (a change of the DiLoCo driver's ``syncs``; for DDP every
  ``--snapshot-every`` steps) rank 0 saves the model's weights with the time since the common start
  (``snap<NNNNN>.pt``); the parent evaluates them, off the workers' clock, and creates ``stop`` when the target is
  reached. Every worker writes ``rank<r>.json`` (its steps, tokens, compute, pad and end-of-step time, a
  timeline of ``[time, steps]``, and the driver's per-round records when it keeps them: ``[sync_every, steps,
  wait s, exchange s]`` per round, one value per worker) after each outer step and when it stops.

Example::

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29531 python -m benchmarks.to_target.unequal_worker \\
        --system ddp --speeds 1 --max-steps 4 --n-layer 1 --n-embd 16 --block 8 --dir /tmp/u
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["parse_args", "speed_at", "pad_seconds", "main"]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse a worker's arguments."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.unequal_worker")
    p.add_argument("--system", required=True, help="a system spec of benchmarks.common.systems")
    p.add_argument("--speeds", required=True, help="speed per rank, e.g. 1,0.8,0.6,0.4")
    p.add_argument("--window", default=None, help="RANK:SPEED:FROM:TO: that rank runs at SPEED for its own "
                                                    "steps FROM <= step < TO (the temporary slowdown)")
    p.add_argument("--step-s", type=float, default=0.0, help="0: pad by (1/s - 1) x the measured compute; T > 0: "
                                                               "pad each step to T / s (a device of fixed step T)")
    p.add_argument("--max-steps", type=int, default=2000, help="a worker stops after this many of its own steps")
    p.add_argument("--snapshot-every", type=int, default=10, help="DDP: steps between saved weights")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--n-head", type=int, default=None, help="default: n_embd / 64, at least 1")
    p.add_argument("--block", type=int, default=128, help="context in bytes")
    p.add_argument("--batch-size", type=int, default=8, help="windows per worker and step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-bytes", type=int, default=8 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", required=True, help="the run's directory (snapshots, stop file, results)")
    return p.parse_args(argv)


def speed_at(rank: int, step: int, speeds: Sequence[float], window: Optional[str]) -> float:
    """This rank's speed at its own ``step``: the profile's, or the window's while it lasts.

    Example:
        >>> speed_at(3, 150, [1, 1, 1, 1], "3:0.3:100:200"), speed_at(3, 200, [1, 1, 1, 1], "3:0.3:100:200")
        (0.3, 1)
    """
    if window:
        w_rank, w_speed, w_from, w_to = window.split(":")
        if int(w_rank) == rank and int(w_from) <= step < int(w_to):
            return float(w_speed)
    return speeds[rank]


def pad_seconds(compute_s: float, speed: float, step_s: float = 0.0) -> float:
    """The sleep that makes a step of ``compute_s`` seconds take ``compute_s / speed``; with ``step_s > 0``, the
    sleep that makes it take ``step_s / speed`` (none when the compute alone takes longer).

    Example:
        >>> round(pad_seconds(0.2, 0.5), 6), pad_seconds(0.2, 1.0), round(pad_seconds(0.3, 0.5, 0.4), 6)
        (0.2, 0.0, 0.5)
    """
    if not 0 < speed <= 1:
        raise ValueError(f"a speed must be in (0, 1], got {speed}")
    if step_s > 0:
        return max(0.0, step_s / speed - compute_s)
    return compute_s * (1.0 / speed - 1.0)


def _syncs(system) -> Optional[Callable[[], int]]:
    """A counter of the system's outer steps, or ``None`` (DDP: snapshots by step count)."""
    bagua_ddp = getattr(system.model, "bagua_ddp", None)
    impl = getattr(bagua_ddp, "impl", None)
    if impl is not None and hasattr(impl, "syncs"):
        return lambda: int(impl.syncs)
    return None


def _save_atomic(path: str, write: Callable[[str], None]) -> None:
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train this worker until ``stop`` appears or ``--max-steps``; write its results (see the module doc)."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    import bagua.torch_api as bagua
    from benchmarks.common.gpt import GPT, GPTConfig, TextBatches, lm_loss, load_text
    from benchmarks.common.measurements import _median_compute_step
    from benchmarks.common.systems import make_system, split_system

    bagua.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    speeds = [float(s) for s in args.speeds.split(",")]
    if len(speeds) != world:
        raise ValueError(f"--speeds gives {len(speeds)} speeds for {world} workers; give one per rank")
    cfg = GPTConfig(block_size=args.block, n_layer=args.n_layer, n_head=args.n_head or max(1, args.n_embd // 64),
                    n_embd=args.n_embd)
    train_data, _ = load_text(args.train_bytes, 1 << 16)
    stream = TextBatches(train_data, args.batch_size, args.block, args.seed, rank)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    is_ddp = split_system(args.system)[0] == "ddp"
    ddp_compute = None
    if is_ddp:  # DDP's backward holds its allreduce: pad by an unwrapped copy's compute instead
        import copy
        ddp_compute = _median_compute_step(copy.deepcopy(model), "adam", args.lr, lm_loss,
                                           [stream.batch(i) for i in range(4)], 3)
    system = make_system(args.system, model, "adam", args.lr, 2)
    inner = getattr(system.model, "module", system.model)
    state = {"fwd": 0.0, "step": 0, "compute": 0.0, "pad": 0.0, "tail": 0.0, "pre_end": 0.0, "overruns": 0}

    def forward_pre(module, inputs) -> None:
        state["fwd"] = time.perf_counter()

    def step_pre(optimizer, a, kw) -> None:
        now = time.perf_counter()
        compute = ddp_compute if is_ddp else now - state["fwd"]
        state["compute"] += now - state["fwd"]
        pad = pad_seconds(compute, speed_at(rank, state["step"], speeds, args.window), args.step_s)
        state["overruns"] += args.step_s > 0 and compute > args.step_s  # the compute alone exceeded the step
        if pad > 0:
            time.sleep(pad)
        state["pad"] += pad
        state["pre_end"] = time.perf_counter()

    inner.register_forward_pre_hook(forward_pre)
    system.optimizer.register_step_pre_hook(step_pre)
    syncs = _syncs(system)
    tokens_per_step = args.batch_size * args.block
    stop_path = os.path.join(args.dir, "stop")
    timeline: list[list[float]] = []

    driver = getattr(getattr(getattr(system.model, "bagua_ddp", None), "impl", None), "driver", None)

    def write_stats(reason: str) -> None:
        records = getattr(driver, "records", None) or []  # the system's own per-round report (rounds="time")
        result = {"rounds": [[r.sync_every, r.steps, [round(w, 4) for w in r.wait_s],
                              [round(e, 4) for e in r.exchange_s]] for r in records],
                  "rank": rank, "speed": speeds[rank], "steps": state["step"],
                  "tokens": state["step"] * tokens_per_step, "compute_s": state["compute"], "pad_s": state["pad"],
                  "step_tail_s": state["tail"], "overruns": state["overruns"],
                  "syncs": syncs() if syncs else None, "timeline": timeline,
                  "ddp_compute_s": ddp_compute, "reason": reason, "notes": system.notes}
        _save_atomic(os.path.join(args.dir, f"rank{rank}.json"), lambda p: json.dump(result, open(p, "w")))

    def snapshot(t: float, count: int) -> None:
        weights = {k: v.detach().clone() for k, v in inner.state_dict().items()}
        _save_atomic(os.path.join(args.dir, f"snap{count:05d}.pt"),
                     lambda p: torch.save({"time_s": t, "steps": state["step"], "weights": weights}, p))

    dist.barrier()
    t0 = time.time()
    if rank == 0:
        _save_atomic(os.path.join(args.dir, "start"), lambda p: open(p, "w").write(repr(t0)))
        snapshot(0.0, 0)
    last_sync, reason = 0, "max_steps"
    while state["step"] < args.max_steps:
        if os.path.exists(stop_path):
            reason = "stop"
            break
        x, y = stream.batch(state["step"])
        system.before_step()
        system.optimizer.zero_grad()
        loss = lm_loss(system.model(x), y)
        loss.backward()
        system.optimizer.step()
        state["tail"] += time.perf_counter() - state["pre_end"]
        state["step"] += 1
        now = time.time() - t0
        timeline.append([round(now, 4), state["step"]])
        count = syncs() if syncs else state["step"] // args.snapshot_every
        if count != last_sync:
            last_sync = count
            if rank == 0:
                snapshot(now, count)
            write_stats("running")
    write_stats(reason)
    os._exit(0)  # peers may still be inside an exchange: leave without a teardown that would wait for them


if __name__ == "__main__":
    main()
