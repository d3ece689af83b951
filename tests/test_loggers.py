"""logger=[tensorboard,csv,wandb,mlflow]: every logger records the same run (config, metrics at the same steps,
final metrics, parameter count, run directory), read back through each tool's own format; bad logger settings are
one line before training."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO, free_port, read_checkpoint, wait_for
from hydraloop.checkpoint import step_checkpoint
from hydraloop.loggers.base import flatten
from tracking_stores import (
    csv_rows,
    event_files,
    events,
    hparams_row,
    isolate_wandb,
    mlflow_history,
    mlflow_runs,
    rejected_in_process,
    wandb_runs,
)

STEPS = [4, 6, 8, 12]  # 2 epochs of 6 steps, train metrics every 4: steps 4, 8, 12; validation after 6 and 12
OVERRIDES = (
    "logger=[tensorboard,csv,wandb,mlflow]",
    "logger.wandb.tags=[digits,smoke]",
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=6",
    "trainer.log_every_n_steps=4",
)


@pytest.fixture(scope="module")
def logged(tmp_path_factory, data_cache, mlflow_uri):
    """One in-process run with all four loggers: (run dir, metrics.json, flattened resolved config, MLflow URI)."""
    root = tmp_path_factory.mktemp("loggers")
    run_dir, tracking_uri = root / "run", mlflow_uri
    run_dir.mkdir()
    with pytest.MonkeyPatch.context() as monkeypatch:
        isolate_wandb(monkeypatch, root)
        monkeypatch.setenv("XDG_CACHE_HOME", str(data_cache))
        monkeypatch.syspath_prepend(str(REPO / "src"))
        import train

        overrides = [*OVERRIDES, f"logger.mlflow.tracking_uri={tracking_uri}"]
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides, f"output_dir={run_dir}", f"log_file={run_dir}/train.log"])
        train.main.__wrapped__(cfg)
    config = flatten(OmegaConf.to_container(cfg, resolve=True))
    return run_dir, json.loads((run_dir / "metrics.json").read_text()), config, tracking_uri


def csv_series(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.csv as {metric: {step: value}}, empty cells left out."""
    series: dict[str, dict[int, float]] = {}
    for row in csv_rows(run_dir):
        for key, value in row.items():
            if key != "step" and value != "":
                series.setdefault(key, {})[int(row["step"])] = float(value)
    return series


def test_csv_has_one_row_per_logged_step(logged):
    run_dir, metrics, _, _ = logged
    rows = csv_rows(run_dir)
    assert [int(row["step"]) for row in rows] == STEPS
    assert list(rows[0])[:2] == ["step", "train/loss"]  # the first metrics logged come first
    last = rows[-1]  # the epoch's last logging step and its validation share one row
    assert float(last["train/epoch_loss"]) == metrics["train/loss"] and float(last["val/acc"]) == metrics["val/acc"]
    assert rows[0]["val/acc"] == "" and rows[1]["train/loss"] == ""


def test_tensorboard_has_the_csv_values_on_the_same_steps(logged):
    run_dir, metrics, _, _ = logged
    accumulator = events(run_dir)
    for name, points in csv_series(run_dir).items():
        logged_points = {event.step: event.value for event in accumulator.Scalars(name)}
        assert logged_points.keys() == points.keys(), name
        for step, value in points.items():
            assert logged_points[step] == pytest.approx(value, rel=1e-6, abs=1e-9), (name, step)  # events: float32
    assert [event.value for event in accumulator.Scalars("model/params")] == [metrics["model/params"]]
    assert event_files(run_dir) == [event_files(run_dir)[0]] and "/" not in event_files(run_dir)[0]
    names, metric_names, values = hparams_row(run_dir)
    # The task's metrics (classification of 10 classes) and the epoch's train loss; no overrides: nothing varied.
    assert metric_names == ["val/loss", "val/acc", "val/acc_top5", "train/epoch_loss"]
    assert names == [] and values == {}


def test_wandb_offline_run(logged):
    run_dir, metrics, config, _ = logged
    (run,) = wandb_runs(run_dir)  # offline: no credentials in the test's environment
    assert (run.project, run.group, run.tags) == ("hydraloop", "", ["digits", "smoke"])
    assert run.config == config  # the resolved config, flattened
    assert run.config["optimizer.lr"] == 0.003 and run.config["model.hidden_sizes"] == "[128, 128]"
    history = {row["_step"]: row for row in run.history}
    assert sorted(history) == STEPS
    for name, points in csv_series(run_dir).items():
        assert {step: row[name] for step, row in history.items() if name in row} == points, name
    for key, value in metrics.items():  # the final metrics: metrics.json as the run's summary
        assert run.summary[key] == value, key
    assert run.summary["run_dir"] == str(run_dir)
    assert run.exit_code == 0


