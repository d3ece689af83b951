"""The training loop. It runs identically on every rank and talks to the parallel strategy only through
`all_reduce` and `unwrap`, and to the run directory only through the (possibly null) run writer."""

import logging
import math
import operator
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from hydraloop.checkpoint import rng_state
from hydraloop.parallel.single import SingleDevice
from hydraloop.run_writer import NullRunWriter
from hydraloop.seeding import epoch_seed, seed_everything

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    epoch: int = 0
    """Completed epochs."""
    global_step: int = 0
    """Completed optimizer steps."""
    best_metric: float | None = None


class Trainer:
    def __init__(
        self,
        strategy: SingleDevice,
        writer: NullRunWriter,
        *,
        max_epochs: int,
        log_every_n_steps: int,
        grad_clip_norm: float | None,
        global_batch_size: int,
        seed: int,
        optimized_metric: str,
        optimized_metric_mode: str,
        config: dict[str, Any],
    ) -> None:
        self.strategy = strategy
        self.writer = writer
        self.max_epochs = max_epochs
        self.log_every_n_steps = log_every_n_steps
        self.grad_clip_norm = grad_clip_norm
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.optimized_metric = optimized_metric
        self.improved = operator.gt if optimized_metric_mode == "max" else operator.lt
        self.config = config  # stored in every checkpoint

    def fit(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        train_loader: DataLoader,
        val_loader: DataLoader,
        state: TrainState,
    ) -> dict[str, Any]:
        """Trains from `state` to `max_epochs`, validating and checkpointing after each epoch."""
        start = time.perf_counter()
        train_loss, val_metrics = None, None
        while state.epoch < self.max_epochs:
            seed_everything(epoch_seed(self.seed, self.strategy.rank, state.epoch))
            train_loader.sampler.set_epoch(state.epoch)  # a new permutation per epoch, the same on every rank
            train_loss = self.train_epoch(model, optimizer, scheduler, train_loader, state)
            state.epoch += 1
            val_metrics = self.evaluate(model, val_loader)
            self.writer.log_metrics({**val_metrics, "train/epoch_loss": train_loss}, state.global_step)
            log.info(
                "epoch %d/%d | train/loss %.4f | val/loss %.4f | val/acc %.4f",
                state.epoch, self.max_epochs, train_loss, val_metrics["val/loss"], val_metrics["val/acc"],
            )
            metric = val_metrics[self.optimized_metric]
            is_best = state.best_metric is None or self.improved(metric, state.best_metric)
            if is_best:
                state.best_metric = metric
            self.writer.save_checkpoint(
                lambda: self.checkpoint(model, optimizer, scheduler, state, val_metrics), is_best=is_best
            )
        if val_metrics is None:  # resumed from a checkpoint at or past max_epochs: nothing left to train
            val_metrics = self.evaluate(model, val_loader)
        return {
            **val_metrics,
            "train/loss": train_loss,
            "epoch": state.epoch,
            "global_step": state.global_step,
            "world_size": self.strategy.world_size,
            "wall_time_s": time.perf_counter() - start,
        }

    def train_epoch(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        loader: DataLoader,
        state: TrainState,
    ) -> float:
        """One pass over this rank's shard; returns the epoch's mean train loss over all ranks."""
        model.train()
        device = self.strategy.device
        # Losses are summed on the device and read back only on logging steps: `.item()` is a host sync.
        epoch_loss = torch.zeros((), device=device)
        interval_loss = torch.zeros((), device=device)
        interval_steps, interval_start = 0, time.perf_counter()
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.grad_clip_norm is not None:
                # DDP has averaged the gradients by now, so every rank clips by the same global norm.
                nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip_norm)
            optimizer.step()
            scheduler.step()
            state.global_step += 1
            interval_loss += loss.detach()
            interval_steps += 1
            if state.global_step % self.log_every_n_steps == 0:
                epoch_loss += interval_loss
                self._log_interval(interval_loss, interval_steps, time.perf_counter() - interval_start, scheduler, state)
                interval_loss = torch.zeros((), device=device)
                interval_steps, interval_start = 0, time.perf_counter()
        epoch_loss += interval_loss
        return self._global_mean(epoch_loss, len(loader))

    def _log_interval(
        self, loss_sum: Tensor, steps: int, seconds: float, scheduler: LRScheduler, state: TrainState
    ) -> None:
        metrics = {
            "train/loss": self._global_mean(loss_sum, steps),
            "train/lr": scheduler.get_last_lr()[0],
            "train/samples_per_sec": steps * self.global_batch_size / seconds,
        }
        self.writer.log_metrics(metrics, state.global_step)
        log.info(
            "epoch %d step %d | train/loss %.4f | lr %.3g | %.0f samples/s",
            state.epoch + 1, state.global_step, metrics["train/loss"], metrics["train/lr"],
            metrics["train/samples_per_sec"],
        )

    def _global_mean(self, loss_sum: Tensor, steps: int) -> float:
        """Mean per-step loss over all ranks (each rank's step loss is the mean over an equal-sized shard)."""
        total = self.strategy.all_reduce(loss_sum.detach().clone().reshape(1)).item()
        return total / max(1, steps * self.strategy.world_size) if steps else math.nan

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: DataLoader) -> dict[str, float]:
        """Loss and accuracy over the whole validation set; each sample is counted once, on one rank."""
        module = self.strategy.eval_module(model)
        module.eval()
        device = self.strategy.device
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            logits = module(inputs)
            totals[0] += F.cross_entropy(logits, targets, reduction="sum").double()
            totals[1] += (logits.argmax(dim=1) == targets).sum()
            totals[2] += targets.numel()
        loss_sum, correct, count = self.strategy.all_reduce(totals).tolist()
        return {"val/loss": loss_sum / count, "val/acc": correct / count}

    def checkpoint(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        state: TrainState,
        metrics: dict[str, float],
    ) -> dict[str, Any]:
        return {
            "model": self.strategy.unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": state.epoch,
            "global_step": state.global_step,
            "best_metric": state.best_metric,
            "metrics": metrics,
            "rng": rng_state(),
            "config": self.config,
        }
