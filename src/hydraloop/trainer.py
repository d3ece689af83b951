"""The training loop. It runs identically on every rank, talks to the parallel strategy only through its small
interface (`all_reduce`, `no_sync`, `eval_module`, `eval_batches`, `state_dicts`), to the objective only through
the task (`loss`, `statistics`, `metrics_from`), and to the run directory only through the (possibly null) run
writer."""

import itertools
import logging
import math
import operator
import time
from contextlib import nullcontext
from typing import Any, NoReturn

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from tqdm import tqdm

from hydraloop.checkpoint import TrainState, checkpoint_state
from hydraloop.early_stopping import EarlyStopping
from hydraloop.errors import Interrupted
from hydraloop.keyed_dropout import KeyedDropout, RowKeys
from hydraloop.losses import Interval, check_finite, check_not_all_skipped, nonfinite_on_any_rank
from hydraloop.parallel.single import SingleDevice
from hydraloop.perf import Throughput, interval_peak_memory_gb
from hydraloop.precision import Precision
from hydraloop.preemption import STOP_SIGNALS, StopRequest
from hydraloop.profiling import NullProfiler
from hydraloop.run_writer import NullRunWriter
from hydraloop.seeding import StepSeeder, epoch_seed, seed_everything
from hydraloop.tasks.base import Task

log = logging.getLogger(__name__)


def planned_steps(settings: Any, steps_per_epoch: int) -> int:
    """The optimizer steps of the whole run (`settings`: the trainer config), which schedules plan for."""
    return settings.max_steps or settings.max_epochs * steps_per_epoch


def batches_per_epoch(loader: DataLoader, limit: int | None, skipped: int = 0) -> int:
    """Steps in a whole epoch; `skipped`: batches the loader leaves out of this one (see ResumableSampler)."""
    full = len(loader) + skipped
    return min(full, limit or full)


