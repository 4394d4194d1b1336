"""One run of the network suite (:mod:`benchmarks.network`): what :mod:`benchmarks.common.workload` trains,
on how many hosts, over which link, and, in time-to-accuracy mode, to which target and in which phase.

Example:
    >>> Job("gpt", "ddp", 2, 10**8, warmup=1, steps=3, epochs=1).describe()
    '2 hosts 100mbit gpt ddp'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from benchmarks.common import netns
__all__ = ["Job"]


@dataclass(frozen=True)
class Job:
    """One training run: a model, a system, a host count and a link rate (``None``: unshaped)."""

    model: str
    system: str
    hosts: int
    rate: Optional[int]
    warmup: int
    steps: int
    epochs: int
    batch_size: Optional[int] = None  # None: the model's own (workload.MODELS)
    target: Optional[float] = None  # time-to-accuracy mode (benchmarks.to_target.to_target) when set
    eval_every: Optional[int] = None
    eval_samples: Optional[int] = None
    max_steps: Optional[int] = None
    qadam_warmup: Optional[int] = None
    seed: int = 0
    phase: Optional[str] = None  # time-to-accuracy phase (benchmarks.to_target.to_target_plan)

    def workload_args(self) -> list[str]:
        """The job's own arguments of ``python -m benchmarks.common.workload`` (options left unset are omitted)."""
        argv = ["--system", self.system, "--model", self.model, "--warmup", str(self.warmup), "--steps",
                str(self.steps), "--epochs", str(self.epochs)]
        for flag, value in (("--batch-size", self.batch_size), ("--target", self.target),
                            ("--eval-every", self.eval_every), ("--eval-samples", self.eval_samples),
                            ("--max-steps", self.max_steps), ("--qadam-warmup", self.qadam_warmup),
                            ("--seed", self.seed or None)):
            if value is not None:
                argv += [flag, str(value)]
        return argv

    @property
    def bandwidth(self) -> str:
        return netns.format_rate(self.rate)

    def describe(self) -> str:
        seed = f" seed {self.seed}" if self.phase in ("convergence", "real") else ""
        return f"{self.hosts} hosts {self.bandwidth} {self.model} {self.system}" + (f" {self.phase}{seed}"
                                                                                     if self.phase else "")

