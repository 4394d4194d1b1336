"""The runs of ``bagua-bench --to-target``: convergence measured once, step time per network, over seeds.

For every host count and model, in this order (DDP first in each phase, since its steps set the others' budgets):

1. ``convergence``: every synchronous system trains to the target on unshaped links, once per seed
   (``--seeds``, or ``--seeds-of SYSTEM=N`` for one system). Its trajectory is the same on any link (the same
   gradients are combined in the same order, only later), so these steps to target hold at every bandwidth;
2. ``step_time``: every synchronous system runs ``--warmup`` + ``--steps`` steps at every bandwidth (seed 0),
   rounded up to whole rounds of a local-update system (:func:`~benchmarks.common.systems.steps_per_round`);
3. ``real``: every system whose trajectory depends on timing (:func:`timing_dependent`: asynchronous averaging,
   or an algorithm class that sets ``trajectory_depends_on_timing = True``, e.g. one overlapping communication
   with later steps) trains to the target for real at every bandwidth asked for (unshaped only when it is one of
   them), once per seed;
4. ``validation`` (``--validate SYSTEM@RATE``): one synchronous system trains to the target for real at a
   shaped bandwidth (seed 0), to check steps x step time against it (:func:`benchmarks.to_target.to_target_table.validate`).

Budgets: DDP trains for at most ``--max-steps``; every other system for 3x DDP's steps of the same seed
(``--budget-factor``).
:mod:`benchmarks.to_target.to_target_table` combines the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence
from benchmarks.to_target import to_target
from benchmarks.common.job import Job

__all__ = ["TIMING_DEPENDENT", "timing_dependent", "plan", "with_budget", "parse_validate", "parse_seeds_of"]

#: systems whose trajectory depends on when communication finishes, not only on the steps taken
TIMING_DEPENDENT = ("async",)


def timing_dependent(spec: str) -> bool:
    """Whether ``spec``'s trajectory depends on timing, so it must be run to the target at every bandwidth."""
    from benchmarks.common.systems import DDP_SYSTEMS, load_algorithm_modules, split_system
    from bagua.torch_api.algorithms import GlobalAlgorithmRegistry

    name = split_system(spec)[0]
    if name in TIMING_DEPENDENT:
        return True
    if name in DDP_SYSTEMS:
        return False
    load_algorithm_modules()
    return bool(getattr(GlobalAlgorithmRegistry.get(name), "trajectory_depends_on_timing", False))


def parse_validate(items: Sequence[str]) -> list[tuple[str, str]]:
    """``SYSTEM@RATE`` items as (system, rate) pairs."""
    out = []
    for item in items:
        system, sep, rate = item.rpartition("@")
        if not sep or not system or not rate:
            raise ValueError(f"--validate {item!r}: write SYSTEM@RATE, e.g. ddp@1gbit")
        out.append((system, rate))
    return out


def parse_seeds_of(items: Sequence[str]) -> dict[str, int]:
    """``SYSTEM=N`` items (``--seeds-of``) as a dict; the system may carry arguments (``diloco:sync_every=10=1``
    reads as system ``diloco:sync_every=10``, 1 seed)."""
    out = {}
    for item in items:
        system, sep, count = item.rpartition("=")
        if not sep or not system or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--seeds-of {item!r}: write SYSTEM=N with N >= 1, e.g. ddp_fp16=1")
        out[system] = int(count)
    return out


def plan(args: argparse.Namespace, systems: Sequence[str], rates: Sequence[Optional[int]]) -> list:
    """The jobs of a ``--to-target`` suite run, in the order they must run (see the module docstring)."""
    from benchmarks.common.netns import parse_rate
    from benchmarks.common.systems import steps_per_round

    systems = sorted(systems, key=lambda s: s != "ddp")
    timed = {s: timing_dependent(s) for s in systems}
    seeds_of = getattr(args, "seeds_of", {})
    unknown = sorted(set(seeds_of) - set(systems))
    if unknown:
        raise ValueError(f"--seeds-of names systems that are not in --systems: {unknown}")
    first = getattr(args, "first_seed", 0)  # a campaign continued with more seeds: --first-seed 1
    step_times_only = getattr(args, "step_times_only", False)
    seeds = {s: range(first, first + seeds_of.get(s, args.seeds)) for s in systems}
    validations = [(s, parse_rate(r)) for s, r in args.validate]
    shaped = [r for r in rates if r is not None]
    jobs = []
    for hosts in args.hosts:
        for model in args.models:
            d = to_target.DEFAULTS[model]
            tt = {"target": args.targets.get(model, d.target), "eval_every": args.eval_every or d.eval_every,
                  "eval_samples": d.eval_samples if args.eval_samples is None else args.eval_samples,
                  "max_steps": args.max_steps or d.max_steps,
                  "qadam_warmup": getattr(args, "qadam_warmup", None)}

            def job(system: str, rate: Optional[int], phase: str, seed: int = 0, **kw) -> Job:
                warmup, steps = args.steps_at.get(rate, (args.warmup, args.steps))
                period = steps_per_round(system)
                steps = -(-steps // period) * period
                return Job(model, system, hosts, rate, warmup, steps, args.epochs, args.batch_size, seed=seed,
                           phase=phase, **kw)

            for system in systems:
                for seed in seeds[system]:
                    if timed[system]:
                        if None in rates:  # a timing-dependent system runs on the links asked for only
                            jobs.append(job(system, None, "real", seed, **tt))
                    elif not step_times_only:
                        jobs.append(job(system, None, "convergence", seed, **tt))
            # unshaped step times go with the unshaped convergence runs; only asked for, with --step-times-only
            unshaped = [None] if None in rates or not step_times_only else []
            for rate in unshaped + shaped:
                jobs += [job(s, rate, "step_time") for s in systems if not timed[s]]
            for rate in shaped:
                jobs += [job(s, rate, "real", seed, **tt) for s in systems if timed[s] for seed in seeds[s]]
            for system, rate in validations:
                if rate in shaped and not timing_dependent(system):
                    jobs.append(job(system, rate, "validation", 0, **tt))
    return jobs


def with_budget(job, rows: Sequence[dict], factor: float = to_target.BUDGET_FACTOR):
    """A non-DDP to-target job with its step budget and QAdam warmup from DDP's convergence row of the same
    model, hosts and seed; without such a row the job keeps its own budget and QAdam warmup
    (``--max-steps``, ``--qadam-warmup``)."""
    if job.target is None or job.system == "ddp":
        return job
    ddp = [r for r in rows if (r["model"], r["hosts"], r["system"], r.get("phase"), r.get("seed", 0)) ==
           (job.model, job.hosts, "ddp", "convergence", job.seed)]
    budget, qadam_warmup = to_target.step_budget(ddp[-1] if ddp else None, job.max_steps, factor)
    return dataclasses.replace(job, max_steps=budget, qadam_warmup=job.qadam_warmup if qadam_warmup is None
                               else qadam_warmup)
