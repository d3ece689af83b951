"""What a run takes of the checkpoint it starts from (hydraloop.resume chose it, and checked that it fits): its
TrainState, the weights (the model's, or those a callback saved, such as callbacks.ema's average), and to resume
training the optimizers' state, their schedules, the loss scaler and the generators. The checkpoint's format is
hydraloop.checkpoint's.

Where the checkpoint and the config differ, the config wins: the optimizer's hyper-parameters are the config's; a
mid-epoch position is kept in samples, so another batch size or world size continues at the right sample; the best
metric belongs to the run directory and the metric it was measured by.
"""

import logging
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from hydraloop.checkpoint import TrainState, load_checkpoint, of_each, restore_rng_state
from hydraloop.errors import ConfigError
from hydraloop.optim import config_key
from hydraloop.parallel.single import SingleDevice
from hydraloop.precision import Precision
from hydraloop.schedulers import apply_current_step
from hydraloop.sharded_checkpoint import in_memory

log = logging.getLogger("hydraloop.resume")  # the resume's lines, under one name


def train_state(checkpoint: dict[str, Any], cfg: Any, own: bool) -> TrainState:
    """The TrainState a checkpoint holds, for a run of `cfg`. `own`: the checkpoint is this run directory's.

    The best metric (what best.pt must beat) and early stopping's state belong to the run directory and the metric
    they were measured in: from another directory's checkpoint, or with another `optimized_metric` or direction,
    they start over (said in one line), so that this directory gets a best.pt of its own.
    """
    state = TrainState.of(checkpoint)
    saved = checkpoint.get("config") or {}
    if "epoch_samples" not in checkpoint and state.epoch_step:  # written before positions were kept in samples
        state.epoch_samples = state.epoch_step * saved.get("data", {}).get("batch_size", 0)
    metric = (cfg.optimized_metric, cfg.optimized_metric_mode)
    saved_metric = (saved.get("optimized_metric", metric[0]), saved.get("optimized_metric_mode", metric[1]))
    if state.best_metric is not None and (not own or saved_metric != metric):
        whose = "another run directory's" if not own else f"by {saved_metric[0]} ({saved_metric[1]})"
        log.info(
            "the checkpoint's best (%.6g) is %s: best.pt and early stopping start over in this run directory, by %s "
            "(%s)",
            state.best_metric,
            whose,
            *metric,
        )
        state.start_own_best()
    return state


def load_weights(path: str | Path, strategy: SingleDevice, model: nn.Module, weights: str = "model") -> TrainState:
    """The checkpoint's weights into the (wrapped) model, for evaluation or prediction; its TrainState says whence.
    `weights` (ckpt_weights): model, or a callback that saved weights of its own, such as callbacks.ema's average."""
    checkpoint = load_checkpoint(path, lazy=True)
    state = model_state(checkpoint, weights, f"ckpt_path={path}", shared_names(strategy.unwrap(model)))
    strategy.load_model_state(model, state)
    return TrainState.of(checkpoint)


def model_state(
    checkpoint: dict[str, Any], weights: str, source: str, shared: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """The checkpoint's `model`, or with `weights` naming a callback, its `weights` in place of the trained ones (the
    model's buffers, which an average leaves alone, stay).

    `shared` (`shared_names`): the other names of each parameter that several modules share, such as a causal
    language model's output layer tied to its input embeddings. A callback holds such a parameter once, under its
    first name; its other names take the callback's value too, or the trained value under one of them, loaded into
    the same tensor after it, would make the model a mixture of the two."""
    if weights == "model":
        return checkpoint["model"]
    saved = checkpoint.get("callbacks", {})
    if "weights" not in saved.get(weights, {}):
        held = ", ".join(name for name, state in saved.items() if "weights" in state)
        raise ConfigError(
            f"ckpt_weights={weights}: {source} holds no weights of callbacks.{weights}; it holds model"
            + (f" and {held}" if held else " only (trained without callbacks that average weights)")
        )
    replaced = saved[weights]["weights"]
    aliases = {alias: replaced[name] for name, others in (shared or {}).items() if name in replaced for alias in others}
    return {**in_memory(checkpoint["model"]), **replaced, **aliases}


def shared_names(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter that several modules share (tied weights), by its first name, the one `named_parameters`
    gives it, with its other names."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {first: others for first, *others in names.values() if others}


def restore(
    checkpoint: dict[str, Any],
    strategy: SingleDevice,
    model: nn.Module,
    optimizers: dict[str, Optimizer],
    schedulers: dict[str, LambdaLR],
    precision: Precision,
    schedule_step: int | None = None,
) -> None:
    """Loads a checkpoint's training objects into the (wrapped) model, the optimizers built from this run's config
    (by name: hydraloop.optim), their schedules, the loss scaler and the generators. Every rank reads the file.

    The optimizers' hyper-parameters are this run's config's, not the checkpoint's: a resume with another
    `optimizer.lr` or `weight_decay` trains with it (from the next step; said in one line), as every record of the
    run says. The optimizers' state (moments, momenta) are the checkpoint's, and so are the schedules' positions,
    unless `schedule_step` places them (hydraloop.loop_state.schedule_plan: a run in epochs under another batch size).
    """
    strategy.load_model_state(model, checkpoint["model"])
    names = list(optimizers)
    saved_schedules = of_each(checkpoint["scheduler"], names)
    changed = []
    for name, saved in of_each(checkpoint["optimizer"], names).items():
        optimizer, scheduler = optimizers[name], schedulers[name]
        configured = [
            {key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups
        ]
        strategy.load_optimizer_state(model, optimizer, saved)
        for group, values in zip(optimizer.param_groups, configured):
            for key, value in values.items():
                if key != "lr" and comparable(group.get(key)) != comparable(value):
                    changed.append(
                        f"{config_key(name)}.{'lr' if key == 'initial_lr' else key} {group.get(key)} -> {value}"
                    )
                group[key] = value
        scheduler.load_state_dict(saved_schedules[name])
        if schedule_step is not None:
            scheduler.last_epoch = schedule_step
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]  # the configured lr
        apply_current_step(scheduler)
    if changed:
        log.info(
            "resumed with new hyper-parameters, from step %d on: %s",
            checkpoint["global_step"],
            ", ".join(dict.fromkeys(changed)),  # once, where several groups changed alike
        )
    precision.load_state_dict(checkpoint.get("grad_scaler", {}))
    restore_rng_state(checkpoint["rng"], strategy.device)


def comparable(value: Any) -> Any:
    """`value` in the form a comparison needs: a list or a tuple as a tuple (a config gives lists, a group tuples)."""
    return tuple(value) if isinstance(value, (list, tuple)) else value
