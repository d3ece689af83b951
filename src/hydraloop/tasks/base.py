"""A task owns how a batch meets the model, and turns the model's outputs and the targets into the training loss and
the validation metrics.

The loop names no loss and no metric, and calls no model itself: it hands the task the (wrapped) model and a batch of
any structure (`training_loss`, `validation_statistics`, `predict`). By default a batch is split into inputs and
targets (`split`): `(inputs, targets)`, `(x1, x2, ..., targets)`, or a dict whose `labels` are the targets; the model
is called with the inputs positionally, or by keyword for a dict (`call`); and the outputs are a tensor of logits, or a
mapping (a Hugging Face ModelOutput among them) holding `logits` (`logits`). A task of one's own overrides any of
these, e.g. `training_loss` to return a model's own `outputs.loss`.
 In validation it adds up the task's statistics of each batch (sums and counts,
in float64), all-reduces the totals once over the ranks, and lets the task turn them into metrics. Every sample is
counted once whatever the world size, so the metrics are exact under every strategy: a mean of per-rank means would
not be, with shards of unequal sizes.
"""

from collections.abc import Mapping
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
    global_batch_loss: ClassVar[bool] = False
    """Whether the loss is over the whole global batch (in-batch negatives): hydraloop.tasks.global_batch's."""

    extra_metrics: Any = None
    """The config's `metrics` (hydraloop.metrics.MetricSet: torchmetrics by name), updated in validation with
    `metric_inputs`; set by the entrypoint. A task's own `validation_statistics` updates them itself."""

    def reported_metrics(self) -> list[str]:
        """The metrics this task reports (all of `metrics`, unless a subclass leaves some out)."""
        return list(self.metrics)

    def all_metrics(self) -> list[str]:
        """What validation reports: the task's metrics, then the config's `metrics`."""
        return [*self.reported_metrics(), *(self.extra_metrics.names if self.extra_metrics else [])]

    target_key: ClassVar[str] = "labels"
    """Where a dict batch holds the targets (Hugging Face's name)."""

    def training_loss(self, model: Any, batch: Any) -> Tensor:
        """The loss a training step minimises on a (micro-)batch: a scalar, the mean over its rows (the loop weights
        each micro-batch by its rows). It may be given a batch of no rows (a rank's share of an incomplete last batch),
        whose loss the loop multiplies by 0: it must still run the model, whose gradient synchronisation every rank
        joins."""
        inputs, targets = self.split(batch)
        return self.loss(call(model, inputs), targets)

    def loss_weight(self, batch: Any) -> Tensor | None:
        """What `training_loss` of a (micro-)batch is a mean over, when that is not its rows: a count as an integer
        tensor, e.g. a language model's target tokens in padded sequences. The loop then weights each micro-batch by
        its count over the global batch's (one more all-reduce per step), so a step's loss is the mean over every
        counted item of the global batch whatever its split. None (here): rows. None for every batch or for none."""
        return None

    def optimizer_steps(self, step: int, optimizers: list[str]) -> list[str]:
        """With several optimizers: those that step at optimizer step `step` (counted from 0), in order, each with a
        pass of its own over the batch, whose loss is `training_loss(model, batch, optimizer=name)`
        (docs/optimizers-and-callbacks.md). Here, every optimizer, in the config's order; a GAN's critic steps every
        time, its generator every n-th step, say."""
        return optimizers

    def validation_statistics(self, model: Any, batch: Any) -> Tensor:
        """The statistics of a validation batch (see `statistics`); the config's `metrics` are updated too."""
        inputs, targets = self.split(batch)
        outputs = call(model, inputs)
        if self.extra_metrics:
            self.extra_metrics.update(*self.metric_inputs(outputs, targets))
        return self.statistics(outputs, targets)

    def metric_inputs(self, outputs: Any, targets: Tensor) -> tuple[Tensor, Tensor]:
        """What the config's `metrics` (torchmetrics) are updated with: the outputs as a tensor (logits), targets."""
        return logits(outputs, self), targets

    def predict(self, model: Any, inputs: Any) -> dict[str, Tensor]:
        """mode=predict: the predictions for a batch of inputs (see `predictions`)."""
        return self.predictions(call(model, inputs))

    def split(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, targets) of a batch or sample: the last item of a tuple or list (the rest are the inputs, one or
        several), or a dict's `target_key`; anything else is one line saying so."""
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            return (batch[0] if len(batch) == 2 else tuple(batch[:-1])), batch[-1]
        if isinstance(batch, Mapping):
            if self.target_key not in batch:
                raise ConfigError(
                    f"the batch is a dict of {', '.join(map(repr, batch))}, without {self.target_key!r}, where "
                    f"{type(self).__name__} reads its targets (a task of your own can read others, or set target_key: "
                    "docs/make-it-yours.md)"
                )
            return {key: value for key, value in batch.items() if key != self.target_key}, batch[self.target_key]
        raise ConfigError(
            f"the batch is a {type(batch).__name__}; {type(self).__name__} takes (inputs, targets), (x1, x2, ..., "
            f"targets) or a dict with {self.target_key!r} (a task of your own takes anything: docs/make-it-yours.md)"
        )

    def loss(self, outputs: Any, targets: Tensor) -> Tensor:
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

    def check_sample(self, sample: Any, where: str) -> None:
        """In the launcher and each rank, on one sample of the training set (`where` names the data set): raises
        ConfigError if it does not fit. Here: its targets (see `split` and `check_targets`)."""
        _, targets = self.split(sample)
        self.check_targets(torch.as_tensor(targets), where)

    def check_targets(self, targets: Tensor, where: str) -> None:
        """On one sample's targets (`where` names the data set): raises ConfigError if they do not fit."""

    def check_all_targets(self, targets: Tensor, where: str) -> None:
        """In the launcher, on every target of a training set held in memory (a TensorDataset's last tensor, read
        at no cost): raises ConfigError for values that do not fit (a class label past data.num_classes), which
        one sample, or the meta device, cannot show."""


def call(model: Any, inputs: Any) -> Any:
    """The model called on a batch's inputs: a tuple or list positionally, a dict by keyword, else as one input."""
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)


def logits(outputs: Any, task: Task) -> Tensor:
    """A model's outputs as a tensor: itself, or a mapping's (a Hugging Face ModelOutput's) `logits`."""
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), Tensor):
        return outputs["logits"]
    raise ConfigError(
        f"the model returns a {type(outputs).__name__}; {type(task).__name__} reads a tensor of outputs, or a mapping "
        "(or a Hugging Face ModelOutput) holding 'logits'"
    )


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
