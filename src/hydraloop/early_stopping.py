"""Early stopping on `optimized_metric` (trainer.early_stopping): patience counted in validations.

The count lives in TrainState, so it is in every checkpoint: a resumed run counts on where it stopped, and one that
stopped early does not train on. The metric is global (reduced over ranks), so every rank decides alike.
"""

import logging

from hydraloop.checkpoint import TrainState

log = logging.getLogger("hydraloop.trainer")


class EarlyStopping:
    def __init__(self, patience: int | None, min_delta: float, metric: str, mode: str) -> None:
        """`patience`: validations in a row without an improvement by more than `min_delta` (in `mode`'s direction,
        max or min) before the run stops; None: never."""
        self.patience, self.min_delta, self.metric = patience, min_delta, metric
        self.sign = 1.0 if mode == "max" else -1.0

    def update(self, state: TrainState, value: float) -> None:
        """After a validation: sets `state.stopped_early` (why) once patience has run out."""
        if self.patience is None:
            return
        if state.patience_best is None or self.sign * (value - state.patience_best) > self.min_delta:
            state.patience_best, state.stale_validations = value, 0
            return
        state.stale_validations += 1
        if state.stale_validations >= self.patience:
            state.stopped_early = (
                f"{self.metric} did not improve by more than {self.min_delta} in {self.patience} validations "
                f"(best {state.patience_best:.6g})"
            )
            log.info("stopping early after step %d: %s", state.global_step, state.stopped_early)
