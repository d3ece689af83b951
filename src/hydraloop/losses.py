"""The train loss between two logging steps, and what a NaN or infinite loss does to the run.

The losses stay on the device until a logging step (or a validation or checkpoint between two) reads back their
reduced sum. Only when that is not finite does the loop look at the single steps, to name the first bad one and the
rank that saw it (`trainer.nonfinite_loss=stop`); nothing is validated or saved from a non-finite loss, nor from
weights that are not finite. With `trainer.nonfinite_loss=skip`, every step asks all ranks whether its loss is
finite before the optimizer steps.
"""

import logging
import math
import time
from typing import Any

import torch
from torch import Tensor

from hydraloop.errors import TrainingDiverged
from hydraloop.parallel.single import SingleDevice

log = logging.getLogger("hydraloop.trainer")


class Interval:
    """What the loop accumulates between two logging steps. A run resumed from a checkpoint written between two
    logging steps carries on the interval the checkpoint was in (`resumed`): its first logged train/loss is then the
    uninterrupted run's."""

    def __init__(
        self, device: torch.device, capacity: int, first_step: int, carried: tuple[float, int, int] = (0.0, 0, 0)
    ) -> None:
        """`first_step`: the global step (counted from 1) of this process's first step in the interval; `carried`:
        the global loss sum, steps and skipped steps of the interval before a resume."""
        # float64: a float32 sum of finite losses near its largest value would overflow into a false infinity.
        self.losses = torch.empty(capacity, dtype=torch.float64, device=device)  # per step, to name a NaN's step
        self.first_step = first_step
        self.carried_sum, self.carried_steps, self.carried_skipped = carried
        self.count = 0  # steps run here, since the interval began or the run resumed
        self.skipped = self.carried_skipped
        self.samples = 0  # global samples of those steps
        self.data_wait_s = 0.0
        self.start = time.perf_counter()

    @classmethod
    def resumed(cls, state: Any, device: torch.device, capacity: int) -> "Interval":
        """The interval `state` (a TrainState) is in: the one a mid-interval checkpoint was written in, or a new one."""
        carried = (state.interval_loss_sum, state.interval_steps, state.interval_skipped)
        return cls(device, capacity, state.global_step + 1, carried)

    def add(self, loss: Tensor | None, samples: int) -> None:
        """None: a step whose update was skipped (trainer.nonfinite_loss=skip); a step, but not in the loss."""
        self.losses[self.count] = 0.0 if loss is None else loss
        self.skipped += loss is None
        self.count += 1
        self.samples += samples

    @property
    def loss_sum(self) -> Tensor:
        """This rank's sum of the losses of the steps run here (not the carried ones)."""
        return self.losses[: self.count].sum()

    @property
    def steps(self) -> int:
        return self.carried_steps + self.count

    @property
    def loss_steps(self) -> int:
        return self.steps - self.skipped

    def carry(self, global_sum: float) -> tuple[float, int, int]:
        """What a checkpoint keeps of this interval, given the global sum of `loss_sum`: (loss sum, steps, skipped)."""
        return self.carried_sum + global_sum, self.steps, self.skipped

    def first_nonfinite_step(self) -> int:
        """The first step whose loss is NaN or infinite; 0 if none (a host sync: only on the failure path)."""
        bad = (~torch.isfinite(self.losses[: self.count])).nonzero()
        return self.first_step + int(bad[0]) if len(bad) else 0


def check_finite(
    loss: float, interval: Interval, epoch: int, strategy: SingleDevice, rerun: str, lr: float | None = None
) -> None:
    """Stops every rank at once if the interval's global mean loss is NaN or infinite, naming the first bad step.

    A NaN on one rank reaches every rank through the reductions, so all ranks get here together; one more
    reduction tells them which rank saw it first, and when. `epoch` is the number of completed epochs; `rerun` says
    where a rerun would continue from; `lr`, the learning rate, is named too (optimizer.lr=1e10 diverges).
    """
    if math.isfinite(loss):
        return
    first_bad = torch.zeros(strategy.world_size, device=strategy.device)
    first_bad[strategy.rank] = interval.first_nonfinite_step()
    per_rank = [(step, rank) for rank, step in enumerate(strategy.all_reduce(first_bad).tolist()) if step > 0]
    if not per_rank:  # every step finite, their sum not: the steps' losses were finite but enormous
        last = interval.first_step + interval.count - 1
        raise TrainingDiverged(f"train/loss overflowed between steps {interval.first_step} and {last}; {rerun}")
    step, rank = min(per_rank)
    at_lr = f", at lr {lr:.3g}" if lr is not None else ""
    raise TrainingDiverged(
        f"train/loss is {loss} at step {int(step)} (epoch {epoch + 1}, first on rank {rank}{at_lr}); {rerun}"
    )


def check_finite_weights(model: torch.nn.Module, step: int, strategy: SingleDevice, rerun: str) -> None:
    """Stops every rank at once if any parameter (any rank's shard of it) or floating-point buffer (batch norm's
    running statistics) is NaN or infinite after `step`: a finite loss can still overflow in the backward pass.
    Called before a validation or a checkpoint, never per step."""
    tensors = [*model.parameters(), *(buffer for buffer in model.buffers() if buffer.is_floating_point())]
    local = [tensor.to_local() if hasattr(tensor, "to_local") else tensor for tensor in tensors]  # FSDP shards
    if not local:
        return
    bad = torch.stack([(~torch.isfinite(param)).any() for param in local]).sum().float().reshape(1)
    if strategy.all_reduce(bad).item():
        raise TrainingDiverged(f"the weights are NaN or infinite after step {step}, from a finite loss; {rerun}")


def nonfinite_on_any_rank(loss: Tensor, strategy: SingleDevice) -> bool:
    """Whether any rank's loss is NaN or infinite: every rank then skips the update together. A collective and a
    host sync per step, the price of deciding before the optimizer steps."""
    bad_ranks = strategy.all_reduce((~torch.isfinite(loss)).float().reshape(1)).item()
    if bad_ranks:
        log.info("non-finite loss on %d rank(s): update skipped (trainer.nonfinite_loss=skip)", bad_ranks)
    return bool(bad_ranks)
