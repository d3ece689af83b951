"""Hydra multirun: each job its own subfolder, logs and metrics; the task returns the optimized metric. The same
DDP sweep with 2 jobs at once (hydra/launcher=joblib), each on its own cores, ends where the sequential one does."""

import json
import re
import subprocess
import sys
from datetime import datetime

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO, TRAIN, max_param_diff, read_checkpoint
from tracking_stores import isolate_wandb, mlflow_runs, wandb_runs

pytestmark = pytest.mark.slow

DDP_SWEEP = ("optimizer.lr=0.01,0.1", "parallel=ddp", "trainer.max_epochs=1")


def jobs(sweep_dir):
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


@pytest.fixture(scope="module")
def ddp_sweep(run_train, tmp_path_factory):
    sweep_dir = tmp_path_factory.mktemp("sequential")
    run = run_train("-m", *DDP_SWEEP, f"hydra.sweep.dir={sweep_dir}")
    assert run.returncode == 0, run.output
    return sweep_dir


def test_lr_sweep_under_ddp(ddp_sweep):
    dirs = jobs(ddp_sweep)
    assert [d.name for d in dirs] == ["0", "1"]
    lrs = []
    for job in dirs:
        metrics = json.loads((job / "metrics.json").read_text())
        assert metrics["world_size"] == 2
        assert (job / "checkpoints" / "last.pt").exists() and (job / "train.log").read_text()
        lrs.append((job / ".hydra" / "overrides.yaml").read_text())
    assert "optimizer.lr=0.01" in lrs[0] and "optimizer.lr=0.1" in lrs[1]
    assert not list(ddp_sweep.glob("*/*/*/.hydra"))  # no nested run dirs from the workers


def test_single_and_ddp_in_one_sweep_agree(run_train, tmp_path):
    run = run_train("-m", "parallel=single,ddp", "trainer.max_epochs=2", f"hydra.sweep.dir={tmp_path}")
    assert run.returncode == 0, run.output
    single, ddp = (json.loads((job / "metrics.json").read_text()) for job in jobs(tmp_path))
    assert (single["world_size"], ddp["world_size"]) == (1, 2)
    assert single["val/acc"] == ddp["val/acc"]


def test_task_returns_the_optimized_metric(tmp_path, monkeypatch, data_cache):
    """What a sweeper receives: main's return value is metrics.json's value of `optimized_metric`."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(data_cache))
    monkeypatch.syspath_prepend(str(REPO / "src"))
    import train  # src/train.py; importing registers the schemas

    returned = {}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for metric in ("val/acc", "val/loss"):
            run_dir = tmp_path / metric.replace("/", "_")
            # Outside a Hydra run there is no hydra:runtime.output_dir to interpolate: name the paths.
            cfg = compose(
                "train",
                overrides=[
                    "trainer.max_epochs=1",
                    "logger=none",
                    f"optimized_metric={metric}",
                    f"output_dir={run_dir}",
                    f"log_file={run_dir}/train.log",
                ],
            )
            run_dir.mkdir()
            returned[metric] = train.main.__wrapped__(cfg)
            assert returned[metric] == json.loads((run_dir / "metrics.json").read_text())[metric]
    assert returned["val/acc"] > 0.5 and 0 < returned["val/loss"] < 2.5
    sys.modules.pop("train", None)


# --- hydra/launcher=joblib: the same sweep, 2 jobs at once ----------------------------------------------------


@pytest.fixture(scope="module")
def joblib_sweep(train_env, tmp_path_factory, mlflow_uri):
    """The DDP sweep again, 2 jobs at once, with the loggers that make runs of their own (W&B offline, MLflow)."""
    sweep_dir = tmp_path_factory.mktemp("parallel")
    with pytest.MonkeyPatch.context() as monkeypatch:
        env = dict(train_env)
        monkeypatch.setattr("os.environ", env)  # isolate_wandb edits this copy, not the test process
        isolate_wandb(monkeypatch, tmp_path_factory.mktemp("wandb"))
    command = [sys.executable, str(TRAIN), "-m", "hydra/launcher=joblib", *DDP_SWEEP, f"hydra.sweep.dir={sweep_dir}"]
    loggers = ["logger=[tensorboard,wandb,mlflow]", f"logger.mlflow.tracking_uri={mlflow_uri}"]
    proc = subprocess.run([*command, *loggers], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sweep_dir


def log_span(job) -> tuple[datetime, datetime]:
    stamps = re.findall(r"^\[([\d-]+ [\d:,]+)\]", (job / "train.log").read_text(), flags=re.M)
    return tuple(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f") for stamp in (stamps[0], stamps[-1]))


def test_joblib_runs_jobs_at_once_on_their_own_cores(joblib_sweep):
    a, b = jobs(joblib_sweep)
    (start_a, end_a), (start_b, end_b) = log_span(a), log_span(b)
    assert start_a < end_b and start_b < end_a  # the jobs overlapped
    shares = [
        re.search(r"in slot (\d) of 2: no GPU, CPU cores ([\d,]+)", (job / "train.log").read_text()) for job in (a, b)
    ]
    assert all(shares)
    assert {share[1] for share in shares} == {"0", "1"}
    assert not set(shares[0][2].split(",")) & set(shares[1][2].split(","))  # disjoint cores


def test_joblib_sweep_ends_where_the_sequential_one_does(ddp_sweep, joblib_sweep):
    for one_by_one, at_once in zip(jobs(ddp_sweep), jobs(joblib_sweep), strict=True):
        expected, found = (json.loads((job / "metrics.json").read_text()) for job in (one_by_one, at_once))
        assert found["world_size"] == 2
        for key in ("val/acc", "val/loss", "train/loss", "global_step"):
            assert found[key] == expected[key], key
        weights = [read_checkpoint(job / "checkpoints" / "last.pt")["model"] for job in (one_by_one, at_once)]
        assert max_param_diff(*weights) < 1e-6


def test_each_job_is_one_run_of_the_sweep_in_wandb_and_mlflow(joblib_sweep, mlflow_uri):
    """Rank 0 alone creates a run; a sweep is one W&B group and one MLflow experiment, also with jobs at once."""
    sweep_jobs = jobs(joblib_sweep)
    for job, lr in zip(sweep_jobs, ("0.01", "0.1")):
        (run,) = wandb_runs(job)
        assert run.group == str(joblib_sweep) and run.config["optimizer.lr"] == float(lr)
        steps = [row["_step"] for row in run.history]
        assert steps == sorted(set(steps)) and steps[-1] == 22  # each step once: no second rank logging
        assert run.summary["val/acc"] == json.loads((job / "metrics.json").read_text())["val/acc"]
    runs = mlflow_runs(mlflow_uri, str(joblib_sweep))
    assert sorted(run.data.tags["run_dir"] for run in runs) == [str(job) for job in sweep_jobs]
    assert {run.info.status for run in runs} == {"FINISHED"}
