"""What the schema's types cannot say, checked in the launcher before any rank starts: ranges, how the global batch
splits over the ranks, k-fold settings, the task's fit to data and model, the data sets themselves, required values,
and the command line's group options; `check_launch` runs them all, with the checks of every node built with
`instantiate` (hydraloop.arguments). A failed check is a ConfigError: one line naming the key and the value, exit 2.
"""

import contextlib
import dataclasses
import difflib
import inspect
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset, default_collate

from hydraloop.activation_checkpointing import checkpointed_classes
from hydraloop.arguments import check_arguments, check_model, check_optimization, raise_refusal, shown
from hydraloop.batches import check_leaves, count_rows
from hydraloop.callbacks import build_callbacks, reported_metrics
from hydraloop.errors import ConfigError, require, unwrap_instantiation
from hydraloop.keyed_dropout import has_plain_dropout
from hydraloop.metrics import MetricSet
from hydraloop.optim import check_optimizers, config_key, optimizer_nodes, schedule_node
from hydraloop.trial import try_batch

PRECISIONS = ("32", "bf16", "fp16")
log = logging.getLogger(__name__)


def check_launch(cfg: Any, strategy: Any) -> Any:
    """Everything the launcher checks of a job's resolved config before any rank starts, but the run directory and
    the checkpoint to resume (which src/train.py checks once it owns the directory). Returns the task."""
    from hydraloop.loggers import build_logger
    from hydraloop.predict import load_inputs

    check_config(cfg, strategy.world_size)
    check_arguments(cfg)
    apply_token_budget(cfg)
    # Before the task's checks: an image folder that is missing explains its 0 classes. Its check gives a sample.
    checked_sample = _built(cfg, "data.check") if cfg.data.check else None
    task = instantiate(cfg.task)
    check_task(cfg, task, build_callbacks(cfg.callbacks))
    train_samples = None if cfg.data.check else check_data(cfg, task)
    if checked_sample is not None:  # the trial batch of a data set too costly to build here
        _check_batch(cfg, task, default_collate([checked_sample, checked_sample]), "data.check")
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
            " masks under every split (model=hf: model.keyed_dropout=true)",
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


def check_data(cfg: Any, task: Any) -> int:
    """The data sets as the ranks will get them: built here (milliseconds for the in-memory ones), so that what their
    constructors refuse (a file's contents, a split, a text shorter than a sample) and what does not fit the batch or
    the task is one line before any rank starts. A data set too costly to build twice gives `data.check` instead, a
    cheaper check of its own (an image folder's: its layout, and one image through both transform lists). Returns
    the training set's size."""
    from hydraloop.data.loaders import check_sizes

    train_set, val_set = _built(cfg, "data.dataset")
    check_sizes(train_set, val_set, cfg.data.batch_size, cfg.data.drop_last)
    where = f"data.dataset._target_={cfg.data.dataset._target_}"
    collate = getattr(train_set, "collate_fn", default_collate)  # a data set's own (data=hf pads its token rows)
    _check_batch(cfg, task, collate([train_set[index] for index in range(min(2, len(train_set)))]), where)
    task.check_sample(train_set[0], where)
    if isinstance(train_set, TensorDataset):  # every label at once, in memory: a range the trial rows cannot show
        task.check_all_targets(train_set.tensors[-1], where)
    return len(train_set)


def planned_schedule(cfg: Any, train_samples: int) -> tuple[int, int]:
    """(total steps, steps per epoch) of the schedule the ranks will plan for a training set of `train_samples`, in
    their own terms (hydraloop.trainer.schedule_plan): a warm-up in epochs is checked against the run here, before
    the run directory is touched, as one in steps is."""
    from hydraloop.checkpoint import TrainState
    from hydraloop.data.loaders import GlobalBatchSampler
    from hydraloop.trainer import schedule_plan

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


def _check_batch(cfg: Any, task: Any, batch: Any, where: str) -> None:
    """A batch of the training set's first samples: tensors that agree on their rows, which the model, the task and
    every configured metric can take (hydraloop.trial: on the meta device, else on the CPU where that is cheap)."""
    check_leaves(batch, where)
    try_batch(cfg, task, batch)


