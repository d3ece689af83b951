"""The training loop. It runs identically on every rank, talks to the parallel strategy only through its small
interface (`all_reduce`, `no_sync`, `eval_module`, `eval_batches`, `sync_buffers`, `state_dicts`), to the objective
only through the task (`loss`, `statistics`, `metrics_from`), and to the run directory only through the (possibly
null) run writer. One optimizer step is hydraloop.step's."""

import itertools
import logging
import math
import operator
import signal
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from tqdm import tqdm

from hydraloop.batches import map_tensors, to_device
from hydraloop.callbacks import Callback, has_gradient_hooks
from hydraloop.checkpoint import TrainState, checkpoint_state, step_checkpoint
from hydraloop.data.loaders import GlobalBatchSampler, TrainLoader
from hydraloop.early_stopping import EarlyStopping
from hydraloop.errors import Interrupted, TrainingDiverged
from hydraloop.keyed_dropout import RowKeys, draws_keyed_masks
from hydraloop.losses import Interval, check_finite, check_finite_weights
from hydraloop.parallel.single import SingleDevice
from hydraloop.perf import Throughput, interval_peak_memory_gb
from hydraloop.precision import Precision
from hydraloop.preemption import STOP_SIGNALS, StopRequest
from hydraloop.profiling import NullProfiler
from hydraloop.replica_check import ReplicaCheck
from hydraloop.run_writer import NullRunWriter
from hydraloop.seeding import AFTER_THE_STEP, StepSeeder, epoch_seed, seed_everything
from hydraloop.sharded_checkpoint import staging_dir
from hydraloop.step import OptimizerStep
from hydraloop.tasks.base import Task

log = logging.getLogger(__name__)


def planned_steps(max_steps: int | None, max_epochs: int, state: TrainState, sampler: GlobalBatchSampler) -> int:
    """The optimizer steps of the whole run, which schedules plan for: `max_steps`, else the steps done so far and
    those the epochs still to come will take (with today's batch size: a resume may have changed it)."""
    if max_steps:
        return max_steps
    if state.epoch >= max_epochs:
        return state.global_step
    rest_of_epoch = sampler.batches_from(state.epoch_samples)
    return state.global_step + rest_of_epoch + (max_epochs - state.epoch - 1) * sampler.steps_per_epoch


