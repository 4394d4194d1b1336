"""A DiLoCo worker healed from a live peer: the peer's outer state bit for bit, its own residuals at zero.

Two ranks train Streaming DiLoCo (2 fragments, uint8 pseudo-gradients with error feedback, AdamW inner steps) for
three rounds; rank 1 then loses its state (weights, global weights, outer momentum, counters scrambled; stale
residuals left in place) and heals from rank 0. The check reads the drivers' attributes directly (not through
``state_dict``, which the transfer uses), then both ranks train one more round: a healed rank on the job's schedule
holds the same global weights as its peer after it, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model


def _raw(opt):
    d = opt.driver
    frags = [
        {
            "global": f.global_.clone(),
            "outer": {k: v.clone() for k, v in f.outer.state.get(f.global_, {}).items()},
            "residual": None if f.workspace is None or f.workspace.residual is None else f.workspace.residual.clone(),
        }
        for f in d.fragments
    ]
    return {"steps": d.steps, "processed": d.processed, "syncs": d.syncs, "fragments": frags}


def _train(model, opt, rank, steps, start):
    for step in range(start, start + steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@torch.no_grad()
def _lose_state(model, opt):
    """What a restart loses: weights, global weights, outer state, counters; residuals stay stale on purpose."""
    d = opt.driver
    torch.manual_seed(99)
    for p in model.parameters():
        p.normal_()
    for f in d.fragments:
        f.global_.normal_()
        f.outer.state.clear()
    d.steps = d.processed = d.syncs = 0


def _worker_heal(rank, world_size, inner_state):
    from bagua.torch_api.contrib.diloco_optimizer import DiLoCoOptimizer
    from bagua.torch_api.fault import heal_driver, heal_group, serve_driver

    group = heal_group()
    model = make_model(rank)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt = DiLoCoOptimizer(inner, sync_every=2, fragments=2, compression="uint8", outer_lr=0.7, outer_momentum=0.9)
    _train(model, opt, rank, 6, 1)
    out = {}
    if rank == 0:
        out["sent"] = serve_driver(opt, dst=1, group=group, optimizer=inner, inner_state=inner_state)
        out["residual_nonzero"] = all(bool(f.workspace.residual.abs().sum() > 0) for f in opt.driver.fragments)
    else:
        _lose_state(model, opt)
        out["took_inner"] = heal_driver(opt, src=0, group=group, optimizer=inner)
    out["healed"] = _raw(opt)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["inner"] = copy.deepcopy(inner.state_dict())  # the live tensors move on with the next round
    _train(model, opt, rank, 2, 7)  # one more round: fragment 0 syncs at step 7, fragment 1 at step 8
    out["after"] = [f.global_.clone() for f in opt.driver.fragments]
    return out


@pytest.mark.parametrize("inner_state", [False, True], ids=["fresh-inner", "peer-inner"])
def test_healed_rank_equals_the_peer_bit_for_bit(inner_state):
    live, healed = run_workers(_worker_heal, 2, inner_state, env={"BAGUA_COMM_TIMEOUT_S": "60"}, timeout=180)
    want, got = live["healed"], healed["healed"]
    assert (got["steps"], got["processed"], got["syncs"]) == (want["steps"], want["processed"], want["syncs"]) \
        == (6, 6, 6)
    for f_want, f_got in zip(want["fragments"], got["fragments"]):
        assert torch.equal(f_got["global"], f_want["global"])
        assert f_want["outer"] and f_got["outer"].keys() == f_want["outer"].keys()
        for k in f_want["outer"]:
            assert torch.equal(f_got["outer"][k], f_want["outer"][k]), k
        assert f_got["residual"] is None  # residuals start empty: zeros at the next exchange
    assert live["residual_nonzero"]  # ...while the peer's were not zero, so they could have been copied wrongly
    # the healed weights are the global weights
    flat = torch.cat([f["global"] for f in got["fragments"]])
    assert torch.equal(torch.cat([p.reshape(-1) for p in healed["params"]]), flat)
    # the inner optimizer: the peer's hyper-parameters always, its moments only when asked for
    assert healed["took_inner"] is inner_state
    assert healed["inner"]["param_groups"] == live["inner"]["param_groups"]
    if inner_state:
        for i, s in live["inner"]["state"].items():
            for k, v in s.items():
                assert torch.equal(healed["inner"]["state"][i][k], v), (i, k)
    else:
        assert healed["inner"]["state"] == {}
    # back on the job's schedule: after one more round both ranks hold the same global weights
    for a, b in zip(live["after"], healed["after"]):
        assert torch.equal(a, b)
    assert not torch.equal(live["after"][0], want["fragments"][0]["global"])  # the round did move them
