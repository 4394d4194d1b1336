"""The kill schedules of the fault benchmarks (:mod:`benchmarks.fault.fault_kill`, :mod:`benchmarks.fault.fault_gpt`).

Fault tolerance: :func:`kill_due` SIGKILLs w1, w2, w3, w1, ... in turn at the planned job steps and restarts the
victim at once; :func:`rejoin_times` reads from the restarted worker's lines when it healed and synchronized again.
The restart baseline: :class:`RestartKills` kills rank 1, 2, 3, ... of successive attempts under the elastic agent
and records when all ranks stepped again; :func:`kill_by_cmdline` ends the ranks left behind.

Both benchmarks' workers print their progress with :func:`say`; the supervisor runs each worker (or the restart
agent) as a :class:`Life`, which reads those lines back, and watches them with :func:`supervise` (fault tolerance)
or :func:`supervise_agent` (the restart baseline).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["WORKERS", "kill_due", "supervise", "rejoin_times", "RestartKills", "supervise_agent", "kill_by_cmdline",
           "say", "parse_line", "Life", "fail"]

ROOT = Path(__file__).resolve().parents[2]

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


def supervise(current: dict[int, Any], lives: list[Any], spawn: Callable[[int], Any], plan: list[int],
              kills: list[dict[str, Any]], done: Callable[[], bool], mode: str, deadline: float,
              coordinator: Any = None) -> None:
    """Watch the fault-tolerant workers ``current`` (index -> :class:`Life`) until ``done()``, reading their lines:
    SIGKILL and restart one on ``plan`` (:func:`kill_due`, recorded in ``kills``); raise :func:`fail` if a worker
    exits with an error or the wall clock passes ``deadline``. Then, or on any error, kill every one of ``lives``
    (all the processes ``spawn`` started) and the ``coordinator``."""
    try:
        while True:
            for life in current.values():
                life.read()
            if done():
                break
            plan = kill_due(current, kills, plan, spawn)
            codes = {i: life.poll() for i, life in current.items()}
            if any(c not in (None, 0) for c in codes.values()):
                raise fail(f"{mode}: a worker failed, exit codes {codes}", current.values())
            if time.time() > deadline:
                raise fail(f"{mode}: the run did not finish within its --timeout", current.values())
            time.sleep(0.05)
    finally:
        for life in lives:
            life.kill()
        if coordinator is not None:
            coordinator.kill()
            coordinator.wait()


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


def supervise_agent(agent: Life, schedule: RestartKills, done: Callable[[], bool], mode: str, deadline: float,
                    marker: str) -> None:
    """Watch the elastic agent's ranks until the agent exits or ``done()``, killing on ``schedule``; raise
    :func:`fail` past ``deadline`` (wall clock). Then, or on any error, kill the agent and every process whose
    command line holds ``marker`` (the ranks run in sessions of their own)."""
    try:
        while agent.poll() is None:
            schedule.see(agent.read())
            if done():
                break
            schedule.kill_due()
            if time.time() > deadline:
                raise fail(f"{mode}: the run did not finish within its --timeout", [agent])
            time.sleep(0.05)
    finally:
        agent.kill()
        kill_by_cmdline(marker)


def kill_by_cmdline(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker`` (ranks in sessions of their own, left behind)."""
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if marker in (proc / "cmdline").read_text(errors="replace"):
                os.kill(int(proc.name), signal.SIGKILL)


# -- the workers' lines, and the processes that print them --------------------------------------------------


def say(kind: str, **fields: Any) -> None:
    """One line the supervisor reads: ``kind key=value ... t=<wall clock>``."""
    line = " ".join([kind, *(f"{k}={v}" for k, v in fields.items()), f"t={time.time():.3f}"])
    sys.stdout.write(line + "\n")  # one write: ranks share the agent's stdout, unbuffered under PYTHONUNBUFFERED
    sys.stdout.flush()


def parse_line(line: str) -> dict[str, Any]:
    kind, _, rest = line.partition(" ")
    if kind == "result":
        return {"kind": kind, **json.loads(rest)}
    if kind in ("joined", "step"):
        try:
            return {"kind": kind, **{k: float(v) for k, v in (f.split("=", 1) for f in rest.split())}}
        except ValueError:  # two ranks' lines interleaved in the agent's pipe: the next line says it again
            return {"kind": None, "text": line}
    return {"kind": None, "text": line}


class Life:
    """One process (a worker, or the restart agent) in a session of its own, and what its log said so far."""

    def __init__(self, cmd: list[str], log: Path, extra: Optional[dict[str, str]] = None) -> None:
        from bagua.torch_api import env

        child = env.environ_snapshot() | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | (extra or {})
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.log, self.lines, self._offset = log, [], 0
        self.step = self.last_sync = 0  # the highest step printed; the step of the last synchronization
        self.joined: Optional[dict[str, Any]] = None  # the "joined" line: healed, resumed or started
        self.first_sync_t: Optional[float] = None  # wall clock of its first synchronization in the loop
        self.end_t: Optional[float] = None  # wall clock when the supervisor saw it exit

    def read(self) -> list[dict[str, Any]]:
        """Parse the complete lines written since the last call."""
        with self.log.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        data = data[:data.rfind(b"\n") + 1]
        self._offset += len(data)
        new = [parse_line(line) for line in data.decode(errors="replace").splitlines()]
        for line in new:
            if line["kind"] == "joined" and self.joined is None:
                self.joined, self.last_sync = line, int(line["step"])
            elif line["kind"] == "step":
                self.step = max(self.step, int(line["step"]))
                if line["sync"]:
                    self.last_sync, self.first_sync_t = int(line["step"]), self.first_sync_t or line["t"]
        self.lines += new
        return new

    def poll(self) -> Optional[int]:
        rc = self.proc.poll()
        self.end_t = self.end_t or (time.time() if rc is not None else None)
        return rc

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its session's group: the agent's children too
        self.proc.wait()


def fail(what: str, lives: Any) -> RuntimeError:
    """An error with the last lines of each log."""
    tails = [f"--- {x.log.name}\n" + "\n".join(x.log.read_text(errors="replace").splitlines()[-25:]) for x in lives]
    return RuntimeError("\n".join([what, *tails]))
