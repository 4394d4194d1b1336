"""What each codec keeps of one DiLoCo round's pseudo-gradient: ``python -m benchmarks.to_target.topk_energy``.

Takes ``--steps`` inner steps of a benchmark model (the benchmark's optimizer and learning rate, rank 0's data of
``--seed``) from its initial weights, forms ``d = initial - trained`` and prints, per codec of the registry, the
energy ``|D(Q(d))|^2 / |d|^2`` and cosine with ``d`` after one encode and decode, then the same for an exact top-k
of each block of 256 at several densities (no quantization). One process, no communication; the GPT's ten steps
take about 2 minutes on this machine.

Example::

    python -m benchmarks.to_target.topk_energy --model gpt --steps 10
"""

from __future__ import annotations

import argparse
import time
from typing import Optional, Sequence

import torch

__all__ = ["pseudo_gradient", "kept", "main"]


def pseudo_gradient(model_name: str, steps: int, seed: int = 0) -> torch.Tensor:
    """``initial - trained`` weights, flat, after ``steps`` inner steps of the benchmark model ``model_name``."""
    from benchmarks.common.models import MODELS, build_model, loss_fn
    from benchmarks.common.systems import _build_optimizer

    spec = MODELS[model_name]
    if spec.data != "text":
        raise ValueError(f"--model takes a text model (gpt, gpt_tiny), got {model_name!r}")
    from benchmarks.common.gpt import TextBatches
    from benchmarks.common.models import _text

    model = build_model(model_name, seed)
    optimizer = _build_optimizer(spec.optimizer, model, spec.lr)
    stream = TextBatches(_text(model_name)[0], spec.batch_size, spec.in_shape[0], seed, 0)
    loss = loss_fn(spec)
    start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    for i in range(steps):
        x, y = stream.batch(i)
        optimizer.zero_grad()
        loss(model(x), y).backward()
        optimizer.step()
    return start - torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def kept(d: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(energy ``|y|^2 / |d|^2``, cosine of ``y`` with ``d``).

    Example:
        >>> kept(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 4.0]))
        (0.64, 0.8)
    """
    energy = (y.norm() / d.norm()).item() ** 2
    return round(energy, 6), round(torch.nn.functional.cosine_similarity(y, d, dim=0).item(), 6)


def main(argv: Optional[Sequence[str]] = None) -> list[tuple[str, float, float]]:
    """Print (and return) ``(what, energy, cosine)`` per codec and per top-k density."""
    from bagua.torch_api.codecs import block as bc

    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.topk_energy", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t = time.monotonic()
    d = pseudo_gradient(args.model, args.steps, args.seed)
    print(f"{args.steps} steps in {time.monotonic() - t:.0f} s, |d| {d.norm():.4f}, {d.numel()} values")
    out = []
    for codec, block in (("topk", 256), ("sign1", 256), ("nf2", 256), ("uint4", 4096)):
        y = bc.decode(bc.encode(d, codec, block), d.numel(), codec, block)
        out.append((f"{codec} (block {block})", *kept(d, y)))
    rows = d[: d.numel() // 256 * 256].view(-1, 256)
    for k in (8, 16, 32, 64, 128):
        _, idx = rows.abs().topk(k, dim=1)
        y = torch.zeros_like(rows).scatter_(1, idx, rows.gather(1, idx))
        out.append((f"exact top {k} of 256", *kept(rows.reshape(-1), y.reshape(-1))))
    for what, energy, cos in out:
        print(f"{what:24s} energy {energy:.3f} cosine {cos:.3f}")
    return out


if __name__ == "__main__":
    main()
