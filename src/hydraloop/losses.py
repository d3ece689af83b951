"""What a NaN or infinite train loss (or weight) does to the run.

The losses stay on the device until a logging step (or a validation or checkpoint between two) reads back their
reduced sum (hydraloop.loop_state). Only when that is not finite does the loop look at the single steps, to name the
first bad one and the rank that saw it (`trainer.nonfinite_loss=stop`); nothing is validated or saved from a
non-finite loss, nor from weights that are not finite. With `trainer.nonfinite_loss=skip`, every step asks all ranks
whether its loss is finite before the optimizer steps.
"""

import logging
import math

import torch
from torch import Tensor

from hydraloop.errors import TrainingDiverged
from hydraloop.loop_state import Interval
from hydraloop.parallel.single import SingleDevice

log = logging.getLogger("hydraloop.trainer")


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