class Trainer:
    def __init__(
        self,
        strategy: SingleDevice,
        writer: NullRunWriter,
        precision: Precision,
        task: Task,
        settings: Any,
        *,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        throughput: Throughput,
        seed: int,
        optimized_metric: str,
        optimized_metric_mode: str,
        config: dict[str, Any],
        stop_request: StopRequest | None = None,
    ) -> None:
        """`settings` is the `trainer` config node (see hydraloop.config.TrainerConfig for each key); `model` is the
        strategy-wrapped model; `stop_request` is set by a stop signal (see hydraloop.preemption)."""
        self.strategy, self.writer, self.precision, self.task = strategy, writer, precision, task
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.max_epochs = settings.max_epochs
        self.max_steps = settings.max_steps
        self.val_every_n_steps = settings.val_every_n_steps
        self.ckpt_every_n_steps = settings.ckpt_every_n_steps
        self.log_every_n_steps = settings.log_every_n_steps
        self.grad_clip_norm = settings.grad_clip_norm
        self.grad_accum_steps = settings.grad_accum_steps
        self.skip_nonfinite = settings.nonfinite_loss == "skip"
        self.save_checkpoints = settings.save_checkpoints
        self.limit_train_batches = settings.limit_train_batches
        self.limit_val_batches = settings.limit_val_batches
        self.channels_last = settings.channels_last
        self.throughput = throughput
        self.seed = seed
        self.optimized_metric = optimized_metric
        self.improved = operator.gt if optimized_metric_mode == "max" else operator.lt
        patience, min_delta = settings.early_stopping.patience, settings.early_stopping.min_delta
        self.early_stopping = EarlyStopping(patience, min_delta, optimized_metric, optimized_metric_mode)
        self.config = config  # stored in every checkpoint
        self.stop_request = stop_request or StopRequest()
        self.stop_signum = 0  # the stop signal all ranks agreed on at the last reduction
        self.seed_step = StepSeeder(seed, strategy.rank, strategy.devices)
        # Only for a model that has KeyedDropout: every other model pays nothing for it.
        keyed = any(isinstance(module, KeyedDropout) for module in model.modules())
        self.row_keys = RowKeys(seed, strategy.rank, strategy.world_size, strategy.device) if keyed else None
        self.progress, self.profiler = tqdm(disable=True), NullProfiler()  # fit() swaps in the writer's
        self.validated_at = self.saved_at = -1  # global steps of the latest validation and checkpoint

    def finished(self, state: TrainState) -> bool:
        if state.stopped_early:
            return True
        return state.global_step >= self.max_steps if self.max_steps else state.epoch >= self.max_epochs

    def fit(self, train_loader: DataLoader, val_loader: DataLoader, state: TrainState) -> dict[str, Any]:
        """Trains from `state` to `max_epochs` (or `max_steps`), validating and checkpointing after each epoch, every
        `val_every_n_steps` / `ckpt_every_n_steps` steps, and at the end.

        On a stop signal, checkpoints after the next logging step (or epoch end) and raises Interrupted.
        """
        start = time.perf_counter()
        train_loss, val_metrics = None, None
        self.val_loader = val_loader
        total_steps = planned_steps(self, batches_per_epoch(train_loader, self.limit_train_batches))
        with (
            self.writer.progress(total_steps, state.global_step) as self.progress,
            self.writer.profiler() as self.profiler,
        ):
            while not self.finished(state):
                seed_everything(epoch_seed(self.seed, self.strategy.rank, state.epoch))
                # A new permutation per epoch, the same on every rank; after a mid-epoch checkpoint, its rest.
                train_loader.sampler.set_epoch(state.epoch, start_batch=state.epoch_step)
                train_loss, epoch_done = self.train_epoch(train_loader, state)
                if not epoch_done:  # max_steps reached mid-epoch
                    break
                state.next_epoch()
                val_metrics = self.validate_and_save(state, {"train/epoch_loss": train_loss})
                if self.stop_signum:
                    self._stop(f"after epoch {state.epoch}")
            if self.validated_at != state.global_step:  # ended mid-epoch, or resumed with nothing left to train
                trained = train_loss is not None
                val_metrics = self.validate_and_save(state, save=trained and self.saved_at != state.global_step)
        wall_time_s = time.perf_counter() - start
        return {**self._summary(val_metrics, state), "train/loss": train_loss, "wall_time_s": wall_time_s}

    def validate_and_save(self, state: TrainState, logged: dict | None = None, save: bool = True) -> dict[str, float]:
        """Validates, logs the metrics (with `logged`), and checkpoints: last.pt, and best.pt if the metric improved."""
        val_metrics = self.evaluate(self.val_loader)
        self.writer.log_metrics({**val_metrics, **(logged or {})}, state.global_step)
        where = (
            f"step {state.global_step}/{self.max_steps}" if self.max_steps else f"epoch {state.epoch}/{self.max_epochs}"
        )
        shown = " | ".join(f"{name} {value:.4f}" for name, value in {**(logged or {}), **val_metrics}.items())
        log.info("%s | %s", where, shown)
        metric = val_metrics[self.optimized_metric]
        is_best = state.best_metric is None or self.improved(metric, state.best_metric)
        if is_best:
            state.best_metric = metric
        self.early_stopping.update(state, metric)
        self.validated_at = state.global_step
        if save:
            self.save_checkpoint(state, val_metrics, is_best=is_best)
        return val_metrics

    def save_checkpoint(self, state: TrainState, val_metrics: dict[str, float], is_best: bool) -> None:
        """The one place a checkpoint is made; called on every rank.

        The strategy decides what that costs each rank: single and DDP build the state only where it is written
        (rank 0; the others have a null writer), FSDP gathers the shards on every rank (a collective).
        """
        self.saved_at = state.global_step
        if not self.save_checkpoints:
            return  # not even FSDP's gather
        state_dicts = self.strategy.state_dicts(self.model, self.optimizer)

        def make_state() -> dict[str, Any]:
            return checkpoint_state(
                *state_dicts(), self.scheduler, self.precision, state, val_metrics, self.config, self.strategy.device
            )

        self.writer.save_checkpoint(make_state, is_best=is_best)

    def validate(self, val_loader: DataLoader, state: TrainState) -> dict[str, Any]:
        """mode=eval: the metrics of the weights as they are, with the checkpoint's epoch and step."""
        start = time.perf_counter()
        metrics = self.evaluate(val_loader)
        return {**self._summary(metrics, state), "wall_time_s": time.perf_counter() - start}

    def _stop(self, where: str) -> NoReturn:
        """Ends the run on a stop signal, after its checkpoint; the loggers mark their runs preempted, not failed."""
        log.info("stopping %s", where)  # the launcher of spawned ranks reports only the signal
        self.writer.interrupted()
        raise Interrupted(self.stop_signum, f"{where}: {self._resume_hint()}")

    def _resume_hint(self) -> str:
        if not self.save_checkpoints:
            return "trainer.save_checkpoints=false, so nothing was saved"
        return "checkpoints/last.pt holds it; the same command run into the same directory continues from there"

    def _summary(self, val_metrics: dict[str, float], state: TrainState) -> dict[str, Any]:
        return {
            **val_metrics,
            "epoch": state.epoch,
            "global_step": state.global_step,
            "skipped_steps": state.skipped_steps,
            "world_size": self.strategy.world_size,
            "stopped_early": {"epoch": state.epoch, "global_step": state.global_step, "reason": state.stopped_early}
            if state.stopped_early
            else None,
        }

    def train_epoch(self, loader: DataLoader, state: TrainState) -> tuple[float, bool]:
        """The rest of one pass over this rank's shard (all of it, unless resumed mid-epoch), or up to `max_steps`.
        Returns the mean train loss over all ranks of the epoch's steps so far, and whether the epoch is complete."""
        self.model.train()
        device = self.strategy.device
        steps = batches_per_epoch(loader, self.limit_train_batches, skipped=state.epoch_step)
        # Losses are summed on the device and read back only on logging steps: `.item()` is a host sync. Each rank
        # starts from the global sum of a resumed epoch's earlier steps; the mean below divides by world size.
        epoch_loss = torch.full((), state.epoch_loss_sum, device=device)
        interval = Interval(device, self.log_every_n_steps, state.global_step + 1)
        batches = iter(loader)
        while state.epoch_step < steps and not self.finished(state):
            wait_start = time.perf_counter()
            inputs, targets = next(batches)
            interval.data_wait_s += time.perf_counter() - wait_start
            self.seed_step(state.global_step)
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            loss = self.train_step(inputs, targets, state.global_step)
            self.scheduler.step()
            self.profiler.step()
            state.global_step += 1
            state.epoch_step += 1
            interval.add(loss)
            if loss is None:
                state.epoch_skipped += 1
                state.skipped_steps += 1
            if state.global_step % self.log_every_n_steps == 0:
                epoch_loss += interval.loss_sum
                self._log_interval(interval, state)
                interval = Interval(device, self.log_every_n_steps, state.global_step + 1)
            self._between_steps(state, epoch_loss, interval, steps)
        epoch_loss += interval.loss_sum
        self.progress.update(interval.steps)
        check_not_all_skipped(interval)
        # The sum of the epoch's global step losses; a checkpoint of an unfinished epoch keeps it, so the resumed
        # epoch reports the uninterrupted epoch's mean.
        state.epoch_loss_sum = self._global_sum(epoch_loss)
        counted = state.epoch_step - state.epoch_skipped
        mean = state.epoch_loss_sum / counted if counted else math.nan
        check_finite(mean, interval, state.epoch, self.strategy)  # the steps since the last logging step
        return mean, state.epoch_step == steps

    def _between_steps(self, state: TrainState, epoch_loss: Tensor, interval: Interval, steps: int) -> None:
        """Validation and checkpoints every N steps, and a stop signal's checkpoint. Not at the epoch's (`steps`) or
        the run's last step: the epoch end validates and checkpoints anyway."""
        at = state.global_step
        validate = bool(self.val_every_n_steps) and at % self.val_every_n_steps == 0
        save = bool(self.ckpt_every_n_steps) and at % self.ckpt_every_n_steps == 0
        if state.epoch_step == steps or self.finished(state) or not (validate or save or self.stop_signum):
            return
        state.epoch_loss_sum = self._global_sum(epoch_loss + interval.loss_sum)
        if validate:
            self.validate_and_save(state)
            self.model.train()
        else:
            self.save_checkpoint(state, {}, is_best=False)
        if self.stop_signum:
            self._stop(f"after step {at} (epoch {state.epoch + 1}, step {state.epoch_step} of {steps})")

    def train_step(self, inputs: Tensor, targets: Tensor, step: int) -> Tensor | None:
        """Optimizer step `step` (counted from 0) over this rank's batch, in `grad_accum_steps` micro-batches; returns
        the mean loss, or None if the update was skipped for a non-finite loss (trainer.nonfinite_loss=skip)."""
        model, optimizer = self.model, self.optimizer
        if self.channels_last and inputs.ndim == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        optimizer.zero_grad(set_to_none=True)
        n = self.grad_accum_steps
        micro_batches = zip(inputs.chunk(n), targets.chunk(n)) if n > 1 else ((inputs, targets),)
        loss_sum = None
        first_row = 0
        for i, (micro_inputs, micro_targets) in enumerate(micro_batches):
            rows = len(micro_inputs)
            keys = self.row_keys(step, first_row, rows) if self.row_keys else nullcontext()
            # Gradients are all-reduced once, after the last micro-batch's backward.
            with self.strategy.no_sync(model) if i < n - 1 else nullcontext():
                with self.precision.autocast(), keys:
                    loss = self.task.loss(model(micro_inputs), micro_targets)
                # Equal micro-batches: the mean of their means is the batch mean, as without accumulation.
                self.precision.backward(loss / n if n > 1 else loss)
            first_row += rows
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        if self.skip_nonfinite and nonfinite_on_any_rank(loss_sum, self.strategy):
            optimizer.zero_grad(set_to_none=True)
            return None
        if self.grad_clip_norm is not None:
            # DDP has averaged the gradients by now, so every rank clips by the same global norm. Under FSDP each
            # rank holds a shard (DTensor) of them, and clip_grad_norm_ takes the norm over all shards.
            self.precision.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip_norm)
        self.precision.step(optimizer)
        return loss_sum / n if n > 1 else loss_sum

    def _log_interval(self, interval: Interval, state: TrainState) -> None:
        check_not_all_skipped(interval)
        # The sync point: the device has caught up once this returns.
        loss = self._global_sum(interval.loss_sum) / interval.loss_steps if interval.loss_steps else math.nan
        check_finite(loss, interval, state.epoch, self.strategy)
        seconds = time.perf_counter() - interval.start
        metrics = {
            "train/loss": loss,
            "train/lr": self.scheduler.get_last_lr()[0],
            **self.throughput.metrics(interval.steps, seconds, interval.data_wait_s),
        }
        if self.strategy.device.type == "cuda":
            metrics["perf/max_memory_gb"] = self._highest_peak_memory_gb()
        self.writer.log_metrics(metrics, state.global_step)
        samples_per_sec = metrics["perf/samples_per_sec"]
        self.progress.update(interval.steps)
        self.progress.set_postfix(
            loss=f"{loss:.4f}", lr=f"{metrics['train/lr']:.3g}", samples_per_s=f"{samples_per_sec:.0f}", refresh=False
        )
        log.info(
            "epoch %d step %d | train/loss %.4f | lr %.3g | %.0f samples/s | data wait %.0f%%",
            state.epoch + 1,
            state.global_step,
            loss,
            metrics["train/lr"],
            samples_per_sec,
            100 * metrics["perf/data_wait_frac"],
        )

    def _highest_peak_memory_gb(self) -> float:
        """The highest peak of any rank's GPU memory over the logging interval (a logging step's extra reduction)."""
        peaks = torch.zeros(self.strategy.world_size, device=self.strategy.device)
        peaks[self.strategy.rank] = interval_peak_memory_gb(self.strategy.devices)
        return self.strategy.all_reduce(peaks).max().item()

    def _global_sum(self, loss_sum: Tensor) -> float:
        """A sum of step losses over all ranks, over the world size: each rank's step loss is the mean over an
        equal-sized shard, so this is the sum of the global batches' mean losses.

        The same all-reduce counts the ranks that got each stop signal: all ranks learn of a stop at the same step.
        """
        votes = [float(self.stop_request.signum == signum) for signum in STOP_SIGNALS]
        reduced = torch.tensor([0.0, *votes], device=loss_sum.device)
        reduced[0] = loss_sum.detach()
        total, *votes = self.strategy.all_reduce(reduced).tolist()
        self.stop_signum = next((signum for signum, n in zip(STOP_SIGNALS, votes) if n), 0)
        return total / self.strategy.world_size

    @torch.no_grad()
    def evaluate(self, loader: DataLoader) -> dict[str, float]:
        """The task's metrics over the whole validation set; each sample is counted once, on one rank."""
        module = self.strategy.eval_module(self.model)
        module.eval()
        device = self.strategy.device
        totals = torch.zeros(self.task.num_statistics, dtype=torch.float64, device=device)
        batches = itertools.islice(loader, self.limit_val_batches)
        for inputs, targets in self.strategy.eval_batches(batches, batches_per_epoch(loader, self.limit_val_batches)):
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            if self.channels_last and inputs.ndim == 4:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            with self.precision.autocast():
                outputs = module(inputs)
            totals += self.task.statistics(outputs, targets)
        return self.task.metrics_from(self.strategy.all_reduce(totals).tolist())
