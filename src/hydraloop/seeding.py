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
