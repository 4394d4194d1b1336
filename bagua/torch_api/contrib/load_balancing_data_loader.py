"""Samplers that give every rank samples of similar complexity at every step.

In synchronous data-parallel training a step ends when the slowest rank ends. With variable-size samples (token
sequences, point clouds), :class:`torch.utils.data.DistributedSampler` hands one rank a long batch and another a
short one, and the short ones wait. These samplers instead:

1. sort the samples by complexity (plus optional noise, ``random_level``);
2. cut the sorted list into *chunks* of ``num_replicas`` consecutive samples, so a chunk holds samples of
   nearly equal complexity;
3. shuffle the order of the chunks with the seed ``seed + epoch`` (same on every rank);
4. give rank ``r`` element ``r`` of every chunk.

Step k of every rank then draws from the same chunks, so per-step work is nearly equal across ranks. Every sample
is visited once per epoch; the number of padded or dropped samples follows ``DistributedSampler`` exactly
(padding repeats the most complex samples, so the padded chunk stays balanced; ``drop_last`` drops random samples
when shuffling, the last indices otherwise).

``complexity_fn`` may be a function of a sample (called once per sample at construction, which reads the whole
dataset) or, cheaper, a precomputed sequence of one number per sample, e.g. token counts from an index file.

Example:
    >>> lengths = [5, 1, 9, 3, 7, 2]
    >>> sampler = LoadBalancingDistributedSampler(range(6), lengths, num_replicas=2, rank=0, shuffle=False)
    >>> list(sampler)  # rank 0 takes the smaller of each pair (1,2) (3,5) (7,9)
    [1, 3, 4]
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"]

Complexity = Union[Callable[[Any], float], Sequence[float], torch.Tensor]


class LoadBalancingDistributedSampler(Sampler[int]):
    """A ``DistributedSampler`` whose ranks receive samples of similar complexity at each position.

    Args:
        dataset: a sized dataset.
        complexity_fn: ``sample -> number`` (called on every ``dataset[i]`` once), or a sequence / tensor / numpy
            array of one number per sample (no dataset reads).
        num_replicas: number of ranks; default: the ``torch.distributed`` world size.
        rank: this rank; default: the ``torch.distributed`` rank.
        shuffle: shuffle the chunk order every epoch (else chunks come in increasing complexity).
        seed: base seed; must be equal on every rank.
        drop_last: drop the tail instead of padding so that every rank gets ``len(dataset) // num_replicas``.
        random_level: in ``[0, 1]``; uniform noise of up to ``random_level * (max - min)`` is added to the
            complexities before sorting, each epoch, so that chunks vary between epochs (only when shuffling).

    Example:
        See the module docstring; call ``set_epoch(epoch)`` before each epoch as with ``DistributedSampler``.
    """

    def __init__(
        self,
        dataset: Any,
        complexity_fn: Complexity,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0,
    ) -> None:
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("pass num_replicas and rank, or initialize torch.distributed before the sampler")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be at least 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must lie in [0, {num_replicas - 1}] for num_replicas={num_replicas}")
        if not 0 <= random_level <= 1:
            raise ValueError(f"random_level={random_level} must lie in [0, 1] (0 = no noise)")
        # user settings
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.random_level = float(random_level)
        # derived, as torch.utils.data.DistributedSampler
        self.complexities = _complexities(dataset, complexity_fn)
        size = len(self.complexities)
        if drop_last and size % num_replicas != 0:
            self.num_samples = math.ceil((size - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.epoch = 0

    def chunks(self) -> torch.Tensor:
        """Return this epoch's assignment: a ``(num_samples, num_replicas)`` tensor; column ``r`` is rank r's order.

        It is the same on every rank (it depends only on the complexities, the seed and the epoch).
        """
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        size = len(self.complexities)
        complexities = self.complexities
        if self.shuffle and self.random_level > 0 and size > 0:
            spread = float(complexities.max() - complexities.min()) * self.random_level
            complexities = complexities + torch.rand(size, generator=generator, dtype=torch.float64) * spread
        if self.total_size < size:  # drop_last: which samples sit out this epoch
            if self.shuffle:
                kept = torch.randperm(size, generator=generator)[: self.total_size].sort().values
            else:
                kept = torch.arange(self.total_size)
        else:  # pad with the most complex samples, as often as DistributedSampler repeats
            by_complexity = torch.argsort(complexities, stable=True)
            padding = self.total_size - size
            extra = by_complexity.flip(0).repeat(math.ceil(padding / size) if size else 0)[:padding]
            kept = torch.cat([torch.arange(size), extra])
        order = kept[torch.argsort(complexities[kept], stable=True)]
        table = order.view(self.num_samples, self.num_replicas)
        if self.shuffle:
            table = table[torch.randperm(self.num_samples, generator=generator)]
        return table

    def __iter__(self) -> Iterator[int]:
        return iter(self.chunks()[:, self.rank].tolist())

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration's shuffle (call it before every epoch on every rank)."""
        self.epoch = epoch


