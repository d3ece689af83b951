"""The resolvers the yaml files use (`${name:...}`), registered by `register_resolvers`. The config is resolved
once, in the launcher: the ranks get plain values."""

import functools
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from hydra.utils import get_class
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from hydraloop.errors import ConfigError


def image_folder_classes(root: str) -> int:
    """`${image_folder_classes:${data.dataset.root}}`: data=image_folder's num_classes, the class folders in
    root/train (0 if there is none: the data set's launcher check then says what is wrong)."""
    from hydraloop.data.image_folder import count_class_folders  # imports no torchvision

    return count_class_folders(root)


def linear_scaling(base_lr: float, base_batch_size: int, global_batch_size: int) -> float:
    """`${linear_scaling:0.1,256,${data.batch_size}}`: the linear scaling rule (Goyal et al. 2017), `base_lr` per
    `base_batch_size` samples, scaled to the global batch."""
    return base_lr * global_batch_size / base_batch_size


def resize_for_center_crop(crop_size: int) -> int:
    """`${resize_for_center_crop:224}`: the shorter side to resize to before a centre crop, 256 for 224 as in
    ImageNet recipes (the crop keeps 87.5%)."""
    return round(crop_size * 256 / 224)


def shared_run_path() -> str:
    """The run folder's path under outputs/, `DATE/TIME`, the same in every process of one job.

    Started by plain `python`, only the launching process runs Hydra: the time is enough. Under torchrun every
    rank runs Hydra itself, and `${now:...}` would differ between ranks (and nodes) that start in different
    seconds, so the ranks agree through the elastic agent's key-value store: the first rank to ask sets the name,
    the others read it. The store outlives worker restarts (`--max-restarts`), so a restarted job finds its own
    folder again. Tasks that SLURM starts directly share the job id.
    """
    name = time.strftime("%Y-%m-%d/%H-%M-%S")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        from torch.distributed import TCPStore  # only here: importing torch.distributed costs start-up time

        store = TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(minutes=5)
        )
        return store.compare_set("hydraloop/run_name", "", name).decode()
    if os.environ.get("SLURM_JOB_ID"):
        return time.strftime(f"%Y-%m-%d/slurm-{os.environ['SLURM_JOB_ID']}")
    return name


class ResolverConfigError(InterpolationResolutionError, ConfigError):
    """A ConfigError raised by a resolver. OmegaConf passes its own errors through as they are, where it would wrap
    any other in a message of several lines and drop the cause: so this one still ends the run as one line."""

    _initialized = True  # tells OmegaConf's error formatting that the message is complete


def _reporting_config_errors(resolver: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(resolver)
    def resolve(*args: Any) -> Any:
        try:
            return resolver(*args)
        except ConfigError as error:
            raise ResolverConfigError(str(error)) from None

    return resolve


def metric_mode(task: str, metric: str, extra: Any = None) -> str:
    """The better direction of a task's metric, of one of the `metrics` node's (`extra`), or of a callback's version
    of one: val/ema/loss is val/loss measured with callbacks.ema's weights. An unknown metric gets a placeholder
    here: check_task names the valid ones."""
    from hydraloop.metrics import metric_direction

    direction = metric_direction(extra, metric)
    if direction is not None:
        return direction
    metrics = get_class(task).metrics
    split, name = metric.split("/"), metric
    if metric not in metrics and len(split) == 3:
        name = f"{split[0]}/{split[2]}"
    return metrics.get(name, "max")


def register_resolvers() -> None:
    """`${sweep_direction:max}` -> maximize (for sweepers), `${shared_run_path:}`, `${default_metric:<task class>}`,
    `${metric_mode:<task class>,<metric>}`, data=text's `${text_vocab:path,level}` and `${text_vocab_size:vocab}`,
    data=tokens' `${token_meta:dir,key}`, data=hf_lm's `${hf_vocab_size:tokenizer,pad_token}`,
    model=timm's `${timm_data:name,key}`,
    `${image_folder_classes:root}`, `${linear_scaling:0.1,256,${data.batch_size}}` and `${resize_for_center_crop:224}`.
    """
    from hydraloop.data import hf, text, tokens  # here, not at the top: the modules import torch and numpy
    from hydraloop.models import timm_model

    resolvers: dict[str, Callable[..., Any]] = {
        "sweep_direction": lambda mode: {"max": "maximize", "min": "minimize"}[mode],
        "default_metric": lambda task: get_class(task).default_metric,
        "metric_mode": metric_mode,
        "text_vocab": _reporting_config_errors(text.text_vocab),
        "text_vocab_size": _reporting_config_errors(text.vocab_size),
        "token_meta": _reporting_config_errors(tokens.token_meta),
        "hf_vocab_size": _reporting_config_errors(hf.tokenizer_size),
        "timm_data": _reporting_config_errors(timm_model.timm_data),
        "image_folder_classes": image_folder_classes,
        "linear_scaling": linear_scaling,
        "resize_for_center_crop": resize_for_center_crop,
    }
    for name, resolver in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
    if not OmegaConf.has_resolver("shared_run_path"):
        OmegaConf.register_new_resolver("shared_run_path", shared_run_path, use_cache=True)
