"""Where a ByteGrad step's time goes: per-step event times and CPU per thread, 2 emulated hosts.

Starts two hosts in network namespaces (``benchmarks.common.netns``, tbf on both ends of each link), trains the
25 M-parameter MLP of the network benchmark (or, with ``--model gpt``, the GPT language model) with ByteGrad on them, and records in every step (times in ms from
the step's start, medians over the steps after ``--skip``):

- ``fwd``: end of the forward; ``ready<i>``: gradient of bucket ``i`` complete (the autograd hook);
- ``b<i>s`` / ``b<i>e``: bucket ``i``'s run on the communication thread starts / ends;
- ``b1_send``: first segment of bucket 1 handed to ``isend``; ``b1_scatter`` / ``b1_gather``: the last
  segment of each phase of bucket 1 received; ``bwd``: backward returned (all buckets done); ``end``: after
  ``optimizer.step()``.

and the CPU time per step of each thread (``/proc/self/task``, summed by thread name; ``main`` is the main
thread) and of each codec function. ``--noop-codec`` replaces the codec with functions that do nothing (the bytes
on the wire are the same, the values wrong): the step it gives is the floor that a free codec would reach. Needs root (network namespaces). Example::

    sudo .venv/bin/python benchmarks/codecs/bytegrad_timeline.py --rate 1gbit --steps 24
    sudo .venv/bin/python benchmarks/codecs/bytegrad_timeline.py --rate 1gbit --steps 24 --noop-codec
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

# the clone's root, for `benchmarks` when run as a file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

__all__: list[str] = []

CODEC = ("chunk_minmax", "pieces_minmax", "encode_chunks", "encode_pieces", "decode_sum_chunks", "decode_chunks")


def _thread_cpu_ms() -> dict[int, tuple[str, float]]:
    """CPU milliseconds (user + system) of every live thread of this process: thread id -> (name, ms)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(os.path.basename(task))] = (name, (int(fields[11]) + int(fields[12])) * 1000 / ticks)
    return out


def _cpu_per_step(start: dict[int, tuple[str, float]], end: dict[int, tuple[str, float]], steps: int) -> dict:
    """CPU ms per step between two :func:`_thread_cpu_ms` readings, summed by thread name; the main thread is
    ``main`` (the other ``python`` thread is the communication thread: Python does not name its threads)."""
    out: dict[str, float] = {}
    for tid, (name, ms) in end.items():
        spent = ms - start.get(tid, (name, 0.0))[1]
        if spent > 0:
            key = "main" if tid == os.getpid() else name
            out[key] = round(out.get(key, 0.0) + spent / steps, 1)
    return out


