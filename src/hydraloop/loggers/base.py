"""What every logger is given, and the logger that logs nothing.

A logger is built from its config node on rank 0 only (every other rank gets NullRunWriter, which holds no logger),
and once more in the launching process to check its settings before any rank starts: so its constructor checks and
writes nothing, and `start` creates the run.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydraloop.errors import ConfigError

Scalar = bool | int | float | str


@dataclass(frozen=True)
class JobInfo:
    """Where this job stands in Hydra's run: its command-line overrides, and the multirun it is part of."""

    overrides: tuple[str, ...] = ()
    """The job's own overrides (`hydra.overrides.task`): a sweep's varying keys and the fixed ones."""
    sweep_dir: str | None = None
    """The multirun's folder, shared by all its jobs; None for a single run."""
    job_num: int | None = None

    @staticmethod
    def from_hydra() -> JobInfo:
        """From the running Hydra job; the empty JobInfo outside one (a test calling the task function directly)."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return JobInfo()
        hydra = HydraConfig.get()
        multirun = hydra.mode == RunMode.MULTIRUN
        return JobInfo(
            overrides=tuple(str(item) for item in hydra.overrides.task),
            sweep_dir=str(hydra.sweep.dir) if multirun else None,
            job_num=int(hydra.job.num) if multirun else None,
        )


@dataclass(frozen=True)
class RunInfo:
    """What a logger's run is told when it starts."""

    run_dir: Path
    config: dict[str, Any]
    """The resolved config, as plain nested values."""
    num_params: int
    job: JobInfo = field(default_factory=JobInfo)
    val_metrics: tuple[str, ...] = ()
    """The names of the validation metrics the task reports (hydraloop.tasks)."""
    start_step: int = 0
    """The step this run resumed from; 0 for a fresh start. A logger that finds its earlier run of this directory
    continues it from there: what the earlier run logged after this step, a killed run's last steps, is redone."""

    @property
    def flat_config(self) -> dict[str, Scalar]:
        """{"optimizer.lr": 0.003, "model.hidden_sizes": "[128, 128]", ...}"""
        return flatten(self.config)

    @property
    def hparams(self) -> dict[str, Scalar]:
        """The job's overridden keys with their resolved values: its row in a comparison of a sweep's jobs."""
        return overridden(self.job.overrides, self.flat_config)


class NullLogger:
    """Logs nothing: `logger=none`, and the interface every logger implements."""

    def start(self, run: RunInfo) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        """Before every checkpoint: what was logged is on disk (as far as the tracker's client allows). A run killed
        after the checkpoint resumes from it and logs again only what came after; what came before must not be lost
        with the process."""

    def interrupted(self, signum: int) -> None:
        """The stop signal `signum` ends the run after a checkpoint, and a rerun will continue it: written out, and
        marked preempted where the tracker has such a state; or Ctrl-C (SIGINT) ended it at once, without one. The
        process exits with 128 + `signum` (a spawned rank hands its stop to the launcher and exits 0)."""

    def finish(self, metrics: dict[str, Any]) -> None:
        """The final metrics (those of metrics.json); then closes the run."""


class LoggerGroup(NullLogger):
    """Several loggers at once (`logger=[tensorboard,csv,wandb]`), each told everything, in order."""

    def __init__(self, loggers: list[NullLogger]) -> None:
        self.loggers = loggers

    def start(self, run: RunInfo) -> None:
        for logger in self.loggers:
            logger.start(run)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def flush(self) -> None:
        for logger in self.loggers:
            logger.flush()

    def interrupted(self, signum: int) -> None:
        for logger in self.loggers:
            logger.interrupted(signum)

    def finish(self, metrics: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.finish(metrics)


def flatten(node: Any, prefix: str = "") -> dict[str, Scalar]:
    """{"optimizer": {"lr": 0.1}} -> {"optimizer.lr": 0.1}; lists and None become strings (loggers take scalars)."""
    if isinstance(node, dict):
        flat: dict[str, Scalar] = {}
        for key, value in node.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    value = str(node) if isinstance(node, (list, tuple)) or node is None else node
    return {prefix.rstrip("."): value}


def overridden(overrides: tuple[str, ...], config: dict[str, Scalar]) -> dict[str, Scalar]:
    """The keys a job's overrides set, with their resolved values (`optimizer.lr=1e-3` -> {"optimizer.lr": 0.001});
    a group choice or a list keeps the override's own text (`parallel=ddp` -> {"parallel": "ddp"})."""
    hparams: dict[str, Scalar] = {}
    for item in overrides:
        if item.startswith("~"):  # a deletion sets nothing
            continue
        key, _, text = item.lstrip("+").partition("=")
        value = config.get(key)
        hparams[key] = value if isinstance(value, (bool, int, float)) else text
    return hparams


def require_package(module: str, extra: str) -> None:
    """Checks that an optional logger's package is installed, or says in one line which extra installs it. Only
    looks for it: the launching process checks every chosen logger, and rank 0 alone imports the package.

    The message starts with ": " so that `build_logger` can put the logger's config key before it.
    """
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f": needs the {module} package, which is not installed; pip install 'hydraloop[{extra}]'")
