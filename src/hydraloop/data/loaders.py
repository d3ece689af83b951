"""DataLoaders that give every rank its shard while keeping one global sample order.

Training draws each epoch's permutation from the run's seed on every rank (also with one process) and deals each
global batch's rows to the ranks in turn (GlobalBatchSampler): global batch k is the slice [k*B, (k+1)*B) of the
permutation whatever the world size, so single-process training visits the same samples per step as DDP, the
incomplete last batch included when drop_last is off. A training set wrapped in SeededAugmentation draws its random
transforms per sample from (seed, epoch, index) alone, so the samples themselves are those of single-process
training too, whatever the number of ranks and workers.
"""

import gc
import math
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    Sampler,
    TensorDataset,
    default_collate,
    get_worker_info,
)

from hydraloop.batches import check_leaves, map_tensors, slice_rows, tensors, to_device
from hydraloop.data.batch_transforms import split_elementwise_tail
from hydraloop.errors import ConfigError, require


class GlobalBatchSampler(Sampler[list]):
    """This rank's part of every global batch of an epoch: one global sample order, whatever the world size.

    An epoch is a permutation of the training set (seeded with `seed + epoch`, as DistributedSampler draws it), cut
    into global batches of `global_batch_size` consecutive positions; rank r takes rows r, r + W, r + 2W, ... of each
    (W ranks). Global batch k is then the slice [kB, (k+1)B) of the permutation under any world size, and row j of a
    rank's batch is row r + W·j of the global one (what KeyedDropout keys on). With `drop_last` the incomplete last
    batch is left out; without, it is kept whole and unpadded: a rank may then hold a row less than another, or none
    (a batch of fewer rows than ranks), and the loop weights each rank's rows by the global batch's.

    An epoch can begin at any sample (`set_epoch(epoch, start_sample)`): a mid-epoch checkpoint stores its position
    in samples, so a run resumed under another batch size or world size continues at the sample it stopped at,
    without loading what it skips. `limit_batches` ends every epoch after that many global batches of the current
    size, `limit_samples` after that many samples (the last batch then holds the rest). With `keyed_by_epoch` it
    yields (epoch, index) keys, which SeededAugmentation and data=tokens' random windows take.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        rank: int,
        world_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        limit_batches: int | None = None,
        limit_samples: int | None = None,
        keyed_by_epoch: bool = False,
    ) -> None:
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.drop_last, self.limit_batches = seed, shuffle, drop_last, limit_batches
        self.usable = min(num_samples, limit_samples or num_samples)  # the samples an epoch may reach
        self.keyed_by_epoch = keyed_by_epoch
        self.set_epoch(0)

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.epoch, self.start_sample = epoch, start_sample
        self.end = self._end(start_sample)
        """One past the epoch's last position: where it ends."""

    def _end(self, start_sample: int) -> int:
        batch = self.global_batch_size
        end = min(self.usable, batch * self.limit_batches) if self.limit_batches else self.usable
        if self.drop_last:  # whole batches only, counted from where the epoch resumes
            end = start_sample + max(0, end - start_sample) // batch * batch
        return max(start_sample, end)

    def batches_from(self, start_sample: int) -> int:
        """Global batches in an epoch that starts (or resumes) at `start_sample`."""
        return math.ceil((self._end(start_sample) - start_sample) / self.global_batch_size)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in a whole epoch of the current size, from its first sample."""
        usable = min(self.usable, self.global_batch_size * (self.limit_batches or self.num_samples))
        full, rest = divmod(usable, self.global_batch_size)
        return full + (0 if self.drop_last or not rest else 1)

    def global_rows(self, position: int) -> int:
        """The rows of the global batch that starts at `position` (B, or fewer for an incomplete last one)."""
        return min(self.global_batch_size, self.end - position)

    def __len__(self) -> int:
        """Global batches left in the epoch (from `start_sample`): every rank takes part in each."""
        return self.batches_from(self.start_sample)

    def __iter__(self) -> Iterator[list]:
        # An array, or a range: 8 bytes a sample, or none, where a list would hold a Python int (~36 bytes) each.
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).numpy()  # the CPU tensor's memory
        else:
            order = range(self.num_samples)
        for start in range(self.start_sample, self.end, self.global_batch_size):
            rows = order[start : min(start + self.global_batch_size, self.end)][self.rank :: self.world_size]
            indices = rows.tolist() if self.shuffle else list(rows)
            yield [(self.epoch, index) for index in indices] if self.keyed_by_epoch else indices


class _NonEmpty(Sampler[list]):
    """The batches of `sampler` that hold at least one sample: a DataLoader cannot collate an empty one."""

    def __init__(self, sampler: GlobalBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list]:
        return (indices for indices in self.sampler if indices)

    def __len__(self) -> int:
        batches = len(self.sampler)
        last_rows = self.sampler.global_rows(self.sampler.start_sample + (batches - 1) * self.sampler.global_batch_size)
        return batches - (batches > 0 and last_rows <= self.sampler.rank)


class TrainLoader:
    """This rank's training batches of an epoch: as many as there are global batches, the same on every rank.

    A rank with no row of the epoch's incomplete last batch (see GlobalBatchSampler) gets an empty batch, of the
    structure of its others, so that it still joins the step's collectives (DDP's gradient all-reduce, FSDP's
    gathers) with nothing to add.
    """

    def __init__(self, batches: "DataLoader | DeviceBatches", sampler: GlobalBatchSampler, first_batch: Any) -> None:
        """`first_batch`: a function returning a batch of the data set's first sample (an empty batch's template)."""
        self.batches, self.sampler, self.first_batch = batches, sampler, first_batch

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_sample)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        batch, count = None, 0
        for batch in self.batches:
            count += 1
            yield batch
        for _ in range(len(self) - count):
            yield slice_rows(self.first_batch() if batch is None else batch, 0, 0)


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

    keyed_by_epoch = True

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
    """Batches indexed straight out of a whole data set held on the device, in the order of `batch_sampler`.

    Same shards and order as a DataLoader over the same batch sampler, without its per-batch Python, collation and
    host-to-device copies. For data sets that fit in device memory; `data` is the whole set as one batch (a tuple of
    tensors, or any structure of them).
    """

    def __init__(self, data: Any, batch_sampler: Sampler[list[int]]) -> None:
        self.data, self.batch_sampler = data, batch_sampler
        self.device = next(tensor for _, tensor in tensors(data)).device

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        for indices in self.batch_sampler:
            index = torch.tensor(indices, dtype=torch.int64, device=self.device)
            yield map_tensors(lambda tensor, index=index: tensor[index], self.data)


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


def check_sizes(train_set: Dataset, val_set: Dataset, global_batch_size: int, drop_last: bool) -> None:
    """Data sets that leave an epoch without a step, or a validation without a sample: one line."""
    for split, dataset in (("training", train_set), ("validation", val_set)):
        require(len(dataset) > 0, f"data.dataset: the {split} set is empty")
    require(
        not drop_last or len(train_set) >= global_batch_size,
        f"data.batch_size={global_batch_size}: more than the training set's {len(train_set)} samples; with "
        "data.drop_last=true an epoch would have no step (lower data.batch_size, or set data.drop_last=false)",
    )


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
    limit_train_batches: int | None = None,
    limit_train_samples: int | None = None,
    elementwise_per_batch: bool = True,
) -> tuple[TrainLoader, DataLoader | DeviceBatches]:
    """The training and validation loaders of this rank. `elementwise_per_batch`: an image folder's closing ToDtype
    and Normalize run once per batch (hydraloop.data.batch_transforms); False runs them per sample (benchmark.py)."""
    val_batch_size = max(1, global_val_batch_size // world_size)
    check_sizes(train_set, val_set, global_batch_size, drop_last)
    if num_workers == "auto":
        num_workers = auto_num_workers()
    train_sampler = GlobalBatchSampler(
        len(train_set),
        global_batch_size,
        rank,
        world_size,
        seed=seed,
        shuffle=shuffle and not getattr(train_set, "draws_its_own_order", False),  # data=tokens' random windows
        drop_last=drop_last,
        limit_batches=limit_train_batches,
        limit_samples=limit_train_samples,
        keyed_by_epoch=getattr(train_set, "keyed_by_epoch", False),  # SeededAugmentation, data=tokens' windows
    )
    val_batches = BatchSampler(ShardSampler(len(val_set), rank, world_size), val_batch_size, drop_last=False)
    if on_device:
        train_data, val_data = _on_device(train_set, device), _on_device(val_set, device)
        train = DeviceBatches(train_data, _NonEmpty(train_sampler))
        return TrainLoader(train, train_sampler, lambda: slice_rows(train_data, 0, 1)), DeviceBatches(
            val_data, val_batches
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
        batch_sampler=_NonEmpty(train_sampler),
        generator=torch.Generator().manual_seed(seed + rank),
        collate_fn=train_collate,
        **common,
    )
    collate = train.collate_fn

    def first_batch() -> Any:
        return collate([train_set[0]])

    val = DataLoader(val_set, batch_sampler=val_batches, collate_fn=val_collate, **common)
    return TrainLoader(train, train_sampler, first_batch), val


def _elementwise_tail_per_batch(dataset: Dataset) -> tuple[Dataset, Callable | None]:
    """split_elementwise_tail, looking through SeededAugmentation: (the data set to load, its collate_fn or None).
    A data set's own `collate_fn` (data=hf's padding) is used where there is no such tail."""
    if hasattr(dataset, "collate_fn"):
        return dataset, dataset.collate_fn
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


def _on_device(dataset: Dataset, device: torch.device) -> Any:
    """The whole data set as one batch on the device: a TensorDataset's tensors, or every sample collated."""
    if isinstance(dataset, TensorDataset):
        return tuple(tensor.to(device) for tensor in dataset.tensors)
    try:
        whole = default_collate([dataset[index] for index in range(len(dataset))])
    except Exception as error:  # noqa: BLE001  samples that do not collate into tensors
        raise ConfigError(
            f"data.on_device=true: the {type(dataset).__name__}'s samples do not collate into tensors ({error})"
        ) from None
    check_leaves(whole, "data.on_device=true")
    return to_device(whole, device)
