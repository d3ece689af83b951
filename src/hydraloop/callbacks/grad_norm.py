"""`callbacks=[grad_norm]`: the norm of the gradients each optimizer steps with, logged as `train/grad_norm` (with
several optimizers, `train/grad_norm/<name>`; another key under `callbacks` names it instead of grad_norm) at the
trainer's logging steps, beside train/loss. It is the norm of the
global batch's mean gradient, unscaled and before clipping (`trainer.grad_clip_norm` compares this number with its
threshold): the same under every strategy and accumulation (under FSDP, over every rank's shards).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.optim import Optimizer

from hydraloop.callbacks import Callback, TrainerView, global_grad_norm
from hydraloop.errors import require

if TYPE_CHECKING:
    from hydraloop.checkpoint import TrainState


class GradNorm(Callback):
    """Logs the gradients' `norm_type`-norm (2: Euclidean; inf: the largest magnitude)."""

    def __init__(self, norm_type: float = 2.0) -> None:
        require(isinstance(norm_type, float | int) and norm_type > 0, f".norm_type={norm_type}: must be positive")
        self.norm_type = float(norm_type)

    def on_before_optimizer_step(
        self, trainer: TrainerView, state: TrainState, optimizer_name: str, optimizer: Optimizer
    ) -> None:
        step = state.global_step + 1  # the step this update makes, as train/loss counts it
        if step % trainer.log_every_n_steps:
            return  # .item() is a host sync: only where the trainer syncs to log anyway
        # Its own key under `callbacks` names the metric: two such callbacks (two norms) log two metrics.
        name = f"train/{self.name}/{optimizer_name}" if optimizer_name else f"train/{self.name}"
        trainer.writer.log_metrics({name: global_grad_norm(optimizer, self.norm_type).item()}, step)
