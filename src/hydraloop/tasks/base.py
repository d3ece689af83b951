"""A task turns a model's outputs and the targets into the training loss and the validation metrics.

The loop names no loss and no metric. In validation it adds up the task's statistics of each batch (sums and counts,
in float64), all-reduces the totals once over the ranks, and lets the task turn them into metrics. Every sample is
counted once whatever the world size, so the metrics are exact under every strategy: a mean of per-rank means would
not be, with shards of unequal sizes.
"""

from typing import Any, ClassVar

import torch
from torch import Tensor

from hydraloop.errors import ConfigError


class Task:
    metrics: ClassVar[dict[str, str]] = {}
    """Every metric a task of this kind can report, and which direction is better: max or min."""
    default_metric: ClassVar[str] = ""
    """`optimized_metric` when the config names none."""
    tokens_per_sample: int | None = None
    """Tokens in one sample's targets (perf/tokens_per_sec); None: the task does not count tokens."""
    num_statistics: int
    """The length of `statistics`' vector (a rank with no validation batch still joins the reduction with zeros)."""

    def reported_metrics(self) -> list[str]:
        """The metrics this task reports (all of `metrics`, unless a subclass leaves some out)."""
        return list(self.metrics)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """The training loss: a scalar, the mean over the batch (equal micro-batches then average to the batch's)."""
        raise NotImplementedError

    def statistics(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """A 1-D float64 tensor of sums and counts over the batch, added over batches and ranks."""
        raise NotImplementedError

    def metrics_from(self, totals: list[float]) -> dict[str, float]:
        """The metrics (`reported_metrics`, in that order) from the statistics summed over the whole validation set."""
        raise NotImplementedError

    def predictions(self, outputs: Tensor) -> dict[str, Tensor]:
        """mode=predict: what is saved for each input, by name (rows: the inputs); here, the model's outputs."""
        return {"outputs": outputs.float()}

    def check(self, cfg: Any) -> None:
        """In the launcher, before any rank starts: does the task fit the data and model configs? Raises ConfigError."""

    def check_targets(self, targets: Tensor, where: str) -> None:
        """In each rank, on one sample's targets (`where` names the data set): raises ConfigError if they do not fit."""


def count(outputs: Tensor, n: int) -> Tensor:
    """`n` as a float64 scalar on the outputs' device: a fill, not a host-to-device copy."""
    return torch.full((), n, dtype=torch.float64, device=outputs.device)


def task_name(cfg: Any) -> str:
    """How the command line names the task (`task=regression`), for messages."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return f"task={HydraConfig.get().runtime.choices.get('task')}"
    return f"task {cfg.task._target_}"


def misfit(task: Task, where: str, found: str, needed: str) -> ConfigError:
    return ConfigError(f"{where}: the training set has {found}; {type(task).__name__} needs {needed}")