class _Recorder:
    """Event times of the current step and codec CPU totals; installs its wrappers into ``bytegrad``."""

    def __init__(self, noop: bool) -> None:
        import torch
        import torch.distributed as dist

        from bagua.torch_api.codecs import compressed_allreduce as bytegrad  # the 8-bit collective ByteGrad runs

        self.t0 = 0.0
        self.events: dict[str, float] = {}
        self.codec_cpu: dict[str, float] = {name: 0.0 for name in CODEC}
        self.lock = threading.Lock()
        self.bucket = ""
        for name in CODEC:
            setattr(bytegrad, name, self._timed(name, getattr(bytegrad, name), noop))
        if noop:
            fixed = torch.tensor([-1.0, 1.0])
            bytegrad.pieces_minmax = lambda pieces: fixed
            bytegrad.chunk_minmax = lambda x: fixed.expand(x.shape[0], 2).clone()
        recorder = self

        class _Work:
            def __init__(self, work: Any, phase: str) -> None:
                self.work, self.phase = work, phase

            def wait(self, *a: Any) -> Any:
                result = self.work.wait(*a)
                recorder.mark(f"{recorder.bucket}_{self.phase}", last=True)
                return result

        class _Dist:
            def __getattr__(self, name: str) -> Any:
                return getattr(dist, name)

            def isend(self, *a: Any, **k: Any) -> Any:
                recorder.mark(f"{recorder.bucket}_send", last=False)
                return dist.isend(*a, **k)

            def irecv(self, *a: Any, **k: Any) -> Any:
                return _Work(dist.irecv(*a, **k), "scatter")

        gather = bytegrad._all_gather_single
        bytegrad.dist = _Dist()
        bytegrad._all_gather_single = lambda *a, **k: _Work(gather(*a, **k), "gather")

    def _timed(self, name: str, fn: Callable, noop: bool) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.thread_time()
            result = None if noop else fn(*a, **k)
            with self.lock:
                self.codec_cpu[name] += (time.thread_time() - start) * 1e3
            return result

        return wrapper

    def mark(self, key: str, last: bool = True) -> None:
        """Record ``key`` now; with ``last=False`` keep the first time it happened in the step."""
        now = (time.perf_counter() - self.t0) * 1e3
        with self.lock:
            if last or key not in self.events:
                self.events[key] = now


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import bagua.torch_api as bagua
    from benchmarks.common import models
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm

    torch.set_num_threads(1)
    recorder = _Recorder(args.noop_codec)
    bagua.init_process_group()
    rank = dist.get_rank()
    spec = models.MODELS[args.model]
    model = models.build_model(args.model)
    opt = (torch.optim.SGD(model.parameters(), lr=spec.lr) if spec.optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=spec.lr))
    # the no-op codec leaves garbage headers: no NaN/Inf policy then
    model = model.with_bagua([opt], ByteGradAlgorithm(nonfinite="ignore" if args.noop_codec else "raise"))
    engine = model.bagua_ddp
    for bucket in engine.bagua_buckets:
        run = bucket.execute

        def timed(run: Callable = run, name: str = bucket.name) -> None:
            recorder.bucket = f"b{name}"
            recorder.mark(f"b{name}s")
            run()
            recorder.mark(f"b{name}e")

        bucket.execute = timed
        for tensor in bucket.tensors:  # the last of them to be ready
            tensor.param.register_post_accumulate_grad_hook(lambda p, name=bucket.name: recorder.mark(f"ready{name}"))
    batches, _ = models.train_batches(
        argparse.Namespace(model=args.model, batch_size=args.batch_size or spec.batch_size, warmup=0,
                           steps=args.steps, seed=0, epochs=1), rank, dist.get_world_size())
    loss_fn = models.loss_fn(spec)
    steps, cpu_start, codec_start = [], {}, {}
    # One barrier before the steps, none inside: a gloo barrier at every step start made the forward and backward
    # of the GPT at batch 2 about twice as slow (fwd 128 ms instead of 60; a step of 471 ms against 265 ms), while
    # the benchmark suite, which has no such barrier, measures about 280 ms. Each rank's events are relative to
    # its own step start, so nothing needs the ranks aligned.
    dist.barrier()
    for i in range(args.steps):
        if i == args.skip:
            cpu_start, codec_start = _thread_cpu_ms(), dict(recorder.codec_cpu)
        recorder.events = {}
        recorder.t0 = time.perf_counter()
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        recorder.mark("fwd")
        loss.backward()
        recorder.mark("bwd")
        opt.step()
        recorder.mark("end")
        steps.append(dict(recorder.events))
    timed = steps[args.skip :]
    cpu_end = _thread_cpu_ms()
    keys = sorted({k for s in timed for k in s}, key=lambda k: statistics.median(s.get(k, 0.0) for s in timed))
    result = {
        "rank": rank,
        "events_ms": {k: round(statistics.median(s[k] for s in timed if k in s), 1) for k in keys},
        "thread_cpu_ms_per_step": _cpu_per_step(cpu_start, cpu_end, len(timed)),
        "codec_cpu_ms_per_step": {
            k: round((v - codec_start.get(k, 0.0)) / len(timed), 2) for k, v in recorder.codec_cpu.items()
        },
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _launch(args: argparse.Namespace) -> int:
    import tempfile
    from benchmarks.common import netns
    from benchmarks import network
    out = tempfile.mkdtemp(prefix="bytegrad-timeline-")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out, "--steps", str(args.steps),
            "--skip", str(args.skip), "--batch-size", str(args.batch_size), "--model", args.model] + (["--noop-codec"] * args.noop_codec)
    with netns.NetnsCluster(2) as cluster:
        cluster.shape(args.rate)
        procs = []
        for host in cluster.hosts:
            child = network._child_env(host, cluster.hosts[0], 29631, 2)
            child["PYTHONPATH"] = os.pathsep.join([os.getcwd(), child.get("PYTHONPATH", "")])
            procs.append(subprocess.Popen(host.exec_prefix() + argv, env=child))
        codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        print(f"workers exited with {codes}", file=sys.stderr)
        return 1
    results = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    print(f"ByteGrad, {args.model}, 2 hosts at {args.rate}, batch {args.batch_size or 'default'}, "
          f"{'no-op codec, ' if args.noop_codec else ''}medians over {args.steps - args.skip} steps")
    for r in results:
        print(f"\nrank {r['rank']} events (ms from step start):")
        print("  " + "  ".join(f"{k}={v:g}" for k, v in r["events_ms"].items()))
        print("  CPU ms/step by thread: " + ", ".join(f"{k} {v:g}" for k, v in r["thread_cpu_ms_per_step"].items()))
        print("  codec CPU ms/step: " + ", ".join(f"{k} {v:g}" for k, v in r["codec_cpu_ms_per_step"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rate": args.rate, "noop_codec": args.noop_codec, "ranks": results}, f, indent=1)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="link rate of each host, as tc writes it")
    parser.add_argument("--steps", type=int, default=24, help="steps in all")
    parser.add_argument("--skip", type=int, default=4, help="first steps left out of the medians")
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt", "resnet", "gpt_tiny", "tiny"],
                        help="benchmark model (benchmarks.common.models): the MLP, or the GPT language model")
    parser.add_argument("--batch-size", type=int, default=0, help="per-host batch size (0: the model's own)")
    parser.add_argument("--noop-codec", action="store_true", help="replace the codec by no-ops (the floor)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the workers are given up")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.skip >= args.steps:
        parser.error(f"--skip {args.skip} leaves no step of --steps {args.steps} to time")
    if args.worker:
        _worker(args)
        return 0
    return _launch(args)


if __name__ == "__main__":
    sys.exit(main())
