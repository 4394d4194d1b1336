"""``outer_lr`` / ``outer_momentum`` / ``outer_lr_warmup="auto"``: the rule gives what docs/algorithms/diloco.md
says, and a ``DiLoCoAlgorithm()`` / ``DiLoCoOptimizer`` left on "auto" trains exactly as the plain-tensor reference
of tests/torch_api/test_diloco.py with the rule's numbers for its number of ranks, warm-up included (rtol=0,
atol=0: float32 at 2 ranks).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.harness import run_workers
from tests.torch_api.test_diloco import _adamw, _train_diloco, _train_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms" / "diloco.md"
MARKER = "<!-- auto_outer table: tests/torch_api/test_diloco_outer.py reads it -->"


def _doc_rows() -> list[tuple[int, int, float, float, int]]:
    """(workers, sync_every, outer_lr, outer_momentum, outer_lr_warmup) of the documented rule's table."""
    text = DOC.read_text()
    assert MARKER in text, f"{DOC} lost the table of outer_lr='auto'"
    rows = []
    for line in text.split(MARKER, 1)[1].lstrip().splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((int(cells[0]), int(cells[1]), float(cells[2]), float(cells[3]), int(cells[4])))
    return rows


def test_the_rule_gives_the_documented_table():
    from bagua.torch_api.ops.diloco_outer import auto_outer

    rows = _doc_rows()
    assert len(rows) >= 4
    for workers, h, lr, momentum, warmup in rows:
        assert tuple(auto_outer(workers, h)) == (lr, momentum, warmup), (workers, h)


def test_auto_resolves_only_what_is_left_on_auto():
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm
    from bagua.torch_api.ops.diloco_outer import resolve_outer

    assert resolve_outer(DiLoCoAlgorithm(sync_every=500), 16).outer_lr == 0.7
    mixed = resolve_outer(DiLoCoAlgorithm(sync_every=500, outer_lr=0.3), 16)
    assert (mixed.outer_lr, mixed.outer_momentum) == (0.3, 0.9)
    # the warm-up comes with the rule's learning rate only; asked for, it stays
    rule = resolve_outer(DiLoCoAlgorithm(), 4)
    assert (rule.outer_lr, rule.outer_momentum, rule.outer_lr_warmup) == (1.0, 0.5, 10)
    assert resolve_outer(DiLoCoAlgorithm(outer_lr=0.5), 4).outer_lr_warmup == 0
    assert resolve_outer(DiLoCoAlgorithm(outer_lr=0.5, outer_lr_warmup=3), 4).outer_lr_warmup == 3
    explicit = DiLoCoAlgorithm(outer_lr=0.5, outer_momentum=0.5, outer_lr_warmup=0)
    assert resolve_outer(explicit, 2) is explicit
    assert resolve_outer(DiLoCoAlgorithm(outer_lr=0.5, outer_momentum=0.5), 2) == explicit
    with pytest.raises(ValueError, match=re.escape("workers >= 1")):
        resolve_outer(DiLoCoAlgorithm(), 0)


def _worker(rank, world_size, steps, H):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm
    from bagua.torch_api.contrib import DiLoCoOptimizer
    from bagua.torch_api.ops.diloco_outer import auto_outer

    rule = auto_outer(world_size, H)
    got = _train_diloco(rank, steps, DiLoCoAlgorithm(sync_every=H, hierarchical=False), _adamw)
    expected = _train_reference(rank, steps, H, 1, 0, 0.0, rule.lr, rule.momentum, _adamw, warmup=rule.warmup)
    # the optimizer form: its resolved settings
    model = torch.nn.Linear(4, 4)
    opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=H)
    settings = (opt.driver.workers, opt.hyper.outer_lr, opt.hyper.outer_momentum, opt.hyper.outer_lr_warmup)
    opt.close()
    return got, expected, tuple(rule), settings


def test_auto_trains_as_the_reference_with_the_rules_numbers():
    H, steps = 3, 13  # 4 outer steps, all in the warm-up: lr 0.1, 0.2, 0.3, 0.4
    results = run_workers(_worker, 2, steps, H, timeout=120)
    for rank, (got, expected, rule, settings) in enumerate(results):
        assert rule == (1.0, 0.5, 10)  # 2 workers, H <= 20 (the table above)
        assert settings == (2, 1.0, 0.5, 10)
        for step, (g, e) in enumerate(zip(got, expected), start=1):
            for a, b in zip(g, e):
                assert torch.equal(a, b), f"rank {rank} step {step}: max diff {(a - b).abs().max()}"
