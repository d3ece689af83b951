"""A job's checks in the launcher, before any rank starts: `check_launch` runs them all on its resolved config (the
command line's came first: hydraloop.checks.command_line): its keys and values (hydraloop.checks.config_values), the
nodes built with `instantiate` (hydraloop.arguments), the data sets and the task (hydraloop.checks.data_and_task), the
model and its optimizers, the schedule as the ranks will plan it, the strategy's launch and the loggers' settings. A
failed check is a ConfigError: one line naming the key and the value, exit 2.
"""

import logging
import math
from typing import Any

import torch
from hydra.utils import instantiate
from torch.utils.data import default_collate

from hydraloop.activation_checkpointing import checkpointed_classes
from hydraloop.arguments import check_arguments, check_model, check_optimization
from hydraloop.backends import one_thread
from hydraloop.batches import count_rows
from hydraloop.callbacks import build_callbacks
from hydraloop.checks.config_values import check_config
from hydraloop.checks.data_and_task import built, check_batch, check_data, check_task
from hydraloop.errors import require
from hydraloop.keyed_dropout import has_plain_dropout
from hydraloop.optim import check_optimizers, config_key, optimizer_nodes, schedule_node

log = logging.getLogger(__name__)


@one_thread()
def check_launch(cfg: Any, strategy: Any) -> Any:
    """Everything the launcher checks of a job's resolved config before any rank starts, but the run directory and
    the checkpoint to resume (which src/train.py checks once it owns the directory). Returns the task."""
    from hydraloop.loggers import build_logger
    from hydraloop.predict import load_inputs

    check_config(cfg, strategy.world_size)
    check_arguments(cfg)
    apply_token_budget(cfg)
    # Before the task's checks: an image folder that is missing explains its 0 classes. Its check gives a sample.
    checked_sample = built(cfg, "data.check") if cfg.data.check else None
    task = built(cfg, "task")
    check_task(cfg, task, build_callbacks(cfg.callbacks), strategy.world_size)
    train_samples = None if cfg.data.check else check_data(cfg, task)
    if checked_sample is not None:  # the trial batch of a data set too costly to build here
        check_batch(cfg, task, default_collate([checked_sample, checked_sample]), "data.check")
    model = check_model(cfg.model)
    if cfg.mode == "train" and model is not None:
        checkpointed_classes(cfg.trainer.activation_checkpointing, model)
        check_optimizers(cfg.optimizer, model)
        warn_plain_dropout(model, strategy.world_size, cfg.trainer.grad_accum_steps)
    plan = planned_schedule(cfg, train_samples) if train_samples else None
    for name, node in optimizer_nodes(cfg.optimizer).items():
        check_optimization(node, schedule_node(node, cfg.scheduler), cfg.trainer.max_steps, config_key(name), plan)
    if cfg.mode == "predict":  # the file fits the model, and gives every rank an input
        inputs = load_inputs(cfg.data.predict_path, cfg.data.input_shape, tokens=task.tokens_per_sample is not None)
        require(
            count_rows(inputs) >= strategy.world_size,
            f"data.predict_path={cfg.data.predict_path}: {count_rows(inputs)} input(s), fewer than the "
            f"{strategy.world_size} ranks; predict them with fewer ranks (parallel=single)",
        )
    strategy.check(cfg)
    build_logger(cfg.logger)  # its settings and package; writes nothing yet
    return task


def warn_plain_dropout(model: torch.nn.Module, world_size: int, grad_accum_steps: int) -> None:
    """One line when the batch is split (ranks, micro-batches) and the model's dropout draws from torch's generator:
    its masks then depend on the split, and this run will not equal the same run on one process in one batch."""
    if (world_size > 1 or grad_accum_steps > 1) and has_plain_dropout(model):
        log.warning(
            "the model has nn.Dropout, whose masks depend on how the batch is split (%d rank(s), grad_accum_steps=%d):"
            " this run will not equal single-process training; hydraloop.keyed_dropout.KeyedDropout draws the same"
            " masks under every split (model=hf and model=timm: model.keyed_dropout=true)",
            world_size,
            grad_accum_steps,
        )


def apply_token_budget(cfg: Any) -> None:
    """`trainer.max_tokens`: sets `trainer.max_steps` (in the config every rank gets and every checkpoint keeps) to
    the optimizer steps of `data.batch_size` samples of the task's tokens that reach it, and says so."""
    tokens = cfg.trainer.max_tokens
    if tokens is None:
        return
    require(
        cfg.trainer.max_steps is None,
        f"trainer.max_tokens={tokens}, trainer.max_steps={cfg.trainer.max_steps}: give one or the other",
    )
    per_sample = instantiate(cfg.task).tokens_per_sample
    require(
        isinstance(tokens, int) and tokens > 0 and per_sample,
        f"trainer.max_tokens={tokens}: a positive number of tokens, for a task that counts them (task=language_model)",
    )
    per_step = cfg.data.batch_size * per_sample
    cfg.trainer.max_steps = math.ceil(tokens / per_step)
    log.info(
        "trainer.max_tokens=%d: %d steps of %d tokens (%d x %d)",
        tokens,
        cfg.trainer.max_steps,
        per_step,
        cfg.data.batch_size,
        per_sample,
    )


def planned_schedule(cfg: Any, train_samples: int) -> tuple[int, int]:
    """(total steps, steps per epoch) of the schedule the ranks will plan for a training set of `train_samples`, in
    their own terms (hydraloop.loop_state.schedule_plan): a warm-up in epochs is checked against the run here, before
    the run directory is touched, as one in steps is."""
    from hydraloop.checkpoint import TrainState
    from hydraloop.data.samplers import GlobalBatchSampler
    from hydraloop.loop_state import schedule_plan

    sampler = GlobalBatchSampler(
        train_samples,
        cfg.data.batch_size,
        rank=0,
        world_size=1,  # an epoch's global batches are the same under every world size
        seed=cfg.seed,
        drop_last=cfg.data.drop_last,
        limit_batches=cfg.trainer.limit_train_batches,
        limit_samples=cfg.trainer.limit_train_samples,
    )
    total_steps = schedule_plan(cfg.trainer.max_steps, cfg.trainer.max_epochs, TrainState(), sampler)[1]
    return total_steps, sampler.steps_per_epoch
