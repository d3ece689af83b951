"""Checkpoints: one dict of CPU tensors, loadable with torch.load(weights_only=True) on any machine, written
atomically.

Keys: model (state_dict of the unwrapped model), optimizer, scheduler, the fields of TrainState (epoch: completed
epochs, global_step, best_metric, skipped_steps, and epoch_step, epoch_loss_sum, epoch_skipped: progress into an
unfinished epoch, for a checkpoint a stop signal asked for), grad_scaler (fp16 loss scale), metrics (the validation
metrics when saved; empty mid-epoch), rng (torch, cuda: the saving rank's own GPU's or None, numpy, python) and
config (resolved).
"""

import logging
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from hydraloop.errors import ConfigError
from hydraloop.parallel.single import SingleDevice
from hydraloop.precision import Precision
from hydraloop.schedulers import apply_current_step
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
    epoch_loss_sum: float = 0.0
    """Sum of those steps' global train losses, so the resumed epoch reports the uninterrupted epoch's mean."""
    epoch_skipped: int = 0
    """Steps of the unfinished epoch whose update was skipped for a non-finite loss (not in epoch_loss_sum)."""
    skipped_steps: int = 0
    """Skipped steps over the whole run (trainer.nonfinite_loss=skip)."""
    best_metric: float | None = None
    patience_best: float | None = None
    """Early stopping: the metric the latest improvement by more than `min_delta` reached..."""
    stale_validations: int = 0
    """...and the validations since then."""
    stopped_early: str = ""
    """Why early stopping ended the run ("": it did not); a resumed run that stopped early does not train on."""

    def next_epoch(self) -> None:
        self.epoch, self.epoch_step, self.epoch_loss_sum, self.epoch_skipped = self.epoch + 1, 0, 0.0, 0


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


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """To the CPU, whatever device wrote it: loading into the model and optimizer copies to their devices, and
    leaves the optimizer's `step` counters on the CPU, where a non-fused optimizer keeps them (on the GPU, AdamW's
    foreach path would read each back to the host, twice per parameter per step)."""
    if not Path(path).exists():
        raise ConfigError(f"ckpt_path={path}: no such file")
    if not Path(path).is_file():
        raise ConfigError(f"ckpt_path={path}: not a file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a truncated file, another format, a pickle with arbitrary objects
        raise ConfigError(f"ckpt_path={path}: not a readable checkpoint ({type(error).__name__})") from None
    missing = [key for key in REQUIRED_KEYS if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise ConfigError(f"ckpt_path={path}: not a hydraloop checkpoint (missing {', '.join(missing)})")
    return checkpoint


def checkpoint_to_resume(cfg: Any, report: bool = False) -> str | None:
    """The checkpoint a run starts from: with `resume=true`, this run directory's own last.pt if it has one (a
    restarted or requeued job, or the same command rerun into the same directory: it continues where it stopped),
    else `ckpt_path` (null: from scratch).

    A last.pt that cannot be read (truncated, empty) gives way to the newest readable step-named checkpoint beside
    it, with one warning line if `report` (the process that owns the run directory; every rank looks for itself).
    """
    directory = Path(cfg.output_dir) / "checkpoints"
    own = [directory / "last.pt", *(path for _, path in sorted(step_checkpoints(directory).items(), reverse=True))]
    own = [path for path in own if path.is_file()] if cfg.resume and cfg.mode == "train" else []
    unreadable = []
    for path in own:
        try:
            load_checkpoint(path)
        except ConfigError:
            unreadable.append(path.name)
            continue
        if unreadable and report:
            log.warning(
                "resume=true: %s cannot be read (truncated, or not a checkpoint): continuing from %s, the newest "
                "readable checkpoint in %s",
                ", ".join(unreadable),
                path.name,
                directory,
            )
        return str(path)
    # None readable: last.pt is the one to report (check_resumable says it cannot be read), if there is one.
    return str(own[0]) if own else cfg.ckpt_path


def check_resumable(path: str | Path, cfg: Any) -> None:
    """Fail before any process starts if the checkpoint does not fit the configured model (and, to resume
    training, optimizer).

    The model is built on the meta device: shapes only, no memory, no initialisation cost.
    """
    checkpoint = load_checkpoint(path)
    # The run directory's own last.pt (resume=true) was not named by the user: say where it came from.
    own = path != cfg.ckpt_path
    source = f"resume=true: {path}" if own else f"ckpt_path={path}"
    hint = " (resume=false starts the run directory over)" if own else ""
    saved_optimizer = checkpoint.get("config", {}).get("optimizer", {}).get("_target_")
    if cfg.mode == "train" and saved_optimizer and saved_optimizer != cfg.optimizer._target_:
        raise ConfigError(
            f"{source}: holds {saved_optimizer} state, the config asks for {cfg.optimizer._target_}{hint}"
        )
    saved_vocab = checkpoint.get("config", {}).get("data", {}).get("vocab")
    if saved_vocab is not None and cfg.data.get("vocab") != saved_vocab:
        raise ConfigError(
            f"{source}: was trained on another vocabulary ({len(saved_vocab)} characters) than data.vocab, read from "
            f"data.dataset.path={cfg.data.dataset.get('path')} ({len(cfg.data.get('vocab') or '')}): the token ids "
            f"would mean other characters{hint}"
        )
    done, max_steps = checkpoint["global_step"], cfg.trainer.max_steps
    if cfg.mode == "train" and max_steps is not None and max_steps < done:
        raise ConfigError(f"trainer.max_steps={max_steps}: below the {done} steps already done ({source}){hint}")
    model_cfg = cfg.model
    saved = {name: tuple(tensor.shape) for name, tensor in checkpoint["model"].items()}
    with torch.device("meta"):
        model = instantiate(model_cfg)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    problems = [f"missing {name}" for name in expected.keys() - saved.keys()]
    problems += [f"unexpected {name}" for name in saved.keys() - expected.keys()]
    problems += [
        f"{name} has shape {list(saved[name])}, model needs {list(shape)}"
        for name, shape in expected.items()
        if name in saved and saved[name] != shape
    ]
    if problems:
        shown = "; ".join(sorted(problems)[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ConfigError(f"{source}: does not fit model {model_cfg._target_} ({shown}){hint}")


def checkpoint_state(
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    scheduler: LambdaLR,
    precision: Precision,
    state: TrainState,
    metrics: dict[str, float],
    config: dict[str, Any],
    device: torch.device,
) -> dict[str, Any]:
    """What a checkpoint holds (see the module docstring). The model's and optimizer's state come from the
    strategy (`SingleDevice.state_dicts`): those of a plain model and optimizer, under every strategy, copied to the
    CPU so that a machine without this GPU (or without any) can open the file."""
    return {
        "model": on_cpu(model_state),
        "optimizer": on_cpu(optimizer_state),
        "scheduler": scheduler.state_dict(),
        **asdict(state),
        "grad_scaler": precision.state_dict(),
        "metrics": metrics,
        "rng": rng_state(device),
        "config": config,
    }


def resume(
    path: str | Path,
    strategy: SingleDevice,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LambdaLR,
    precision: Precision,
    model_only: bool = False,
) -> TrainState:
    """Loads everything a checkpoint holds into the (wrapped) model and the training objects; with
    `model_only` (evaluation), the weights alone. Every rank reads the file."""
    checkpoint = load_checkpoint(path)
    strategy.load_model_state(model, checkpoint["model"])
    state = TrainState(**{field.name: checkpoint.get(field.name, field.default) for field in fields(TrainState)})
    if model_only:
        return state
    strategy.load_optimizer_state(model, optimizer, checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    apply_current_step(scheduler)
    precision.load_state_dict(checkpoint.get("grad_scaler", {}))
    restore_rng_state(checkpoint["rng"], strategy.device)
    return state


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
