"""Callbacks: the `callbacks` config group. Each option is one callback under its own name (`callbacks.ema.decay`),
so Hydra's list syntax picks several: `callbacks=[ema]`. A callback of a user's own is a class with these methods
and a yaml file beside conf/callbacks/ema.yaml naming it.

Every rank calls every method at the same moment (a callback may run collectives: validating, gathering shards);
only rank 0 writes, through the trainer's writer: `trainer.writer.log_metrics({"train/my_metric": value}, step)` logs
a metric (a float, the same on every rank; the other ranks' writer drops it). What `state_dict` returns is saved in
each checkpoint, under `callbacks.<name>`, and given back to `load_state_dict` on resume.

The gradient hooks (`on_before_optimizer_step`, `on_after_clipping`) and `on_optimizer_step` act on the state every
rank holds alike, and draw random numbers alike: torch's generators are seeded there from the run's seed and the step,
not the rank (hydraloop.seeding), so `torch.randn_like(param.grad)` is the same on every rank and the same as one
process draws, under every strategy and accumulation. Python's `random` and numpy's are per rank: draw from torch's.

What a callback may use of the trainer it is given is `TrainerView` (hydraloop.trainer.Trainer is one).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch
from hydra.utils import instantiate
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from hydraloop.errors import ConfigError, unwrap_instantiation

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.data import DataLoader

    from hydraloop.checkpoint import TrainState
    from hydraloop.parallel.single import SingleDevice
    from hydraloop.run_writer import NullRunWriter

log = logging.getLogger("hydraloop.trainer")  # a line of the loop's, under the loop's name


class TrainerView(Protocol):
    """What a callback (and hydraloop.replica_check) may use of the trainer it is given; every rank's is alike."""

    strategy: SingleDevice
    """The parallel strategy: `strategy.unwrap(model)` is the plain model; `rank`, `world_size`, `device`."""
    model: nn.Module
    """The model as the strategy wrapped it."""
    optimizers: dict[str, Optimizer]
    """By name: "" for a plain run's one optimizer (hydraloop.optim)."""
    callbacks: dict[str, Callback]
    """The run's callbacks by name, in the order chosen."""
    writer: NullRunWriter
    """`writer.log_metrics({name: value}, step)`: rank 0 writes; the other ranks' writer drops it."""
    val_loader: DataLoader
    """The validation set, once training started."""
    log_every_n_steps: int
    """trainer.log_every_n_steps: the steps where the trainer syncs with the device to log anyway."""

    def evaluate(self, loader: DataLoader) -> dict[str, float]:
        """The task's metrics of the model's weights as they are, over `loader` (a collective: every rank calls it)."""
        ...

    def rerun_note(self) -> str:
        """Where a rerun into this run directory would continue from, for a line that ends the run."""
        ...


