"""The loop's checkpoints: what every rank makes sure of before one (or a validation), the one place the trainer
makes one (on every rank), the wait for one written in the background, the end of training (on a stop signal, once
its checkpoint is written; or finished), and where a rerun into the run directory would continue from, which the
line that ends a failed or stopped run says. What a checkpoint holds is hydraloop.checkpoint's; what rank 0 writes,
hydraloop.run_writer's."""

import logging
import signal
from pathlib import Path
from typing import Any, NoReturn

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hydraloop.callbacks import TrainerView
from hydraloop.checkpoint import TrainState, checkpoint_state, step_checkpoint
from hydraloop.errors import Interrupted
from hydraloop.loop_state import GlobalSums
from hydraloop.losses import check_finite_weights
from hydraloop.parallel.single import SingleDevice
from hydraloop.precision import Precision
from hydraloop.replica_check import ReplicaCheck
from hydraloop.run_writer import NullRunWriter
from hydraloop.sharded_checkpoint import staging_dir

log = logging.getLogger("hydraloop.trainer")  # a line of the loop's, under the loop's name


class LoopCheckpoints:
    """`config` is stored in every checkpoint, and names the run directory (`output_dir`); `settings`: the `trainer`
    config node; `rerun_starts_from`: where a rerun into this run directory starts while this run has saved nothing
    (said when the run fails); `global_sums`: where the ranks agree on a stop signal (hydraloop.loop_state)."""

    def __init__(
        self,
        strategy: SingleDevice,
        writer: NullRunWriter,
        precision: Precision,
        model: nn.Module,
        optimizers: dict[str, Optimizer],
        schedulers: dict[str, LRScheduler],
        config: dict[str, Any],
        settings: Any,
        rerun_starts_from: str,
        global_sums: GlobalSums,
    ) -> None:
        self.strategy, self.writer, self.precision = strategy, writer, precision
        self.model, self.optimizers, self.schedulers = model, optimizers, schedulers
        self.config = config
        self.checkpoint_dir = Path(config.get("output_dir", ".")) / "checkpoints"
        self.save_checkpoints = settings.save_checkpoints
        self.replica_check = ReplicaCheck(settings.replica_check_every_n_steps, strategy)
        self.rerun_starts_from, self.global_sums = rerun_starts_from, global_sums
        self.saved_at = -1  # the global step of this run's latest checkpoint

    def before_validation_or_checkpoint(self, trainer: TrainerView, state: TrainState) -> None:
        """Weights that are not finite (from an overflowing gradient, say) are neither validated nor saved: the run
        ends, naming the checkpoint a rerun would start from. And every rank takes rank 0's buffers (batch norm's
        running statistics, which each rank updates from its own shard): the ones rank 0 saves. Replicas that
        differ (hydraloop.replica_check) end the run too."""
        check_finite_weights(self.model, state.global_step, self.strategy, self.rerun_note())
        self.replica_check(trainer, state.global_step)
        self.strategy.sync_buffers(self.model)

    def save(self, trainer: TrainerView, state: TrainState, val_metrics: dict[str, float], is_best: bool) -> None:
        """The one place a checkpoint is made; called on every rank, with the trainer whose callbacks' states it
        keeps.

        The strategy decides what that costs each rank: single and DDP build the state only where it is written
        (rank 0; the others have a null writer); under FSDP every rank writes its own shards (or, with
        `parallel.checkpoint=full`, gathers them for rank 0: a collective).
        """
        if not self.save_checkpoints:
            self.saved_at = state.global_step
            return  # not even FSDP's gather
        staging = staging_dir(step_checkpoint(self.checkpoint_dir, state.global_step))
        state_dicts = self.strategy.state_dicts(self.model, self.optimizers, staging)
        callback_states = {name: callback.state_dict(trainer) for name, callback in trainer.callbacks.items()}

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
        self.global_sums.agree_now()  # a stop signal that came while rank 0 wrote: the run stops here

    def written(self) -> None:
        """Waits for a checkpoint written in the background (parallel.async_checkpoint) to be on disk, and names it
        last.pt (and best.pt); a failed write ends the run in one line, the checkpoints before it intact."""
        self.strategy.wait_for_checkpoint()
        self.writer.checkpoint_written()

    def rerun_note(self) -> str:
        """Where a rerun into this run directory would continue from, for the line that ends a failed run."""
        if not self.save_checkpoints:
            return "trainer.save_checkpoints=false: nothing was saved"
        if self.saved_at >= 0:
            return f"checkpoints/last.pt holds step {self.saved_at}, where a rerun continues"
        return f"no checkpoint was saved in this run: a rerun starts from {self.rerun_starts_from}"

    def finish(self, signum: int) -> None:
        """At the end of training: waits for the last checkpoint. A stop signal `signum` that came at or after the
        run's last step finds nothing left to stop for: the run finishes as it would have, said in one line."""
        self.written()
        if signum:
            log.info(
                "%s came at or after the run's last step: nothing is left to stop for, the run finishes (metrics.json)",
                signal.Signals(signum).name,
            )

    def stop(self, where: str, signum: int) -> NoReturn:
        """Ends the run on the stop signal `signum` the ranks agreed on, once its checkpoint is written; the loggers
        mark their runs preempted, not failed."""
        log.info("stopping %s", where)
        self.written()
        self.writer.interrupted(signum)
        raise Interrupted(signum, f"{where}: {self._resume_hint()}")

    def _resume_hint(self) -> str:
        if not self.save_checkpoints:
            return "trainer.save_checkpoints=false, so nothing was saved"
        return "checkpoints/last.pt holds it; the same command run into the same directory continues from there"
