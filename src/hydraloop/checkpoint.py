"""Checkpoints: one dict of CPU tensors, loadable with torch.load(weights_only=True) on any machine, written
atomically; or, under parallel=fsdp, the same dict as a directory of shards (hydraloop.sharded_checkpoint), which
`load_checkpoint` reads back as this dict.

Keys: model (state_dict of the unwrapped model), optimizer and scheduler (several optimizers' by name: `by_name`),
the fields of TrainState (epoch: completed epochs, global_step, best_metric, ..., and epoch_samples, epoch_step,
epoch_loss_sum, ...: progress into an unfinished epoch), grad_scaler (fp16 loss scale), metrics (the validation
metrics when saved; empty mid-epoch), rng (torch, cuda: the saving rank's own GPU's or None, numpy, python), config
(resolved) and callbacks (each callback's state, by name: hydraloop.callbacks). What a resume takes of one is
hydraloop.restore's.
"""

import logging
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.optim.lr_scheduler import LambdaLR

from hydraloop import sharded_checkpoint
from hydraloop.errors import ConfigError
from hydraloop.precision import Precision
from hydraloop.storage import write_atomic

log = logging.getLogger(__name__)

REQUIRED_KEYS = ("model", "optimizer", "scheduler", "epoch", "global_step", "rng")


@dataclass
class TrainState:
    """Where training stands; restored from a checkpoint on resume."""

    epoch: int = 0
    """Completed epochs."""
    global_step: int = 0
    """Completed optimizer steps."""
    epoch_step: int = 0
    """Completed steps of the unfinished epoch `epoch + 1` (non-zero only in a mid-epoch checkpoint)."""
    epoch_samples: int = 0
    """Samples of that epoch trained on (all ranks): where a resume continues it, whatever its batch size."""
    epoch_loss_sum: float = 0.0
    """Sum of those steps' global train losses, so the resumed epoch reports the uninterrupted epoch's mean."""
    epoch_skipped: int = 0
    """Steps of the unfinished epoch whose update was skipped for a non-finite loss (not in epoch_loss_sum)."""
    interval_loss_sum: float = 0.0
    """The unfinished logging interval's sum of global train losses, steps and skipped steps: the first train/loss
    a resumed run logs is then the uninterrupted run's."""
    interval_steps: int = 0
    interval_skipped: int = 0
    skipped_steps: int = 0
    """Skipped steps over the whole run (trainer.nonfinite_loss=skip)."""
    skipped_in_a_row: int = 0
    """Skipped steps since the last update: trainer.max_consecutive_skips of them end the run."""
    train_loss: float | None = None
    """The mean train loss of the latest epoch's steps (metrics.json's train/loss)."""
    best_metric: float | None = None
    patience_best: float | None = None
    """Early stopping: the metric the latest improvement by more than `min_delta` reached..."""
    stale_validations: int = 0
    """...and the validations since then."""
    stopped_early: str = ""
    """Why early stopping ended the run ("": it did not); a resumed run that stopped early does not train on."""

    @classmethod
    def of(cls, checkpoint: dict[str, Any]) -> "TrainState":
        """The state a checkpoint holds; fields it lacks (an older format's) take their defaults."""
        return cls(**{field.name: checkpoint.get(field.name, field.default) for field in fields(cls)})

    def next_epoch(self) -> None:
        self.epoch, self.epoch_step, self.epoch_samples, self.epoch_loss_sum, self.epoch_skipped = (
            self.epoch + 1,
            0,
            0,
            0.0,
            0,
        )

    def start_own_best(self) -> None:
        """The best metric and early stopping's count start over: they belonged to another run or another metric."""
        self.best_metric, self.patience_best, self.stale_validations, self.stopped_early = None, None, 0, ""


def save_atomic(obj: Any, path: Path, consequence: str = "") -> None:
    """Written beside `path`, fsync'ed, then renamed (hydraloop.storage): a crash or a full disk mid-write never
    leaves a truncated checkpoint, and a failed write raises StorageError naming `path` and the cause."""
    # A file object, not a path: torch then writes through Python, whose OSError (with its errno) is kept.
    write_atomic(path, lambda file: torch.save(obj, file), consequence)