def _complexities(dataset: Any, complexity_fn: Complexity) -> torch.Tensor:
    if callable(complexity_fn):
        values = [complexity_fn(dataset[i]) for i in range(len(dataset))]
    else:
        values = complexity_fn
        if len(values) != len(dataset):
            raise ValueError(
                f"got {len(values)} complexities for a dataset of {len(dataset)} samples; give one per sample"
            )
    out = torch.as_tensor(values, dtype=torch.float64).reshape(-1).clone()
    if out.numel() != len(dataset) or not bool(torch.isfinite(out).all()):
        raise ValueError("complexities must be one finite number per sample")
    return out


class LoadBalancingDistributedBatchSampler(Sampler[List[int]]):
    """Group a :class:`LoadBalancingDistributedSampler`'s indices into batches with ``batch_fn``, for every rank.

    ``batch_fn`` runs on every rank's index list, so all ranks agree on the number of batches: the largest count
    (shorter lists repeat their first batches) or, with ``drop_last``, the smallest.

    Args:
        sampler: a ``LoadBalancingDistributedSampler`` built with ``drop_last=False``.
        batch_fn: ``indices -> list of batches (lists of indices)``, e.g. cut into batches of at most N tokens.
        drop_last: truncate every rank to the smallest batch count instead of padding.

    Example:
        >>> sampler = LoadBalancingDistributedSampler(range(8), list(range(8)), num_replicas=2, rank=1,
        ...                                           shuffle=False)
        >>> pairs = lambda idx: [idx[i:i + 2] for i in range(0, len(idx), 2)]
        >>> list(LoadBalancingDistributedBatchSampler(sampler, pairs))
        [[1, 3], [5, 7]]
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Callable[[List[int]], List[List[int]]],
        drop_last: bool = False,
    ) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise ValueError(f"sampler must be a LoadBalancingDistributedSampler, got {type(sampler).__name__}")
        if sampler.drop_last:
            raise ValueError("build the sampler with drop_last=False; pass drop_last to the batch sampler instead")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last
        self.batches: List[List[int]] = []
        self.generate_batches()

    def generate_batches(self) -> None:
        """Recompute this rank's batches for the sampler's current epoch."""
        table = self.sampler.chunks()
        per_rank = [self._batches_of(table[:, r].tolist()) for r in range(self.sampler.num_replicas)]
        counts = [len(batches) for batches in per_rank]
        total = min(counts) if self.drop_last else max(counts)
        mine = per_rank[self.sampler.rank]
        if len(mine) < total:
            if not mine:
                raise ValueError(f"batch_fn returned no batch for rank {self.sampler.rank}; it must cover its input")
            mine = (mine * math.ceil(total / len(mine)))[:total]
        self.batches = mine[:total]

    def _batches_of(self, indices: List[int]) -> List[List[int]]:
        batches = [list(batch) for batch in self.batch_fn(indices)]
        if any(len(batch) == 0 for batch in batches):
            raise ValueError("batch_fn returned an empty batch; every batch needs at least one index")
        return batches

    def __iter__(self) -> Iterator[List[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        """Set the sampler's epoch and recompute the batches."""
        self.sampler.set_epoch(epoch)
        self.generate_batches()
