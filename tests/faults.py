"""Fault-injection models for the failure tests: real MLPs that misbehave on one rank at one training step.

Selected from the command line like any model, e.g. `model._target_=tests.faults.RaisingMLP +model.fail_rank=1`.
"""

import os
import time

from hydraloop.models.mlp import MLP


class RaisingMLP(MLP):
    def __init__(self, *args, fail_rank: int = 1, fail_at_step: int = 3, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_rank, self.fail_at_step, self.steps = fail_rank, fail_at_step, 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            if int(os.environ.get("RANK", 0)) == self.fail_rank and self.steps == self.fail_at_step:
                self.misbehave()
        return super().forward(x)

    def misbehave(self) -> None:
        raise RuntimeError(f"injected failure at step {self.steps}")


class HangingMLP(RaisingMLP):
    """Stops answering (no exception): the other ranks wait in the gradient all-reduce until the timeout."""

    def misbehave(self) -> None:
        time.sleep(3600)


class NaNMLP(RaisingMLP):
    """Returns NaN logits at one step on one rank: the loss diverges there."""

    def forward(self, x):
        out = super().forward(x)
        return out * float("nan") if self.training and self.diverged_now else out

    @property
    def diverged_now(self) -> bool:
        return int(os.environ.get("RANK", 0)) == self.fail_rank and self.steps == self.fail_at_step

    def misbehave(self) -> None:
        pass
