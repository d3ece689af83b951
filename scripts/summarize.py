"""Summarize a Hydra multirun: one row per job, best first, and the validation curves of all jobs in one figure.

    python scripts/summarize.py outputs/multirun/DATE/TIME [--out DIR]

Reads every job folder (0, 1, ...): `.hydra/overrides.yaml`, `.hydra/config.yaml` (for `optimized_metric` and
`optimized_metric_mode`, which set the order) and `metrics.json`. Jobs without `metrics.json` (failed or still
running) are skipped with a note on stderr. Writes into the multirun folder (or DIR):

- `summary.md`: a markdown table (also printed to stdout), sorted best-first by the optimized metric;
- `summary.csv`: the same rows with every key of metrics.json, values exactly as the jobs wrote them;
- `val_curves.png`: val/acc and val/loss against the optimizer step, one line per job, read from the job's
  TensorBoard event files; a job without events (logger=none) shows as one point, its final metrics.

A k-fold sweep (`-m data.num_folds=5 data.fold=0,1,2,3,4 ...`) also gets, per configuration (a job's overrides
less `data.fold`), the mean and standard deviation over its folds: a second table, and a figure of one mean curve
per configuration with a band of one standard deviation either side.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hydraloop.errors import ConfigError
from hydraloop.storage import check_makeable

RUN_METRICS = ("train/loss", "epoch", "wall_time_s")
"""Shown after the task's validation metrics (those of the jobs' metrics.json), which come first."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun folder, with job folders 0, 1, ...")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the multirun folder)")
    args = parser.parse_args(argv)

    sweep_dir: Path = args.sweep_dir
    if not sweep_dir.is_dir():
        print(f"summarize: {sweep_dir}: no such folder", file=sys.stderr)
        return 2
    out: Path = args.out or sweep_dir
    try:
        check_makeable(out, "--out")
    except ConfigError as error:
        print(f"summarize: {error}", file=sys.stderr)
        return 2
    job_dirs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not job_dirs:
        print(f"summarize: {sweep_dir}: no job folders (0, 1, ...); is it a multirun folder?", file=sys.stderr)
        return 2
    jobs = [job for job in map(read_job, job_dirs) if job is not None]
    if not jobs:
        print(f"summarize: {sweep_dir}: none of the {len(job_dirs)} jobs wrote metrics.json", file=sys.stderr)
        return 1

    metric, mode = order_by(jobs)
    jobs.sort(key=lambda job: sort_key(job, metric, mode))
    common = label_jobs(jobs)
    for job in jobs:
        read_curves(job)

    configurations = group_folds(jobs, metric, mode)

    out.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(sweep_dir, jobs, metric, mode, common, skipped=len(job_dirs) - len(jobs))
    if configurations:
        markdown += render_folds(configurations, metric, mode)
    (out / "summary.md").write_text(markdown)
    write_csv(out / "summary.csv", jobs, metric)
    plot_curves(out / "val_curves.png", sweep_dir, jobs, metric, mode, configurations)
    print(markdown, end="")
    print(f"\nwrote {out / 'summary.md'}, {out / 'summary.csv'}, {out / 'val_curves.png'}", file=sys.stderr)
    return 0


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


def table_metrics(jobs: list[Job], metric: str) -> list[str]:
    """The optimized metric, the task's other validation metrics, then RUN_METRICS."""
    found = {key for job in jobs for key in job.metrics if key.startswith("val/")}
    return [metric, *sorted(found - {metric}), *RUN_METRICS]


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


def legend_labels(named: list[tuple[str, str]], width: int = 90) -> list[str]:
    """Shorter legend labels for (name, label) pairs: `optimizer.lr=0.006511539963572568` -> `lr=0.006512` (the key's
    last part where that is unambiguous; floats to 4 significant digits), cut at `width` characters."""
    keys = {item.split("=", 1)[0] for _, label in named for item in label.split() if "=" in item}
    last = [key.rsplit(".", 1)[-1] for key in keys]
    short = {key: key.rsplit(".", 1)[-1] if last.count(key.rsplit(".", 1)[-1]) == 1 else key for key in keys}
    labels = []
    for name, label in named:
        parts = []
        for item in label.split():
            key, sep, value = item.partition("=")
            value = re.sub(r"(?<![\w.])-?\d+\.\d{5,}(?:e-?\d+)?", lambda m: f"{float(m.group()):.4g}", value)
            parts.append(f"{short.get(key, key)}{sep}{value}")
        text = f"{name}: {' '.join(parts)}"
        labels.append(text if len(text) <= width else text[: width - 1] + "…")
    return labels


# --- writing ---------------------------------------------------------------------------------------------------


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3g}"
    return str(value)


