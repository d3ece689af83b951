"""Metric loggers: the `logger` config group. Each option is one logger under its own name (`logger.wandb.project`),
so Hydra's list syntax picks several at once: `logger=[tensorboard,csv,wandb]`.

Only rank 0 builds loggers; every other rank gets NullRunWriter. Optional loggers import their package only when
chosen, and say which extra installs it when it is missing.
"""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate

from hydraloop.errors import ConfigError, unwrap_instantiation
from hydraloop.loggers.base import JobInfo, LoggerGroup, NullLogger, RunInfo
from hydraloop.loggers.tensorboard import TensorBoardLogger

__all__ = ["JobInfo", "LoggerGroup", "NullLogger", "RunInfo", "TensorBoardLogger", "build_logger"]


def build_logger(loggers: Any) -> NullLogger:
    """The `logger` node ({name: logger config}) as one logger. Builds nothing that writes: `start` does that.

    A logger's ConfigError names its setting relative to its own node; the message gets the node's key in front.
    """
    loggers = loggers or {}
    if "_target_" in loggers:  # one logger's own node, not yet under its name
        loggers = {"": loggers}
    built = []
    for name, node in loggers.items():
        try:
            built.append(instantiate(node))
        except Exception as error:
            cause = unwrap_instantiation(error)
            if isinstance(cause, ConfigError):
                raise ConfigError(f"logger{'.' if name else ''}{name}{cause}") from None
            raise
    return built[0] if len(built) == 1 else LoggerGroup(built)