def test_mlflow_run(logged):
    run_dir, metrics, config, tracking_uri = logged
    (run,) = mlflow_runs(tracking_uri, "Default")  # a single run: MLflow's default experiment
    assert run.info.status == "FINISHED"
    assert run.data.tags["run_dir"] == str(run_dir)
    assert run.data.params == {key: str(value) for key, value in config.items()}
    for name, points in csv_series(run_dir).items():
        assert mlflow_history(tracking_uri, run.info.run_id, name) == points, name
    assert mlflow_history(tracking_uri, run.info.run_id, "model/params") == {0: metrics["model/params"]}
    final = {key.removeprefix("final/"): value for key, value in run.data.metrics.items() if key.startswith("final/")}
    assert final == {key: value for key, value in metrics.items() if isinstance(value, (int, float))}


def test_parameter_count(logged):
    run_dir, metrics, _, _ = logged
    weights = read_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]
    assert metrics["model/params"] == sum(tensor.numel() for tensor in weights.values()) == 26122


def test_a_resumed_run_continues_each_loggers_run(logged, train_in_process, monkeypatch, tmp_path):
    """A run that logged past its last checkpoint (a killed run's case) and was resumed: each logger continues its
    run, with every step once and the uninterrupted run's values."""
    uninterrupted, _, _, tracking_uri = logged
    isolate_wandb(monkeypatch, tmp_path)
    overrides = (*OVERRIDES, f"logger.mlflow.tracking_uri={tracking_uri}", "logger.mlflow.experiment_name=resumed")
    _, run_dir = train_in_process(*overrides)
    last = run_dir / "checkpoints" / "last.pt"
    last.unlink()  # a hard link to step 12's file: replaced, not written through
    last.hardlink_to(step_checkpoint(last.parent, 6))  # as if killed after logging steps 8 and 12
    metrics, _ = train_in_process(*overrides, run_dir=run_dir)
    assert metrics["global_step"] == 12

    timings = ("perf/", "train/samples_per_sec")
    expected = {name: points for name, points in csv_series(uninterrupted).items() if not name.startswith(timings)}
    assert [int(row["step"]) for row in csv_rows(run_dir)] == STEPS
    resumed = csv_series(run_dir)
    for name, points in expected.items():
        assert resumed[name] == pytest.approx(points, rel=1e-6), name
    accumulator, reference = events(run_dir), events(uninterrupted)  # the first run's steps 8 and 12 purged
    for name in expected:
        steps_values = [(event.step, event.value) for event in reference.Scalars(name)]
        assert [(event.step, event.value) for event in accumulator.Scalars(name)] == steps_values, name
    assert [event.value for event in accumulator.Scalars("model/params")] == [metrics["model/params"]]

    (run,) = mlflow_runs(tracking_uri, "resumed")  # one run, continued
    assert run.info.status == "FINISHED" and run.data.tags["run_dir"] == str(run_dir)
    for name, points in expected.items():
        assert mlflow_history(tracking_uri, run.info.run_id, name) == pytest.approx(points, rel=1e-6), name

    first, second = wandb_runs(run_dir)  # offline, W&B cannot resume: one run id in two folders, in step order
    assert first.run_id == second.run_id
    assert [row["_step"] for row in first.history] == STEPS
    assert [row["_step"] for row in second.history] == [8, 12]

    train_in_process(*overrides, "resume=false", run_dir=run_dir)  # starting over: a new run, the old rows gone
    assert [int(row["step"]) for row in csv_rows(run_dir)] == STEPS
    steps = [event.step for event in reference.Scalars("train/loss")]
    assert [event.step for event in events(run_dir).Scalars("train/loss")] == steps
    assert len(mlflow_runs(tracking_uri, "resumed")) == 2


