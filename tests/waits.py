"""Fault-injection hooks that hold a run at one moment until the test acts: the process writes its id to a
`pause_file` (so the test knows whom to signal or kill) and waits until `resume_file` exists (two minutes at most),
however slowly what the test does starts. Selected from the command line like any model or callback, e.g.
`model._target_=tests.waits.WaitingMLP +model.fail_rank=0 +model.fail_at_step=13 +model.pause_file=... ...`."""

import collections
import os
import time

from tests.faults import PausingMLP

from hydraloop.callbacks import Callback
from hydraloop.models.mlp import MLP

WAIT_AT_MOST_S = 120


def pause_until(pause_file: str, resume_file: str) -> None:
    """Writes this process's id to `pause_file` (atomically), then waits until `resume_file` exists."""
    with open(pause_file + ".tmp", "w") as file:
        file.write(str(os.getpid()))
    os.replace(pause_file + ".tmp", pause_file)
    deadline = time.monotonic() + WAIT_AT_MOST_S
    while not os.path.exists(resume_file) and time.monotonic() < deadline:
        time.sleep(0.05)


class WaitingMLP(PausingMLP):
    """Like PausingMLP, but waits in that step until `resume_file` exists."""

    def __init__(self, *args, resume_file: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.resume_file = resume_file

    def misbehave(self) -> None:
        if not os.path.exists(self.pause_file):
            pause_until(self.pause_file, self.resume_file)


class WaitingInARankMLP(WaitingMLP):
    """WaitingMLP, waiting in a rank only: the launcher's trial batch (hydraloop.trial) is its model's step 1."""

    def misbehave(self) -> None:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            super().misbehave()


class WaitingInValidationMLP(WaitingInARankMLP):
    """WaitingInARankMLP, waiting in the validation after training step `fail_at_step` instead of in that step: in
    its validation batch `at_batch` (counted from 1), mid-way through the pass, the other ranks' batches going on."""

    def __init__(self, *args, at_batch: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.at_batch, self.val_batches = at_batch, 0

    def forward(self, x):
        if not self.training and self.steps == self.fail_at_step and int(os.environ.get("RANK", 0)) == self.fail_rank:
            self.val_batches += 1
            if self.val_batches == self.at_batch:
                super().misbehave()
        return super().forward(x)

    def misbehave(self) -> None:  # not in the training step
        pass


class WaitingInCheckpointWrite(Callback):
    """A callback whose state makes the writer (rank 0) wait inside the write of the checkpoint of step `at_step`,
    as torch.save pickles it (once per `pause_file`). The file being written is open meanwhile:
    `step-<at_step>.pt.tmp` under single and ddp; under fsdp the shards are in the staging directory
    `step-<at_step>.pt.tmp/` and `state.pt` is being written beside them. What it saves reads back as an empty dict."""

    def __init__(self, at_step: int, pause_file: str, resume_file: str) -> None:
        self.at_step, self.pause_file, self.resume_file = at_step, pause_file, resume_file

    def state_dict(self, trainer) -> dict:
        # On every rank, as the replica check compares them; only the writer's (rank 0) is pickled.
        if trainer.state.global_step == self.at_step:
            return _WaitWhenPickled(self.pause_file, self.resume_file)
        return {}


class _WaitWhenPickled:
    def __init__(self, pause_file: str, resume_file: str) -> None:
        self.pause_file, self.resume_file = pause_file, resume_file

    def __repr__(self) -> str:  # the replica check's digest of it: the same on every rank
        return "OrderedDict()"

    def __reduce__(self):
        if not os.path.exists(self.pause_file):
            pause_until(self.pause_file, self.resume_file)
        return collections.OrderedDict, ()  # what torch.load(weights_only=True) reads


class WaitingInFirstAttemptMLP(MLP):
    """Every rank of the job's first attempt (TORCHELASTIC_RESTART_COUNT 0) writes its process id to
    `<pid_dir>/<RANK>` in training step `wait_at_step`, then waits there until `resume_file` exists: a test can act
    on chosen ranks (kill a node) while every rank is certainly in that step. A restarted attempt trains on without
    waiting."""

    def __init__(self, *args, wait_at_step: int, pid_dir: str, resume_file: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.wait_at_step, self.pid_dir, self.resume_file, self.steps = wait_at_step, pid_dir, resume_file, 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            if self.steps == self.wait_at_step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                pause_until(os.path.join(self.pid_dir, os.environ.get("RANK", "0")), self.resume_file)
        return super().forward(x)
