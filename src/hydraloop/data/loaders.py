"""DataLoaders that give every rank its shard while keeping one global sample order.

Training batches follow GlobalBatchSampler's order (hydraloop.data.samplers), so single-process training visits the
same samples per step as DDP, and a training set wrapped in SeededAugmentation (hydraloop.data.seeded_augmentation)
draws its random transforms per sample from (seed, epoch, index) alone, so the samples themselves are those of
single-process training too, whatever the number of ranks and workers. Here: what a DataLoader adds to them (an empty
batch for a rank with no row of an incomplete last batch, batches indexed on the device, workers forked from a
server and seeded), and the check that the data sets give an epoch a step.
"""

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, TensorDataset, default_collate

from hydraloop.batches import check_leaves, map_tensors, slice_rows, tensors, to_device
from hydraloop.data.batch_transforms import split_elementwise_tail
from hydraloop.data.samplers import GlobalBatchSampler, ShardSampler
from hydraloop.data.seeded_augmentation import SeededAugmentation
from hydraloop.data.workers import LOADER_CONTEXT, start_fork_server, start_worker
from hydraloop.errors import ConfigError, require


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
        start_fork_server(train_set, val_set)
    common = dict(
        num_workers=num_workers,
        pin_memory=device.type == "cuda",  # page-locked host memory: asynchronous (non_blocking) copies
        persistent_workers=num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        worker_init_fn=functools.partial(start_worker, os.getpid()) if num_workers > 0 else None,
        # Workers fork from a server process started once per rank (with persistent workers, once per run), not
        # from the training process: by the time a loader starts its workers, that one runs threads (gloo,
        # TensorBoard's writer, OpenMP's pool) whose locks a fork may copy held, and may have initialised CUDA,
        # which a forked child cannot use. The server imports the entrypoint once (~1 s); each worker then gets a
        # pickled copy of the data set. Python 3.14 makes forkserver the default on Linux too.
        multiprocessing_context=LOADER_CONTEXT if num_workers > 0 else None,
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
