"""MoE at 2 ranks equals the same experts run plainly in one process; expert checkpoints round-trip per rank.

The reference gathers all 4 experts (2 per rank) into one process and computes the gating plainly, token by token:
first choice (for top-2 also the second best), slots given in token order up to the capacity (top-2: all first
choices before second choices), output = gate-weighted sum of the kept experts' outputs. Tolerance: float32,
rtol = atol = 1e-5 (experts run on slot buffers instead of single tokens; sums in another order).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from bagua.torch_api.moe import MoE
from tests.harness import run_workers

H, LOCAL, WORLD, TOKENS = 6, 2, 2, (3, 4)  # 12 tokens per rank
TOL = dict(rtol=1e-5, atol=1e-5)
CASES = [  # (k, capacity_factor, eval_capacity_factor, min_capacity): small capacities drop tokens
    (1, 1.0, 2.0, 1),
    (2, 0.75, 1.5, 1),
]


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(H, 5), torch.nn.Tanh(), torch.nn.Linear(5, H))


def _fill(expert: torch.nn.Module, expert_id: int) -> None:
    g = torch.Generator().manual_seed(100 + expert_id)
    with torch.no_grad():
        for p in expert.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _data(rank: int):
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(TOKENS + (H,), generator=g), torch.randn(TOKENS + (H,), generator=g)


def _build(rank: int, case, **kwargs) -> MoE:
    k, cf, ecf, minc = case
    torch.manual_seed(0)
    moe = MoE(H, _expert(), num_local_experts=LOCAL, k=k, capacity_factor=cf, eval_capacity_factor=ecf,
              min_capacity=minc, **kwargs)
    for j, expert in enumerate(moe.bagua_moe.experts.bagua_experts):
        _fill(expert, rank * LOCAL + j)
    return moe


def _worker_parity(rank, world_size):
    out = []
    for case in CASES:
        moe = _build(rank, case)
        x, w = _data(rank)
        x.requires_grad_()
        y, l_aux, counts = moe(x)
        ((y * w).sum() + 0.5 * l_aux).backward()
        moe.eval()
        with torch.no_grad():
            y_eval = moe(x)[0]
        noisy = _build(rank, case, noisy_gate_policy="RSample")
        y_noisy = noisy(x)[0]  # training: Gumbel noise chooses the experts
        noisy.eval()
        out.append({
            "y": y.detach(), "l_aux": l_aux.detach(), "counts": counts, "dx": x.grad, "y_eval": y_eval,
            "wg": moe.bagua_moe.gate.wg.weight.detach(), "dwg": moe.bagua_moe.gate.wg.weight.grad,
            "dexperts": [[p.grad for p in e.parameters()] for e in moe.bagua_moe.experts.bagua_experts],
            "noisy_finite": bool(torch.isfinite(y_noisy).all()),
            "noisy_eval": noisy(x)[0].detach(),
        })
    return out


def _reference(tokens, wg, experts, k, capacity_factor, min_capacity):
    """Plain top-k gating with capacity, one token at a time; returns (output, l_aux, first-choice counts)."""
    num_experts = wg.shape[0]
    gates = F.softmax(tokens @ wg.t(), dim=1)
    capacity = max(min_capacity, math.ceil(k * tokens.shape[0] / num_experts * capacity_factor))
    choices = [[int(gates[s].argmax())] for s in range(tokens.shape[0])]
    if k == 2:
        for s, c in enumerate(choices):
            rest = gates[s].clone()
            rest[c[0]] = -1.0
            c.append(int(rest.argmax()))
    fill, kept = [0] * num_experts, [[] for _ in choices]
    for rank_of_choice in range(k):  # all first choices take slots before any second choice
        for s, c in enumerate(choices):
            e = c[rank_of_choice]
            if fill[e] < capacity:
                fill[e] += 1
                kept[s].append(e)
    rows = []
    for s, es in enumerate(kept):
        row = torch.zeros(H)
        if es:
            probs = torch.stack([gates[s, e] for e in es])
            weights = probs if k == 1 else probs / probs.sum()
            for weight, e in zip(weights, es):
                row = row + weight * experts[e](tokens[s:s + 1])[0]
        rows.append(row)
    first = torch.tensor([c[0] for c in choices])
    counts = torch.bincount(first, minlength=num_experts)
    l_aux = num_experts * (gates.mean(0) * counts.float() / tokens.shape[0]).sum()
    return torch.stack(rows), l_aux, counts


def test_moe_matches_all_experts_in_one_process():
    results = run_workers(_worker_parity, WORLD, timeout=90)
    for i, (k, cf, ecf, minc) in enumerate(CASES):
        wg = results[0][i]["wg"].clone().requires_grad_()
        torch.testing.assert_close(results[1][i]["wg"], wg.detach(), rtol=0, atol=0)  # the gate is replicated
        experts = [_expert() for _ in range(WORLD * LOCAL)]
        for e, expert in enumerate(experts):
            _fill(expert, e)
        loss = 0.0
        xs = []
        for rank in range(WORLD):
            x, w = _data(rank)
            x = x.reshape(-1, H).requires_grad_()
            xs.append(x)
            y, l_aux, counts = _reference(x, wg, experts, k, cf, minc)
            got = results[rank][i]
            torch.testing.assert_close(got["y"].reshape(-1, H), y, **TOL)
            torch.testing.assert_close(got["l_aux"], l_aux, **TOL)
            assert got["counts"].tolist() == counts.tolist()
            with torch.no_grad():
                y_eval = _reference(x, wg, experts, k, ecf, minc)[0]
            torch.testing.assert_close(got["y_eval"].reshape(-1, H), y_eval, **TOL)
            torch.testing.assert_close(got["noisy_eval"].reshape(-1, H), y_eval, **TOL)  # noise is for training
            assert got["noisy_finite"]
            loss = loss + (y * w.reshape(-1, H)).sum() + 0.5 * l_aux
        loss.backward()
        for rank in range(WORLD):
            got = results[rank][i]
            torch.testing.assert_close(got["dx"].reshape(-1, H), xs[rank].grad, **TOL)
            for j in range(LOCAL):  # a rank's expert gets the gradient of every rank's tokens routed to it
                for g, p in zip(got["dexperts"][j], experts[rank * LOCAL + j].parameters()):
                    torch.testing.assert_close(g, p.grad, **TOL)
        torch.testing.assert_close(results[0][i]["dwg"] + results[1][i]["dwg"], wg.grad, **TOL)


class _Net(torch.nn.Module):
    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(1)  # the replicated layer starts equal on every rank
        self.inp = torch.nn.Linear(H, H)
        self.moe = _build(rank, CASES[0])

    def forward(self, x):
        out, l_aux, _ = self.moe(self.inp(x))
        return out.sum() + l_aux


def _worker_checkpoint(rank, world_size, path):
    from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint

    model = _Net(rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(_data(rank)[0]).backward()
    for p in model.parameters():  # what data-parallel training does: average all but the expert parameters
        if not getattr(p, "expert", False):
            torch.distributed.all_reduce(p.grad)
            p.grad /= world_size
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    expert_weight = model.moe.bagua_moe.experts.bagua_experts[1][0].weight
    saved_exp_avg = optimizer.state[expert_weight]["exp_avg"].clone()
    save_checkpoint(3, path, model, optimizer)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    assert load_checkpoint(path, model, fresh) == 3
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(fresh.state[expert_weight]["exp_avg"], saved_exp_avg, rtol=0, atol=0)
    return saved["moe.bagua_moe.experts.bagua_experts.1.0.weight"]


def test_expert_checkpoint_round_trip_per_rank(tmp_path):
    weights = run_workers(_worker_checkpoint, WORLD, str(tmp_path), timeout=90)
    directory = tmp_path / "iter_0000003"
    names = sorted(os.listdir(directory))
    assert names == sorted([f"expert_{e}_mp_rank_00_model_states.pt" for e in range(WORLD * LOCAL)]
                           + [f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(WORLD)]
                           + ["mp_rank_00_model_states.pt"])
    # global expert 3 is rank 1's local expert 1, stored under its global id
    expert3 = torch.load(directory / "expert_3_mp_rank_00_model_states.pt", weights_only=True)
    torch.testing.assert_close(expert3["moe.bagua_moe.experts.bagua_experts.3.0.weight"], weights[1], rtol=0, atol=0)
    assert not torch.equal(weights[0], weights[1])  # each rank got its own experts back, not rank 0's


def test_single_process_moe_marks_experts_and_masks_unused_tokens():
    moe = MoE(H, _expert(), num_local_experts=3, k=2, min_capacity=16)
    assert moe.num_experts == 3
    assert all(p.expert for p in moe.bagua_moe.experts.parameters())
    assert not hasattr(moe.bagua_moe.gate.wg.weight, "expert")
    x = torch.randn(8, H)
    used = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1])
    y, _, counts = moe(x, used_token=used)
    assert torch.all(y[used == 0] == 0) and torch.all(y[used == 1].abs().sum(1) > 0)
    assert int(counts.sum()) == int(used.sum())
    moe.train()
    assert torch.isfinite(MoE(H, _expert(), 2, noisy_gate_policy="Jitter")(x)[0]).all()
    with pytest.raises(ValueError, match="only top-1 and top-2"):
        MoE(H, _expert(), k=3)
    with pytest.raises(ValueError, match="choose one of"):
        MoE(H, _expert(), noisy_gate_policy="Gumbel")
