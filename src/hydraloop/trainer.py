"""The training loop. It runs identically on every rank, talks to the parallel strategy only through its small
interface (`all_reduce`, `no_sync`, `eval_module`, `eval_batches`, `sync_buffers`, `state_dicts`), to the objective
only through the task (`loss`, `statistics`, `metrics_from`), and to the run directory only through the (possibly
null) run writer. One optimizer step is hydraloop.step's; what the loop carries between steps and into checkpoints
(loss sums, skipped steps, stop votes) is hydraloop.loop_state's; a validation, hydraloop.validation's; a checkpoint
is made by hydraloop.loop_checkpoints, and a logging step reported by hydraloop.interval_log."""

import logging
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from tqdm import tqdm

from hydraloop.batches import map_tensors, to_device
from hydraloop.callbacks import Callback, has_gradient_hooks, load_callback_states
from hydraloop.checkpoint import TrainState
from hydraloop.data.loaders import TrainLoader
from hydraloop.data.samplers import GlobalBatchSampler
from hydraloop.draw_watch import DrawWatch, split_of
from hydraloop.interval_log import IntervalLog
from hydraloop.loop_checkpoints import LoopCheckpoints
from hydraloop.loop_state import EpochLosses, GlobalSums, Interval, count_skipped, planned_steps
from hydraloop.losses import check_finite
from hydraloop.parallel.single import SingleDevice
from hydraloop.perf import Throughput
from hydraloop.precision import Precision
from hydraloop.preemption import StopRequest
from hydraloop.profiling import NullProfiler
from hydraloop.row_keys import RowKeys
from hydraloop.run_writer import NullRunWriter
from hydraloop.seeding import AFTER_THE_STEP, StepSeeder, epoch_seed, seed_everything
from hydraloop.step import OptimizerStep
from hydraloop.tasks.base import Task
from hydraloop.validation import Validation, run_summary

