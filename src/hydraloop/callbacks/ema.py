"""`callbacks=[ema]`: an exponential moving average of the weights, validated beside them. Under its name in the
config (`callbacks.ema`; another, `callbacks.ema_slow`, with `_target_: hydraloop.callbacks.ema.EMA`) its metrics
are `val/<name>/<metric>` (val/ema/acc), and `ckpt_weights=<name>` evaluates or predicts with its weights.

After every `every_n_steps`-th optimizer step, each trainable parameter's average moves towards it:
`average = decay_k * average + (1 - decay_k) * weight`, where `decay_k` is `decay`, or with `warmup` the smaller
`(1 + k) / (10 + k)` for the k-th update (k from 0; TensorFlow's ExponentialMovingAverage with num_updates): early
averages do not drag the random initial weights along for thousands of steps. Buffers (batch norm's
running statistics) are not averaged: the averaged weights are validated and saved with the model's own.

Each rank averages the parameters it holds: all of them under single and DDP (where every rank's are equal), its
shard under FSDP, so the average costs no communication; the checkpoint gathers FSDP's shards into full tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from hydraloop.callbacks import Callback, TrainerView
from hydraloop.errors import ConfigError, require

if TYPE_CHECKING:
    from hydraloop.checkpoint import TrainState


class EMA(Callback):
    """The average of the trainable weights (see the module docstring)."""

    def __init__(self, decay: float = 0.999, warmup: bool = True, every_n_steps: int = 1) -> None:
        require(isinstance(decay, float | int) and 0 < decay < 1, f".decay={decay}: must be in (0, 1)")
        require(isinstance(every_n_steps, int) and every_n_steps >= 1, f".every_n_steps={every_n_steps}: must be >= 1")
        self.decay, self.warmup, self.every_n_steps = float(decay), warmup, every_n_steps
        self.updates = 0

    def setup(self, trainer: TrainerView) -> None:
        named = [(n, p) for n, p in trainer.strategy.unwrap(trainer.model).named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        with torch.no_grad():
            self.average = [param.detach().clone() for param in self.params]
        # The foreach kernels run on each rank's own tensors (FSDP's shards: DTensor has no foreach copy).
        self.local_params = [_local(param) for param in self.params]
        self.local_average = [_local(average) for average in self.average]

    def decay_at(self, update: int) -> float:
        """The decay of the `update`-th update (from 0)."""
        return min(self.decay, (1 + update) / (10 + update)) if self.warmup else self.decay

    @torch.no_grad()
    def on_optimizer_step(self, trainer: TrainerView, state: TrainState) -> None:
        if state.global_step % self.every_n_steps:
            return
        # One foreach kernel over all parameters: average += (1 - decay) * (weight - average).
        torch._foreach_lerp_(self.local_average, self.local_params, 1.0 - self.decay_at(self.updates))
        self.updates += 1

    def on_validation(self, trainer: TrainerView, state: TrainState, metrics: dict[str, float]) -> dict[str, float]:
        with self.weights_in_model(trainer):
            averaged = trainer.evaluate(trainer.val_loader)
        return {self._metric(name): value for name, value in averaged.items()}

    def reported_metrics(self, task_metrics: list[str]) -> list[str]:
        return [self._metric(name) for name in task_metrics]

    def _metric(self, name: str) -> str:
        return f"val/{self.name}/{name.removeprefix('val/')}"

    @contextmanager
    def weights_in_model(self, trainer: TrainerView) -> Iterator[None]:
        """The averages in the model's parameters, in place (so any wrapper sees them), and the weights back after.
        Each write follows the strategy's `reshard`: under FSDP a forward may have left gathered copies, which the
        next forward would read instead: the raw weights would be validated as the average, and the average, left
        gathered by that validation, trained on."""
        trainer.strategy.reshard(trainer.model)
        with torch.no_grad():
            weights = [param.clone() for param in self.local_params]
            torch._foreach_copy_(self.local_params, self.local_average)
        try:
            yield
        finally:
            trainer.strategy.reshard(trainer.model)
            with torch.no_grad():
                torch._foreach_copy_(self.local_params, weights)

    def state_dict(self, trainer: TrainerView) -> dict[str, Any]:
        # Every rank takes part in gathering FSDP's shards; under single and DDP these are the averages themselves.
        full = [average.full_tensor() if isinstance(average, DTensor) else average for average in self.average]
        return {"updates": self.updates, "weights": dict(zip(self.names, full, strict=True))}

    @torch.no_grad()
    def load_state_dict(self, trainer: TrainerView, state: dict[str, Any]) -> None:
        saved = state["weights"]
        if sorted(saved) != sorted(self.names):  # a resume into another set of trainable parameters
            raise ConfigError(
                f"callbacks.{self.name}: the checkpoint averages other parameters ({len(saved)}) than the model trains "
                f"({len(self.names)}); resume without callbacks.{self.name}, or with the parameters trained before"
            )
        for average, name in zip(self.average, self.names, strict=True):
            full = saved[name].to(average.device)
            if isinstance(average, DTensor):  # this rank's shard of the full tensor
                full = distribute_tensor(full, average.device_mesh, average.placements)
            _local(average).copy_(_local(full))
        self.updates = state["updates"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`, sharing its memory: a DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
