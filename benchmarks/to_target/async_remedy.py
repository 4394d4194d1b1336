"""Choose asynchronous DiLoCo's staleness remedy: a small simulation on CPU, one process, a few seconds per run.

``N`` workers of the given speeds train a small MLP classifier (inputs 32, hidden 64, 8 classes, labels from a
fixed random teacher), each on its own non-IID shard (each worker sees mostly two of the classes), with AdamW
inner steps (lr 3e-3, batch 32) and ``sync_every`` steps per round. Time is simulated: a round of worker ``i``
takes ``H / speed_i``. Asynchronous runs apply each worker's pseudo-gradient when its round ends (the order of
the events, ties by worker), through :class:`~bagua.torch_api.ops.diloco_async_outer.AsyncOuter`, the code the
library runs; the synchronous baseline waits for the slowest worker every round and takes torch's SGD step on
the mean. Each run stops at the same simulated time; the figure is the loss on held-out data from all classes.

    .venv/bin/python benchmarks/to_target/async_remedy.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import heapq
import statistics

import torch

from bagua.torch_api.ops.diloco_async_outer import REMEDIES, AsyncOuter

__all__ = ["simulate"]

DIM, HIDDEN, CLASSES, BATCH = 32, 64, 8, 32


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _load(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class _Data:
    def __init__(self, seed: int, workers: int) -> None:
        g = torch.Generator().manual_seed(1000 + seed)
        self.teacher = torch.randn(DIM, CLASSES, generator=g)
        self.gen = [torch.Generator().manual_seed(2000 + 97 * seed + w) for w in range(workers)]
        self.workers = workers
        x = torch.randn(2048, DIM, generator=g)
        self.eval = (x, self._labels(x))

    def _labels(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.teacher).argmax(1)

    def batch(self, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        # non-IID: 75 % of a worker's samples are of its two classes (rejection from the teacher's labels)
        g = self.gen[worker]
        x = torch.randn(BATCH * 8, DIM, generator=g)
        y = self._labels(x)
        mine = (y % self.workers) == worker
        keep = torch.cat([x[mine][: BATCH * 3 // 4], x[~mine][: BATCH - min(int(mine.sum()), BATCH * 3 // 4)]])
        return keep, self._labels(keep)


def _eval(model: torch.nn.Module, data: _Data) -> float:
    with torch.no_grad():
        x, y = data.eval
        return float(torch.nn.functional.cross_entropy(model(x), y))


def simulate(speeds: list[float], mode: str, seed: int, H: int, budget: float, lr: float, momentum: float,
             warmup: int) -> float:
    """Eval loss at simulated time ``budget`` for ``mode``: ``"sync"``, or one of ``REMEDIES``, optionally with
    ``"+dylu"`` (each worker's rounds ``round(H * speed / fastest)`` steps)."""
    n = len(speeds)
    data = _Data(seed, n)
    models = [_model(seed) for _ in range(n)]
    inner = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0) for m in models]
    global_ = _flat(models[0]).clone()

    def round_of(w: int) -> torch.Tensor:
        base = global_.clone()
        _load(models[w], base)
        for _ in range(H):
            x, y = data.batch(w)
            inner[w].zero_grad()
            torch.nn.functional.cross_entropy(models[w](x), y).backward()
            inner[w].step()
        return base - _flat(models[w])

    if mode == "sync":
        outer_param = torch.nn.Parameter(global_)
        opt = torch.optim.SGD([outer_param], lr=lr, momentum=momentum, nesterov=momentum > 0)
        now, k = 0.0, 0
        while now + H / min(speeds) <= budget:
            deltas = [round_of(w) for w in range(n)]
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (k + 1) / warmup) if warmup else lr
            outer_param.grad = torch.stack(deltas).mean(0)
            opt.step()
            global_ = outer_param.detach()
            now += H / min(speeds)
            k += 1
    else:
        remedy, _, dylu = mode.partition("+")
        # "+dylu": Async Local-SGD's dynamic local updates, each worker's H proportional to its speed
        steps = [max(1, round(H * s / max(speeds))) if dylu else H for s in speeds]
        outer = AsyncOuter(global_, n, lr, momentum, True, warmup, remedy=remedy)
        bases = [0] * n
        events = [(steps[w] / speeds[w], w) for w in range(n)]
        heapq.heapify(events)
        starts = {w: global_.clone() for w in range(n)}
        while events and events[0][0] <= budget:
            now, w = heapq.heappop(events)
            start = starts[w]
            _load(models[w], start)
            for _ in range(steps[w]):
                x, y = data.batch(w)
                inner[w].zero_grad()
                torch.nn.functional.cross_entropy(models[w](x), y).backward()
                inner[w].step()
            outer.apply(w, steps[w], bases[w], start - _flat(models[w]))
            bases[w] = outer.version
            starts[w] = global_.clone()
            heapq.heappush(events, (now + steps[w] / speeds[w], w))
    final = _model(seed)
    _load(final, global_)
    return _eval(final, data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--budget", type=float, default=300.0, help="simulated time (a speed-1 step takes 1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    profiles = {"1,1": [1.0, 1.0], "1,0.5": [1.0, 0.5], "1,0.8,0.6,0.4": [1.0, 0.8, 0.6, 0.4]}
    outers = {"lr1 m0.5 warm10": (1.0, 0.5, 10), "lr0.7 m0.9": (0.7, 0.9, 0)}
    print(f"eval loss at simulated time {args.budget} (mean over seeds {args.seeds}; lower is better)")
    for oname, (lr, m, warm) in outers.items():
        for pname, speeds in profiles.items():
            row = []
            for mode in ("sync",) + REMEDIES + ("delayed_nesterov+dylu",):
                losses = [simulate(speeds, mode, s, args.sync_every, args.budget, lr, m, warm) for s in args.seeds]
                row.append(f"{mode}={statistics.mean(losses):.4f}±{statistics.pstdev(losses):.4f}")
            print(f"{oname:16s} speeds {pname:14s} " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
