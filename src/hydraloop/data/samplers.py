"""Which samples each rank takes: one global sample order, whatever the world size.

Training draws each epoch's permutation from the run's seed on every rank (also with one process) and deals each
global batch's rows to the ranks in turn (GlobalBatchSampler): global batch k is the slice [k*B, (k+1)*B) of the
permutation whatever the world size, so single-process training visits the same samples per step as DDP, the
incomplete last batch included when drop_last is off. Evaluation gives each rank every world_size-th sample, without
padding (ShardSampler): each sample is evaluated exactly once.
"""

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


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


class ShardSampler(Sampler[int]):
    """Every `world_size`-th index from `rank`, in order, without padding: each sample is evaluated exactly once."""

    def __init__(self, dataset_size: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, dataset_size, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
