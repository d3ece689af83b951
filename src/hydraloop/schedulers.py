"""Learning-rate schedules as LambdaLR over optimizer steps, completed in code with the run's step counts.

The schedule is a function of the step only, so a resumed run (which restores the step) follows the same curve.
"""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from hydraloop.errors import require


def apply_current_step(scheduler: LambdaLR) -> None:
    """Sets the optimizer's lr to this schedule's value at its current step.

    After a resume the optimizer state brings back the lr of the checkpoint's plan; when `trainer.max_epochs`
    changed, the plan (total steps) changed too, and the very next step must already follow the new one.
    """
    for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)


def constant(optimizer: Optimizer, *, total_steps: int, steps_per_epoch: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: 1.0)


def cosine_with_warmup(
    optimizer: Optimizer,
    *,
    total_steps: int,
    steps_per_epoch: int,
    warmup_epochs: float | None = None,
    warmup_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Linear warm-up from 0 over `warmup_steps` optimizer steps, or `warmup_epochs` epochs (one or the other; neither:
    one epoch), then cosine decay to `min_lr_ratio` times the lr at the run's last step."""
    require(
        warmup_epochs is None or warmup_steps is None,
        f"scheduler.warmup_steps={warmup_steps}, scheduler.warmup_epochs={warmup_epochs}: give one or the other "
        "(set the other to null)",
    )
    require(warmup_epochs is None or warmup_epochs >= 0, f"scheduler.warmup_epochs={warmup_epochs}: must be at least 0")
    require(warmup_steps is None or warmup_steps >= 0, f"scheduler.warmup_steps={warmup_steps}: must be at least 0")
    require(0 <= min_lr_ratio <= 1, f"scheduler.min_lr_ratio={min_lr_ratio}: must be between 0 and 1")
    if warmup_steps is None:
        key, value = "warmup_epochs", 1.0 if warmup_epochs is None else warmup_epochs
        warmup_steps = round(value * steps_per_epoch)
    else:
        key, value = "warmup_steps", warmup_steps
    # A warm-up longer than the run never reaches the peak lr (warmup_epochs=5 with max_steps=30: a sixth of it).
    # One exactly as long reaches it at the last step: a 1-epoch trial of a recipe with a 1-epoch warm-up.
    require(
        warmup_steps <= total_steps,
        f"scheduler.{key}={value}: a warm-up of {warmup_steps} steps passes the run's {total_steps} steps"
        + (f" ({steps_per_epoch} per epoch)" if key == "warmup_epochs" else "")
        + ", so the lr never reaches its peak; shorten it",
    )

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def step_decay(
    optimizer: Optimizer, *, total_steps: int, steps_per_epoch: int, step_epochs: int = 30, gamma: float = 0.1
) -> LambdaLR:
    """The lr times `gamma` after every `step_epochs` epochs, at the epoch's first step (torch's StepLR, by epoch)."""
    require(step_epochs > 0, f"scheduler.step_epochs={step_epochs}: must be positive")
    require(gamma > 0, f"scheduler.gamma={gamma}: must be positive")
    return LambdaLR(optimizer, lambda step: gamma ** (step // (step_epochs * steps_per_epoch)))