def _built(cfg: Any, path: str) -> Any:
    """The node at `path`, built; what its constructor refuses as one line (see arguments.raise_refusal)."""
    node = OmegaConf.select(cfg, path)
    try:
        return instantiate(node)
    except Exception as error:  # noqa: BLE001  bad input is reported, anything else raised
        raise_refusal(path, node, unwrap_instantiation(error))
        raise


def check_config(cfg: Any, world_size: int) -> None:
    """What the schema's types cannot say: ranges, and how the global batch splits over `world_size` ranks."""
    _check_schema_keys(cfg)
    require(cfg.mode in ("train", "eval", "predict"), f"mode={cfg.mode}: must be train, eval or predict")
    purpose = {"eval": "evaluate", "predict": "predict with"}.get(cfg.mode)
    require(cfg.mode == "train" or cfg.ckpt_path, f"mode={cfg.mode}: needs ckpt_path=<checkpoint to {purpose}>")
    require(
        cfg.mode != "predict" or cfg.data.predict_path,
        "mode=predict: needs data.predict_path=<.npz or .pt file holding x, the inputs>",
    )
    require(
        cfg.mode != "train" or cfg.ckpt_weights == "model",
        f"ckpt_weights={cfg.ckpt_weights}: for mode=eval and mode=predict; training resumes the trained weights, "
        "and each callback its own state",
    )
    require(cfg.seed >= 0, f"seed={cfg.seed}: must be non-negative")
    batch_size = cfg.data.batch_size
    require(batch_size > 0, f"data.batch_size={batch_size}: must be positive")
    block_size = cfg.data.get("block_size")
    require(block_size is None or block_size > 0, f"data.block_size={block_size}: must be positive")
    shape = list(cfg.data.input_shape)
    sized_by = " (data.image_size sets the last two)" if "image_size" in cfg.data else ""
    require(all(size > 0 for size in shape), f"data.input_shape={shape}: must be positive sizes{sized_by}")
    require(
        batch_size % world_size == 0,
        f"data.batch_size={batch_size}: not divisible by the world size {world_size} "
        "(it is the global batch, split evenly over the ranks)",
    )
    workers = cfg.data.num_workers
    require(
        workers == "auto" or isinstance(workers, int) and not isinstance(workers, bool) and workers >= 0,
        f"data.num_workers={workers}: must be a number of worker processes (0 or more) or auto",
    )
    val_batch_size = cfg.data.val_batch_size
    require(val_batch_size is None or val_batch_size > 0, f"data.val_batch_size={val_batch_size}: must be positive")
    prefetch = cfg.data.prefetch_factor
    require(prefetch is None or prefetch > 0, f"data.prefetch_factor={prefetch}: must be positive, or null")
    require(cfg.trainer.max_epochs > 0, f"trainer.max_epochs={cfg.trainer.max_epochs}: must be positive")
    for key in (
        "max_steps",
        "val_every_n_steps",
        "ckpt_every_n_steps",
        "peak_tflops",
        "cpu_threads",
        "max_consecutive_skips",
        "early_stopping.patience",
    ):
        value = OmegaConf.select(cfg.trainer, key)
        require(value is None or value > 0, f"trainer.{key}={value}: must be positive, or null")
    replica_check = cfg.trainer.replica_check_every_n_steps
    require(
        replica_check is None or replica_check >= 0,
        f"trainer.replica_check_every_n_steps={replica_check}: must be 0 (off), positive, or null (at checkpoints)",
    )
    min_delta = cfg.trainer.early_stopping.min_delta
    require(min_delta >= 0, f"trainer.early_stopping.min_delta={min_delta}: must be at least 0")
    require(
        not cfg.trainer.eval_best or cfg.trainer.save_checkpoints,
        "trainer.eval_best=true: needs trainer.save_checkpoints=true, for checkpoints/best.pt",
    )
    require(
        cfg.trainer.log_every_n_steps > 0,
        f"trainer.log_every_n_steps={cfg.trainer.log_every_n_steps}: must be positive",
    )
    accum = cfg.trainer.grad_accum_steps
    require(accum > 0, f"trainer.grad_accum_steps={accum}: must be positive")
    require(
        batch_size % (world_size * accum) == 0,
        f"trainer.grad_accum_steps={accum}: data.batch_size={batch_size} does not split into {world_size} rank(s) "
        f"x {accum} equal micro-batches",
    )
    keep = cfg.trainer.keep_last_k
    require(keep >= 1, f"trainer.keep_last_k={keep}: must be at least 1 (the newest checkpoint is one of them)")
    nonfinite = cfg.trainer.nonfinite_loss
    require(nonfinite in ("stop", "skip"), f"trainer.nonfinite_loss={nonfinite}: must be stop or skip")
    precision = str(cfg.trainer.precision)
    require(precision in PRECISIONS, f"trainer.precision={precision}: must be one of {', '.join(PRECISIONS)}")
    for key in ("limit_train_batches", "limit_train_samples", "limit_val_batches"):
        limit = cfg.trainer[key]
        require(limit is None or limit > 0, f"trainer.{key}={limit}: must be positive, or null for no limit")
    samples = cfg.trainer.limit_train_samples
    require(
        samples is None or samples >= batch_size or not cfg.data.drop_last,
        f"trainer.limit_train_samples={samples}: fewer than data.batch_size={batch_size}; with data.drop_last=true "
        "an epoch would have no step (set data.drop_last=false)",
    )
    clip = cfg.trainer.grad_clip_norm
    require(clip is None or clip > 0, f"trainer.grad_clip_norm={clip}: must be positive, or null for no clipping")
    for name, node in optimizer_nodes(cfg.optimizer).items():
        lr = node.get("lr") if OmegaConf.is_dict(node) else None
        require(
            isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < math.inf,
            f"{config_key(name)}.lr={lr}: must be a positive finite number",
        )
    mode = cfg.optimized_metric_mode
    require(mode in ("max", "min"), f"optimized_metric_mode={mode}: must be max or min")
    _check_folds(cfg.data)


