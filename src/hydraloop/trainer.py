"""The training loop. It runs identically on every rank, talks to the parallel strategy only through its small
interface (`all_reduce`, `no_sync`, `eval_module`, `eval_batches`, `state_dicts`), and to the run directory only
through the (possibly null) run writer."""

import itertools
import logging
import math
import operator
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from tqdm import tqdm

from hydraloop.checkpoint import TrainState, checkpoint_state
from hydraloop.errors import Interrupted
from hydraloop.losses import Interval, check_finite, check_not_all_skipped, nonfinite_on_any_rank
from hydraloop.parallel.single import SingleDevice
from hydraloop.precision import Precision
from hydraloop.preemption import STOP_SIGNALS, StopRequest
from hydraloop.profiling import NullProfiler
from hydraloop.run_writer import NullRunWriter
from hydraloop.seeding import StepSeeder, epoch_seed, seed_everything

log = logging.getLogger(__name__)


def interval_peak_memory_gb(devices: list[torch.device]) -> float:
    """The most memory allocated on any of this rank's GPUs since the last call (then the peak is reset): the peak of
    one logging interval, not of the whole process."""
    peak = max(torch.cuda.max_memory_allocated(device) for device in devices)
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)
    return peak / 1e9


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
        settings: Any,
        *,
        global_batch_size: int,
        seed: int,
        optimized_metric: str,
        optimized_metric_mode: str,
        config: dict[str, Any],
        stop_request: StopRequest | None = None,
    ) -> None:
        """`settings` is the `trainer` config node (see hydraloop.config.TrainerConfig for each key);
        `stop_request` is set by a stop signal (see hydraloop.preemption)."""
        self.strategy = strategy
        self.writer = writer
        self.precision = precision
        self.max_epochs = settings.max_epochs
        self.log_every_n_steps = settings.log_every_n_steps
        self.grad_clip_norm = settings.grad_clip_norm
        self.grad_accum_steps = settings.grad_accum_steps
        self.skip_nonfinite = settings.nonfinite_loss == "skip"
        self.save_checkpoints = settings.save_checkpoints
        self.limit_train_batches = settings.limit_train_batches
        self.limit_val_batches = settings.limit_val_batches
        self.channels_last = settings.channels_last
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.optimized_metric = optimized_metric
        self.improved = operator.gt if optimized_metric_mode == "max" else operator.lt
        self.config = config  # stored in every checkpoint
        self.stop_request = stop_request or StopRequest()
        self.stop_signum = 0  # the stop signal all ranks agreed on at the last reduction
        self.seed_step = StepSeeder(seed, strategy.rank, strategy.devices)
        self.progress, self.profiler = tqdm(disable=True), NullProfiler()  # fit() swaps in the writer's

    def fit(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        train_loader: DataLoader,
        val_loader: DataLoader,
        state: TrainState,
    ) -> dict[str, Any]:
        """Trains from `state` to `max_epochs`, validating and checkpointing after each epoch.

        On a stop signal, checkpoints after the next logging step (or epoch end) and raises Interrupted.
        """
        start = time.perf_counter()
        train_loss, val_metrics = None, None
        total_steps = self.max_epochs * batches_per_epoch(train_loader, self.limit_train_batches)
        with (
            self.writer.progress(total_steps, state.global_step) as self.progress,
            self.writer.profiler() as self.profiler,
        ):
            while state.epoch < self.max_epochs:
                seed_everything(epoch_seed(self.seed, self.strategy.rank, state.epoch))
                # A new permutation per epoch, the same on every rank; after a mid-epoch checkpoint, its rest.
                train_loader.sampler.set_epoch(state.epoch, start_batch=state.epoch_step)
                train_loss = self.train_epoch(model, optimizer, scheduler, train_loader, state)
                state.next_epoch()
                val_metrics = self.evaluate(model, val_loader)
                self.writer.log_metrics({**val_metrics, "train/epoch_loss": train_loss}, state.global_step)
                log.info(
                    "epoch %d/%d | train/loss %.4f | val/loss %.4f | val/acc %.4f",
                    state.epoch,
                    self.max_epochs,
                    train_loss,
                    val_metrics["val/loss"],
                    val_metrics["val/acc"],
                )
                metric = val_metrics[self.optimized_metric]
                is_best = state.best_metric is None or self.improved(metric, state.best_metric)
                if is_best:
                    state.best_metric = metric
                self.save_checkpoint(model, optimizer, scheduler, state, val_metrics, is_best=is_best)
                if self.stop_signum:
                    log.info("stopping after epoch %d", state.epoch)
                    raise Interrupted(self.stop_signum, f"after epoch {state.epoch}: {self._resume_hint()}")
        if val_metrics is None:  # resumed from a checkpoint at or past max_epochs: nothing left to train
            val_metrics = self.evaluate(model, val_loader)
        wall_time_s = time.perf_counter() - start
        return {**self._summary(val_metrics, state), "train/loss": train_loss, "wall_time_s": wall_time_s}

    def save_checkpoint(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        state: TrainState,
        val_metrics: dict[str, float],
        is_best: bool,
    ) -> None:
        """The one place a checkpoint is made; called on every rank.

        The strategy decides what that costs each rank: single and DDP build the state only where it is written
        (rank 0; the others have a null writer), FSDP gathers the shards on every rank (a collective).
        """
        if not self.save_checkpoints:
            return  # not even FSDP's gather
        state_dicts = self.strategy.state_dicts(model, optimizer)

        def make_state() -> dict[str, Any]:
            return checkpoint_state(
                *state_dicts(), scheduler, self.precision, state, val_metrics, self.config, self.strategy.device
            )

        self.writer.save_checkpoint(make_state, is_best=is_best)

    def validate(self, model: nn.Module, val_loader: DataLoader, state: TrainState) -> dict[str, Any]:
        """mode=eval: the metrics of the weights as they are, with the checkpoint's epoch and step."""
        start = time.perf_counter()
        metrics = self.evaluate(model, val_loader)
        return {**self._summary(metrics, state), "wall_time_s": time.perf_counter() - start}

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
        }

    def train_epoch(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        loader: DataLoader,
        state: TrainState,
    ) -> float:
        """The rest of one pass over this rank's shard (all of it, unless resumed mid-epoch); returns the epoch's
        mean train loss over all ranks."""
        model.train()
        device = self.strategy.device
        steps = batches_per_epoch(loader, self.limit_train_batches, skipped=state.epoch_step)
        # Losses are summed on the device and read back only on logging steps: `.item()` is a host sync. Each rank
        # starts from the global sum of a resumed epoch's earlier steps; the mean below divides by world size.
        epoch_loss = torch.full((), state.epoch_loss_sum, device=device)
        interval = Interval(device, self.log_every_n_steps, state.global_step + 1)
        batches = iter(loader)
        for _ in range(state.epoch_step, steps):
            wait_start = time.perf_counter()
            inputs, targets = next(batches)
            interval.data_wait_s += time.perf_counter() - wait_start
            self.seed_step(state.global_step)
            loss = self.train_step(
                model, optimizer, inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            )
            scheduler.step()
            self.profiler.step()
            state.global_step += 1
            state.epoch_step += 1
            interval.add(loss)
            if loss is None:
                state.epoch_skipped += 1
                state.skipped_steps += 1
            if state.global_step % self.log_every_n_steps == 0:
                epoch_loss += interval.loss_sum
                self._log_interval(interval, scheduler, state)
                interval = Interval(device, self.log_every_n_steps, state.global_step + 1)
                if self.stop_signum:
                    self._stop_mid_epoch(model, optimizer, scheduler, state, epoch_loss, steps)
        epoch_loss += interval.loss_sum
        self.progress.update(interval.steps)
        check_not_all_skipped(interval)
        mean = self._global_mean(epoch_loss, steps - state.epoch_skipped)
        check_finite(mean, interval, state.epoch, self.strategy)  # the steps since the last logging step
        return mean

    def _stop_mid_epoch(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        state: TrainState,
        epoch_loss: Tensor,
        steps: int,
    ) -> None:
        state.epoch_loss_sum = self._global_mean(epoch_loss, 1)  # every rank's sum, over the world size
        self.save_checkpoint(model, optimizer, scheduler, state, {}, is_best=False)
        where = f"after step {state.global_step} (epoch {state.epoch + 1}, step {state.epoch_step} of {steps})"
        log.info("stopping %s", where)  # the launcher of spawned ranks reports only the signal
        raise Interrupted(self.stop_signum, f"{where}: {self._resume_hint()}")

    def train_step(self, model: nn.Module, optimizer: Optimizer, inputs: Tensor, targets: Tensor) -> Tensor | None:
        """One optimizer step over this rank's batch, in `grad_accum_steps` micro-batches; returns the mean loss,
        or None if the update was skipped for a non-finite loss (trainer.nonfinite_loss=skip)."""
        if self.channels_last and inputs.ndim == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        optimizer.zero_grad(set_to_none=True)
        n = self.grad_accum_steps
        micro_batches = zip(inputs.chunk(n), targets.chunk(n)) if n > 1 else ((inputs, targets),)
        loss_sum = None
        for i, (micro_inputs, micro_targets) in enumerate(micro_batches):
            # Gradients are all-reduced once, after the last micro-batch's backward.
            with self.strategy.no_sync(model) if i < n - 1 else nullcontext():
                with self.precision.autocast():
                    loss = F.cross_entropy(model(micro_inputs), micro_targets)
                # Equal micro-batches: the mean of their means is the batch mean, as without accumulation.
                self.precision.backward(loss / n if n > 1 else loss)
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

    def _log_interval(self, interval: Interval, scheduler: LRScheduler, state: TrainState) -> None:
        check_not_all_skipped(interval)
        loss = self._global_mean(interval.loss_sum, interval.loss_steps)  # the sync point: the device caught up
        check_finite(loss, interval, state.epoch, self.strategy)
        seconds = time.perf_counter() - interval.start
        samples_per_sec = interval.steps * self.global_batch_size / seconds
        metrics = {
            "train/loss": loss,
            "train/lr": scheduler.get_last_lr()[0],
            "train/samples_per_sec": samples_per_sec,
            "perf/samples_per_sec": samples_per_sec,
            "perf/step_time_ms": 1000 * seconds / interval.steps,
            "perf/data_wait_frac": interval.data_wait_s / seconds,
        }
        if self.strategy.device.type == "cuda":
            metrics["perf/max_memory_gb"] = self._highest_peak_memory_gb()
        self.writer.log_metrics(metrics, state.global_step)
        self.progress.update(interval.steps)
        self.progress.set_postfix(
            loss=f"{metrics['train/loss']:.4f}",
            lr=f"{metrics['train/lr']:.3g}",
            samples_per_s=f"{samples_per_sec:.0f}",
            refresh=False,
        )
        log.info(
            "epoch %d step %d | train/loss %.4f | lr %.3g | %.0f samples/s | data wait %.0f%%",
            state.epoch + 1,
            state.global_step,
            metrics["train/loss"],
            metrics["train/lr"],
            samples_per_sec,
            100 * metrics["perf/data_wait_frac"],
        )

    def _highest_peak_memory_gb(self) -> float:
        """The highest peak of any rank's GPU memory over the logging interval (a logging step's extra reduction)."""
        peaks = torch.zeros(self.strategy.world_size, device=self.strategy.device)
        peaks[self.strategy.rank] = interval_peak_memory_gb(self.strategy.devices)
        return self.strategy.all_reduce(peaks).max().item()

    def _global_mean(self, loss_sum: Tensor, steps: int) -> float:
        """Mean per-step loss over all ranks (each rank's step loss is the mean over an equal-sized shard).

        The same all-reduce counts the ranks that got each stop signal: all ranks learn of a stop at the same step.
        """
        votes = [float(self.stop_request.signum == signum) for signum in STOP_SIGNALS]
        reduced = torch.tensor([0.0, *votes], device=loss_sum.device)
        reduced[0] = loss_sum.detach()
        total, *votes = self.strategy.all_reduce(reduced).tolist()
        self.stop_signum = next((signum for signum, n in zip(STOP_SIGNALS, votes) if n), 0)
        return total / max(1, steps * self.strategy.world_size) if steps else math.nan

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: DataLoader) -> dict[str, float]:
        """Loss and accuracy over the whole validation set; each sample is counted once, on one rank."""
        module = self.strategy.eval_module(model)
        module.eval()
        device = self.strategy.device
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        batches = itertools.islice(loader, self.limit_val_batches)
        for inputs, targets in self.strategy.eval_batches(batches, batches_per_epoch(loader, self.limit_val_batches)):
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            if self.channels_last and inputs.ndim == 4:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            with self.precision.autocast():
                logits = module(inputs)
            totals[0] += F.cross_entropy(logits.float(), targets, reduction="sum").double()
            totals[1] += (logits.argmax(dim=1) == targets).sum()
            totals[2] += targets.numel()
        loss_sum, correct, count = self.strategy.all_reduce(totals).tolist()
        return {"val/loss": loss_sum / count, "val/acc": correct / count}
