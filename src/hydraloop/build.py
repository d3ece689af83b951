"""The run's parts, built in each rank from the resolved config: the data loaders, the model (seeded the same on every
rank; activation checkpointing, channels-last and compilation as the config says; wrapped by the strategy), its
optimizers and schedules, precision, the checkpoint to resume, the callbacks, the run writer (rank 0's; a null one
elsewhere) and the trainer that holds them. src/train.py builds them with `build_run_parts`, then runs the loop.
"""

import logging
from dataclasses import dataclass

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from hydraloop.activation_checkpointing import checkpoint_activations, checkpointed_classes
from hydraloop.callbacks import build_callbacks, reported_metrics
from hydraloop.checkpoint import TrainState, load_checkpoint
from hydraloop.data.loaders import TrainLoader, build_loaders
from hydraloop.loggers import JobInfo, build_logger
from hydraloop.loop_state import planned_steps, schedule_plan
from hydraloop.metrics import MetricSet
from hydraloop.optim import build_optimizers, optimizer_nodes, part_modules, schedule_node
from hydraloop.parallel.single import SingleDevice
from hydraloop.perf import Throughput, flops_per_sample, peak_flops
from hydraloop.precision import Precision
from hydraloop.preemption import StopRequest
from hydraloop.restore import load_weights, restore, train_state
from hydraloop.resume import checkpoint_to_resume, is_own
from hydraloop.run_writer import NullRunWriter, RunWriter
from hydraloop.seeding import seeded_build
from hydraloop.tasks.base import Task
from hydraloop.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass
class RunParts:
    """What the loop runs with: the trainer (which holds the model, optimizers, schedules, precision, callbacks and
    writer), the loaders, and where the run starts."""

    trainer: Trainer
    model: nn.Module  # as the strategy wrapped it
    train_loader: TrainLoader
    val_loader: DataLoader
    state: TrainState  # the checkpoint's, on a resume; a new one otherwise
    writer: RunWriter | NullRunWriter
    stop_request: StopRequest
    num_params: int  # before a strategy shards the model
    trainable_params: int


def build_run_parts(cfg: DictConfig, strategy: SingleDevice, job: JobInfo, task: Task) -> RunParts:
    """Builds data, model, optimizers, the checkpoint's state and the run writer from the config, for mode=train or
    mode=eval, on this rank."""
    task.extra_metrics = MetricSet(cfg.metrics, strategy.device)
    train_set, val_set = seeded_build(cfg.data.dataset, cfg.seed)
    task.check_sample(train_set[0], f"data.dataset._target_={cfg.data.dataset._target_}")
    train_loader, val_loader = build_loaders(
        train_set,
        val_set,
        global_batch_size=cfg.data.batch_size,
        global_val_batch_size=cfg.data.val_batch_size or cfg.data.batch_size,
        rank=strategy.rank,
        world_size=strategy.world_size,
        seed=cfg.seed,
        num_workers=cfg.data.num_workers,
        drop_last=cfg.data.drop_last,
        shuffle=cfg.data.shuffle,
        device=strategy.device,
        on_device=cfg.data.on_device,
        prefetch_factor=cfg.data.prefetch_factor,
        limit_train_batches=cfg.trainer.limit_train_batches,
        limit_train_samples=cfg.trainer.limit_train_samples,
    )

    # Seeded alike on every rank: DDP starts from the weights single-process starts from.
    model = strategy.build(lambda: seeded_build(cfg.model, cfg.seed))
    num_params = sum(p.numel() for p in model.parameters())  # before a strategy shards it
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("model %s: %s parameters (%s trainable)", type(model).__name__, f"{num_params:,}", f"{trainable:,}")
    throughput = Throughput(
        task.tokens_per_sample,
        flops_per_sample(model, task.tokens_per_sample),
        peak_flops(strategy.device, cfg.trainer.peak_tflops),
        gpus=strategy.world_size * len(strategy.devices),
    )
    checkpoint_activations(model, checkpointed_classes(cfg.trainer.activation_checkpointing, model))
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.trainer.compile:
        model.compile()  # in place: no wrapper, so checkpoint keys stay those of the plain model
    model = strategy.wrap(model, part_modules(cfg.optimizer))
    optimizers = build_optimizers(cfg.optimizer, strategy.unwrap(model))
    # Per rank, per start: a restarted rank finds the latest checkpoint. Training loads all of it, evaluation the
    # weights; the state comes first, as the schedule plans the run's steps from where it stands.
    ckpt_path = checkpoint_to_resume(cfg)
    own = bool(ckpt_path) and is_own(ckpt_path, cfg)
    checkpoint = load_checkpoint(ckpt_path, lazy=True) if ckpt_path and cfg.mode == "train" else None
    state = train_state(checkpoint, cfg, own) if checkpoint else TrainState()
    sampler = train_loader.sampler
    total_steps = planned_steps(cfg.trainer.max_steps, cfg.trainer.max_epochs, state, sampler)
    log.info("%d optimizer steps per epoch, %d in all", sampler.steps_per_epoch, total_steps)
    schedule_step, schedule_steps = schedule_plan(cfg.trainer.max_steps, cfg.trainer.max_epochs, state, sampler)
    schedulers = {  # each optimizer's own: from `scheduler`, or from its own node's
        name: instantiate(schedule_node(node, cfg.scheduler))(
            optimizers[name], total_steps=schedule_steps, steps_per_epoch=sampler.steps_per_epoch
        )
        for name, node in optimizer_nodes(cfg.optimizer).items()
    }
    precision = Precision(cfg.trainer.precision, strategy.device)
    if checkpoint:
        restore(checkpoint, strategy, model, optimizers, schedulers, precision, schedule_step)
    elif ckpt_path:
        state = load_weights(ckpt_path, strategy, model, cfg.ckpt_weights)
    if ckpt_path:
        log.info("loaded %s: epoch %d, step %d", ckpt_path, state.epoch, state.global_step)

    config = OmegaConf.to_container(cfg, resolve=True)
    callbacks = build_callbacks(cfg.callbacks) if cfg.mode == "train" else {}
    writer = (
        RunWriter(
            cfg.output_dir,
            build_logger(cfg.logger),
            config,
            save_checkpoints=cfg.trainer.save_checkpoints and cfg.mode == "train",
            profile=cfg.trainer.profile,
            keep_last_k=cfg.trainer.keep_last_k,
            start_step=state.global_step,
            num_params=num_params,
            job=job,
            val_metrics=reported_metrics(task.all_metrics(), callbacks),
        )
        if strategy.is_main_process
        else NullRunWriter()
    )
    stop_request = StopRequest()
    trainer = Trainer(
        strategy,
        writer,
        precision,
        task,
        cfg.trainer,
        model=model,
        optimizers=optimizers,
        schedulers=schedulers,
        throughput=throughput,
        seed=cfg.seed,
        optimized_metric=cfg.optimized_metric,
        optimized_metric_mode=cfg.optimized_metric_mode,
        config=config,
        global_batch_size=cfg.data.batch_size,
        stop_request=stop_request,
        rerun_starts_from=f"{ckpt_path} (step {state.global_step})" if ckpt_path else "scratch",
        validated=checkpoint["metrics"] if own and checkpoint else None,
        callbacks=callbacks,
    )
    if checkpoint:
        trainer.load_callback_states(checkpoint.get("callbacks", {}))
    return RunParts(
        trainer,
        model,
        train_loader,
        val_loader,
        state,
        writer,
        stop_request,
        num_params=num_params,
        trainable_params=trainable,
    )
