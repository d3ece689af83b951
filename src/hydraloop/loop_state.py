"""What the loop carries from step to step and keeps in every checkpoint, beside TrainState's counters: the train
losses of the unfinished epoch and logging interval, and the skipped steps. A run resumed from a checkpoint written
anywhere (mid-epoch, between two logging steps) logs and reports the uninterrupted run's train losses.

The losses stay on the device, summed per epoch (`EpochLosses`) and per logging interval (`Interval`); the ranks
read back their global sums only where they meet anyway: a logging, validation or checkpoint step, or the epoch end
(`GlobalSums`). That one reduction also carries each rank's stop vote (hydraloop.preemption), as a validation's own
does. What a NaN or infinite
loss does to the run is hydraloop.losses'.

From where the run stands, the steps it plans for (`planned_steps`, `schedule_plan`), in steps of today's batch size:
a resume may have changed it, and a mid-epoch position is kept in samples.
"""

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hydraloop.checkpoint import TrainState
from hydraloop.data.samplers import GlobalBatchSampler
from hydraloop.draw_watch import DrawWatch
from hydraloop.errors import TrainingDiverged
from hydraloop.parallel.single import SingleDevice
from hydraloop.preemption import STOP_SIGNALS, StopRequest


class Interval:
    """What the loop accumulates between two logging steps. A run resumed from a checkpoint written between two
    logging steps carries on the interval the checkpoint was in (`resumed`): its first logged train/loss is then the
    uninterrupted run's."""

    def __init__(
        self, device: torch.device, capacity: int, first_step: int, carried: tuple[float, int, int] = (0.0, 0, 0)
    ) -> None:
        """`first_step`: the global step (counted from 1) of this process's first step in the interval; `carried`:
        the global loss sum, steps and skipped steps of the interval before a resume."""
        # float64: a float32 sum of finite losses near its largest value would overflow into a false infinity.
        self.losses = torch.empty(capacity, dtype=torch.float64, device=device)  # per step, to name a NaN's step
        self.first_step = first_step
        self.carried_sum, self.carried_steps, self.carried_skipped = carried
        self.count = 0  # steps run here, since the interval began or the run resumed
        self.skipped = self.carried_skipped
        self.samples = 0  # global samples of those steps
        self.data_wait_s = 0.0
        self.start = time.perf_counter()

    @classmethod
    def resumed(cls, state: Any, device: torch.device, capacity: int) -> "Interval":
        """The interval `state` (a TrainState) is in: the one a mid-interval checkpoint was written in, or a new one."""
        carried = (state.interval_loss_sum, state.interval_steps, state.interval_skipped)
        return cls(device, capacity, state.global_step + 1, carried)

    def add(self, loss: Tensor | None, samples: int) -> None:
        """None: a step whose update was skipped (trainer.nonfinite_loss=skip); a step, but not in the loss."""
        self.losses[self.count] = 0.0 if loss is None else loss
        self.skipped += loss is None
        self.count += 1
        self.samples += samples

    @property
    def loss_sum(self) -> Tensor:
        """This rank's sum of the losses of the steps run here (not the carried ones)."""
        return self.losses[: self.count].sum()

    @property
    def steps(self) -> int:
        return self.carried_steps + self.count

    @property
    def loss_steps(self) -> int:
        return self.steps - self.skipped

    def carry(self, global_sum: float) -> tuple[float, int, int]:
        """What a checkpoint keeps of this interval, given the global sum of `loss_sum`: (loss sum, steps, skipped)."""
        return self.carried_sum + global_sum, self.steps, self.skipped

    def first_nonfinite_step(self) -> int:
        """The first step whose loss is NaN or infinite; 0 if none (a host sync: only on the failure path)."""
        bad = (~torch.isfinite(self.losses[: self.count])).nonzero()
        return self.first_step + int(bad[0]) if len(bad) else 0


class GlobalSums:
    """Sums of step losses over all ranks, over the world size: each rank's step loss is its share of the global
    batch's mean loss times the world size (hydraloop.step), so these are sums of the global batches' means.

    The same all-reduce counts the ranks that got each stop signal: all ranks learn of a stop at the same step; and
    the ranks that drew from torch's generators in a pass over a split batch (hydraloop.draw_watch).
    """

    def __init__(self, strategy: SingleDevice, stop_request: StopRequest, draw_watch: DrawWatch) -> None:
        self.strategy, self.stop_request, self.draw_watch = strategy, stop_request, draw_watch
        self.stop_signum = 0  # the stop signal all ranks agreed on at the last reduction

    def __call__(self, *loss_sums: Tensor) -> list[float]:
        count = len(loss_sums)
        flags = [*self.stop_votes(), self.draw_watch.flag()]
        reduced = torch.tensor([0.0] * count + flags, dtype=torch.float64, device=loss_sums[0].device)
        reduced[:count] = torch.stack([loss_sum.detach() for loss_sum in loss_sums])
        reduced = self.strategy.all_reduce(reduced).tolist()
        self.agree(reduced[count:-1])
        self.draw_watch.reduced(reduced[-1])
        return [total / self.strategy.world_size for total in reduced[:count]]

    def stop_votes(self) -> list[float]:
        """This rank's vote for each stop signal, to be summed over the ranks and handed to `agree`. A validation
        carries them in its own all-reduce (hydraloop.validation): a signal that came during it stops the run at its
        checkpoint, not at the next logging step's (after another checkpoint)."""
        return [float(self.stop_request.signum == signum) for signum in STOP_SIGNALS]

    def agree_now(self) -> None:
        """An all-reduce of the stop votes alone: after a checkpoint's write (hydraloop.loop_checkpoints), which a
        signal may have come during, so that the run stops at that checkpoint, not after another."""
        if self.strategy.world_size == 1:  # its own vote: no collective, no read-back from the device
            self.agree(self.stop_votes())
            return
        votes = torch.tensor(self.stop_votes(), dtype=torch.float64, device=self.strategy.device)
        self.agree(self.strategy.all_reduce(votes).tolist())

    def agree(self, summed_votes: list[float]) -> None:
        self.stop_signum = next((signum for signum, n in zip(STOP_SIGNALS, summed_votes) if n), 0)


