"""Summarize a Hydra multirun: one row per job, best first, and the validation curves of all jobs in one figure.

    python scripts/summarize.py outputs/multirun/DATE/TIME [--out DIR]

Reads every job folder (0, 1, ...; scripts/sweep_jobs.py): `.hydra/overrides.yaml`, `.hydra/config.yaml` (for
`optimized_metric` and `optimized_metric_mode`, which set the order) and `metrics.json`. Jobs without `metrics.json`
(failed or still running) are skipped with a note on stderr. Writes into the multirun folder (or DIR):

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
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from sweep_jobs import (
    CURVES,
    Configuration,
    Job,
    group_folds,
    label_jobs,
    load_yaml,
    order_by,
    read_curves,
    read_job,
    sort_key,
)

from hydraloop.errors import ConfigError
from hydraloop.storage import check_makeable

RUN_METRICS = ("train/loss", "epoch", "wall_time_s")
"""Shown after the task's validation metrics (those of the jobs' metrics.json), which come first."""


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


def table_metrics(jobs: list[Job], metric: str) -> list[str]:
    """The optimized metric, the task's other validation metrics, then RUN_METRICS."""
    found = {key for job in jobs for key in job.metrics if key.startswith("val/")}
    return [metric, *sorted(found - {metric}), *RUN_METRICS]


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