def schedule_plan(
    max_steps: int | None, max_epochs: int, state: TrainState, sampler: GlobalBatchSampler
) -> tuple[int, int]:
    """(the step a schedule stands at, its total steps), in steps of today's batch size. A run in steps plans in
    the steps counted. A run in epochs plans in epochs: a resume under another batch size (or limit) starts the
    schedule where today's steps would have brought it after the epochs done so far, so a decay every N epochs and a
    warm-up in epochs still end at the epochs they name."""
    if max_steps:
        return state.global_step, max_steps
    steps = sampler.steps_per_epoch
    done_in_epoch = steps - sampler.batches_from(state.epoch_samples) if state.epoch_samples else 0
    return state.epoch * steps + max(0, done_in_epoch), max_epochs * steps


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
        self.max_epochs = settings.max_epochs
        self.max_steps = settings.max_steps
        self.val_every_n_steps = settings.val_every_n_steps
        self.ckpt_every_n_steps = settings.ckpt_every_n_steps
        self.log_every_n_steps = settings.log_every_n_steps
        self.max_consecutive_skips = settings.max_consecutive_skips
        self.save_checkpoints = settings.save_checkpoints
        self.limit_val_batches = settings.limit_val_batches
        self.channels_last = settings.channels_last
        self.throughput = throughput
        self.seed = seed
        self.optimized_metric = optimized_metric
        self.improved = operator.gt if optimized_metric_mode == "max" else operator.lt
        patience, min_delta = settings.early_stopping.patience, settings.early_stopping.min_delta
        self.early_stopping = EarlyStopping(patience, min_delta, optimized_metric, optimized_metric_mode)
        self.config = config  # stored in every checkpoint
        self.checkpoint_dir = Path(config.get("output_dir", ".")) / "checkpoints"
        self.stop_request = stop_request or StopRequest()
        self.stop_signum = 0  # the stop signal all ranks agreed on at the last reduction
        self.seed_step = StepSeeder(seed, strategy.rank, strategy.devices)
        self.replica_check = ReplicaCheck(settings.replica_check_every_n_steps, strategy)
        # Only for a model that draws keyed masks: every other model pays nothing for it.
        keyed = draws_keyed_masks(model)
        row_keys = RowKeys(seed, strategy.rank, strategy.world_size, strategy.device) if keyed else None
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
            gradient_hooks=self._gradient_hooks if has_gradient_hooks(callbacks or {}) else None,
        )
        self.progress, self.profiler = tqdm(disable=True), NullProfiler()  # fit() swaps in the writer's
        self.saved_at = -1  # the global step of this run's latest checkpoint
        self.rerun_starts_from = rerun_starts_from
        self.validated = validated or {}  # the latest validation's metrics...
        self.validated_at = -1  # ...and its global step (see fit for a resumed checkpoint's)
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
        for name, callback in self.callbacks.items():
            if name in states:
                callback.load_state_dict(self, states[name])
            else:
                log.info("callbacks.%s: the checkpoint holds no state of it; it starts from the loaded weights", name)
        for name in states.keys() - self.callbacks.keys():
            log.info("callbacks.%s: the checkpoint holds its state, and this run has no such callback: dropped", name)

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
        if self.validated:  # a checkpoint of a validated step: validating it again would log its metrics twice
            self.validated_at = state.global_step
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
                if self.stop_signum and not self.finished(state):  # at the last epoch's end the run finishes
                    self._stop(f"after epoch {state.epoch}")
            if self.validated_at != state.global_step:  # ended mid-epoch, or resumed with nothing left to train
                trained = state.global_step > start_step
                self.validate_and_save(state, save=trained and self.saved_at != state.global_step)
        self.checkpoint_written()
        if self.stop_request.signum:
            log.info(
                "%s came at or after the run's last step: nothing is left to stop for, the run finishes (metrics.json)",
                signal.Signals(self.stop_request.signum).name,
            )
        wall_time_s = time.perf_counter() - start
        # The latest validation's: also one every N steps that early stopping ended the run at, mid-epoch.
        return {**self._summary(self.validated, state), "train/loss": state.train_loss, "wall_time_s": wall_time_s}

    def validate_and_save(self, state: TrainState, logged: dict | None = None, save: bool = True) -> dict[str, float]:
        """Validates, logs the metrics (with `logged`), and checkpoints: last.pt, and best.pt if the metric improved.
        Weights that are not finite are neither: the run ends naming the checkpoint a rerun would start from."""
        self._before_validation_or_checkpoint(state)
        val_metrics = self.validation_metrics(state)
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
        if save:
            self.save_checkpoint(state, val_metrics, is_best=is_best)
        return val_metrics

    def validation_metrics(self, state: TrainState) -> dict[str, float]:
        """The task's metrics of the weights as they are, and the callbacks' (val/ema/... beside them)."""
        metrics = self.evaluate(self.val_loader)
        for callback in self.callbacks.values():
            metrics.update(callback.on_validation(self, state, metrics))
        return metrics

    def save_checkpoint(self, state: TrainState, val_metrics: dict[str, float], is_best: bool) -> None:
        """The one place a checkpoint is made; called on every rank.

        The strategy decides what that costs each rank: single and DDP build the state only where it is written
        (rank 0; the others have a null writer); under FSDP every rank writes its own shards (or, with
        `parallel.checkpoint=full`, gathers them for rank 0: a collective).
        """
        if not self.save_checkpoints:
            self.saved_at = state.global_step
            return  # not even FSDP's gather
        staging = staging_dir(step_checkpoint(self.checkpoint_dir, state.global_step))
        state_dicts = self.strategy.state_dicts(self.model, self.optimizers, staging)
        callback_states = {name: callback.state_dict(self) for name, callback in self.callbacks.items()}

        def make_state() -> dict[str, Any]:
            return checkpoint_state(
                *state_dicts(),
                self.schedulers,
                self.precision,
                state,
                val_metrics,
                self.config,
                self.strategy.device,
                callback_states,
            )

        self.writer.save_checkpoint(make_state, is_best=is_best)
        self.saved_at = state.global_step

    def checkpoint_written(self) -> None:
        """Waits for a checkpoint written in the background (parallel.async_checkpoint) to be on disk, and names it
        last.pt (and best.pt); a failed write ends the run in one line, the checkpoints before it intact."""
        self.strategy.wait_for_checkpoint()
        self.writer.checkpoint_written()

    def _check_finite(self, loss: float, interval: Interval, state: TrainState) -> None:
        lr = next(iter(self.schedulers.values())).get_last_lr()[0]
        check_finite(loss, interval, state.epoch, self.strategy, self.rerun_note(), lr=lr)

    def _before_validation_or_checkpoint(self, state: TrainState) -> None:
        """Weights that are not finite (from an overflowing gradient, say) are neither validated nor saved: the run
        ends, naming the checkpoint a rerun would start from. And every rank takes rank 0's buffers (batch norm's
        running statistics, which each rank updates from its own shard): the ones rank 0 saves. Replicas that
        differ (hydraloop.replica_check) end the run too."""
        check_finite_weights(self.model, state.global_step, self.strategy, self.rerun_note())
        self.replica_check(self, state.global_step)
        self.strategy.sync_buffers(self.model)

    def validate(self, val_loader: DataLoader, state: TrainState) -> dict[str, Any]:
        """mode=eval: the metrics of the weights as they are, with the checkpoint's epoch and step."""
        start = time.perf_counter()
        metrics = self.evaluate(val_loader)
        return {**self._summary(metrics, state), "wall_time_s": time.perf_counter() - start}

    def rerun_note(self) -> str:
        """Where a rerun into this run directory would continue from, for the line that ends a failed run."""
        if not self.save_checkpoints:
            return "trainer.save_checkpoints=false: nothing was saved"
        if self.saved_at >= 0:
            return f"checkpoints/last.pt holds step {self.saved_at}, where a rerun continues"
        return f"no checkpoint was saved in this run: a rerun starts from {self.rerun_starts_from}"

    def _stop(self, where: str) -> NoReturn:
        """Ends the run on a stop signal, after its checkpoint; the loggers mark their runs preempted, not failed."""
        log.info("stopping %s", where)
        self.checkpoint_written()
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

    def train_epoch(self, loader: TrainLoader, state: TrainState) -> bool:
        """The rest of one pass over this rank's shard (all of it, unless resumed mid-epoch), or up to `max_steps`.
        Sets `state.train_loss`, the mean train loss over all ranks of the epoch's steps so far; returns whether the
        epoch is complete."""
        self.model.train()
        device = self.strategy.device
        sampler = loader.sampler
        steps = state.epoch_step + len(loader)  # the epoch's steps in all, for messages
        # Losses are summed on the device and read back only on logging steps: `.item()` is a host sync. Each rank
        # starts from the global sum of a resumed epoch's (and logging interval's) earlier steps; the means below
        # divide by world size.
        epoch_loss = torch.full((), state.epoch_loss_sum, dtype=torch.float64, device=device)
        interval = Interval.resumed(state, device, self.log_every_n_steps)
        batches = iter(loader)
        while state.epoch_samples < sampler.end and not self.finished(state):
            wait_start = time.perf_counter()
            batch = next(batches)
            interval.data_wait_s += time.perf_counter() - wait_start
            global_rows = sampler.global_rows(state.epoch_samples)
            loss = self.step(self._on_device(batch), global_rows, state.global_step)
            for scheduler in self.schedulers.values():
                scheduler.step()
            self.profiler.step()
            state.global_step += 1
            state.epoch_step += 1
            state.epoch_samples += global_rows
            interval.add(loss, global_rows)
            if loss is None:
                self._skipped(state)
            else:
                state.skipped_in_a_row = 0
                self.seed_step.replicated(state.global_step, AFTER_THE_STEP)  # as in the step: alike on every rank
                with self.strategy.whole_tensor_draws():
                    for callback in self.callbacks.values():
                        callback.on_optimizer_step(self, state)
            self.replica_check.after_step(self, state.global_step)
            if state.global_step % self.log_every_n_steps == 0:
                epoch_loss += interval.loss_sum
                self._log_interval(interval, state)
                interval = Interval(device, self.log_every_n_steps, state.global_step + 1)
            self._between_steps(state, epoch_loss, interval, sampler, steps)
        epoch_loss += interval.loss_sum
        self.progress.update(interval.count)
        # The sum of the epoch's global step losses; a checkpoint of an unfinished epoch keeps it, and the unfinished
        # logging interval's, so the resumed run reports the uninterrupted run's means.
        state.epoch_loss_sum, interval_sum = self._global_sums(epoch_loss, interval.loss_sum)
        counted = state.epoch_step - state.epoch_skipped
        state.train_loss = state.epoch_loss_sum / counted if counted else None  # None: every step skipped
        if counted:
            self._check_finite(state.train_loss, interval, state)
        done = state.epoch_samples >= sampler.end
        # An epoch's end also ends its logging interval: the next epoch starts one of its own.
        state.interval_loss_sum, state.interval_steps, state.interval_skipped = (
            (0.0, 0, 0) if done else interval.carry(interval_sum)
        )
        return done

    def _on_device(self, batch: Any) -> Any:
        batch = to_device(batch, self.strategy.device)
        if not self.channels_last:
            return batch
        to_channels_last = lambda tensor: tensor.contiguous(memory_format=torch.channels_last)  # noqa: E731
        return map_tensors(lambda tensor: to_channels_last(tensor) if tensor.dim() == 4 else tensor, batch)

    def _skipped(self, state: TrainState) -> None:
        """A step whose update was skipped (trainer.nonfinite_loss=skip): the odd bad batch. A run of them as long
        as `max_consecutive_skips` has diverged, wherever the logging steps fall."""
        state.epoch_skipped += 1
        state.skipped_steps += 1
        state.skipped_in_a_row += 1
        if state.skipped_in_a_row >= self.max_consecutive_skips:
            first = state.global_step - state.skipped_in_a_row + 1
            raise TrainingDiverged(
                f"train/loss was non-finite at every step from {first} to {state.global_step}, all skipped "
                f"(trainer.nonfinite_loss=skip ends the run after trainer.max_consecutive_skips="
                f"{self.max_consecutive_skips} in a row); {self.rerun_note()}"
            )

    def _between_steps(
        self, state: TrainState, epoch_loss: Tensor, interval: Interval, sampler: GlobalBatchSampler, steps: int
    ) -> None:
        """Validation and checkpoints every N steps, and a stop signal's checkpoint. Not at the epoch's or the run's
        last step: the epoch end validates and checkpoints anyway. Only from finite losses: a non-finite one since
        the last logging step ends the run first, naming its step."""
        at = state.global_step
        validate = bool(self.val_every_n_steps) and at % self.val_every_n_steps == 0
        save = bool(self.ckpt_every_n_steps) and at % self.ckpt_every_n_steps == 0
        if state.epoch_samples >= sampler.end or self.finished(state) or not (validate or save or self.stop_signum):
            return
        state.epoch_loss_sum, interval_sum = self._global_sums(epoch_loss + interval.loss_sum, interval.loss_sum)
        self._check_finite(interval_sum, interval, state)
        # Kept in the checkpoint: a run resumed from it logs this interval's mean as the uninterrupted run does.
        state.interval_loss_sum, state.interval_steps, state.interval_skipped = interval.carry(interval_sum)
        if validate:
            self.validate_and_save(state)
            self.model.train()
        else:
            self._before_validation_or_checkpoint(state)
            self.save_checkpoint(state, {}, is_best=False)
        if self.stop_signum:
            self._stop(f"after step {at} (epoch {state.epoch + 1}, step {state.epoch_step} of {steps})")

    def _log_interval(self, interval: Interval, state: TrainState) -> None:
        # The sync point: the device has caught up once this returns.
        loss_sum = self._global_sum(interval.loss_sum) + interval.carried_sum
        if interval.loss_steps:
            loss = loss_sum / interval.loss_steps
            self._check_finite(loss, interval, state)
        else:  # every step of the interval skipped (trainer.nonfinite_loss=skip): no loss to average
            loss = math.nan
        seconds = time.perf_counter() - interval.start
        lrs = {f"train/lr/{name}" if name else "train/lr": s.get_last_lr()[0] for name, s in self.schedulers.items()}
        metrics = {
            **({"train/loss": loss} if interval.loss_steps else {}),
            **lrs,
            **self.throughput.metrics(interval.count, interval.samples, seconds, interval.data_wait_s),
        }
        if self.strategy.device.type == "cuda":
            metrics["perf/max_memory_gb"] = self._highest_peak_memory_gb()
        self.writer.log_metrics(metrics, state.global_step)
        samples_per_sec = metrics["perf/samples_per_sec"]
        self.progress.update(interval.count)
        lr = next(iter(lrs.values()))
        self.progress.set_postfix(
            loss=f"{loss:.4f}", lr=f"{lr:.3g}", samples_per_s=f"{samples_per_sec:.0f}", refresh=False
        )
        log.info(
            "epoch %d step %d | train/loss %.4f | lr %.3g | %.0f samples/s | data wait %.0f%%",
            state.epoch + 1,
            state.global_step,
            loss,
            lr,
            samples_per_sec,
            100 * metrics["perf/data_wait_frac"],
        )

    def _highest_peak_memory_gb(self) -> float:
        """The highest peak of any rank's GPU memory over the logging interval (a logging step's extra reduction)."""
        peaks = torch.zeros(self.strategy.world_size, device=self.strategy.device)
        peaks[self.strategy.rank] = interval_peak_memory_gb(self.strategy.devices)
        return self.strategy.all_reduce(peaks).max().item()

    def _global_sum(self, loss_sum: Tensor) -> float:
        return self._global_sums(loss_sum)[0]

    def _global_sums(self, *loss_sums: Tensor) -> list[float]:
        """Sums of step losses over all ranks, over the world size: each rank's step loss is its share of the global
        batch's mean loss times the world size (hydraloop.step), so these are sums of the global batches' means.

        The same all-reduce counts the ranks that got each stop signal: all ranks learn of a stop at the same step.
        """
        count = len(loss_sums)
        votes = [float(self.stop_request.signum == signum) for signum in STOP_SIGNALS]
        reduced = torch.tensor([0.0] * count + votes, dtype=torch.float64, device=loss_sums[0].device)
        reduced[:count] = torch.stack([loss_sum.detach() for loss_sum in loss_sums])
        reduced = self.strategy.all_reduce(reduced).tolist()
        self.stop_signum = next((signum for signum, n in zip(STOP_SIGNALS, reduced[count:]) if n), 0)
        return [total / self.strategy.world_size for total in reduced[:count]]

    @torch.no_grad()
    def evaluate(self, loader: DataLoader) -> dict[str, float]:
        """The task's metrics over the whole validation set; each sample is counted once, on one rank."""
        module = self.strategy.eval_module(self.model)
        module.eval()
        device = self.strategy.device
        totals = torch.zeros(self.task.num_statistics, dtype=torch.float64, device=device)
        batches = itertools.islice(loader, self.limit_val_batches)
        count = min(len(loader), self.limit_val_batches or len(loader))
        for batch in self.strategy.eval_batches(batches, count):
            with self.precision.autocast():
                totals += self.task.validation_statistics(module, self._on_device(batch))
        metrics = self.task.metrics_from(self.strategy.all_reduce(totals).tolist())
        return {**metrics, **(self.task.extra_metrics.compute() if self.task.extra_metrics else {})}
