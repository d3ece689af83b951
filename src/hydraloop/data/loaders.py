"""DataLoaders that give every rank its shard while keeping one global sample order.

Training uses DistributedSampler with the run's seed on every rank (also with one process, as a 1-replica sampler).
Global batch k is then the contiguous slice [k*B, (k+1)*B) of the epoch's permutation whatever the world size, so
single-process training visits the same samples per step as DDP. With drop_last the incomplete tail (and with it
the sampler's padding) is dropped, which keeps that true for the last step too.
"""

import random
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


class ShardSampler(Sampler[int]):
    """Every `world_size`-th index from `rank`, in order, without padding: each sample is evaluated exactly once."""

    def __init__(self, dataset_size: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, dataset_size, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; derive numpy's and Python's seeds from it too.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def build_loaders(
    train_set: Dataset,
    val_set: Dataset,
    *,
    global_batch_size: int,
    global_val_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    num_workers: int,
    drop_last: bool,
    pin_memory: bool,
) -> tuple[DataLoader, DataLoader]:
    # The sampler drops (rather than pads) the tail that does not split evenly over the ranks, so no rank
    # takes an extra batch of duplicated samples that one process would not see.
    train_sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
    )
    common = dict(
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        worker_init_fn=_seed_worker if num_workers > 0 else None,
    )
    train = DataLoader(
        train_set,
        batch_size=global_batch_size // world_size,
        sampler=train_sampler,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed + rank),
        **common,
    )
    val = DataLoader(
        val_set,
        batch_size=max(1, global_val_batch_size // world_size),
        sampler=ShardSampler(len(val_set), rank, world_size),
        **common,
    )
    return train, val
