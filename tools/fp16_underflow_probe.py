"""How much of the GPT's gradient torch's ``fp16_compress_hook`` pushes out of fp16's normal range.

The hook casts each bucket to float16 and then divides it by the world size. This probe trains the benchmark GPT
in one process on the suite's own batches of rank 0 (seed 0, Adam at the suite's learning rate) and, at a few
steps, reports the share of the nonzero gradient entries that the cast-then-divide flushes to zero, and the share
left below fp16's smallest normal number (6.1e-5, where precision starts to drop), for a world of 2 and of 4.

    .venv/bin/python tools/fp16_underflow_probe.py            # about a minute on one core
"""

from __future__ import annotations

import torch

from benchmarks.common.gpt import TextBatches, lm_loss, load_text
from benchmarks.common.models import MODELS, build_model

FP16_MIN_NORMAL = 6.1e-5


def main(steps: tuple[int, ...] = (0, 10, 20, 40), worlds: tuple[int, ...] = (2, 4)) -> None:
    torch.set_num_threads(1)
    spec = MODELS["gpt"]
    model = build_model("gpt", 0)
    batches = TextBatches(load_text()[0], spec.batch_size, spec.in_shape[0], seed=0, rank=0)
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    for step in range(max(steps) + 1):
        x, y = batches.batch(step)
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if step in steps:
            grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            nonzero = grad != 0
            for world in worlds:
                sent = grad.half().div_(world).float()  # what the hook puts on the wire
                flushed = (nonzero & (sent == 0)).sum() / nonzero.sum()
                below = (nonzero & (sent.abs() < FP16_MIN_NORMAL)).sum() / nonzero.sum()
                print(f"step {step:3d}  loss {loss.item():.3f}  world {world}: flushed to zero {flushed:.1%}, "
                      f"below fp16's normal range {below:.1%}")
        opt.step()


if __name__ == "__main__":
    main()
