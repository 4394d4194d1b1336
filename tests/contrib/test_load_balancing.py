"""Load-balanced samplers: exact coverage and padding as torch's DistributedSampler, determinism, balance."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from bagua.torch_api.contrib import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


def _lognormal(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [max(1, int(x)) for x in rng.lognormal(mean=4.0, sigma=1.0, size=n)]


def _all_ranks(n, replicas, **kwargs):
    complexities = kwargs.pop("complexities", None) or _lognormal(n)
    samplers = [LoadBalancingDistributedSampler(range(n), complexities, num_replicas=replicas, rank=r, **kwargs)
                for r in range(replicas)]
    return samplers, [list(s) for s in samplers]


def _reference_chunks(complexities, replicas, seed, epoch):
    """The algorithm written out plainly (shuffle=True, random_level=0, no padding needed)."""
    order = sorted(range(len(complexities)), key=lambda i: (complexities[i], i))
    chunks = [order[i:i + replicas] for i in range(0, len(order), replicas)]
    gen = torch.Generator().manual_seed(seed + epoch)
    return [chunks[j] for j in torch.randperm(len(chunks), generator=gen).tolist()]


@pytest.mark.parametrize("n", [1, 7, 40, 41, 103])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_coverage_and_padding_match_distributed_sampler(n, replicas, drop_last, shuffle):
    if drop_last and n < replicas:
        pytest.skip("torch's DistributedSampler yields nothing here either")
    samplers, orders = _all_ranks(n, replicas, drop_last=drop_last, shuffle=shuffle, seed=3)
    torch_samplers = [DistributedSampler(range(n), replicas, r, shuffle=shuffle, drop_last=drop_last)
                      for r in range(replicas)]
    assert [len(s) for s in samplers] == [len(s) for s in torch_samplers]
    assert [len(o) for o in orders] == [len(list(s)) for s in torch_samplers]
    counts = Counter(i for order in orders for i in order)
    assert set(counts) <= set(range(n))
    total = sum(counts.values())
    if drop_last:
        assert all(c == 1 for c in counts.values()) and total == replicas * (n // replicas)
    else:  # every sample once, plus exactly torch's padding
        assert set(counts) == set(range(n)) and total == replicas * math.ceil(n / replicas)
        assert all(c <= math.ceil(total / n) for c in counts.values())


def test_matches_reference_algorithm_and_is_deterministic():
    complexities = _lognormal(64, seed=5)
    for epoch in (0, 1, 7):
        samplers, orders = _all_ranks(64, 4, complexities=complexities, seed=11)
        for s in samplers:
            s.set_epoch(epoch)
        orders = [list(s) for s in samplers]
        expected = _reference_chunks(complexities, 4, seed=11, epoch=epoch)
        assert orders == [[chunk[r] for chunk in expected] for r in range(4)]
    again = LoadBalancingDistributedSampler(range(64), complexities, 4, 2, seed=11)
    again.set_epoch(7)
    assert list(again) == orders[2]
    again.set_epoch(8)
    assert list(again) != orders[2]


def test_unshuffled_single_replica_is_sorted_and_callable_equals_sequence():
    data = [torch.zeros(length) for length in _lognormal(50, seed=2)]
    by_fn = LoadBalancingDistributedSampler(data, lambda x: x.numel(), num_replicas=1, rank=0, shuffle=False)
    by_seq = LoadBalancingDistributedSampler(data, np.array([x.numel() for x in data]), 1, 0, shuffle=False)
    order = list(by_fn)
    assert order == list(by_seq)
    assert [data[i].numel() for i in order] == sorted(x.numel() for x in data)


def test_random_level_varies_chunks_between_epochs():
    complexities = list(range(400))
    samplers = [LoadBalancingDistributedSampler(range(400), complexities, 2, r, random_level=0.2) for r in (0, 1)]
    pairs = []
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        pairs.append({frozenset(p) for p in zip(*(list(s) for s in samplers))})
    assert pairs[0] != pairs[1]  # noise regrouped some chunks
    gaps = [abs(a - b) for pair in pairs[0] for a, b in [tuple(pair)]]
    assert max(gaps) <= 0.2 * 400 + 1 and np.mean(gaps) < 40  # but chunk members stay close in complexity


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_per_step_work_is_balanced(batch):
    complexities = _lognormal(8000, seed=1)
    _, orders = _all_ranks(8000, 4, complexities=complexities, seed=0)
    ratios = []
    for step in range(len(orders[0]) // batch):
        work = [sum(complexities[i] for i in o[step * batch:(step + 1) * batch]) for o in orders]
        ratios.append(max(work) / np.mean(work))
    torch_orders = [list(DistributedSampler(range(8000), 4, r, seed=0)) for r in range(4)]
    torch_ratios = [max(w) / np.mean(w) for w in (
        [sum(complexities[i] for i in o[s * batch:(s + 1) * batch]) for o in torch_orders]
        for s in range(len(torch_orders[0]) // batch))]
    assert np.mean(ratios) <= 1.02 < np.mean(torch_ratios)


def test_validation():
    with pytest.raises(ValueError, match="random_level"):
        LoadBalancingDistributedSampler(range(4), [1] * 4, 2, 0, random_level=1.5)
    with pytest.raises(ValueError, match="rank=2"):
        LoadBalancingDistributedSampler(range(4), [1] * 4, 2, 2)
    with pytest.raises(ValueError, match="one per sample"):
        LoadBalancingDistributedSampler(range(4), [1] * 3, 2, 0)
    with pytest.raises(ValueError, match="finite"):
        LoadBalancingDistributedSampler(range(2), [1, float("nan")], 2, 0)
    with pytest.raises(ValueError, match="initialize torch.distributed"):
        LoadBalancingDistributedSampler(range(4), [1] * 4)
    with pytest.raises(ValueError, match="drop_last=False"):
        LoadBalancingDistributedBatchSampler(LoadBalancingDistributedSampler(range(4), [1] * 4, 2, 0,
                                                                             drop_last=True), lambda i: [i])


def _token_budget(complexities, budget):
    def batch_fn(indices):
        batches, current, used = [], [], 0
        for i in sorted(indices, key=lambda i: complexities[i]):
            if current and used + complexities[i] > budget:
                batches.append(current)
                current, used = [], 0
            current.append(i)
            used += complexities[i]
        return batches + [current] if current else batches
    return batch_fn


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_groups_and_agrees_across_ranks(drop_last):
    complexities = _lognormal(300, seed=4)
    batch_fn = _token_budget(complexities, budget=400)
    ranks = []
    for r in range(3):
        sampler = LoadBalancingDistributedSampler(range(300), complexities, 3, r, seed=1)
        batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn, drop_last=drop_last)
        mine = batch_fn(list(sampler))
        batches = list(batch_sampler)
        # this rank's batches are batch_fn's own, in order, padded by repetition from the start or truncated
        assert batches == (mine * 2)[:len(batches)]
        ranks.append(batch_sampler)
    counts = {len(b) for b in ranks}
    assert len(counts) == 1  # every rank takes the same number of steps
    per_rank_counts = [len(batch_fn(list(b.sampler))) for b in ranks]
    assert counts == {min(per_rank_counts) if drop_last else max(per_rank_counts)}
    if not drop_last:
        seen = Counter(i for b in ranks for batch in b for i in batch)
        assert set(seen) == set(range(300))
    before = list(ranks[0])
    ranks[0].set_epoch(1)
    assert list(ranks[0]) != before and ranks[0].sampler.epoch == 1


def _worker_default_group(rank, world_size, store_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    sampler = LoadBalancingDistributedSampler(range(11), _lognormal(11))  # replicas and rank from the group
    return sampler.num_replicas, sampler.rank, list(sampler)


def test_defaults_come_from_the_process_group(tmp_path):
    from tests.harness import run_workers

    results = run_workers(_worker_default_group, 2, str(tmp_path / "store"), init_bagua=False, timeout=60)
    assert [r[:2] for r in results] == [(2, 0), (2, 1)]
    _, expected = _all_ranks(11, 2)
    assert [r[2] for r in results] == expected