class Callback:
    """The moments of the loop a callback acts at. Each does nothing here: a callback overrides what it needs."""

    name: str = ""
    """Its key under `callbacks` (set when built): its metrics' and its checkpoint state's name."""

    def setup(self, trainer: TrainerView) -> None:
        """Once, when the loop is built: the model is wrapped by its strategy and holds its first (or loaded)
        weights; a checkpoint's state comes after, through `load_state_dict`."""

    def on_before_optimizer_step(
        self, trainer: TrainerView, state: TrainState, optimizer_name: str, optimizer: Optimizer
    ) -> None:
        """Before each step of each optimizer (Lightning's moment of the same name), with its parameters' gradients
        as the step takes them: reduced over the ranks and the micro-batches (the global batch's mean), unscaled
        (fp16's loss scale divided out), not yet clipped; a callback may read or change them (`param.grad`). Under
        FSDP each is a DTensor of which this rank holds a shard: a statistic needs all of them, as
        `global_grad_norm` below computes. `optimizer_name`: its key under `optimizer` ("" for a plain run's one
        optimizer). `state.global_step` counts the steps before this one: a metric of this step is logged at
        `state.global_step + 1`, as train/loss is. Not called for a step skipped for a non-finite loss
        (trainer.nonfinite_loss=skip); under fp16, a step that the loss scaler skips for gradients that overflowed
        has called it, with them."""

    def on_after_clipping(
        self, trainer: TrainerView, state: TrainState, optimizer_name: str, optimizer: Optimizer
    ) -> None:
        """Next, after `trainer.grad_clip_norm`'s clipping (if set): the gradients the optimizer steps with."""

    def on_optimizer_step(self, trainer: TrainerView, state: TrainState) -> None:
        """After each optimizer step that updated the weights (once per step, whatever the accumulation; not after
        a step skipped for a non-finite loss); `state.global_step` counts it."""

    def on_validation(self, trainer: TrainerView, state: TrainState, metrics: dict[str, float]) -> dict[str, float]:
        """After each validation, with its metrics: returns metrics of its own to log beside them (global: the same
        on every rank), which `optimized_metric` may name."""
        return {}

    def reported_metrics(self, task_metrics: list[str]) -> list[str]:
        """The names `on_validation` returns, given the task's: the launcher checks `optimized_metric` against them."""
        return []

    def state_dict(self, trainer: TrainerView) -> dict[str, Any]:
        """At each checkpoint save, on every rank (a state sharded by FSDP is gathered here): plain values and CPU
        tensors, as torch.load(weights_only=True) reads them. The same on every rank that holds a copy of the model
        (ddp's): the replica check compares them (trainer.replica_check_every_n_steps), so a wall clock or a rank's
        own random state belongs elsewhere."""
        return {}

    def load_state_dict(self, trainer: TrainerView, state: dict[str, Any]) -> None:
        """On resume, on every rank, after `setup`: what `state_dict` saved."""


def build_callbacks(node: Any) -> dict[str, Callback]:
    """The `callbacks` node ({name: callback config}) as callbacks by name, in the order chosen. A constructor's
    ConfigError names its setting relative to its own node (".decay=2: ..."); the message gets
    `callbacks.<name>` in front."""
    built = {}
    for name, config in (node or {}).items():
        try:
            built[name] = instantiate(config)
            built[name].name = name
        except Exception as error:
            cause = unwrap_instantiation(error)
            if isinstance(cause, ConfigError):
                raise ConfigError(f"callbacks.{name}{cause}") from None
            raise
    return built


def load_callback_states(trainer: TrainerView, states: dict[str, Any]) -> None:
    """A checkpoint's callback states (its `callbacks`), into the trainer's callbacks, those of this run's config."""
    for name, callback in trainer.callbacks.items():
        if name in states:
            callback.load_state_dict(trainer, states[name])
        else:
            log.info("callbacks.%s: the checkpoint holds no state of it; it starts from the loaded weights", name)
    for name in states.keys() - trainer.callbacks.keys():
        log.info("callbacks.%s: the checkpoint holds its state, and this run has no such callback: dropped", name)


def has_gradient_hooks(callbacks: dict[str, Callback]) -> bool:
    """Whether a callback has a gradient hook of its own: the step calls them (and unscales fp16's gradients for
    them) only then."""
    hooks = ("on_before_optimizer_step", "on_after_clipping")
    return any(getattr(type(c), hook) is not getattr(Callback, hook) for c in callbacks.values() for hook in hooks)


def global_grad_norm(optimizer: Optimizer, norm_type: float = 2.0) -> Tensor:
    """The norm of all the gradients `optimizer` steps with, over all of them (every rank's shards under FSDP: a
    collective, which every rank calls), as a plain tensor on the device: the same under every strategy."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def reported_metrics(task_metrics: list[str], callbacks: dict[str, Callback]) -> list[str]:
    """The validation metrics of a run: the task's, then each callback's."""
    return [
        *task_metrics,
        *(name for callback in callbacks.values() for name in callback.reported_metrics(task_metrics)),
    ]
