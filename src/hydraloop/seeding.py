import random
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate

from hydraloop.row_keys import mix_int


def seed_everything(seed: int) -> None:
    """Seeds Python, numpy and torch (all devices). Any int is a seed, 0 included."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seeded_build(node: Any, seed: int, **kwargs: Any) -> Any:
    """`instantiate(node, **kwargs)` with Python's, numpy's and torch's generators seeded from `seed` first.

    Every process builds the run's parts (the launcher to check them; each rank, forked or spawned, to train), and
    each from a generator state of its own: whatever a constructor draws (a `random_split`, a random subset, generated
    data, initial weights) would differ between runs of the same seed, between the launcher and the ranks, and between
    the ranks, which would then train and validate on different samples. Seeded before each part, every process builds
    the same one."""
    seed_everything(seed)
    return instantiate(node, **kwargs)


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    """A well-mixed seed for one rank's randomness (dropout, augmentation) in one epoch.

    Reseeding at every epoch start from (seed, rank, epoch) makes a run resumed at an epoch boundary draw exactly
    what the uninterrupted run drew, with any world size, and gives each rank its own stream.
    """
    return int(np.random.SeedSequence([seed, rank, epoch]).generate_state(1)[0])


class StepSeeder:
    """Reseeds torch's generators (the CPU's and those of the GPUs this rank computes on) before each part of a
    training step, from what that part acts on.

    A forward and backward pass acts on this rank's rows: before it, the generators are seeded from (seed, rank,
    step, pass), so each rank draws its own dropout masks and a run resumed at any step, mid-epoch included, draws
    what the uninterrupted run drew. The rest of the step acts on the state every rank holds alike, from the reduced
    gradients on (the callbacks' gradient hooks, clipping, the optimizer's step, the callbacks' `on_optimizer_step`),
    and so does a task choosing the step's passes (`Task.optimizer_steps`): before each, they are seeded from (seed,
    step, part) alone (`replicated`), so whatever it draws (noise added to the weights or the gradients) is the same
    on every rank and the same as one process draws, whatever the world size and the accumulation (under FSDP the
    strategy makes a shard's draws its slice of the whole tensor's: hydraloop.parallel.shard_draws). Python's
    `random` and numpy's are not reseeded: code there draws from torch's generators.

    Setting a generator's seed is a microsecond on the host and no device work (`torch.manual_seed` itself costs
    60 us: it looks for every accelerator each call). `devices`: more than one under DataParallel, whose replicas
    draw from their own GPUs' generators.
    """

    def __init__(self, seed: int, rank: int, devices: list[torch.device]) -> None:
        self.base = int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])
        self.replicated_base = int(np.random.SeedSequence([seed, _REPLICATED]).generate_state(1)[0])
        self.generators = [torch.default_generator]
        self.generators += [torch.cuda.default_generators[device.index] for device in devices if device.type == "cuda"]

    def __call__(self, step: int, pass_index: int = 0) -> None:
        """Before the forward and backward passes of step `step` (counted from 0); `pass_index`: with several
        optimizers, the pass of the step (hydraloop.step), each drawing masks of its own."""
        self._seed(self.base + step if pass_index == 0 else _mixed(self.base, step, pass_index))

    def replicated(self, step: int, part: int) -> None:
        """Before a part of step `step` that acts on the state every rank holds alike: `part` is the pass index of
        the optimizer about to step (hydraloop.step), `CHOOSING_THE_PASSES` or `AFTER_THE_STEP`."""
        self._seed(_mixed(self.replicated_base, step, part))

    def _seed(self, seed: int) -> None:
        for generator in self.generators:
            generator.manual_seed(seed)


# Parts of a step besides its optimizers' passes (indexed from 0; there are fewer of those).
CHOOSING_THE_PASSES = 1 << 16  # Task.optimizer_steps, with several optimizers
AFTER_THE_STEP = CHOOSING_THE_PASSES + 1  # the callbacks' on_optimizer_step
_REPLICATED = 0x7265706C  # in place of a rank: no rank has this number, so no rank's stream is the rank-free one


def _mixed(base: int, step: int, part: int) -> int:
    """A seed for (`base`, `step`, `part`), well mixed in its low 32 bits, which are all the CPU's generator (a
    Mersenne Twister) takes: steps and parts added in the high bits would be lost there."""
    return mix_int(base + step + (part << 40)) & (2**63 - 1)