def _check_schema_keys(cfg: Any) -> None:
    """Keys added with `+` to a typed node (`+trainer.max_epchs=1`): Hydra takes them, and nothing would read them."""
    from hydraloop.config import DataConfig, EarlyStoppingConfig, TrainConfig, TrainerConfig

    for path, schema in (
        ("", TrainConfig),
        ("trainer", TrainerConfig),
        ("trainer.early_stopping", EarlyStoppingConfig),
        ("data", DataConfig),
    ):
        node = OmegaConf.select(cfg, path) if path else cfg
        fields = [field.name for field in dataclasses.fields(schema)]
        for key in node if OmegaConf.is_dict(node) else ():
            if key not in fields:
                close = difflib.get_close_matches(str(key), fields, n=1)
                where = path or "the config"
                raise ConfigError(
                    f"{path + '.' if path else ''}{key}={shown(node[key])}: {where} has no key {key!r}"
                    + (f"; did you mean {close[0]}?" if close else "")
                )


def _check_folds(data: Any) -> None:
    num_folds, fold = data.num_folds, data.fold
    if num_folds is None:
        require(fold == 0, f"data.fold={fold}: needs data.num_folds (k-fold cross-validation)")
        return
    require(num_folds >= 2, f"data.num_folds={num_folds}: must be at least 2, or null for no k-fold")
    require(0 <= fold < num_folds, f"data.fold={fold}: must be in [0, data.num_folds={num_folds})")
    require(
        "num_folds" in data.dataset,
        f"data.num_folds={num_folds}: the data set {data.dataset.get('_target_')} takes no num_folds "
        "(see hydraloop.data.folds for how the in-memory data sets do k-fold)",
    )


def check_task(cfg: Any, task: Any, callbacks: dict) -> None:
    """The task fits the data and model, and it or a callback reports `optimized_metric`."""
    task.check(cfg)
    _check_optimizer_steps(cfg, task)
    task.extra_metrics = MetricSet(cfg.metrics, torch.device("cpu"))  # each one built: bad input is found here
    own = task.reported_metrics()
    for name in task.extra_metrics.names if task.extra_metrics else []:
        require(
            name not in own,
            f"metrics.{name.removeprefix('val/')}: {name} is the task's own metric, which it would overwrite (the "
            f"task reports {', '.join(own)}); give it another name",
        )
    metric, reported = cfg.optimized_metric, reported_metrics(task.all_metrics(), callbacks)
    require(metric in reported, f"optimized_metric={metric}: the task reports {', '.join(reported)}")


