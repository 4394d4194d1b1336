"""DCP checkpoints of DiLoCo on sharded replicas with the inner optimizers the docs use: AdamW, Adam and SGD.

4 processes as 2 replicas x 2 shards. One spawn trains every optimizer ``SAVED`` steps, saves the model, the
optimizer and ``model.bagua_sharded`` with DCP, and trains ``MORE`` steps; a second spawn builds fresh runs, loads
the checkpoints and trains the same ``MORE`` steps. After the load each rank's weights and its inner optimizer's
state are the bytes saved, and the resumed runs end on the uninterrupted runs' bytes. (``AdamW``'s ``defaults``
hold ``decoupled_weight_decay``, which its constructor rejects in torch 2.13: rebuilding the optimizer from its
``defaults`` made every rank's save raise.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_workers
from tests.sharded.common import batch as _batch
from tests.sharded.common import model as _model

SAVED, MORE = 3, 4
#: the inner optimizers, each with a setting that puts something in its state or its update
OPTIMIZERS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),  # weight_decay=0.01 by default: decoupled
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3),
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
}
# sync_every=2: outer steps at steps 2 and 4, so the save (after step 3) falls between outer steps, with the
# replicas' weights apart and the outer momentum set
DILOCO = {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}


def _setup(optimizer_name: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    model = model.with_bagua([optimizer], DiLoCoAlgorithm(**DILOCO), device_mesh=mesh, replicate_dim="replicate")
    return model, optimizer


def _state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
            "bagua": model.bagua_sharded}


def _train(model, optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _local(model, optimizer) -> dict:
    """This rank's shards of the weights and of the inner optimizer's state (not gathered: replicas differ)."""
    def local(value):
        return value.to_local().detach().clone() if hasattr(value, "to_local") else value.detach().clone()

    return {"params": [local(p) for p in model.parameters()],
            "optim": [{k: local(v) for k, v in sorted(optimizer.state[p].items())} for p in model.parameters()]}


def _worker_save(rank, world, root):
    import torch.distributed.checkpoint as dcp

    out = {}
    for name in OPTIMIZERS:
        model, optimizer = _setup(name)
        _train(model, optimizer, rank, range(SAVED))
        dcp.save(_state(model, optimizer), checkpoint_id=f"{root}/{name}")
        saved = _local(model, optimizer)
        _train(model, optimizer, rank, range(SAVED, SAVED + MORE))
        out[name] = {"saved": saved, "end": _local(model, optimizer), "syncs": model.bagua_sharded.driver.syncs}
        model.bagua_sharded.close()
    dist.barrier()  # FSDP2's gloo teardown: every rank done before the groups go
    return out


def _worker_load(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    out = {}
    for name in OPTIMIZERS:
        model, optimizer = _setup(name)
        state = _state(model, optimizer)
        dcp.load(state, checkpoint_id=f"{root}/{name}")
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        loaded = _local(model, optimizer)
        _train(model, optimizer, rank, range(SAVED, SAVED + MORE))
        out[name] = {"loaded": loaded, "end": _local(model, optimizer), "syncs": model.bagua_sharded.driver.syncs}
        model.bagua_sharded.close()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both spawns, once for every optimizer: ``(uninterrupted, resumed)`` per rank."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    uninterrupted = run_workers(_worker_save, 4, root, timeout=240)
    resumed = run_workers(_worker_load, 4, root, timeout=240)
    return uninterrupted, resumed


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if isinstance(a, dict):
            assert sorted(a) == sorted(b)
            for key in a:
                torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=lambda m: f"state {key!r}: {m}")
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_load_restores_weights_and_optimizer_state_exactly(runs, name):
    uninterrupted, resumed = runs
    for r in range(4):
        saved, loaded = uninterrupted[r][name]["saved"], resumed[r][name]["loaded"]
        assert all(loaded["optim"]), f"rank {r}: the loaded optimizer holds no state"
        _assert_same(loaded["params"], saved["params"])
        _assert_same(loaded["optim"], saved["optim"])
    # the replicas differ at the save (between outer steps), so a wrong replica's copy would be caught
    assert any(not torch.equal(a, b) for a, b in zip(uninterrupted[0][name]["saved"]["params"],
                                                      uninterrupted[2][name]["saved"]["params"]))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resumed_training_equals_uninterrupted_bitwise(runs, name):
    uninterrupted, resumed = runs
    for r in range(4):
        # outer steps at steps 2, 4 and 6 (uninterrupted); 4 and 6 after the load (a count, not checkpointed)
        assert (uninterrupted[r][name]["syncs"], resumed[r][name]["syncs"]) == (3, 2)
        _assert_same(resumed[r][name]["end"]["params"], uninterrupted[r][name]["end"]["params"])
        _assert_same(resumed[r][name]["end"]["optim"], uninterrupted[r][name]["end"]["optim"])


@pytest.mark.parametrize("name", ["ASGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam",
                                  "RMSprop", "Rprop", "SGD"])
def test_state_keys_are_those_a_real_step_makes(name):
    """In one process, for torch's optimizers of per-element state: the keys a throwaway copy shows before the first
    step are those the real optimizer holds after it, per parameter group; the real one is left as it was."""
    from bagua.torch_api.sharded.checkpoint import _inner_keys

    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    extra = {"momentum": 0.9} if name == "SGD" else {}
    optimizer = getattr(torch.optim, name)([{"params": [w]}, {"params": [b], "lr": 0.5, **extra}], lr=0.01)
    def snapshot():  # Adagrad's constructor already fills its state
        return [p.detach().clone() for p in (w, b)] + [
            (id(p), k, v.clone()) for p, state in optimizer.state.items() for k, v in sorted(state.items())]

    before = snapshot()
    keys = _inner_keys(optimizer)
    after = snapshot()
    assert w.grad is None and b.grad is None and len(after) == len(before)
    for x, y in zip(after, before):
        assert torch.equal(x, y) if torch.is_tensor(x) else (x[:2] == y[:2] and torch.equal(x[2], y[2]))
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    optimizer.step()
    for p in (w, b):
        tensors = {k: v for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
        elements = sorted(k for k, v in tensors.items() if v.shape == p.shape)
        assert keys[id(p)] == (elements, sorted(set(tensors) - set(elements))), name
    if name == "SGD":  # momentum in the second group only
        assert keys[id(w)] == ([], []) and keys[id(b)] == (["momentum_buffer"], [])
