"""One multi-process harness for every distributed test.

``run_workers(fn, world_size, *args)`` starts ``world_size`` CPU processes, rendezvouses them through a
``FileStore`` in a fresh temporary directory (no port races), runs the module-level function
``fn(rank, world_size, *args)`` in each after ``bagua.init_process_group``, and returns the per-rank results in
rank order. A worker's exception comes back with its traceback and fails the test; a worker that does not
finish within ``timeout`` seconds fails it too, and every process is killed. The process group is always
destroyed.

Workers come from a forkserver that has imported torch once (``_PRELOAD``), not from a fresh interpreter each:
importing torch took about 1.2 s of CPU per worker, most of a short test's time on 2 cores. Each worker still gets
the parent's environment and working directory of the moment it starts, as a spawned process would, and imports
bagua and the test module itself.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

__all__ = ["run_workers", "WorkerError"]


class WorkerError(AssertionError):
    """A worker raised; the message carries its rank and traceback."""


def _entry(fn, rank, world_size, local_size, args, store_path, environ, env, results, init_bagua):
    # The forkserver was started with the environment of the first test that used it; give this worker the
    # parent's environment of now, as a spawned process would have it.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % local_size),
            "LOCAL_WORLD_SIZE": str(local_size),
            "NODE_RANK": str(rank // local_size),
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init_bagua:
            import bagua.torch_api as bagua

            store = dist.FileStore(store_path, world_size)
            bagua.init_process_group(store=store, rank=rank, world_size=world_size, local_world_size=local_size)
        # Tensors go back as bytes: torch's shared-memory pickling would need this process alive to read them.
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Imported once in the forkserver. None of these reads an environment variable at import time that a test sets;
# bagua (whose settings tests change through the environment) is imported by each worker.
_PRELOAD = ["torch", "torch.distributed", "pytest"]
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(_PRELOAD)


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    local_size: Optional[int] = None,
    env: Optional[dict] = None,
    timeout: float = 120.0,
    init_bagua: bool = True,
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return results by rank.

    ``local_size`` ranks share a "node" (``LOCAL_WORLD_SIZE``), so 4 ranks with ``local_size=2`` emulate two
    nodes of two processes each. By default every rank is a node of its own, as on emulated hosts: hierarchical
    algorithms then run their flat form (on one node of several ranks they would train the node average). ``env``
    is added to every worker's environment.
    """
    ctx = _CTX
    results = ctx.Queue()
    local_size = local_size or 1
    with tempfile.TemporaryDirectory(prefix="bagua-test-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world_size, local_size, args, store_path, dict(os.environ), env, results, init_bagua),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        exited_at: dict[int, float] = {}
        try:
            while len(out) < world_size:
                try:
                    rank, ok, value = results.get(timeout=0.2)
                except queue.Empty:
                    now = time.monotonic()
                    for r, p in enumerate(procs):
                        if r not in out and p.exitcode is not None:
                            # give a result already in the queue a moment to arrive before blaming the process
                            if now - exited_at.setdefault(r, now) > 2.0:
                                raise WorkerError(f"rank {r} exited with code {p.exitcode} without reporting")
                    if now > deadline:
                        missing = sorted(set(range(world_size)) - set(out))
                        raise WorkerError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
                    continue
                if not ok:
                    raise WorkerError(f"rank {rank} failed:\n{value}")
                import torch

                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]
