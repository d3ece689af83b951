"""DataLoaders that give every rank its shard while keeping one global sample order.

Training uses DistributedSampler with the run's seed on every rank (also with one process, as a 1-replica sampler).
Global batch k is then the contiguous slice [k*B, (k+1)*B) of the epoch's permutation whatever the world size, so
single-process training visits the same samples per step as DDP. With drop_last the incomplete tail (and with it
the sampler's padding) is dropped, which keeps that true for the last step too.
"""

import itertools
import random
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from hydraloop.errors import ConfigError


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose epoch can begin part-way, after its first `start_batch` batches: a run resumed from a
    mid-epoch checkpoint sees the rest of the epoch the uninterrupted run saw, without loading what it skips.

    Every rank skips `start_batch` of its own batches, which together are the first `start_batch` global batches.
    """

    def __init__(self, *args, batch_size: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        super().set_epoch(epoch)
        self.start_batch = start_batch

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start_batch * self.batch_size, None)

    def __len__(self) -> int:
        return max(0, super().__len__() - self.start_batch * self.batch_size)


class ShardSampler(Sampler[int]):
    """Every `world_size`-th index from `rank`, in order, without padding: each sample is evaluated exactly once."""

    def __init__(self, dataset_size: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, dataset_size, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class DeviceBatches:
    """Batches indexed straight out of tensors that live on the device, in the order of `sampler`.

    Same shards and order as a DataLoader over the same sampler, without its per-batch Python, collation and
    host-to-device copies. For data sets that fit in device memory.
    """

    def __init__(self, tensors: tuple[Tensor, ...], sampler: Sampler[int], batch_size: int, drop_last: bool) -> None:
        self.tensors, self.sampler, self.batch_size, self.drop_last = tensors, sampler, batch_size, drop_last

    def __len__(self) -> int:
        full, rest = divmod(len(self.sampler), self.batch_size)
        return full + (0 if self.drop_last or rest == 0 else 1)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        order = torch.tensor(list(self.sampler), device=self.tensors[0].device)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start : start + self.batch_size]
            yield tuple(tensor[index] for tensor in self.tensors)


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
    device: torch.device,
    shuffle: bool = True,
    on_device: bool = False,
    prefetch_factor: int | None = None,
) -> tuple[DataLoader | DeviceBatches, DataLoader | DeviceBatches]:
    # The sampler drops (rather than pads) the tail that does not split evenly over the ranks, so no rank
    # takes an extra batch of duplicated samples that one process would not see.
    batch_size, val_batch_size = global_batch_size // world_size, max(1, global_val_batch_size // world_size)
    train_sampler = ResumableSampler(
        train_set,
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        batch_size=batch_size,
    )
    val_sampler = ShardSampler(len(val_set), rank, world_size)
    if on_device:
        return (
            DeviceBatches(_device_tensors(train_set, device), train_sampler, batch_size, drop_last),
            DeviceBatches(_device_tensors(val_set, device), val_sampler, val_batch_size, drop_last=False),
        )
    common = dict(
        num_workers=num_workers,
        pin_memory=device.type == "cuda",  # page-locked host memory: asynchronous (non_blocking) copies
        persistent_workers=num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        worker_init_fn=_seed_worker if num_workers > 0 else None,
    )
    train = DataLoader(
        train_set,
        batch_size=batch_size,
        sampler=train_sampler,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed + rank),
        **common,
    )
    val = DataLoader(val_set, batch_size=val_batch_size, sampler=val_sampler, **common)
    return train, val


def _device_tensors(dataset: Dataset, device: torch.device) -> tuple[Tensor, ...]:
    if not isinstance(dataset, TensorDataset):
        raise ConfigError(f"data.on_device=true: needs a TensorDataset, the data set is a {type(dataset).__name__}")
    return tuple(tensor.to(device) for tensor in dataset.tensors)
