"""What the loop reports at each logging step (trainer.log_every_n_steps): the interval's mean train loss over all
ranks, each optimizer's learning rate, throughput (hydraloop.perf) and the highest GPU memory peak of any rank; to
the loggers (through the run writer), the progress bar and the log."""

import logging
import time

import torch
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm

from hydraloop.checkpoint import TrainState
from hydraloop.loop_state import Interval
from hydraloop.parallel.single import SingleDevice
from hydraloop.perf import Throughput, interval_peak_memory_gb
from hydraloop.run_writer import NullRunWriter

log = logging.getLogger("hydraloop.trainer")  # a line of the loop's, under the loop's name


class IntervalLog:
    def __init__(
        self, strategy: SingleDevice, writer: NullRunWriter, schedulers: dict[str, LRScheduler], throughput: Throughput
    ) -> None:
        self.strategy, self.writer, self.schedulers, self.throughput = strategy, writer, schedulers, throughput

    def __call__(self, interval: Interval, loss: float, state: TrainState, progress: tqdm) -> None:
        """Logs `interval`, whose global mean train loss is `loss` (NaN and not logged: every step skipped), at
        `state.global_step`, and moves `progress` on by its steps."""
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
        progress.update(interval.count)
        lr = next(iter(lrs.values()))
        progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.3g}", samples_per_s=f"{samples_per_sec:.0f}", refresh=False)
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
