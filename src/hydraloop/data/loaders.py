"""DataLoaders that give every rank its shard while keeping one global sample order.

Training uses DistributedSampler with the run's seed on every rank (also with one process, as a 1-replica sampler).
Global batch k is then the contiguous slice [k*B, (k+1)*B) of the epoch's permutation whatever the world size, so
single-process training visits the same samples per step as DDP. With drop_last the incomplete tail (and with it
the sampler's padding) is dropped, which keeps that true for the last step too. A training set wrapped in
SeededAugmentation draws its random transforms per sample from (seed, epoch, index) alone, so the samples
themselves are those of single-process training too, whatever the number of ranks and workers.
"""

import gc
import itertools
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset, get_worker_info

from hydraloop.data.batch_transforms import CollateThenTransform, split_elementwise_tail
from hydraloop.errors import ConfigError, require


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose epoch can begin part-way, after its first `start_batch` batches: a run resumed from a
    mid-epoch checkpoint sees the rest of the epoch the uninterrupted run saw, without loading what it skips.

    Every rank skips `start_batch` of its own batches, which together are the first `start_batch` global batches.
    With `keyed_by_epoch` it yields (epoch, index) pairs, the keys SeededAugmentation takes.
    """

    def __init__(self, *args, batch_size: int, keyed_by_epoch: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        self.keyed_by_epoch = keyed_by_epoch
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        super().set_epoch(epoch)
        self.start_batch = start_batch

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        indices = itertools.islice(super().__iter__(), self.start_batch * self.batch_size, None)
        return zip(itertools.repeat(self.epoch), indices) if self.keyed_by_epoch else indices

    def __len__(self) -> int:
        return max(0, super().__len__() - self.start_batch * self.batch_size)


class SeededAugmentation(Dataset):
    """A training set whose random transforms (crops, flips) are a function of (seed, epoch, sample index) alone.

    Before each sample, torch's generator is seeded with SeedSequence([seed, epoch]) + index, as StepSeeder does per
    step (a well-mixed base; Mersenne Twister's seeding decorrelates neighbouring seeds). A sample then gets the same
    crop in the same epoch whatever the world size, the number of DataLoader workers, and the step a run resumed
    from. The base is computed once per epoch: a SeedSequence per sample would cost ~10 us, 3% of a small image.
    Seeding itself (Mersenne Twister's 624-word state, refilled at the first draw) costs ~4 us a sample in a worker:
    2% of decoding and cropping a 32x32 PNG (200 us), 1.2% for a 128x128 one; a photograph takes milliseconds.

    The epoch travels with the index: the training sampler yields (epoch, index) keys, since worker processes
    (persistent ones included) never see the sampler's set_epoch. The transforms must draw from torch's default
    generator, as all of torchvision's do. A plain index (a hand-written loader) gets an unseeded sample.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.epoch, self.epoch_base = -1, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int] | int) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]] | list[int]) -> list[Any]:
        """A batch's samples; the DataLoader fetches whole batches through this when a data set has it."""
        # With num_workers=0 this runs in the training process, whose own stream is put back after the batch. (A
        # worker's stream serves nothing else.)
        saved = torch.get_rng_state() if get_worker_info() is None else None
        try:
            return [self._sample(key) for key in keys]
        finally:
            if saved is not None:
                torch.set_rng_state(saved)

    def _sample(self, key: tuple[int, int] | int) -> Any:
        if isinstance(key, int):
            return self.dataset[key]
        epoch, index = key
        if epoch != self.epoch:
            self.epoch, self.epoch_base = epoch, int(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0])
        torch.default_generator.manual_seed(self.epoch_base + index)  # torch.manual_seed would look for accelerators
        return self.dataset[index]


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


def _start_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; derive numpy's and Python's seeds from it too.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    # What the worker holds by now (torch, the data set) lives as long as it does: out of the collector's way, as
    # src/train.py does for its own imports; each full collection would otherwise re-scan it.
    gc.freeze()


def auto_num_workers() -> int:
    """data.num_workers=auto: this rank's share of the CPU cores it may run on, less one for the rank itself.

    torch.distributed.elastic (spawned ranks, torchrun) starts LOCAL_WORLD_SIZE ranks that share one affinity mask;
    a SLURM task (one rank per task under hydra/launcher=slurm) owns SLURM_CPUS_PER_TASK cores, pinned or not.
    """
    cores = len(os.sched_getaffinity(0))
    if "SLURM_CPUS_PER_TASK" in os.environ:
        cores = min(cores, int(os.environ["SLURM_CPUS_PER_TASK"]))
    ranks_sharing = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if "TORCHELASTIC_RUN_ID" in os.environ else 1
    return max(1, cores // ranks_sharing - 1)


def build_loaders(
    train_set: Dataset,
    val_set: Dataset,
    *,
    global_batch_size: int,
    global_val_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    num_workers: int | str,
    drop_last: bool,
    device: torch.device,
    shuffle: bool = True,
    on_device: bool = False,
    prefetch_factor: int | None = None,
    elementwise_per_batch: bool = True,
) -> tuple[DataLoader | DeviceBatches, DataLoader | DeviceBatches]:
    """The training and validation loaders of this rank. `elementwise_per_batch`: an image folder's closing ToDtype
    and Normalize run once per batch (hydraloop.data.batch_transforms); False runs them per sample (benchmark.py)."""
    # The sampler drops (rather than pads) the tail that does not split evenly over the ranks, so no rank
    # takes an extra batch of duplicated samples that one process would not see.
    batch_size, val_batch_size = global_batch_size // world_size, max(1, global_val_batch_size // world_size)
    for split, dataset in (("training", train_set), ("validation", val_set)):
        require(len(dataset) > 0, f"data.dataset: the {split} set is empty")
    require(
        not drop_last or len(train_set) >= global_batch_size,
        f"data.batch_size={global_batch_size}: more than the training set's {len(train_set)} samples; with "
        "data.drop_last=true an epoch would have no step (lower data.batch_size, or set data.drop_last=false)",
    )
    if num_workers == "auto":
        num_workers = auto_num_workers()
    train_sampler = ResumableSampler(
        train_set,
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        batch_size=batch_size,
        keyed_by_epoch=isinstance(train_set, SeededAugmentation),
    )
    val_sampler = ShardSampler(len(val_set), rank, world_size)
    if on_device:
        return (
            DeviceBatches(_device_tensors(train_set, device), train_sampler, batch_size, drop_last),
            DeviceBatches(_device_tensors(val_set, device), val_sampler, val_batch_size, drop_last=False),
        )
    (train_set, train_collate), (val_set, val_collate) = (
        _elementwise_tail_per_batch(dataset) if elementwise_per_batch else (dataset, None)
        for dataset in (train_set, val_set)
    )
    if num_workers > 0:
        _preload_for_workers(train_set, val_set)
    common = dict(
        num_workers=num_workers,
        pin_memory=device.type == "cuda",  # page-locked host memory: asynchronous (non_blocking) copies
        persistent_workers=num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        worker_init_fn=_start_worker if num_workers > 0 else None,
        # Workers fork from a server process started once per rank (with persistent workers, once per run), not
        # from the training process: by the time a loader starts its workers, that one runs threads (gloo,
        # TensorBoard's writer, OpenMP's pool) whose locks a fork may copy held, and may have initialised CUDA,
        # which a forked child cannot use. The server imports the entrypoint once (~1 s); each worker then gets a
        # pickled copy of the data set. Python 3.14 makes forkserver the default on Linux too.
        multiprocessing_context="forkserver" if num_workers > 0 else None,
    )
    train = DataLoader(
        train_set,
        batch_size=batch_size,
        sampler=train_sampler,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed + rank),
        collate_fn=train_collate,
        **common,
    )
    val = DataLoader(val_set, batch_size=val_batch_size, sampler=val_sampler, collate_fn=val_collate, **common)
    return train, val


def _elementwise_tail_per_batch(dataset: Dataset) -> tuple[Dataset, CollateThenTransform | None]:
    """split_elementwise_tail, looking through SeededAugmentation: (the data set to load, its collate_fn or None)."""
    if not isinstance(dataset, SeededAugmentation):
        return split_elementwise_tail(dataset)
    head, collate = split_elementwise_tail(dataset.dataset)
    return (SeededAugmentation(head, dataset.seed) if collate else dataset), collate


def _preload_for_workers(*datasets: Dataset) -> None:
    """Has the forkserver (see build_loaders) import the data sets' modules, torch and torchvision among them, before
    it forks any worker: each worker would otherwise import them itself, ~0.5 s of CPU apiece."""
    modules = {type(dataset).__module__ for dataset in datasets}
    modules |= {type(dataset.dataset).__module__ for dataset in datasets if isinstance(dataset, SeededAugmentation)}
    torch.multiprocessing.get_context("forkserver").set_forkserver_preload(["__main__", *sorted(modules)])


def _device_tensors(dataset: Dataset, device: torch.device) -> tuple[Tensor, ...]:
    if not isinstance(dataset, TensorDataset):
        raise ConfigError(f"data.on_device=true: needs a TensorDataset, the data set is a {type(dataset).__name__}")
    return tuple(tensor.to(device) for tensor in dataset.tensors)
