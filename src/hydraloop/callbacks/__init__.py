"""Callbacks: the `callbacks` config group. Each option is one callback under its own name (`callbacks.ema.decay`),
so Hydra's list syntax picks several: `callbacks=[ema]`. A callback of a user's own is a class with these methods
and a yaml file beside conf/callbacks/ema.yaml naming it.

Every rank calls every method at the same moment (a callback may run collectives: validating, gathering shards);
only rank 0 writes, through the trainer's writer. What `state_dict` returns is saved in each checkpoint, under
`callbacks.<name>`, and given back to `load_state_dict` on resume.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hydra.utils import instantiate

from hydraloop.errors import ConfigError, unwrap_instantiation

if TYPE_CHECKING:
    from hydraloop.checkpoint import TrainState
    from hydraloop.trainer import Trainer


class Callback:
    """The moments of the loop a callback acts at. Each does nothing here: a callback overrides what it needs."""

    name: str = ""
    """Its key under `callbacks` (set when built): its metrics' and its checkpoint state's name."""

    def setup(self, trainer: Trainer) -> None:
        """Once, when the loop is built: the model is wrapped by its strategy and holds its first (or loaded)
        weights; a checkpoint's state comes after, through `load_state_dict`."""

    def on_optimizer_step(self, trainer: Trainer, state: TrainState) -> None:
        """After each optimizer step that updated the weights (once per step, whatever the accumulation; not after
        a step skipped for a non-finite loss); `state.global_step` counts it."""

    def on_validation(self, trainer: Trainer, state: TrainState, metrics: dict[str, float]) -> dict[str, float]:
        """After each validation, with its metrics: returns metrics of its own to log beside them (global: the same
        on every rank), which `optimized_metric` may name."""
        return {}

    def reported_metrics(self, task_metrics: list[str]) -> list[str]:
        """The names `on_validation` returns, given the task's: the launcher checks `optimized_metric` against them."""
        return []

    def state_dict(self, trainer: Trainer) -> dict[str, Any]:
        """At each checkpoint save, on every rank (a state sharded by FSDP is gathered here): plain values and CPU
        tensors, as torch.load(weights_only=True) reads them."""
        return {}

    def load_state_dict(self, trainer: Trainer, state: dict[str, Any]) -> None:
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


def reported_metrics(task_metrics: list[str], callbacks: dict[str, Callback]) -> list[str]:
    """The validation metrics of a run: the task's, then each callback's."""
    return [
        *task_metrics,
        *(name for callback in callbacks.values() for name in callback.reported_metrics(task_metrics)),
    ]
