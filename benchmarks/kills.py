"""The kill schedules of the fault benchmarks (:mod:`benchmarks.fault_kill`, :mod:`benchmarks.fault_gpt`).

Fault tolerance: :func:`kill_due` SIGKILLs w1, w2, w3, w1, ... in turn at the planned job steps and restarts the
victim at once; :func:`rejoin_times` reads from the restarted worker's lines when it healed and synchronized again.
The restart baseline: :class:`RestartKills` kills rank 1, 2, 3, ... of successive attempts under the elastic agent
and records when all ranks stepped again; :func:`kill_by_cmdline` ends the ranks left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["WORKERS", "kill_due", "rejoin_times", "RestartKills", "kill_by_cmdline"]

#: the benchmarks' workers (processes, or hosts); w0 is never killed
WORKERS = 4


def kill_due(current: dict[int, Any], kills: list[dict[str, Any]], plan: list[int],
             spawn: Callable[[int], Any]) -> list[int]:
    """Once any worker reached ``plan[0]``, SIGKILL the next victim (w1, w2, w3, w1, ...) and restart it at once with
    ``spawn``; record the kill in ``kills`` (its new life under ``"life"``, for :func:`rejoin_times`); return the
    rest of the plan."""
    if not plan or max(life.step for life in current.values()) < plan[0]:
        return plan
    victim = 1 + len(kills) % (WORKERS - 1)
    current[victim].kill()
    kills.append({"victim": f"w{victim}", "step": current[victim].step, "t": time.time()})
    current[victim] = spawn(victim)
    kills[-1]["life"] = current[victim]
    return plan[1:]


def rejoin_times(kills: list[dict[str, Any]]) -> None:
    """Replace each kill's ``"life"`` with what the restarted worker's lines said: when it healed ("joined"), the
    heal's seconds and bytes, and its first own synchronization, in seconds after the kill."""
    for k in kills:
        life = k.pop("life")
        j, t = life.joined or {}, k["t"]
        k |= {"healed_after_s": j["t"] - t if j else None, "joined_step": j.get("step"), "heal_s": j.get("heal_s"),
              "heal_bytes": j.get("heal_bytes"), "first_sync_after_s": life.first_sync_t and life.first_sync_t - t}


class RestartKills:
    """The restart baseline's schedule, read from the ranks' lines under the elastic agent: kill ``k`` SIGKILLs rank
    ``1 + k % 3`` of attempt ``k`` once that attempt reached ``plan[k]``; ``kills`` records each, and when all ranks
    stepped again (``back_after_s``) from which step."""

    def __init__(self, plan: list[int]) -> None:
        self.plan, self.kills = list(plan), []  # type: list[int], list[dict[str, Any]]
        self.pids: dict[tuple[int, int], int] = {}  # (attempt, rank) -> pid
        self.attempt_step = {0: 0}  # attempt -> the highest step its ranks printed

    def see(self, lines: list[dict[str, Any]]) -> None:
        for line in lines:
            if line["kind"] == "joined":
                self.pids[(int(line["attempt"]), int(line["rank"]))] = int(line["pid"])
            elif line["kind"] == "step":
                a = int(line["attempt"])
                self.attempt_step[a] = max(self.attempt_step.get(a, 0), int(line["step"]))
                if a and a == len(self.kills) and "back_after_s" not in self.kills[-1]:
                    self.kills[-1] |= {"back_after_s": line["t"] - self.kills[-1]["t"],
                                       "resumed_step": int(line["step"]) - 1}

    def kill_due(self) -> None:
        victim, a = 1 + len(self.kills) % (WORKERS - 1), len(self.kills)  # kill k in attempt k, by its own lines
        if self.plan and self.attempt_step.get(a, 0) >= self.plan[0] and (a, victim) in self.pids:
            os.kill(self.pids[(a, victim)], signal.SIGKILL)
            self.kills.append({"victim": f"rank{victim}", "step": self.attempt_step[a], "t": time.time()})
            self.plan = self.plan[1:]


def kill_by_cmdline(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker`` (ranks in sessions of their own, left behind)."""
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if marker in (proc / "cmdline").read_text(errors="replace"):
                os.kill(int(proc.name), signal.SIGKILL)
