"""scripts/summarize.py over a real multirun: the table holds exactly what the jobs wrote, best first, and the
curves figure is a real image."""

import csv
import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "summarize.py"


def summarize(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


def load_sweep_jobs():
    """scripts/sweep_jobs.py, summarize.py's reading of the job folders."""
    spec = importlib.util.spec_from_file_location("sweep_jobs", REPO / "scripts" / "sweep_jobs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def table_rows(markdown: str) -> list[dict[str, str]]:
    """The first markdown table's rows, each a dict from its header's names to the cells."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    header, *rows = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    return [dict(zip(header, row)) for row in rows]


@pytest.mark.slow
def test_lr_sweep_summary(run_train, tmp_path):
    sweep = tmp_path / "sweep"
    run = run_train("-m", "optimizer.lr=0.003,0.03", "trainer.max_epochs=2", f"hydra.sweep.dir={sweep}")
    assert run.returncode == 0, run.output
    written = {job: json.loads((sweep / job / "metrics.json").read_text()) for job in ("0", "1")}
    # A third job that failed before writing metrics.json: skipped, with a note.
    shutil.copytree(sweep / "0", sweep / "2")
    (sweep / "2" / "metrics.json").unlink()

    result = summarize(sweep)
    assert result.returncode == 0, result.stderr
    assert "skipping job 2: no metrics.json" in result.stderr

    # CSV: one row per finished job, every metrics.json value exactly as written.
    with (sweep / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(row["job"] for row in rows) == ["0", "1"]
    for row in rows:
        metrics = written[row["job"]]
        for key, value in metrics.items():
            assert (row[key] == "") if value is None else (type(value)(row[key]) == value), (key, row[key], value)
        assert row["overrides"] == f"optimizer.lr={'0.003' if row['job'] == '0' else '0.03'}"
        assert row["all_overrides"] == f"{row['overrides']} trainer.max_epochs=2"

    # Markdown: best val/acc first (the sweep's optimized_metric, mode max), same text on stdout.
    markdown = (sweep / "summary.md").read_text()
    assert result.stdout == markdown
    assert "Overrides shared by all jobs: `trainer.max_epochs=2`" in markdown
    table = table_rows(markdown)
    best_first = sorted(written, key=lambda job: -written[job]["val/acc"])
    assert [row["job"] for row in table] == best_first
    assert [row["job"] for row in rows] == best_first
    assert list(table[0])[:3] == ["job", "overrides", "val/acc"]  # the optimized metric first, then the task's others
    for row in table:
        assert float(row["val/acc"]) == pytest.approx(written[row["job"]]["val/acc"], abs=5e-5)
        assert float(row["val/loss"]) == pytest.approx(written[row["job"]]["val/loss"], abs=5e-5)

    # The figure: a PNG of a plausible size, not blank.
    from matplotlib.image import imread

    png = sweep / "val_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(png)
    height, width, channels = image.shape
    assert 400 <= height <= 2000 and 1000 <= width <= 3000 and channels in (3, 4)
    assert image[..., :3].std() > 0.05  # lines and text on white, not an empty canvas

    # The curves come from TensorBoard: one point per epoch, ending at the final metrics.
    module = load_sweep_jobs()
    job = module.read_job(sweep / "0")
    module.read_curves(job)
    assert job.from_events
    steps = [step for step, _ in job.curves["val/acc"]]
    assert steps == [written["0"]["global_step"] // 2, written["0"]["global_step"]]
    assert job.curves["val/acc"][-1][1] == pytest.approx(written["0"]["val/acc"], abs=1e-6)
    assert job.curves["val/loss"][-1][1] == pytest.approx(written["0"]["val/loss"], rel=1e-6)


@pytest.mark.slow
def test_without_events_and_minimizing_val_loss(run_train, tmp_path):
    sweep, out = tmp_path / "sweep", tmp_path / "report"
    run = run_train(
        "-m",
        "optimizer.lr=0.0003,0.003",
        "trainer.max_epochs=1",
        "logger=none",
        "optimized_metric=val/loss",
        "optimized_metric_mode=min",
        f"hydra.sweep.dir={sweep}",
    )
    assert run.returncode == 0, run.output
    written = {job: json.loads((sweep / job / "metrics.json").read_text()) for job in ("0", "1")}

    result = summarize(sweep, "--out", out)
    assert result.returncode == 0, result.stderr
    assert {path.name for path in out.iterdir()} == {"summary.md", "summary.csv", "val_curves.png"}
    assert not (sweep / "summary.md").exists()
    assert "best first by `val/loss` (min)" in result.stdout
    assert [row["job"] for row in table_rows(result.stdout)] == sorted(
        written, key=lambda job: written[job]["val/loss"]
    )

    module = load_sweep_jobs()  # no events: the final point from metrics.json
    job = module.read_job(sweep / "1")
    module.read_curves(job)
    assert not job.from_events
    assert job.curves["val/loss"] == [(written["1"]["global_step"], written["1"]["val/loss"])]


@pytest.mark.slow
def test_a_sweep_logged_to_csv_alone_gets_its_curves_from_metrics_csv(run_train, tmp_path):
    sweep = tmp_path / "sweep"
    run = run_train("-m", "seed=0,1", "trainer.max_epochs=2", "logger=csv", f"hydra.sweep.dir={sweep}")
    assert run.returncode == 0, run.output
    module = load_sweep_jobs()
    job = module.read_job(sweep / "1")
    module.read_curves(job)
    with (sweep / "1" / "metrics.csv").open() as handle:
        logged = [(int(row["step"]), float(row["val/acc"])) for row in csv.DictReader(handle) if row["val/acc"]]
    assert job.from_events and job.curves["val/acc"] == logged and len(logged) == 2


def test_bad_folders(tmp_path):
    result = summarize(tmp_path / "nope")
    assert result.returncode == 2 and f"{tmp_path / 'nope'}: no such folder" in result.stderr
    result = summarize(tmp_path)
    assert result.returncode == 2 and "no job folders (0, 1, ...)" in result.stderr
    (tmp_path / "0").mkdir()
    result = summarize(tmp_path)
    assert result.returncode == 1 and "none of the 1 jobs wrote metrics.json" in result.stderr