def step_checkpoint(directory: Path, step: int) -> Path:
    """`step-00000120.pt`: the checkpoint written after optimizer step 120 (zero-padded, so `ls` lists them in
    order)."""
    return directory / f"step-{step:08d}.pt"


def step_checkpoints(directory: Path) -> dict[int, Path]:
    """The step-named checkpoints in `directory`, by step."""
    found = {}
    for path in directory.glob("step-*.pt"):
        digits = path.name.removeprefix("step-").removesuffix(".pt")
        if digits.isdigit():
            found[int(digits)] = path
    return found


def load_checkpoint(path: str | Path, source: str | None = None, lazy: bool = False) -> dict[str, Any]:
    """To the CPU, whatever device wrote it: loading into the model and optimizer copies to their devices, and
    leaves the optimizer's `step` counters on the CPU, where a non-fused optimizer keeps them (on the GPU, AdamW's
    foreach path would read each back to the host, twice per parameter per step). `source`: where the path came
    from, for the one line that refuses it (default: `ckpt_path=...`). `lazy`: a sharded checkpoint's tensors stay
    on disk, as `Shards` that the strategy loads (hydraloop.sharded_checkpoint); a file is memory-mapped anyway."""
    source = source or f"ckpt_path={path}"
    if not Path(path).exists():
        raise ConfigError(f"{source}: no such file")
    if Path(path).is_dir():
        return sharded_checkpoint.read(Path(path), source, lazy)
    if not Path(path).is_file():
        raise ConfigError(f"{source}: not a file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a truncated file, another format, a pickle with arbitrary objects
        raise ConfigError(f"{source}: not a readable checkpoint ({type(error).__name__})") from None
    missing = [key for key in REQUIRED_KEYS if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise ConfigError(f"{source}: not a hydraloop checkpoint (missing {', '.join(missing)})")
    return checkpoint


def checkpoint_state(
    model_state: dict[str, Any],
    optimizer_states: dict[str, dict[str, Any]],
    schedulers: dict[str, LambdaLR],
    precision: Precision,
    state: TrainState,
    metrics: dict[str, float],
    config: dict[str, Any],
    device: torch.device,
    callbacks: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint holds (see the module docstring). The model's and optimizer's state come from the
    strategy (`SingleDevice.state_dicts`): those of a plain model and optimizer, under every strategy, copied to the
    CPU so that a machine without this GPU (or without any) can open the file."""
    return {
        "model": on_cpu(model_state),
        "optimizer": by_name(on_cpu(optimizer_states)),
        "scheduler": by_name({name: scheduler.state_dict() for name, scheduler in schedulers.items()}),
        **asdict(state),
        "grad_scaler": precision.state_dict(),
        "metrics": metrics,
        "rng": rng_state(device),
        "config": config,
        "callbacks": on_cpu(callbacks or {}),
    }


def by_name(states: dict[str, Any]) -> Any:
    """How a checkpoint holds a state per optimizer: one optimizer's (named "") as it is, a plain optimizer's
    state_dict; several by name."""
    return states[""] if list(states) == [""] else states


def of_each(saved: Any, names: list[str]) -> dict[str, Any]:
    """`by_name`'s inverse, for the optimizers `names`: a checkpoint's state per optimizer, by name."""
    return {"": saved} if names == [""] else {name: saved[name] for name in names}


def on_cpu(tree: Any) -> Any:
    """`tree` (dicts, lists, tuples) with every tensor copied to the CPU; CPU tensors are kept as they are."""
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {key: on_cpu(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(on_cpu(value) for value in tree)
    return tree


def rng_state(device: torch.device) -> dict[str, Any]:
    """The generators' states; for CUDA only this rank's GPU's, so that a checkpoint from an 8-GPU node resumes on a
    machine with one (every rank reseeds its GPU's generator before each step anyway: hydraloop.seeding)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        # numpy's state holds an ndarray, which weights_only loading refuses; store it as a tensor.
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": np_pos,
            "has_gauss": np_has_gauss,
            "gauss": np_gauss,
        },
        "python": random.getstate(),
    }


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    # A checkpoint from the CPU has none; one from before this format, a list of every GPU's: both are skipped.
    if device.type == "cuda" and isinstance(state.get("cuda"), torch.Tensor):
        torch.cuda.set_rng_state(state["cuda"], device)
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["name"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["gauss"],
        )
    )
    random.setstate(state["python"])
