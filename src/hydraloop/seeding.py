import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seeds Python, numpy and torch (all devices). Any int is a seed, 0 included."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    """A well-mixed seed for one rank's randomness (dropout, augmentation) in one epoch.

    Reseeding at every epoch start from (seed, rank, epoch) makes a run resumed at an epoch boundary draw exactly
    what the uninterrupted run drew, with any world size, and gives each rank its own stream.
    """
    return int(np.random.SeedSequence([seed, rank, epoch]).generate_state(1)[0])


class StepSeeder:
    """Reseeds torch's generators (the CPU's and those of the GPUs this rank computes on) before every training step
    from (seed, rank, step).

    Then a run resumed at any step, mid-epoch included, draws the dropout masks the uninterrupted run drew. Setting a
    generator's seed is a microsecond on the host and no device work (`torch.manual_seed` itself costs 60 us: it
    looks for every accelerator each call). `devices`: more than one under DataParallel, whose replicas draw from
    their own GPUs' generators.
    """

    def __init__(self, seed: int, rank: int, devices: list[torch.device]) -> None:
        self.base = int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])
        self.generators = [torch.default_generator]
        self.generators += [torch.cuda.default_generators[device.index] for device in devices if device.type == "cuda"]

    def __call__(self, step: int) -> None:
        for generator in self.generators:
            generator.manual_seed(self.base + step)
