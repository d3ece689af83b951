"""A training set whose random transforms (crops, flips) are drawn per sample from (seed, epoch, index) alone, so its
samples are those of single-process training whatever the number of ranks and DataLoader workers.
"""

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info


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
