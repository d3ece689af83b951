"""Fault-injection models for the failure tests: real MLPs that misbehave on one rank at one training step.

Selected from the command line like any model, e.g. `model._target_=tests.faults.RaisingMLP +model.fail_rank=1`.
"""

import contextlib
import math
import os
import signal
import time
from pathlib import Path

import torch

from hydraloop.callbacks import Callback
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


class PausingMLP(RaisingMLP):
    """Pauses rank `fail_rank` for a few seconds in step `fail_at_step`, once per `pause_file` (which it creates with
    its process id, so a test knows the run is mid-step and whom to signal; a rerun finds the file, does not pause)."""

    def __init__(self, *args, pause_file: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pause_file = pause_file

    def misbehave(self) -> None:
        if not os.path.exists(self.pause_file):
            with open(self.pause_file + ".tmp", "w") as file:
                file.write(str(os.getpid()))
            os.replace(self.pause_file + ".tmp", self.pause_file)
            self.wait()

    def wait(self) -> None:
        time.sleep(3)


class KilledMLP(RaisingMLP):
    """Dies without a word at one step: SIGKILL to itself, as the out-of-memory killer or a lost node would do."""

    def misbehave(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class FailingOnceMLP(RaisingMLP):
    """Raises only in the job's first attempt: torchrun's restarts (TORCHELASTIC_RESTART_COUNT > 0) run cleanly."""

    def misbehave(self) -> None:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            super().misbehave()


class NaNFromMLP(NaNMLP):
    """Returns NaN logits at every training step from `fail_at_step` on, on rank `fail_rank`: a run that diverged."""

    @property
    def diverged_now(self) -> bool:
        return int(os.environ.get("RANK", 0)) == self.fail_rank and self.steps >= self.fail_at_step


class HugeLossMLP(RaisingMLP):
    """Class 0's logit raised by 5e37 in training: a sample of another class has a finite cross-entropy of about
    5e37 (float32 ends at 3.4e38) and ordinary gradients. With 2 samples a batch each step's mean loss is finite,
    while a float32 sum of twenty of them would overflow."""

    def forward(self, x):
        out = super().forward(x)
        if not self.training:
            return out
        offset = torch.zeros(out.shape[1], device=out.device)
        offset[0] = 5e37
        return out + offset


class InfGradMLP(RaisingMLP):
    """A finite loss whose gradient is infinite at one step on one rank: the update makes the weights infinite."""

    def misbehave(self) -> None:
        first = next(self.parameters())
        first.register_hook(lambda grad: grad * float("inf") if self.steps == self.fail_at_step else grad)


class KillingLogger:
    """A logger that kills its process at the end of the run, after the last checkpoint and before metrics.json:
    `+logger.killer._target_=tests.faults.KillingLogger`."""

    def start(self, run) -> None:
        pass

    def log_metrics(self, metrics, step) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, metrics) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class BatchNormNaNMLP(RaisingMLP):
    """Batch norm in front of the MLP, and a NaN input at one step on one rank: the forward pass puts NaN into the
    running statistics, whatever happens to the update."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.norm = torch.nn.BatchNorm1d(self.net[1].in_features)

    def forward(self, x):
        if self.training and self.steps + 1 == self.fail_at_step and int(os.environ.get("RANK", 0)) == self.fail_rank:
            x = x * float("nan")
        return super().forward(self.norm(x.flatten(1)).view_as(x))

    def misbehave(self) -> None:
        pass


def nan_ring(nan_rows: list[int], **ring):
    """data=ring with NaN points at the training rows `nan_rows`: the discriminator's loss of their batch is NaN."""
    from hydraloop.data.gaussians import make_ring

    train, val = make_ring(**ring)
    train.tensors[0][list(nan_rows)] = float("nan")
    return train, val


class KilledWhileSavingMLP(RaisingMLP):
    """Dies without a word (SIGKILL) on rank `fail_rank` as the first checkpoint after training step `fail_at_step`
    starts: that rank's shards of it never reach the disk, while the other ranks may be writing theirs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)

        def saving(module, state, prefix, local_metadata) -> None:  # a function: torch marks it as registered
            if int(os.environ.get("RANK", 0)) == self.fail_rank and self.steps >= self.fail_at_step:
                os.kill(os.getpid(), signal.SIGKILL)

        self.register_state_dict_post_hook(saving)

    def misbehave(self) -> None:
        pass


class NudgeOnOneRank(Callback):
    """A callback that moves one value up by one ulp on rank `rank`, after optimizer step `at_step`: a change that
    rank alone makes, outside the all-reduced gradient. `value`: model, the first parameter's first element (this
    rank's shard of it under fsdp); optimizer, the first element of that parameter's first state tensor (exp_avg)."""

    def __init__(self, rank: int = 1, at_step: int = 1, value: str = "model") -> None:
        self.rank, self.at_step, self.value = rank, at_step, value

    @torch.no_grad()
    def on_optimizer_step(self, trainer, state) -> None:
        if int(os.environ.get("RANK", 0)) != self.rank or state.global_step != self.at_step:
            return
        tensor = next(trainer.strategy.unwrap(trainer.model).parameters())
        if self.value == "optimizer":
            moments = trainer.optimizers[""].state[tensor]
            tensor = next(moments[key] for key in sorted(moments) if moments[key].dim())
        first = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).view(-1)[:1]
        first.copy_(torch.nextafter(first, torch.full_like(first, math.inf)))


class SlowStartMLP(MLP):
    """Waits in its constructor where a rank builds it for real (the launcher builds models on the meta device only):
    the run directory is taken and the run accepted, and the training loop not started. Writes its process id to
    `pause_file`, then waits until `resume_file` exists (two minutes at most)."""

    def __init__(self, *args, pause_file: str, resume_file: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if next(self.parameters()).is_meta:
            return
        with open(pause_file + ".tmp", "w") as file:
            file.write(str(os.getpid()))
        os.replace(pause_file + ".tmp", pause_file)
        deadline = time.monotonic() + 120
        while not os.path.exists(resume_file) and time.monotonic() < deadline:
            time.sleep(0.05)


class StopWrappedMLP(MLP):
    """Where rank `fail_rank` builds it for real, a SIGTERM lands in code that raises an error of its own from it, as
    DTensor's sharding propagation does (`RuntimeError(...) from error`) while fsdp builds its parameters. The
    launcher gets the signal too, as a terminal's or a scheduler's reaches the whole process group, and passes it on
    while the rank handles its own; with `alone`, it does not (`kill <the rank's pid>`)."""

    def __init__(self, *args, fail_rank: int = 0, alone: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if next(self.parameters()).is_meta or int(os.environ.get("RANK", 0)) != fail_rank:
            return
        try:
            signal.raise_signal(signal.SIGTERM)  # handled at the next instruction, inside the try
            time.sleep(0.01)
        except Exception as error:
            if "TORCHELASTIC_RUN_ID" in os.environ and not alone:  # a rank its launcher started
                os.kill(os.getppid(), signal.SIGTERM)
                time.sleep(0.5)  # the launcher's comes meanwhile
            raise RuntimeError(f"{error}\n\nSharding propagation failed for aten.empty_like.default") from error


class RankDependentMLP(MLP):
    """An MLP whose classifier reads the rank in training, as a layer that reads RANK or keeps a generator per
    process would: rank r scales the logits by 1 + r / 10. Single-process training is rank 0 alone, so every
    strategy of 2 ranks trains other weights (scripts/check_exact.py must fail on it)."""

    def forward(self, x):
        out = super().forward(x)
        return out * (1 + int(os.environ.get("RANK", 0)) / 10) if self.training else out


class StopSignalAt(Callback):
    """A callback that sends `signal_name` to the run's launcher, as a scheduler would, from rank 0 at a chosen moment:
    after optimizer step `at_step` (`during=step`), or in the validation of step `at_step` (`during=validation`),
    once that validation's metrics are known. The launcher is this process where the run trains in it
    (parallel=single), the parent of a rank that torch.distributed.elastic started (spawned ranks, torchrun). With
    `every_process`, to the launcher and every process under it, one by one, as SLURM signals a job step's (the
    ranks, their loaders' fork servers and workers, the resource tracker)."""

    def __init__(
        self, at_step: int, during: str = "step", signal_name: str = "SIGTERM", every_process: bool = False
    ) -> None:
        self.at_step, self.during = at_step, during
        self.signum, self.every_process = signal.Signals[signal_name], every_process

    def on_optimizer_step(self, trainer, state) -> None:
        if self.during == "step":
            self._signal(state.global_step)

    def on_validation(self, trainer, state, metrics) -> dict[str, float]:
        if self.during == "validation":
            self._signal(state.global_step)
        return {}

    def _signal(self, step: int) -> None:
        if int(os.environ.get("RANK", 0)) == 0 and step == self.at_step:
            launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
            for pid in [launcher, *descendants(launcher)] if self.every_process else [launcher]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, self.signum)


def descendants(pid: int) -> list[int]:
    """The processes under `pid`, children first, from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(0), [])
        found += below
        queue += below
    return found
