"""The pieces of a healing state that need no second process: the manifest a receiver accepts, and an optimizer's
state dict as tensors plus JSON (compared against the optimizer's own ``state_dict``)."""

from __future__ import annotations

import json

import pytest
import torch

from bagua.torch_api.fault import flatten_optimizer_state, transfer, unflatten_optimizer_state


def _manifest(**change):
    m = {"format": transfer.FORMAT, "total_bytes": 128, "bucket_bytes": 64, "tensors": [["w", "float32", [4], 64]]}
    m.update(change)
    return json.dumps(m).encode()


@pytest.mark.parametrize("raw,why", [
    (b"\x80\x04pickle", "not JSON"),
    (_manifest(format="bagua-state/0"), "format"),
    (_manifest(tensors=[["w", "object", [4], 0]]), "entry"),  # a dtype outside the table
    (_manifest(tensors=[["w", "float32", [4], 8]]), "entry"),  # an offset off the 64-byte grid
    (_manifest(tensors=[["w", "float32", [-1], 0]]), "entry"),
    (_manifest(tensors=[["w", "float32", [40], 64]]), "ends past the payload"),
    (_manifest(bucket_bytes=0), "sizes"),
])
def test_malformed_manifest_is_refused(raw, why):
    with pytest.raises(ValueError, match=why):
        transfer._parse_manifest(raw, 0)


def test_manifest_of_pack_parses_back_to_the_same_tensors():
    state = {"a": torch.arange(5, dtype=torch.int16), "b": torch.randn(2, 3).to(torch.bfloat16)}
    raw, payload = transfer.pack(state)
    got = transfer.unpack(transfer._parse_manifest(raw, 0), payload)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in state.items())


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(0.8, 0.95)),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
], ids=["adamw", "sgd"])
def test_optimizer_state_round_trips_through_tensors_and_json(make):
    params = [torch.randn(3, 2, requires_grad=True), torch.randn(4, requires_grad=True)]
    opt = make(params)
    for _ in range(2):
        opt.zero_grad()
        sum((p * p).sum() for p in params).backward()
        opt.step()
    want = opt.state_dict()
    flat = flatten_optimizer_state(want)
    assert all(torch.is_tensor(v) for v in flat.values())
    got = unflatten_optimizer_state(flat)
    assert got["param_groups"] == want["param_groups"]  # tuples (betas) stay tuples, int keys stay ints
    assert got["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        assert got["state"][i].keys() == s.keys()
        assert all(torch.equal(got["state"][i][k], v) for k, v in s.items())
    fresh = make([torch.zeros(3, 2, requires_grad=True), torch.zeros(4, requires_grad=True)])
    fresh.load_state_dict(got)  # what heal_driver does with it


def test_optimizer_state_refuses_leaves_json_cannot_carry():
    with pytest.raises(ValueError, match="only tensors, None, bool, int, float and str travel"):
        flatten_optimizer_state({"state": {}, "param_groups": [{"fn": print}]})