class EpochLosses:
    """This process's train losses of one pass over an epoch (all of it, or its rest after a mid-epoch checkpoint):
    the epoch's sum and the logging interval's, on the device."""

    def __init__(self, state: TrainState, device: torch.device, log_every_n_steps: int) -> None:
        # Losses are summed on the device and read back only on logging steps: `.item()` is a host sync. Each rank
        # starts from the global sum of a resumed epoch's (and logging interval's) earlier steps; the means below
        # divide by world size.
        self.epoch_sum = torch.full((), state.epoch_loss_sum, dtype=torch.float64, device=device)
        self.interval = Interval.resumed(state, device, log_every_n_steps)
        self.device, self.log_every_n_steps = device, log_every_n_steps

    def interval_mean(self, global_sums: GlobalSums) -> float:
        """The logging interval's mean train loss over all ranks, the steps carried from before a resume included;
        NaN if every step of it was skipped (trainer.nonfinite_loss=skip): no loss to average. The sync point: the
        device has caught up once this returns."""
        loss_sum = global_sums(self.interval.loss_sum)[0] + self.interval.carried_sum
        return loss_sum / self.interval.loss_steps if self.interval.loss_steps else math.nan

    def next_interval(self, first_step: int) -> None:
        """After a logging step: its interval's losses join the epoch's, and the next interval begins with the global
        step `first_step`."""
        self.epoch_sum += self.interval.loss_sum
        self.interval = Interval(self.device, self.log_every_n_steps, first_step)

    def carry_into(self, state: TrainState, global_sums: GlobalSums) -> float:
        """Before a checkpoint between two logging steps: the global sums of the epoch's and the interval's losses
        into `state`, kept in the checkpoint: a run resumed from it logs this interval's mean as the uninterrupted
        run does. Returns the global sum of the interval's steps run here, for the non-finite check."""
        state.epoch_loss_sum, interval_sum = global_sums(
            self.epoch_sum + self.interval.loss_sum, self.interval.loss_sum
        )
        state.interval_loss_sum, state.interval_steps, state.interval_skipped = self.interval.carry(interval_sum)
        return interval_sum

    def end(self, state: TrainState, global_sums: GlobalSums, epoch_done: bool) -> None:
        """At the end of the pass (the epoch's, or max_steps' mid-epoch): `state.train_loss`, the mean train loss over
        all ranks of the epoch's steps so far (None: every step skipped). A checkpoint of an unfinished epoch keeps
        the sum of the epoch's global step losses, and the unfinished logging interval's, so the resumed run reports
        the uninterrupted run's means."""
        self.epoch_sum += self.interval.loss_sum
        state.epoch_loss_sum, interval_sum = global_sums(self.epoch_sum, self.interval.loss_sum)
        counted = state.epoch_step - state.epoch_skipped
        state.train_loss = state.epoch_loss_sum / counted if counted else None  # None: every step skipped
        # An epoch's end also ends its logging interval: the next epoch starts one of its own.
        state.interval_loss_sum, state.interval_steps, state.interval_skipped = (
            (0.0, 0, 0) if epoch_done else self.interval.carry(interval_sum)
        )


def count_skipped(state: TrainState, max_consecutive_skips: int, rerun_note: Callable[[], str]) -> None:
    """A step whose update was skipped (trainer.nonfinite_loss=skip): the odd bad batch. A run of them as long
    as `max_consecutive_skips` has diverged, wherever the logging steps fall (`rerun_note`: where a rerun would
    continue from, for the line that ends the run)."""
    state.epoch_skipped += 1
    state.skipped_steps += 1
    state.skipped_in_a_row += 1
    if state.skipped_in_a_row >= max_consecutive_skips:
        first = state.global_step - state.skipped_in_a_row + 1
        raise TrainingDiverged(
            f"train/loss was non-finite at every step from {first} to {state.global_step}, all skipped "
            f"(trainer.nonfinite_loss=skip ends the run after trainer.max_consecutive_skips="
            f"{max_consecutive_skips} in a row); {rerun_note()}"
        )


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
