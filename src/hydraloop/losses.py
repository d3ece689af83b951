"""The train loss between two logging steps, and what a NaN or infinite loss does to the run.

The losses stay on the device until a logging step reads back their reduced mean. Only when that mean is not finite
does the loop look at the single steps, to name the first bad one and the rank that saw it
(`trainer.nonfinite_loss=stop`). With `trainer.nonfinite_loss=skip`, every step asks all ranks whether its loss is
finite before the optimizer steps.
"""

import logging
import math
import time

import torch
from torch import Tensor

from hydraloop.errors import TrainingDiverged
from hydraloop.parallel.single import SingleDevice

log = logging.getLogger("hydraloop.trainer")


class Interval:
    """What the loop accumulates between two logging steps."""

    def __init__(self, device: torch.device, capacity: int, first_step: int) -> None:
        self.losses = torch.empty(capacity, device=device)  # kept per step, to name the step of a NaN
        self.first_step = first_step
        self.steps = 0
        self.skipped = 0
        self.data_wait_s = 0.0
        self.start = time.perf_counter()

    def add(self, loss: Tensor | None) -> None:
        """None: a step whose update was skipped (trainer.nonfinite_loss=skip); a step, but not in the loss."""
        self.losses[self.steps] = 0.0 if loss is None else loss
        self.skipped += loss is None
        self.steps += 1

    @property
    def loss_sum(self) -> Tensor:
        return self.losses[: self.steps].sum()

    @property
    def loss_steps(self) -> int:
        return self.steps - self.skipped

    def first_nonfinite_step(self) -> int:
        """The first step whose loss is NaN or infinite; 0 if none (a host sync: only on the failure path)."""
        bad = (~torch.isfinite(self.losses[: self.steps])).nonzero()
        return self.first_step + int(bad[0]) if len(bad) else 0


def check_finite(loss: float, interval: Interval, epoch: int, strategy: SingleDevice) -> None:
    """Stops every rank at once if the interval's global mean loss is NaN or infinite, naming the first bad step.

    A NaN on one rank reaches every rank through the reductions, so all ranks get here together; one more
    reduction tells them which rank saw it first, and when. `epoch` is the number of completed epochs.
    """
    if math.isfinite(loss):
        return
    first_bad = torch.zeros(strategy.world_size, device=strategy.device)
    first_bad[strategy.rank] = interval.first_nonfinite_step()
    per_rank = strategy.all_reduce(first_bad).tolist()
    step, rank = min((s, r) for r, s in enumerate(per_rank) if s > 0)
    raise TrainingDiverged(
        f"train/loss is {loss} at step {int(step)} (epoch {epoch + 1}, first on rank {rank}); "
        f"the last checkpoint holds epoch {epoch}"
    )


def nonfinite_on_any_rank(loss: Tensor, strategy: SingleDevice) -> bool:
    """Whether any rank's loss is NaN or infinite: every rank then skips the update together. A collective and a
    host sync per step, the price of deciding before the optimizer steps."""
    bad_ranks = strategy.all_reduce((~torch.isfinite(loss)).float().reshape(1)).item()
    if bad_ranks:
        log.info("non-finite loss on %d rank(s): update skipped (trainer.nonfinite_loss=skip)", bad_ranks)
    return bool(bad_ranks)


def check_not_all_skipped(interval: Interval) -> None:
    """Skipping is for the odd bad batch; an interval with nothing but skipped steps has diverged."""
    if interval.steps and interval.skipped == interval.steps:
        raise TrainingDiverged(
            f"train/loss was non-finite at every step from {interval.first_step} to "
            f"{interval.first_step + interval.steps - 1}, all skipped (trainer.nonfinite_loss=skip)"
        )
