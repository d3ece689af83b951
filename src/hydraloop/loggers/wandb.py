"""logger=wandb: a Weights & Biases run, in `<run dir>/wandb/`. Needs `pip install 'hydraloop[wandb]'`.

Without credentials (no WANDB_API_KEY, no `wandb login`) the run is offline: W&B writes it to disk only, which
works on a cluster without internet, and `wandb sync <run dir>/wandb/offline-run-*` uploads it later.

A resumed run (a restart, a requeue, a rerun after a stop) continues the directory's W&B run. Online, W&B resumes
the run itself and ignores steps it already holds (a killed run's steps after its last checkpoint, which the resumed
run recomputes exactly). Offline, W&B cannot resume (wandb/wandb#4624): the resumed part is a second offline folder
with the same run id, uploaded after the first with `wandb sync --append`.
"""

from __future__ import annotations

import atexit
import netrc
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from hydraloop.errors import ConfigError, first_line
from hydraloop.loggers.base import NullLogger, RunInfo, require_package

MODES = ("online", "offline", "disabled", "shared")


class WandbLogger(NullLogger):
    def __init__(
        self,
        project: str = "hydraloop",
        entity: str | None = None,
        group: str | None = None,
        tags: Sequence[str] = (),
        name: str | None = None,
        mode: str | None = None,
    ) -> None:
        """`group` null: a multirun's folder, so its jobs form one group; `mode` null: WANDB_MODE if set, else
        online with credentials and offline without."""
        require_package("wandb", extra="wandb")
        if mode is not None and mode not in MODES:
            raise ConfigError(f".mode={mode}: must be one of {', '.join(MODES)}, or null (offline without credentials)")
        _check_environment()
        self.project, self.entity, self.group, self.tags, self.name = project, entity, group, list(tags), name
        self.mode = mode or (None if os.environ.get("WANDB_MODE") else "online" if _has_credentials() else "offline")

    def start(self, run: RunInfo) -> None:
        import wandb

        # A resumed run continues this directory's earlier W&B run: the one wandb/latest-run links to, which holds
        # its records as run-<id>.wandb.
        records = sorted((Path(run.run_dir) / "wandb" / "latest-run").glob("run-*.wandb")) if run.start_step else []
        earlier = records[0].stem.removeprefix("run-") if records else None
        self.run = wandb.init(
            id=earlier,
            resume="allow" if earlier else None,
            project=self.project,
            entity=self.entity,
            group=self.group or run.job.sweep_dir,
            tags=self.tags,
            name=self.name,
            mode=self.mode,
            dir=run.run_dir,
            config=run.flat_config,
            # The console is already in train.log; W&B's capture would wrap the progress bar's stream.
            settings=wandb.Settings(console="off", quiet=True),
        )
        self.run.summary["model/params"] = run.num_params
        self.run.summary["run_dir"] = str(run.run_dir)
        # A run that raises is finished as failed here, at its exit, before W&B's own exit handler (registered
        # before, so run after) tears its service down: torn down unfinished, the run's pending requests ended as
        # HandleAbandonedError tracebacks in its debug.log.
        atexit.register(self._finish_failed)

    def _finish_failed(self) -> None:
        self.run.finish(exit_code=1)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # Calls with the same step (train and validation metrics at an epoch's last step) fill one history row.
        self.run.log(metrics, step=step)

    def interrupted(self, signum: int) -> None:
        if signum != signal.SIGINT:  # Ctrl-C is no preemption
            self.run.mark_preempting()  # shown as preempted, not crashed, as it ends with a non-zero exit code
        # Finished here, with the process's exit code: left to W&B's exit handler, a spawned rank's run (the rank
        # exits 0) was recorded as exit 0, and the service was torn down under it (HandleAbandonedError).
        self.run.finish(exit_code=128 + signum)
        atexit.unregister(self._finish_failed)

    def finish(self, metrics: dict[str, Any]) -> None:
        self.run.log({}, commit=True)  # the last row first: written later, it would overwrite the summary below
        self.run.summary.update(metrics)
        self.run.finish()
        atexit.unregister(self._finish_failed)


def _check_environment() -> None:
    """The WANDB_* variables, as W&B's settings take them when rank 0 starts the run: a value they refuse
    (`WANDB_MODE=offlne`) is one line in the launcher here, not a pydantic traceback from the rank."""
    variables = sorted((name, value) for name, value in os.environ.items() if name.startswith("WANDB_"))
    if not variables:
        return  # nothing to check: W&B's import (seconds) is left to the rank
    import wandb

    if not hasattr(wandb.Settings, "update_from_env_vars"):  # W&B before 0.19 reads them otherwise
        return
    for name, value in variables:
        try:
            wandb.Settings().update_from_env_vars({name: value})
        except ValueError as error:  # pydantic's ValidationError
            details = error.errors() if hasattr(error, "errors") else []
            reason = details[0]["msg"] if details else first_line(error)
            raise ConfigError(f": {name}={value} in the environment: W&B refuses it ({reason})") from None


def _has_credentials() -> bool:
    """An API key in the environment, or one that `wandb login` saved to ~/.netrc for W&B's host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