log = logging.getLogger(__name__)


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
        optimizers: dict[str, Optimizer],
        schedulers: dict[str, LRScheduler],
        throughput: Throughput,
        seed: int,
        optimized_metric: str,
        optimized_metric_mode: str,
        config: dict[str, Any],
        global_batch_size: int,
        stop_request: StopRequest | None = None,
        rerun_starts_from: str = "scratch",
        validated: dict[str, float] | None = None,
        callbacks: dict[str, Callback] | None = None,
    ) -> None:
        """`settings` is the `trainer` config node (see hydraloop.config.TrainerConfig for each key); `model` is the
        strategy-wrapped model; `optimizers` and their `schedulers`, by name (one named "": hydraloop.optim);
        `stop_request` is set by a stop signal (see hydraloop.preemption);
        `rerun_starts_from`: where a rerun into this run directory starts while this run has saved nothing (said
        when the run fails); `validated`: the metrics of the resumed checkpoint's step, if it holds them;
        `callbacks`: by name (hydraloop.callbacks), set up last, once the loop is built."""
        self.strategy, self.writer, self.precision, self.task = strategy, writer, precision, task
        self.model, self.optimizers, self.schedulers = model, optimizers, schedulers
        self.max_epochs, self.max_steps = settings.max_epochs, settings.max_steps
        self.val_every_n_steps, self.ckpt_every_n_steps = settings.val_every_n_steps, settings.ckpt_every_n_steps
        self.log_every_n_steps, self.max_consecutive_skips = settings.log_every_n_steps, settings.max_consecutive_skips
        self.channels_last = settings.channels_last
        self.seed = seed
        self.stop_request = stop_request or StopRequest()
        split = split_of(strategy, settings.grad_accum_steps)
        self.draw_watch = DrawWatch(strategy.devices, split, strategy.is_main_process, not settings.compile)
        # And `stop_signum`, the stop the ranks agreed on; and whether a rank drew from torch's generators.
        self.global_sums = sums = GlobalSums(strategy, self.stop_request, self.draw_watch)
        self.checkpoints = LoopCheckpoints(
            strategy, writer, precision, model, optimizers, schedulers, config, settings, rerun_starts_from, sums
        )
        self.replica_check = self.checkpoints.replica_check  # before each checkpoint, and every N steps here
        self.interval_log = IntervalLog(strategy, writer, schedulers, throughput)
        metric = (optimized_metric, optimized_metric_mode)
        # Keyed randomness (the model's KeyedDropout, the task's hydraloop.keyed_random draws) reads the rows a
        # batch holds; they are made on the device only where something reads them.
        row_keys = RowKeys(seed, strategy.rank, strategy.world_size, strategy.device)
        self.validation = Validation(
            strategy,
            writer,
            precision,
            task,
            model,
            settings,
            metric,
            validated,
            self._on_device,
            row_keys,
            self.global_sums,
        )
        self.seed_step = StepSeeder(seed, strategy.rank, strategy.devices)
        self.step = OptimizerStep(
            strategy,
            precision,
            task,
            model,
            optimizers,
            global_batch_size=global_batch_size,
            grad_accum_steps=settings.grad_accum_steps,
            grad_clip_norm=settings.grad_clip_norm,
            skip_nonfinite=settings.nonfinite_loss == "skip",
            row_keys=row_keys,
            seeder=self.seed_step,
            draw_watch=self.draw_watch,
            gradient_hooks=self._gradient_hooks if has_gradient_hooks(callbacks or {}) else None,
        )
        self.progress, self.profiler = tqdm(disable=True), NullProfiler()  # fit() swaps in the writer's
        if list(optimizers) != [""]:
            # Each schedule follows the global step; an optimizer the task steps less often than every step (a GAN's
            # generator, every n_critic-th) has not stepped yet when its schedule first does, which torch warns of.
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before", UserWarning)
        self.callbacks = callbacks or {}
        for callback in self.callbacks.values():
            callback.setup(self)

    def _gradient_hooks(self, hook: str, optimizer_name: str, optimizer: Optimizer) -> None:
        """Each callback's `hook` (on_before_optimizer_step, on_after_clipping), for hydraloop.step."""
        for callback in self.callbacks.values():
            getattr(callback, hook)(self, self.state, optimizer_name, optimizer)

    def load_callback_states(self, states: dict[str, Any]) -> None:
        """A checkpoint's callback states (its `callbacks`), into the callbacks of this run's config."""
        load_callback_states(self, states)

    def finished(self, state: TrainState) -> bool:
        if state.stopped_early:
            return True
        return state.global_step >= self.max_steps if self.max_steps else state.epoch >= self.max_epochs

    def fit(self, train_loader: TrainLoader, val_loader: DataLoader, state: TrainState) -> dict[str, Any]:
        """Trains from `state` to `max_epochs` (or `max_steps`), validating and checkpointing after each epoch, every
        `val_every_n_steps` / `ckpt_every_n_steps` steps, and at the end.

        On a stop signal, checkpoints at the next point where the ranks meet (a logging, validation or checkpoint
        step, or the epoch end) and raises Interrupted; unless that point is the run's last step, or the signal came
        after it: then the run ends as it would have, with its last validation and checkpoint (hydraloop.preemption).
        """
        start, start_step = time.perf_counter(), state.global_step
        if self.validation.validated:  # a checkpoint of a validated step: validating it again would log it twice
            self.validation.validated_at = state.global_step
        self.val_loader, self.state = val_loader, state
        total_steps = planned_steps(self.max_steps, self.max_epochs, state, train_loader.sampler)
        with (
            self.writer.progress(total_steps, state.global_step) as self.progress,
            self.writer.profiler() as self.profiler,
        ):
            while not self.finished(state):
                seed_everything(epoch_seed(self.seed, self.strategy.rank, state.epoch))
                # A new permutation per epoch, the same on every rank; after a mid-epoch checkpoint, its rest.
                train_loader.set_epoch(state.epoch, start_sample=state.epoch_samples)
                epoch_done = self.train_epoch(train_loader, state)
                if not epoch_done:  # max_steps reached mid-epoch
                    break
                state.next_epoch()
                epoch_loss = {"train/epoch_loss": state.train_loss} if state.train_loss is not None else {}
                self.validate_and_save(state, epoch_loss)
                signum = self.global_sums.stop_signum
                if signum and not self.finished(state):  # at the last epoch's end the run finishes
                    self.checkpoints.stop(f"after epoch {state.epoch}", signum)
            # Ended mid-epoch, or resumed with nothing left to train.
            if self.validation.validated_at != state.global_step:
                trained = state.global_step > start_step
                self.validate_and_save(state, save=trained and self.checkpoints.saved_at != state.global_step)
        self.checkpoints.finish(self.stop_request.signum)
        wall_time_s = time.perf_counter() - start
        # The latest validation's: also one every N steps that early stopping ended the run at, mid-epoch.
        summary = run_summary(self.validation.validated, state, self.strategy.world_size)
        return {**summary, "train/loss": state.train_loss, "wall_time_s": wall_time_s}

    def validate_and_save(self, state: TrainState, logged: dict | None = None, save: bool = True) -> dict[str, float]:
        """Validates, logs the metrics (with `logged`), and checkpoints: last.pt, and best.pt if the metric improved.
        Weights that are not finite are neither: the run ends naming the checkpoint a rerun would start from."""
        self.checkpoints.before_validation_or_checkpoint(self, state)
        val_metrics = self.validation_metrics(state)
        is_best = self.validation.record(state, val_metrics, logged)
        if save:
            self.checkpoints.save(self, state, val_metrics, is_best=is_best)
        return val_metrics

    def validation_metrics(self, state: TrainState) -> dict[str, float]:
        """The task's metrics of the weights as they are, and the callbacks' (val/ema/... beside them)."""
        return self.validation.metrics(self, state)

    def _check_finite(self, loss: float, interval: Interval, state: TrainState) -> None:
        lr = next(iter(self.schedulers.values())).get_last_lr()[0]
        check_finite(loss, interval, state.epoch, self.strategy, self.rerun_note(), lr=lr)

    def validate(self, val_loader: DataLoader, state: TrainState) -> dict[str, Any]:
        """mode=eval: the metrics of the weights as they are, with the checkpoint's epoch and step."""
        start = time.perf_counter()
        metrics = self.evaluate(val_loader)
        return {**run_summary(metrics, state, self.strategy.world_size), "wall_time_s": time.perf_counter() - start}

    def rerun_note(self) -> str:
        """Where a rerun into this run directory would continue from, for the line that ends a failed run."""
        return self.checkpoints.rerun_note()

    def train_epoch(self, loader: TrainLoader, state: TrainState) -> bool:
        """The rest of one pass over this rank's shard (all of it, unless resumed mid-epoch), or up to `max_steps`.
        Sets `state.train_loss`, the mean train loss over all ranks of the epoch's steps so far; returns whether the
        epoch is complete."""
        self.model.train()
        sampler = loader.sampler
        steps = state.epoch_step + len(loader)  # the epoch's steps in all, for messages
        losses = EpochLosses(state, self.strategy.device, self.log_every_n_steps)  # with a resumed epoch's sums
        batches = iter(loader)
        while state.epoch_samples < sampler.end and not self.finished(state):
            wait_start = time.perf_counter()
            batch = next(batches)
            losses.interval.data_wait_s += time.perf_counter() - wait_start
            global_rows = sampler.global_rows(state.epoch_samples)
            loss = self.step(self._on_device(batch), global_rows, state.global_step)
            for scheduler in self.schedulers.values():
                scheduler.step()
            self.profiler.step()
            state.global_step += 1
            state.epoch_step += 1
            state.epoch_samples += global_rows
            losses.interval.add(loss, global_rows)
            if loss is None:
                count_skipped(state, self.max_consecutive_skips, self.rerun_note)
            else:
                state.skipped_in_a_row = 0
                self.seed_step.replicated(state.global_step, AFTER_THE_STEP)  # as in the step: alike on every rank
                with self.strategy.whole_tensor_draws():
                    for callback in self.callbacks.values():
                        callback.on_optimizer_step(self, state)
            self.replica_check.after_step(self, state.global_step)
            if state.global_step % self.log_every_n_steps == 0:
                self._log_interval(losses, state)
            self._between_steps(state, losses, sampler, steps)
        self.progress.update(losses.interval.count)
        done = state.epoch_samples >= sampler.end
        losses.end(state, self.global_sums, epoch_done=done)
        if state.train_loss is not None:  # None: every step skipped
            self._check_finite(state.train_loss, losses.interval, state)
        return done

    def _on_device(self, batch: Any) -> Any:
        batch = to_device(batch, self.strategy.device)
        if not self.channels_last:
            return batch
        to_channels_last = lambda tensor: tensor.contiguous(memory_format=torch.channels_last)  # noqa: E731
        return map_tensors(lambda tensor: to_channels_last(tensor) if tensor.dim() == 4 else tensor, batch)

    def _between_steps(self, state: TrainState, losses: EpochLosses, sampler: GlobalBatchSampler, steps: int) -> None:
        """Validation and checkpoints every N steps, and a stop signal's checkpoint. Not at the epoch's or the run's
        last step: the epoch end validates and checkpoints anyway. Only from finite losses: a non-finite one since
        the last logging step ends the run first, naming its step."""
        at = state.global_step
        validate = bool(self.val_every_n_steps) and at % self.val_every_n_steps == 0
        save = bool(self.ckpt_every_n_steps) and at % self.ckpt_every_n_steps == 0
        if (
            state.epoch_samples >= sampler.end
            or self.finished(state)
            or not (validate or save or self.global_sums.stop_signum)
        ):
            return
        # Kept in the checkpoint: a run resumed from it logs this interval's mean as the uninterrupted run does.
        interval_sum = losses.carry_into(state, self.global_sums)
        self._check_finite(interval_sum, losses.interval, state)
        if validate:
            self.validate_and_save(state)
            self.model.train()
        else:
            self.checkpoints.before_validation_or_checkpoint(self, state)
            self.checkpoints.save(self, state, {}, is_best=False)
        if self.global_sums.stop_signum:
            where = f"after step {at} (epoch {state.epoch + 1}, step {state.epoch_step} of {steps})"
            self.checkpoints.stop(where, self.global_sums.stop_signum)

    def _log_interval(self, losses: EpochLosses, state: TrainState) -> None:
        loss = losses.interval_mean(self.global_sums)  # the sync point: the device has caught up once this returns
        if losses.interval.loss_steps:  # else every step of the interval skipped: no loss to check
            self._check_finite(loss, losses.interval, state)
        self.interval_log(losses.interval, loss, state, self.progress)
        losses.next_interval(state.global_step + 1)

    def evaluate(self, loader: DataLoader) -> dict[str, float]:
        """The task's metrics over the whole validation set; each sample is counted once, on one rank."""
        return self.validation.evaluate(loader)
