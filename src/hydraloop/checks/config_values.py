"""The composed config's keys and values, checked where the schema's types cannot: values the user must give (`???`),
keys added with `+` that a typed node lacks, ranges, how the global batch splits over the ranks, and k-fold settings.
"""

import dataclasses
import difflib
import math
from collections.abc import Iterator
from typing import Any

from omegaconf import OmegaConf

from hydraloop.arguments import shown
from hydraloop.errors import ConfigError, require
from hydraloop.optim import config_key, optimizer_nodes

PRECISIONS = ("32", "bf16", "fp16")


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
