"""Run by tests/test_clean_exit.py under the launcher: init only, or a few steps of an algorithm, then a plain exit.

Usage: exit_after.py ALGORITHM|none MARKER_DIR (each rank writes MARKER_DIR/done-RANK as its last act)
"""

import os
import sys

import torch

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm

bagua.init_process_group()
name = sys.argv[1]
if name != "none":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kwargs = {"async": {"sync_interval_ms": 5}}.get(name, {})
    model = model.with_bagua([opt], Algorithm.init(name, **kwargs))
    for step in range(10):
        opt.zero_grad()
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
    if name == "async":
        # every rank that stops training calls abort (documented): a peer that disappears without it is a dead
        # peer to the others, whose next forward raises
        model.bagua_algorithm.abort(model)
with open(os.path.join(sys.argv[2], f"done-{bagua.get_rank()}"), "w") as f:
    f.write("done")

