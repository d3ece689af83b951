"""logger=mlflow: an MLflow run, through MLflow's own tracking client. Needs `pip install 'hydraloop[mlflow]'`.

The default store is `sqlite:///mlflow.db` in the working directory, where `mlflow ui` looks without arguments
(MLflow 3 refuses a plain folder store unless MLFLOW_ALLOW_FILE_STORE is set). A multirun is one experiment, named
after its folder; a single run goes to MLflow's `Default` experiment.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from hydraloop.errors import ConfigError
from hydraloop.loggers.base import NullLogger, RunInfo, require_package
from hydraloop.storage import check_appendable, check_writable

MAX_BATCH = 100  # MLflow takes at most this many params (and 1000 metrics) per log_batch call


class MLflowLogger(NullLogger):
    def __init__(
        self,
        tracking_uri: str = "sqlite:///mlflow.db",
        experiment_name: str | None = None,
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        require_package("mlflow", extra="mlflow")
        self.tracking_uri = _checked_uri(tracking_uri)
        self.experiment_name, self.run_name, self.tags = experiment_name, run_name, dict(tags or {})

    def start(self, run: RunInfo) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        self.client = _client(MlflowClient, self.tracking_uri)
        experiment_id = self._experiment_id(self.experiment_name or run.job.sweep_dir or "Default")
        run_dir = str(Path(run.run_dir).resolve())
        earlier = self._earlier_run(experiment_id, run_dir) if run.start_step else None
        if earlier:
            # A resumed run continues this directory's MLflow run. Its params stay those it started with (MLflow
            # refuses to change one); a killed run's steps after its last checkpoint are logged again, with the
            # same values (the resume is exact) but for the timings.
            self.run_id = earlier
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {"run_dir": run_dir, **self.tags}
            self.run_id = self.client.create_run(experiment_id, run_name=self.run_name, tags=tags).info.run_id
        atexit.register(self._end, "FAILED")  # a run that raises is not left RUNNING
        if not earlier:
            self._log_params(run)

    def _log_params(self, run: RunInfo) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)) for key, value in run.flat_config.items()]
        for start in range(0, len(params), MAX_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + MAX_BATCH])
        self.log_metrics({"model/params": run.num_params}, step=0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        timestamp = int(time.time() * 1000)
        entries = [self.Metric(key, float(value), timestamp, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=entries)

    def interrupted(self, signum: int) -> None:
        self._end("KILLED")  # MLflow's state for a run stopped from outside; the rerun sets it RUNNING again
        atexit.unregister(self._end)

    def finish(self, metrics: dict[str, Any]) -> None:
        # Under their own prefix: metrics.json's train/loss (the last epoch's mean) is not the last point of the
        # train/loss series (a logging interval's mean).
        final = {f"final/{key}": value for key, value in metrics.items() if isinstance(value, (int, float))}
        self.log_metrics(final, step=metrics.get("global_step", 0))
        self._end("FINISHED")
        atexit.unregister(self._end)

    def _end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)

    def _earlier_run(self, experiment_id: str, run_dir: str) -> str | None:
        """The id of the newest run of `run_dir` in the experiment, if any."""
        if "'" in run_dir:  # not expressible in MLflow's filter syntax
            return None
        runs = self.client.search_runs(
            [experiment_id], f"tags.run_dir = '{run_dir}'", order_by=["attributes.start_time DESC"], max_results=1
        )
        return runs[0].info.run_id if runs else None

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # a job of the same sweep, running at the same time, created it first
            return self.client.get_experiment_by_name(name).experiment_id


def _client(client_class: type, uri: str) -> Any:
    """MLflow's client; a new SQLite database is made under a file lock: the jobs of a parallel sweep would otherwise
    all run MLflow's table migrations on it at once."""
    if not uri.startswith("sqlite:///") or Path(uri.removeprefix("sqlite:///")).exists():
        return client_class(uri)
    database = Path(uri.removeprefix("sqlite:///"))
    database.parent.mkdir(parents=True, exist_ok=True)
    with database.with_name(database.name + ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return client_class(uri)  # the first to get the lock makes the tables; the others find them


def _checked_uri(uri: str) -> str:
    """The store's URI, a relative SQLite path made absolute (every rank and job then means the same file); a
    server that does not answer, or a database in a folder that cannot be made, is bad input.

    The message starts with "." so that `build_logger` can put the logger's config key before it.
    """
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            socket.create_connection((parsed.hostname, port), timeout=5).close()
        except OSError as error:
            raise ConfigError(
                f".tracking_uri={uri}: no MLflow server answers at {parsed.hostname}:{port} ({error.strerror or error})"
            ) from None
    if parsed.scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
        raise ConfigError(
            f".tracking_uri={uri}: a folder store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true; "
            "use a database, e.g. sqlite:///mlflow.db"
        )
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///")).resolve()
        existing = next(parent for parent in path.parents if parent.exists())
        if not existing.is_dir():
            raise ConfigError(f".tracking_uri={uri}: cannot make the database in {path.parent}")
        try:
            # Tried for real (os.access, for root, sees no read-only mount or immutable folder): the database and
            # the folder it is in (SQLite writes a journal beside it).
            check_writable(existing, "folder")
            check_appendable(path, "database")
        except ConfigError as error:
            raise ConfigError(f".tracking_uri={uri}: {error}") from None
        return f"sqlite:///{path}"
    return uri