STEPS_ORDERED = 1000  # the steps whose order the launcher asks the task for: an optimizer it never names is bad input


def _check_optimizer_steps(cfg: Any, task: Any) -> None:
    """Several optimizers need a task with a loss per optimizer, that steps each of them (and no other); one optimizer
    a task whose loss needs no optimizer's name."""
    names = [name for name in optimizer_nodes(cfg.optimizer) if name]
    takes = inspect.signature(task.training_loss).parameters.get("optimizer")
    where = f"task._target_={cfg.task._target_}"
    if not names:
        require(
            takes is None or takes.default is not inspect.Parameter.empty,
            f"{where}: its training_loss takes a loss per optimizer (optimizer=...), and the optimizer node is one "
            "optimizer: give several by name, as optimizer=gan does (docs/optimizers-and-callbacks.md)",
        )
        return
    require(
        takes is not None,
        f"optimizer: {' and '.join(f'optimizer.{name}' for name in names)} each need a loss of their own, and "
        f"{where} has one: its training_loss takes no optimizer argument (docs/optimizers-and-callbacks.md)",
    )
    stepped: set[str] = set()
    for step in range(STEPS_ORDERED):
        stepped.update(task.optimizer_steps(step, list(names)))
    unknown = sorted(stepped - set(names))
    require(
        not unknown,
        f"{where}: its optimizer_steps names {', '.join(map(repr, unknown))}, which the optimizer node does not have "
        f"(it has {', '.join(names)})",
    )
    never = [name for name in names if name not in stepped]
    require(
        not never,
        f"optimizer.{never[0] if never else ''}: {where} never steps it in its first {STEPS_ORDERED} steps (its "
        f"optimizer_steps names {', '.join(sorted(stepped))}), so it would train nothing",
    )


def check_required(cfg: Any) -> None:
    """`???` in a yaml marks a value the user must give, e.g. data=tensors's data.dataset.path."""
    missing = list(_missing_paths(OmegaConf.to_container(cfg, resolve=False)))  # interpolations stay text
    if missing:
        raise ConfigError(f"{', '.join(missing)}: required; set it on the command line, e.g. {missing[0]}=...")


def _missing_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, (dict, list)):
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            yield from _missing_paths(value, f"{prefix}{key}.")
    elif node == "???":
        yield prefix.rstrip(".")


def check_group_options(args: list[str], conf_dir: Path) -> None:
    """`logger=foo` or `-m optimizer=adamw,sgdd`: an option that is neither a file of its group in `conf_dir` nor
    registered in Hydra's ConfigStore is one line listing the group's options, exit 2. Run on the command line's
    overrides before Hydra composes, whose own error for it spans several lines and exits 1. Hydra's groups
    (hydra/...) and a command line that adds config folders (--config-dir, hydra.searchpath) are left to Hydra, as
    is anything Hydra's parser rejects."""
    overrides = [arg for arg in args if "=" in arg and not arg.startswith("-")]
    if any(arg.startswith(("-cd", "--config-dir")) for arg in args) or any("searchpath" in o for o in overrides):
        return
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return
    for override in parsed:
        group = conf_dir / override.key_or_group
        if override.is_delete() or override.key_or_group.startswith("hydra") or not group.is_dir():
            continue
        options = sorted(_group_options(group, override.key_or_group))
        for option in _option_names(override.value()):
            require(
                option in options,
                f"{override.input_line}: {option!r} is not an option of {override.key_or_group} ({', '.join(options)})",
            )


def _group_options(folder: Path, group: str) -> set[str]:
    """The group's yaml files, and the options registered in Python (Hydra's ConfigStore)."""
    options = {str(path.relative_to(folder).with_suffix("")) for path in folder.rglob("*.yaml")}
    with contextlib.suppress(OSError):  # OSError: none registered
        options |= {name.removesuffix(".yaml") for name in ConfigStore.instance().list(group)}
    return options


def _option_names(value: Any) -> Iterator[str]:
    """The options an override's value names: one, a list (`logger=[csv,wandb]`) or a choice sweep (`a,b`)."""
    if isinstance(value, ChoiceSweep):
        value = value.list
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _option_names(item)
    elif isinstance(value, str):  # null, numbers, globs and ranges: not option names, left to Hydra
        yield value