def render_markdown(sweep_dir: Path, jobs: list[Job], metric: str, mode: str, common: list[str], skipped: int) -> str:
    lines = [f"# Sweep summary: {sweep_dir}", ""]
    lines.append(
        f"{len(jobs)} job(s), best first by `{metric}` ({mode})"
        + (f"; {skipped} job(s) without metrics.json skipped." if skipped else ".")
    )
    if common:
        lines.append(f"Overrides shared by all jobs: `{' '.join(common)}`")
    results = load_yaml(sweep_dir / "optimization_results.yaml")
    if isinstance(results, dict) and "best_value" in results:
        params = " ".join(f"{key}={value}" for key, value in (results.get("best_params") or {}).items())
        lines.append(f"Optuna's best: {fmt(results['best_value'])} with `{params}`")
    columns = table_metrics(jobs, metric)
    lines += ["", "| job | overrides | " + " | ".join(columns) + " |", "|---:|---|" + "---:|" * len(columns)]
    for job in jobs:
        cells = [job.name, f"`{job.label}`".replace("|", "\\|"), *(fmt(job.metrics.get(key)) for key in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_folds(configurations: list[Configuration], metric: str, mode: str) -> str:
    jobs = [job for configuration in configurations for job in configuration.jobs]
    columns = [key for key in table_metrics(jobs, metric) if key not in ("epoch", "wall_time_s")]
    lines = [
        "",
        "## Cross-validation: mean ± standard deviation over folds",
        "",
        f"{len(configurations)} configuration(s), best first by the mean of `{metric}` ({mode}).",
        "",
        "| configuration | folds | " + " | ".join(columns) + " |",
        "|---|---:|" + "---:|" * len(columns),
    ]
    for configuration in configurations:
        cells = [f"`{configuration.label}`".replace("|", "\\|"), str(len(configuration.jobs))]
        for key in columns:
            stats = configuration.mean_std(key)
            cells.append("-" if stats is None else fmt(stats[0]) + ("" if stats[1] is None else f" ± {fmt(stats[1])}"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, jobs: list[Job], metric: str) -> None:
    """Every metrics.json key (the table's first), values as written: json floats round-trip through repr."""
    shown = table_metrics(jobs, metric)
    extra = sorted({key for job in jobs for key in job.metrics} - set(shown))
    columns = ["job", "overrides", "all_overrides", *shown, *extra]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for job in jobs:
            row = {"job": job.name, "overrides": job.label, "all_overrides": " ".join(job.overrides)}
            row.update({key: job.metrics.get(key, "") for key in (*shown, *extra)})
            writer.writerow({key: "" if value is None else value for key, value in row.items()})


def plot_curves(
    path: Path, sweep_dir: Path, jobs: list[Job], metric: str, mode: str, configurations: list[Configuration]
) -> None:
    """One line per job; for a k-fold sweep, one mean line per configuration with a band of one standard deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if configurations:
        series = [fold_curves(configuration) for configuration in configurations]
        labels = legend_labels([(f"{len(c.jobs)} folds", c.label) for c in configurations])
        legend_title = f"folds: configuration, mean ± std (best first by mean {metric}, {mode})"
    else:
        series = [{tag: (*zip(*job.curves[tag]), None) for tag in job.curves} for job in jobs]
        labels = legend_labels([(job.name, job.label) for job in jobs])
        legend_title = f"job: overrides (best first by {metric}, {mode})"
    columns = 1 if len(series) <= 8 else 2
    legend_rows = -(-len(series) // columns)
    fig, axes = plt.subplots(1, len(CURVES), figsize=(14, 4.5 + 0.2 * legend_rows), constrained_layout=True)
    colors = plt.get_cmap("viridis" if len(series) > 10 else "tab10")
    for index, (curves, label) in enumerate(zip(series, labels)):  # best first: first colour, thicker line
        color = colors(index / max(1, len(series) - 1)) if len(series) > 10 else colors(index % 10)
        for ax, (tag, _) in zip(axes, CURVES):
            if tag not in curves:
                continue
            steps, values, stds = curves[tag]
            marker = "o" if len(steps) == 1 else ("." if len(steps) <= 30 else None)
            ax.plot(
                steps,
                values,
                color=color,
                linewidth=2.4 if index == 0 else 1.2,
                marker=marker,
                label=label,
                zorder=len(series) - index,
            )
            if stds is not None:  # one standard deviation: bars at the points, a band between them
                ax.errorbar(steps, values, yerr=stds, fmt="none", ecolor=color, capsize=3, zorder=len(series) - index)
                low = [value - std for value, std in zip(values, stds)]
                high = [value + std for value, std in zip(values, stds)]
                ax.fill_between(steps, low, high, color=color, alpha=0.15, linewidth=0)
    for ax, (tag, title) in zip(axes, CURVES):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(tag)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize=8, title=legend_title)
    title = f"Validation curves: {'/'.join(sweep_dir.resolve().parts[-2:])}"
    if not all(job.from_events for job in jobs):
        title += "\n(single points: the final metrics.json of jobs that logged no curve, e.g. logger=none)"
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fold_curves(configuration: Configuration) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """Per curve: the folds' n-th points averaged (step and value), and the values' standard deviation."""
    curves = {}
    for tag, _ in CURVES:
        folds = [job.curves[tag] for job in configuration.jobs if job.curves.get(tag)]
        if not folds:
            continue
        points = [[fold[n] for fold in folds] for n in range(min(map(len, folds)))]
        steps = [statistics.fmean(step for step, _ in point) for point in points]
        values = [[value for _, value in point] for point in points]
        stds = [statistics.stdev(vs) if len(vs) > 1 else 0.0 for vs in values]
        curves[tag] = (steps, [statistics.fmean(vs) for vs in values], stds)
    return curves


if __name__ == "__main__":
    sys.exit(main())
