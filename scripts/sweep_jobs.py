"""A Hydra multirun's jobs, read for scripts/summarize.py: each job folder's overrides, config (its optimized metric and
mode) and metrics.json, its validation curves from what its loggers wrote; the jobs in order, labelled by what sets
them apart, and a k-fold sweep's jobs grouped by configuration."""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CURVES = (("val/acc", "validation accuracy"), ("val/loss", "validation loss"))


@dataclass
class Job:
    name: str
    path: Path
    overrides: list[str]
    metrics: dict[str, Any]
    optimized_metric: str
    mode: str
    fold: int | None = None
    label: str = ""
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    from_events: bool = False
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class Configuration:
    """The folds of one configuration in a k-fold sweep."""

    label: str
    jobs: list[Job]

    def mean_std(self, key: str) -> tuple[float, float | None] | None:
        """Mean and sample standard deviation over the folds (None with one fold); None if no fold has `key`."""
        values = [job.metrics[key] for job in self.jobs if isinstance(job.metrics.get(key), (int, float))]
        if not values:
            return None
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


# --- reading ---------------------------------------------------------------------------------------------------


def read_job(path: Path) -> Job | None:
    metrics_file = path / "metrics.json"
    if not metrics_file.is_file():
        print(f"summarize: skipping job {path.name}: no metrics.json (failed or unfinished)", file=sys.stderr)
        return None
    overrides = load_yaml(path / ".hydra" / "overrides.yaml") or []
    config = load_yaml(path / ".hydra" / "config.yaml") or {}
    metric, mode = optimization_of(path / ".hydra" / "config.yaml")
    return Job(
        name=path.name,
        path=path,
        overrides=[str(item) for item in overrides],
        metrics=json.loads(metrics_file.read_text()),
        optimized_metric=metric,
        mode=mode,
        fold=(config.get("data") or {}).get("fold") if (config.get("data") or {}).get("num_folds") else None,
        config=config,
    )


def optimization_of(config_file: Path) -> tuple[str, str]:
    """`optimized_metric` and its mode. Hydra saves the config unresolved, and both default to interpolations of the
    task (`${default_metric:...}`): they are resolved here with hydraloop's resolvers."""
    if not config_file.is_file():
        return "val/acc", "max"
    from omegaconf import OmegaConf

    from hydraloop.config import register_configs

    register_configs()
    config = OmegaConf.load(config_file)
    return str(OmegaConf.select(config, "optimized_metric")), str(OmegaConf.select(config, "optimized_metric_mode"))


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def read_curves(job: Job) -> None:
    """The job's val curves from what its loggers wrote (TensorBoard events, metrics.csv, an MLflow run), else the
    final point from metrics.json."""
    for reader in (_tensorboard_curves, _csv_curves, _mlflow_curves):
        job.curves = reader(job)
        if job.curves:
            job.from_events = True
            return
    step = job.metrics.get("global_step", 0)
    for tag, _ in CURVES:
        if isinstance(job.metrics.get(tag), (int, float)):
            job.curves[tag] = [(step, float(job.metrics[tag]))]


def _tensorboard_curves(job: Job) -> dict[str, list[tuple[int, float]]]:
    events = job.path / "tensorboard"
    if not (events.is_dir() and any(events.glob("events.out.tfevents.*"))):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    tags = set(accumulator.Tags().get("scalars", []))
    # The last write per step: a resumed run logs its steps after the checkpoint again.
    return {
        tag: sorted({event.step: event.value for event in accumulator.Scalars(tag)}.items())
        for tag, _ in CURVES
        if tag in tags
    }


def _csv_curves(job: Job) -> dict[str, list[tuple[int, float]]]:
    path = job.path / "metrics.csv"
    if not path.is_file():
        return {}
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    curves = {}
    for tag, _ in CURVES:
        points = {int(row["step"]): float(row[tag]) for row in rows if row.get(tag)}
        if points:
            curves[tag] = sorted(points.items())
    return curves


def _mlflow_curves(job: Job) -> dict[str, list[tuple[int, float]]]:
    """The job's MLflow run (tagged with its run directory), in the tracking store its config names: an SQLite
    path relative to where the sweep ran is looked for from here."""
    logger = (job.config.get("logger") or {}).get("mlflow")
    uri = str((logger or {}).get("tracking_uri", ""))
    if not uri or uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return {}
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        return {}
    client = MlflowClient(uri)
    run_dir = str(job.path.resolve())
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    runs = client.search_runs(experiments, f"tags.run_dir = '{run_dir}'", max_results=1) if "'" not in run_dir else []
    if not runs:
        return {}
    curves = {}
    for tag, _ in CURVES:
        points = {metric.step: metric.value for metric in client.get_metric_history(runs[0].info.run_id, tag)}
        if points:
            curves[tag] = sorted(points.items())
    return curves


# --- ordering and labels ---------------------------------------------------------------------------------------


def order_by(jobs: list[Job]) -> tuple[str, str]:
    """The sweep's optimized metric and mode, from the jobs' configs (the first job's if they disagree)."""
    choices = {(job.optimized_metric, job.mode) for job in jobs}
    metric, mode = jobs[0].optimized_metric, jobs[0].mode
    if len(choices) > 1:
        print(
            f"summarize: jobs optimize different metrics {sorted(choices)}; ordering by {metric} ({mode})",
            file=sys.stderr,
        )
    return metric, mode


def sort_key(job: Job, metric: str, mode: str) -> tuple[bool, float, int]:
    value = job.metrics.get(metric)
    missing = not isinstance(value, (int, float)) or math.isnan(value)
    score = 0.0 if missing else (-value if mode == "max" else value)
    return missing, score, int(job.name)  # jobs without the metric last; ties in job order


def label_jobs(jobs: list[Job]) -> list[str]:
    """Labels each job by the overrides that differ between jobs; returns the overrides all jobs share."""
    shared = set.intersection(*(set(job.overrides) for job in jobs)) if len(jobs) > 1 else set()
    for job in jobs:
        own = [item for item in job.overrides if item not in shared]
        job.label = " ".join(own) or " ".join(job.overrides) or "(no overrides)"
    return [item for item in jobs[0].overrides if item in shared]


def group_folds(jobs: list[Job], metric: str, mode: str) -> list[Configuration]:
    """A k-fold sweep's jobs by configuration, best mean first; [] if no job ran k-fold. Labels are the overrides
    (less `data.fold`) that differ between configurations."""
    if all(job.fold is None for job in jobs):
        return []
    groups: dict[tuple[str, ...], list[Job]] = {}
    for job in sorted(jobs, key=lambda job: int(job.name)):
        groups.setdefault(tuple(item for item in job.overrides if not item.startswith("data.fold=")), []).append(job)
    shared = set.intersection(*map(set, groups)) if len(groups) > 1 else set()
    configurations = [
        Configuration(" ".join(item for item in key if item not in shared) or " ".join(key) or "(no overrides)", jobs)
        for key, jobs in groups.items()
    ]

    def best_first(configuration: Configuration) -> tuple[bool, float]:
        stats = configuration.mean_std(metric)
        return stats is None, 0.0 if stats is None else (-stats[0] if mode == "max" else stats[0])

    return sorted(configurations, key=best_first)