@pytest.mark.slow
def test_a_stop_signal_marks_the_run_preempted_and_the_rerun_finishes_it(logged, train_env, tmp_path):
    uninterrupted, _, _, tracking_uri = logged
    env = {**train_env, "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp_path), "WANDB_CACHE_DIR": str(tmp_path)}
    command = [
        sys.executable,
        str(REPO / "src" / "train.py"),
        f"hydra.run.dir={tmp_path / 'run'}",
        *(override for override in OVERRIDES if not override.startswith("logger.wandb.tags")),
        f"logger.mlflow.tracking_uri={tracking_uri}",
        "logger.mlflow.experiment_name=stopped",
        "model._target_=tests.faults.PausingMLP",
        f"+model.pause_file={tmp_path / 'paused'}",
        "+model.fail_rank=0",
        "+model.fail_at_step=3",
    ]
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(tmp_path / "paused", job)  # inside step 3: the run stops after the logging step 4
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 128 + signal.SIGTERM, job.communicate()[0]
    (run,) = mlflow_runs(tracking_uri, "stopped")
    assert run.info.status == "KILLED"
    (stopped,) = wandb_runs(tmp_path / "run")
    assert stopped.preempting and [row["_step"] for row in stopped.history] == [4]
    assert stopped.exit_code == 128 + signal.SIGTERM
    assert [int(row["step"]) for row in csv_rows(tmp_path / "run")] == [4]

    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    (run,) = mlflow_runs(tracking_uri, "stopped")
    assert run.info.status == "FINISHED"
    assert [int(row["step"]) for row in csv_rows(tmp_path / "run")] == STEPS
    first, second = wandb_runs(tmp_path / "run")
    assert first.run_id == second.run_id and not second.preempting


@pytest.mark.slow
@pytest.mark.parametrize("end", ["failed", "stopped", "ctrl-c"])
def test_a_ddp_runs_wandb_run_is_finished_with_the_jobs_exit_code(end, train_env, tmp_path):
    """A ddp run whose rank 1 raises: rank 0 finishes its W&B run at its exit, with exit code 1. One stopped by
    SIGTERM: rank 0 finishes it as it stops, preempted, with exit code 143 (the rank itself hands its stop to the
    launcher and exits 0). Left to W&B's own exit handler, the service was torn down under the unfinished run: its
    debug.log held HandleAbandonedError tracebacks, and the stopped run was recorded with exit code 0. Ctrl-C to the
    whole process group, as a terminal sends it: rank 0 finishes it where it comes, exit code 130, not preempted, its
    rows kept (killed with its peers, it left an empty record)."""
    env = {**train_env, "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp_path), "WANDB_CACHE_DIR": str(tmp_path)}
    command = [sys.executable, str(REPO / "src" / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", "parallel=ddp"]
    command += ["logger=wandb", "trainer.max_epochs=1"]
    if end == "failed":
        command += ["model._target_=tests.faults.RaisingMLP", "+model.fail_rank=1"]
        failed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert "rank 1 failed (exit code 1): RuntimeError: injected failure at step 3" in failed.stderr + failed.stdout
    else:
        command += ["model._target_=tests.faults.PausingMLP", f"+model.pause_file={tmp_path / 'paused'}"]
        command += ["+model.fail_rank=0", "+model.fail_at_step=13", "trainer.log_every_n_steps=5"]  # rows 5, 10
        output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        job = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True, **output)
        wait_for(tmp_path / "paused", job)
        sent = signal.SIGTERM if end == "stopped" else signal.SIGINT
        job.send_signal(sent) if end == "stopped" else os.killpg(job.pid, sent)
        assert job.wait(timeout=120) == 128 + sent, job.communicate()[0]
    (run,) = wandb_runs(tmp_path / "run")
    assert run.exit_code == {"failed": 1, "stopped": 128 + signal.SIGTERM, "ctrl-c": 128 + signal.SIGINT}[end]
    assert run.preempting == (end == "stopped") and (run.history or end == "failed")
    (debug_log,) = (tmp_path / "run").glob("wandb/offline-run-*/logs/debug.log")
    assert "HandleAbandonedError" not in debug_log.read_text()


# --- bad input ---------------------------------------------------------------------------------------------------


@pytest.fixture
def reject(train_in_process, tmp_path, caplog):
    return lambda *overrides: rejected_in_process(train_in_process, tmp_path, caplog, *overrides)


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_missing_package_names_the_extra(reject, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # Python's own way to make `import wandb` fail
    error = reject(f"logger=[tensorboard,{package}]")
    assert error == (
        f"logger.{package}: needs the {package} package, which is not installed; pip install 'hydraloop[{package}]'"
    )


def test_unreachable_tracking_uri(reject, tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    error = reject("logger=mlflow", f"logger.mlflow.tracking_uri={uri}")
    assert error.startswith(f"logger.mlflow.tracking_uri={uri}: no MLflow server answers at 127.0.0.1:"), error


def test_tracking_database_that_cannot_be_made(reject, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    error = reject("logger=mlflow", f"logger.mlflow.tracking_uri=sqlite:///{blocker}/mlflow.db")
    assert error == f"logger.mlflow.tracking_uri=sqlite:///{blocker}/mlflow.db: cannot make the database in {blocker}"
    blocker.unlink()


def test_folder_store(reject, monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    error = reject("logger=mlflow", f"logger.mlflow.tracking_uri={tmp_path / 'mlruns'}")
    assert error.startswith(f"logger.mlflow.tracking_uri={tmp_path / 'mlruns'}: a folder store, which MLflow 3 refuses")


def test_wandb_mode_follows_credentials(monkeypatch, tmp_path):
    from hydraloop.loggers.wandb import WandbLogger

    isolate_wandb(monkeypatch, tmp_path)
    assert WandbLogger().mode == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert WandbLogger().mode == "online"
    monkeypatch.delenv("WANDB_API_KEY")
    (tmp_path / "no-netrc").write_text("machine api.wandb.ai login user password " + "y" * 40 + "\n")
    (tmp_path / "no-netrc").chmod(0o600)
    assert WandbLogger().mode == "online"  # `wandb login` saved a key
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert WandbLogger().mode is None  # W&B's own variable decides
    assert WandbLogger(mode="offline").mode == "offline"
