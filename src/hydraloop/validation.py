"""The loop's validations: the task's metrics of the weights as they are, over the whole validation set (each sample
counted once, on one rank), with the callbacks' beside them; and what the loop keeps of each: the logged metrics and
the log line, the latest metrics (metrics.json's), the best metric (what best.pt must beat) and early stopping's
count, both in TrainState."""

import itertools
import logging
import math
import operator
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from hydraloop.batches import count_rows
from hydraloop.callbacks import TrainerView
from hydraloop.checkpoint import TrainState
from hydraloop.draw_watch import DrawWatch, split_of
from hydraloop.early_stopping import EarlyStopping
from hydraloop.global_batch import global_batch_statistics
from hydraloop.loop_state import GlobalSums
from hydraloop.parallel.single import SingleDevice
from hydraloop.precision import Precision
from hydraloop.preemption import STOP_SIGNALS
from hydraloop.row_keys import VALIDATION_PASS, RowKeys
from hydraloop.run_writer import NullRunWriter
from hydraloop.tasks.base import Task

log = logging.getLogger("hydraloop.trainer")  # a line of the loop's, under the loop's name


class Validation:
    def __init__(
        self,
        strategy: SingleDevice,
        writer: NullRunWriter,
        precision: Precision,
        task: Task,
        model: nn.Module,
        settings: Any,
        metric: tuple[str, str],
        validated: dict[str, float] | None,
        on_device: Callable[[Any], Any],
        row_keys: RowKeys | None = None,
        global_sums: GlobalSums | None = None,
    ) -> None:
        """`settings`: the `trainer` config node; `metric`: optimized_metric and optimized_metric_mode (max, min);
        `validated`: the metrics of the resumed checkpoint's step, if it holds them; `on_device`: a batch as the
        model takes it, on this rank's device; `row_keys`: the rows of each batch, for keyed draws (its samples'
        indices in the validation set: the same numbers at every validation, under every strategy); `global_sums`:
        the loop's, whose stop votes each validation's all-reduce carries (hydraloop.loop_state)."""
        optimized_metric, optimized_metric_mode = metric
        self.strategy, self.writer, self.precision, self.task, self.model = strategy, writer, precision, task, model
        self.max_epochs, self.max_steps = settings.max_epochs, settings.max_steps
        self.limit_val_batches = settings.limit_val_batches
        self.on_device = on_device
        self.optimized_metric = optimized_metric
        self.improved = operator.gt if optimized_metric_mode == "max" else operator.lt
        patience, min_delta = settings.early_stopping.patience, settings.early_stopping.min_delta
        self.early_stopping = EarlyStopping(patience, min_delta, optimized_metric, optimized_metric_mode)
        self.validated = validated or {}  # the latest validation's metrics...
        self.validated_at = -1  # ...and its global step (see Trainer.fit for a resumed checkpoint's)
        self.row_keys, self.global_sums = row_keys, global_sums
        split = split_of(strategy, 1)
        self.draw_watch = DrawWatch(strategy.devices, split, strategy.is_main_process, name_draws=not settings.compile)

    @torch.no_grad()
    def evaluate(self, loader: DataLoader) -> dict[str, float]:
        """The task's metrics over the whole validation set; each sample is counted once, on one rank."""
        strategy, task = self.strategy, self.task
        module = strategy.eval_module(self.model)
        module.eval()
        # The statistics, the ranks' stop votes, and last whether a rank drew from torch's generators
        # (hydraloop.draw_watch).
        num_statistics = task.num_statistics
        totals = torch.zeros(num_statistics + len(STOP_SIGNALS) + 1, dtype=torch.float64, device=strategy.device)
        batches = itertools.islice(loader, self.limit_val_batches)
        count = min(len(loader), self.limit_val_batches or len(loader))
        # A loss over the global batch gathers over the ranks in every batch: every rank runs as many.
        every_rank = strategy.batches_on_every_rank if task.global_batch_loss else strategy.eval_batches
        first_row = 0  # the rank's samples so far: its next sample is rank + world_size * first_row of the set
        for batch in every_rank(batches, count):
            batch, rows = self.on_device(batch), count_rows(batch)
            keys = self.row_keys(0, first_row, rows, VALIDATION_PASS) if self.row_keys else nullcontext()
            with self.precision.autocast(), keys, self.draw_watch.watching(None):
                if task.global_batch_loss:
                    totals[:num_statistics] += global_batch_statistics(task, module, batch, strategy)
                else:
                    totals[:num_statistics] += task.validation_statistics(module, batch)
            first_row += rows
        if self.global_sums:  # a stop signal that came during the pass is agreed on at its end
            totals[num_statistics:-1] = torch.tensor(self.global_sums.stop_votes(), dtype=torch.float64)
        totals[-1] = self.draw_watch.flag()
        totals = strategy.all_reduce(totals).tolist()
        if self.global_sums:
            self.global_sums.agree(totals[num_statistics:-1])
        self.draw_watch.reduced(totals[-1])
        metrics = task.metrics_from(totals[:num_statistics])
        return {**metrics, **(task.extra_metrics.compute() if task.extra_metrics else {})}

    def metrics(self, trainer: TrainerView, state: TrainState) -> dict[str, float]:
        """The task's metrics of the weights as they are, and the callbacks' (val/ema/... beside them)."""
        metrics = self.evaluate(trainer.val_loader)
        for callback in trainer.callbacks.values():
            metrics.update(callback.on_validation(trainer, state, metrics))
        return metrics

    def record(self, state: TrainState, val_metrics: dict[str, float], logged: dict | None) -> bool:
        """Logs a validation's metrics (with `logged`), keeps them as the latest, and the best metric and early
        stopping's count in `state`; returns whether the metric is the best so far (best.pt)."""
        self.writer.log_metrics({**val_metrics, **(logged or {})}, state.global_step)
        where = (
            f"step {state.global_step}/{self.max_steps}" if self.max_steps else f"epoch {state.epoch}/{self.max_epochs}"
        )
        shown = " | ".join(f"{name} {value:.4f}" for name, value in {**(logged or {}), **val_metrics}.items())
        log.info("%s | %s", where, shown)
        metric = val_metrics[self.optimized_metric]
        # A metric that is not a number (weights that diverged in validation only) is never the best.
        is_best = math.isfinite(metric) and (state.best_metric is None or self.improved(metric, state.best_metric))
        if is_best:
            state.best_metric = metric
        self.early_stopping.update(state, metric)
        self.validated_at, self.validated = state.global_step, val_metrics
        return is_best


def run_summary(val_metrics: dict[str, float], state: TrainState, world_size: int) -> dict[str, Any]:
    """What metrics.json reports of a run besides its timing: `val_metrics` and where the run stands."""
    return {
        **val_metrics,
        "epoch": state.epoch,
        "global_step": state.global_step,
        "skipped_steps": state.skipped_steps,
        "world_size": world_size,
        "stopped_early": {"epoch": state.epoch, "global_step": state.global_step, "reason": state.stopped_early}
        if state.stopped_early
        else None,
    }
