"""Workers of different speeds on links that change: time to the target per system and speed profile.

``sudo .venv/bin/python -m benchmarks.to_target.unequal --profiles equal,graded --systems diloco,diloco_time``

Four emulated hosts (:class:`benchmarks.common.netns.NetnsCluster`, one rank each, every link shaped with tbf) train
the benchmark GPT (:mod:`benchmarks.common.gpt`, the size given by ``--n-layer``/``--n-embd``/``--block``) until the
validation loss of the global weights reaches ``--target``. Each host runs
:mod:`benchmarks.to_target.unequal_worker`, which makes a worker of speed ``s`` slow by a sleep inside
``optimizer.step()`` (before the update and the system's exchange), so the system sees the slowness and takes its
own trajectory: with ``--step-s T`` every step is padded to ``T / s``; without, by ``(1/s - 1)`` times that step's
measured compute (on a CPU shared by more workers than cores that compute shrinks when the others sleep, so the
speeds drift: see the log page).

- **Profiles** (:data:`PROFILES`): ``equal`` 1,1,1,1; ``half`` 1,1,1,0.5; ``graded`` 1,0.8,0.6,0.4; ``dip``: rank 3
  at 0.3 for ``--dip-steps`` of its own steps from ``--dip-from`` (the middle of the equal run).
- **Links** (:data:`LINKS`): ``100mbit``, ``10mbit``, and ``drop``: 100 Mbit/s, 10 Mbit/s from ``--drop-period``/3
  seconds after the start to 2/3 of it, then 100 Mbit/s again (the parent re-shapes every host's link).
- **Systems** (:func:`system_spec`): ``ddp``; ``diloco``: the pick of ``bagua/advise/picks.json`` for 4 hosts at
  the link (100 Mbit/s for ``drop``), ``hierarchical=False``; ``diloco_time``: the same with ``rounds="time"``;
  ``diloco_async``: the same with ``asynchronous=True``. Extra ``:key=value`` settings append to a name.
- **Time to target**: rank 0 saves the weights after every outer step (DDP: every 10 steps) with the time since the
  common start; this process evaluates the newest (on a quarter of the ``--eval-samples`` validation windows, then
  on all of them when within 0.05 of the target; off the workers' clock), stops the run when it reaches the
  target, and walks back through the snapshots it skipped to the first that did (:func:`_first_hit`). Tokens to target: every worker's steps
  done by then (its own timeline) x its tokens per step.

Rows go to ``<out-dir>/<name>.json`` as each run ends; :mod:`benchmarks.to_target.unequal_report` tabulates them
(medians over seeds, the ideal, ratios) and plots time to target per profile.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Optional, Sequence

__all__ = ["PROFILES", "LINKS", "system_spec", "pick_settings", "tokens_by", "parse_args", "run_one", "main"]

#: speed per rank; ``dip`` adds a window (rank 3 at 0.3 for --dip-steps of its steps)
PROFILES = {"equal": (1.0, 1.0, 1.0, 1.0), "half": (1.0, 1.0, 1.0, 0.5), "graded": (1.0, 0.8, 0.6, 0.4),
            "dip": (1.0, 1.0, 1.0, 1.0)}
DIP_RANK, DIP_SPEED = 3, 0.3
#: link name -> (rate at the start, rate during the drop or None)
LINKS = {"100mbit": ("100mbit", None), "10mbit": ("10mbit", None), "drop": ("100mbit", "10mbit")}
_PICK_LINK = {"100mbit": "100 Mbit/s", "10mbit": "10 Mbit/s", "drop": "100 Mbit/s"}
_EXTRA = {"diloco": "", "diloco_time": ":rounds=time", "diloco_async": ":asynchronous=True"}
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pick_settings(link: str, hosts: int = 4, path: Optional[str] = None) -> str:
    """The DiLoCo settings ``picks.json`` gives at ``hosts`` hosts for ``link``, as ``:key=value`` pairs.

    Example:
        >>> pick_settings("100mbit")  # doctest: +SKIP
        ':sync_every=10:outer_lr=1.0:outer_momentum=0.5:outer_lr_warmup=10:compression=uint4'
    """
    path = path or os.path.join(_ROOT, "bagua", "advise", "picks.json")
    with open(path) as f:
        picks = json.load(f)
    for row in picks["rows"]:
        if row["hosts"] == hosts and row["link"] == _PICK_LINK[link]:
            if row["algorithm"] != "diloco":
                raise ValueError(f"picks.json picks {row['algorithm']} at {hosts} hosts, {link}; not DiLoCo")
            settings = row["settings"]
            for name, preset in picks["presets"].items():
                settings = settings.replace("{" + name + "}", preset)
            pairs = [p.strip().replace('"', "") for p in settings.split(",") if p.strip()]
            return "".join(f":{p}" for p in pairs)
    raise ValueError(f"picks.json has no row for {hosts} hosts at {_PICK_LINK[link]}")


def system_spec(name: str, link: str) -> str:
    """The system spec (:func:`benchmarks.common.systems.split_system`) of a benchmark system name at ``link``.

    Example:
        >>> system_spec("ddp", "100mbit"), system_spec("diloco_time:sync_every_max=40", "100mbit")[-31:]
        ('ddp', ':rounds=time:sync_every_max=40')
    """
    base, _, extra = name.partition(":")
    if base == "ddp":
        return name
    if base not in _EXTRA:
        raise ValueError(f"unknown system {base!r}; choose ddp, {', '.join(_EXTRA)}")
    return "diloco" + pick_settings(link) + ":hierarchical=False" + _EXTRA[base] + (":" + extra if extra else "")


def tokens_by(timeline: list, t: float, tokens_per_step: int) -> int:
    """Tokens a worker had trained on by time ``t``, from its ``[[time, steps], ...]`` timeline.

    Example:
        >>> tokens_by([[1.0, 1], [2.0, 2], [3.0, 3]], 2.5, 100)
        200
    """
    steps = 0
    for when, n in timeline:
        if when > t:
            break
        steps = n
    return steps * tokens_per_step


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the benchmark's arguments."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.unequal", description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="diloco,diloco_time", help="comma list: ddp, diloco, diloco_time, "
                                                                   "diloco_async (each may add :key=value)")
    p.add_argument("--profiles", default="equal,graded", help=f"comma list of {', '.join(PROFILES)}")
    p.add_argument("--links", default="100mbit", help=f"comma list of {', '.join(LINKS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds")
    p.add_argument("--target", type=float, required=True, help="validation loss to reach")
    p.add_argument("--max-steps", type=int, default=1500, help="per worker: its own steps")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is stopped as not reached")
    p.add_argument("--dip-from", type=int, default=100, help="dip: rank 3's own step where 0.3 starts")
    p.add_argument("--dip-steps", type=int, default=100)
    p.add_argument("--drop-period", type=float, default=90.0, help="drop: the run length the drop is placed in")
    p.add_argument("--step-s", type=float, default=0.0, help="0: pad by (1/s - 1) x the measured compute; T: pad "
                                                               "every step to T / s (unequal_worker)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--speeds", default=None, help="comma list: these speeds instead of the profile's (tests)")
    p.add_argument("--loopback", action="store_true", help="no namespaces or shaping (tests)")
    p.add_argument("--out-dir", default="docs/log/results")
    p.add_argument("--name", default="unequal-workers")
    return p.parse_args(argv)


def _speeds(args: argparse.Namespace, profile: str) -> list[float]:
    speeds = [float(s) for s in args.speeds.split(",")] if args.speeds else list(PROFILES[profile])
    if len(speeds) != args.hosts:
        raise ValueError(f"{len(speeds)} speeds for {args.hosts} hosts: pass --speeds with one per host")
    return speeds


def _worker_argv(args: argparse.Namespace, spec: str, profile: str, seed: int, run_dir: str) -> list[str]:
    speeds = _speeds(args, profile)
    argv = ["--system", spec, "--speeds", ",".join(str(s) for s in speeds), "--max-steps", str(args.max_steps),
            "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--block", str(args.block),
            "--batch-size", str(args.batch_size), "--seed", str(seed), "--dir", run_dir,
            "--step-s", str(args.step_s)]
    if profile == "dip":
        argv += ["--window", f"{DIP_RANK}:{DIP_SPEED}:{args.dip_from}:{args.dip_from + args.dip_steps}"]
    return argv


class _Evaluator:
    """Validation loss of saved weights, on this process's one thread."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from benchmarks.common.gpt import GPT, GPTConfig, load_text, validation_windows

        torch.set_num_threads(1)
        self.torch = torch
        cfg = GPTConfig(block_size=args.block, n_layer=args.n_layer, n_head=max(1, args.n_embd // 64),
                        n_embd=args.n_embd)
        self.model = GPT(cfg)
        _, val = load_text(1 << 16, 1 << 20)
        self.x, self.y = validation_windows(val, args.eval_samples, args.block)

    def loss(self, path: str, screen: bool = False) -> tuple[float, dict]:
        """The loss of the weights in ``path`` on every window, or (``screen``) on a quarter of them."""
        from benchmarks.common.gpt import lm_loss

        snap = self.torch.load(path)
        self.model.load_state_dict(snap["weights"])
        self.model.eval()
        x, y = (self.x[::4], self.y[::4]) if screen else (self.x, self.y)
        with self.torch.no_grad():
            return float(lm_loss(self.model(x), y)), snap


#: a snapshot whose screened loss is within this of the target gets the full evaluation
SCREEN_MARGIN = 0.05


def _first_hit(evaluator: _Evaluator, paths: list[str], target: float, curve: list) -> Optional[dict]:
    """Evaluate the newest snapshot (screened first, so the evaluation keeps pace with the workers); when it reached
    the target, walk back through the snapshots skipped before it to the first that did. Evaluated points go to
    ``curve`` as ``[steps, time s, loss]``; returns the first snapshot that reached the target, or ``None``."""
    screened, snap = evaluator.loss(paths[-1], screen=True)
    if screened > target + SCREEN_MARGIN:
        curve.append([snap["steps"], round(snap["time_s"], 3), None, round(screened, 4)])
        return None
    hit = None
    for path in reversed(paths):
        loss, snap = evaluator.loss(path)
        curve.append([snap["steps"], round(snap["time_s"], 3), round(loss, 4)])
        if loss > target:
            break
        hit = snap
    return hit


def run_one(cluster, args: argparse.Namespace, evaluator: _Evaluator, system: str, profile: str, link: str,
            seed: int, port: int) -> dict:
    """Train one (system, profile, link, seed) to the target; return its row (``status`` says how it ended)."""
    from benchmarks.common import netns
    from benchmarks.network import _child_env

    spec = system_spec(system, link)
    start_rate, drop_rate = LINKS[link]
    if cluster.emulated:
        cluster.shape(start_rate)
    run_dir = tempfile.mkdtemp(prefix="unequal-")
    row: dict = {"system": system, "spec": spec, "profile": profile, "speeds": _speeds(args, profile),
                 "link": link, "seed": seed, "target": args.target, "hosts": args.hosts,
                 "pad_rule": f"step {args.step_s} s / speed" if args.step_s else "(1/s - 1) x measured compute"}
    if profile == "dip":
        row["dip"] = {"rank": DIP_RANK, "speed": DIP_SPEED, "from": args.dip_from, "steps": args.dip_steps}
    procs, curve, hit = [], [], None
    row["load_start"] = [round(x, 2) for x in os.getloadavg()]  # the machine is shared: say how loaded it was
    start = time.monotonic()
    try:
        for host in cluster.hosts[: args.hosts]:
            argv = host.exec_prefix() + [sys.executable, "-m", "benchmarks.to_target.unequal_worker",
                                         *_worker_argv(args, spec, profile, seed, run_dir)]
            log = open(os.path.join(run_dir, f"rank{host.index}.log"), "w")
            procs.append(netns.popen(argv, _child_env(host, cluster.hosts[0], port, args.hosts), log, log))
        seen, pending, t0, phase = set(), [], None, 0
        while hit is None:
            if t0 is None and os.path.exists(os.path.join(run_dir, "start")):
                t0 = float(open(os.path.join(run_dir, "start")).read())
            if drop_rate and t0 is not None and cluster.emulated:
                elapsed = time.time() - t0
                if phase == 0 and elapsed >= args.drop_period / 3:
                    cluster.shape(drop_rate)
                    phase, row["drop_at_s"] = 1, elapsed
                elif phase == 1 and elapsed >= 2 * args.drop_period / 3:
                    cluster.shape(start_rate)
                    phase, row["recover_at_s"] = 2, elapsed
            new = sorted(set(glob.glob(os.path.join(run_dir, "snap*.pt"))) - seen)
            if new:
                pending += new
                seen.update(new)
                hit = _first_hit(evaluator, pending, args.target, curve)
                pending = [] if hit is None else pending
            # a worker that ran its --max-steps ends the run (peers inside an exchange with it then fail)
            done = any(p.poll() == 0 for p in procs)
            failed = not done and any(p.poll() not in (None, 0) for p in procs)
            if hit is None and (failed or done or time.monotonic() - start > args.timeout):
                row["status"] = ("failed" if failed else "not reached")
                break
            time.sleep(0.1)
        open(os.path.join(run_dir, "stop"), "w").close()
        deadline = time.monotonic() + 2  # each worker wrote its stats at its last outer step already
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        if cluster.emulated and drop_rate:
            cluster.shape(start_rate)
    row["wall_s"] = round(time.monotonic() - start, 1)
    row["load_end"] = [round(x, 2) for x in os.getloadavg()]
    row["curve"] = sorted(curve, key=lambda c: c[1])
    workers = []
    for rank in range(args.hosts):
        try:
            with open(os.path.join(run_dir, f"rank{rank}.json")) as f:
                workers.append(json.load(f))
        except (OSError, ValueError):
            workers.append({"rank": rank, "missing": True})
    tokens_per_step = args.batch_size * args.block
    if hit is not None:
        t = hit["time_s"]
        row.update(status="reached", time_to_target_s=round(t, 2), steps_to_target=hit["steps"],
                   tokens_to_target=sum(tokens_by(w.get("timeline", []), t, tokens_per_step) for w in workers),
                   worker_steps_to_target=[tokens_by(w.get("timeline", []), t, 1) for w in workers])
    elif "status" not in row:
        row["status"] = "not reached"
    if row["status"] == "failed":
        row["error"] = open(os.path.join(run_dir, f"rank{failed_rank(procs)}.log")).read()[-1500:]
    row["workers"] = [{k: v for k, v in w.items() if k not in ("timeline", "rounds")} for w in workers]
    row["rounds"] = workers[0].get("rounds") or None  # the system's per-round records, the same on every rank
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def failed_rank(procs: list) -> int:
    """The first process that exited with an error (0 when none did)."""
    return next((i for i, p in enumerate(procs) if p.returncode not in (None, 0)), 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the matrix in the order given (links, then profiles, then systems, then seeds); append each row."""
    from benchmarks.common import netns

    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, f"{args.name}.json")
    data = json.load(open(out)) if os.path.exists(out) else {"runs": [], "rows": []}
    data["runs"].append({"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                               time.gmtime())})
    evaluator = _Evaluator(args)
    ok, why = (False, "--loopback") if args.loopback else netns.netns_available()
    if not ok:
        print(f"unequal: no network emulation ({why}); loopback, unshaped", file=sys.stderr)
    netns.install_signal_handlers()
    cluster = (netns.NetnsCluster(args.hosts, prefix=f"ueq{os.getpid() % 100000}", subnet="10.232.0")
               if ok else netns.LoopbackCluster(args.hosts))
    port = 29600 + os.getpid() % 1000
    with cluster:
        for link in args.links.split(","):
            for profile in args.profiles.split(","):
                for system in args.systems.split(","):
                    for seed in (int(s) for s in args.seeds.split(",")):
                        port += 1
                        row = run_one(cluster, args, evaluator, system, profile, link, seed, port)
                        row["emulated"] = cluster.emulated
                        data["rows"].append(row)
                        with open(out + ".tmp", "w") as f:
                            json.dump(data, f, indent=1)
                        os.replace(out + ".tmp", out)
                        print(f"{link} {profile} {system} seed {seed}: {row['status']} "
                              f"t={row.get('time_to_target_s')} steps={row.get('steps_to_target')} "
                              f"wall={row['wall_s']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
