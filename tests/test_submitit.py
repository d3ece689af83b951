"""hydra-submitit-launcher: each submitit task is one DDP rank, the ranks of a job share the job's run directory,
the job computes what one process computes, and the sweeper receives rank 0's result.

The jobs run on submitit's local executor (`hydra/launcher=submitit_local`), which starts its tasks the way
`hydra/launcher=slurm` does on a cluster, minus SLURM: same plugin, same pickled task, same result files.
"""

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from conftest import REPO, TRAIN, max_param_diff, read_checkpoint, wait_for
from hydraloop.config import register_configs
from hydraloop.parallel.cluster import export_submitit_rank_env, master_port

TOLERANCE = 1e-5  # as in test_exactness.py: DDP agrees with one process to float round-off after 2 epochs
TWO_RANK_JOBS = ("-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", "parallel=ddp")
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_slurm_launcher_config():
    register_configs()
    keys = ["nodes=2", "tasks_per_node=4", "partition=gpu", "account=lab"]
    overrides = ["hydra/launcher=slurm", *(f"hydra.launcher.{key}" for key in keys)]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)  # one task per GPU
    assert (launcher.partition, launcher.account, launcher.signal_delay_s) == ("gpu", "lab", 120)


def test_rank_env_from_a_slurm_task(monkeypatch):
    """Task 5 of a job of 2 nodes x 4 tasks: the env:// variables DDPStrategy joins the group with."""
    for key in RANK_ENV:
        monkeypatch.setenv(key, "stale")  # as if inherited from the submitting shell; restored after the test
    slurm = dict(SLURM_JOB_ID="123", SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="2", SLURM_NODEID="1")
    slurm.update(SLURM_JOB_NODELIST="gpu-[3-4]", SLURM_PROCID="5", SLURM_LOCALID="1", SUBMITIT_EXECUTOR="slurm")
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)

    assert export_submitit_rank_env() == 8
    ranks = dict(RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4")
    assert {key: os.environ[key] for key in RANK_ENV} == ranks | dict(
        MASTER_ADDR="gpu-3", MASTER_PORT=str(master_port("123"))
    )
    assert 20000 <= master_port("123") != master_port("124")  # every task of a job agrees; jobs differ

    # A job of one task is one machine's share: the strategy starts its ranks itself, as on a workstation.
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("RANK", "stale")
    assert export_submitit_rank_env() == 1 and os.environ["RANK"] == "stale"
    monkeypatch.delenv("SUBMITIT_EXECUTOR")
    assert export_submitit_rank_env() == 1


def test_tasks_without_ddp_are_refused(train_in_process, monkeypatch, caplog):
    """Two tasks under parallel=single would be two rank 0s writing one run directory."""
    for key in RANK_ENV:
        monkeypatch.setenv(key, "stale")  # restored after the test
    local = dict(SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_JOB_ID="7", SUBMITIT_LOCAL_NTASKS="2")
    for key, value in (local | dict(SUBMITIT_LOCAL_GLOBALID="0", SUBMITIT_LOCAL_LOCALID="0")).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        train_in_process("parallel=single")
    assert exit_info.value.code == 2
    refused = "WORLD_SIZE=2: torchrun or hydra.launcher started 2 processes, one rank each, but SingleDevice"
    assert refused in caplog.text


def sweep_and_jobs(sweep_root: Path) -> tuple[Path, list[Path]]:
    """The one sweep directory under `sweep_root`, and its job directories in job order."""
    (sweep,) = sweep_root.iterdir()
    return sweep, sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def task_returns(sweep: Path, job: Path) -> list[float]:
    """What each task of the job returned, by rank: the result files the launcher's `job.results()` reads."""
    hydra_config = yaml.safe_load((job / ".hydra" / "hydra.yaml").read_text())
    job_id = str(hydra_config["hydra"]["job"]["id"])  # the plugin sets hydra.job.id to submitit's job id
    returns = []
    for rank in range(2):
        result = sweep / ".submitit" / job_id / f"{job_id}_{rank}_result.pkl"
        outcome, job_return = pickle.loads(result.read_bytes())
        assert outcome == "success", job_return
        returns.append(job_return.return_value)
    return returns


@pytest.mark.slow
def test_two_rank_jobs_one_run_dir_each_and_match_single(run_train, tmp_path):
    """Two jobs at once (seed=0,1) of two tasks each: four processes, two process groups on one machine."""
    # Microseconds in the sweep dir: tasks that resolved `now` themselves would make sweep dirs of their own.
    sweep_dir = f"hydra.sweep.dir={tmp_path}/sweep/${{now:%H-%M-%S-%f}}"
    run = run_train(*TWO_RANK_JOBS, "seed=0,1", "trainer.max_epochs=2", sweep_dir)
    assert run.returncode == 0, run.output
    sweep, jobs = sweep_and_jobs(tmp_path / "sweep")
    assert [job.name for job in jobs] == ["0", "1"]
    assert not list(sweep.glob("*/*/.hydra"))  # no rank made a run directory of its own inside a job's
    for seed, job in enumerate(jobs):
        metrics = json.loads((job / "metrics.json").read_text())
        assert metrics["world_size"] == 2 and metrics["epoch"] == 2
        assert f"seed={seed}" in (job / ".hydra" / "overrides.yaml").read_text()
        # Written by rank 0 alone: one TensorBoard writer, one line per epoch in the shared log.
        assert len(list((job / "tensorboard").glob("events.out.tfevents.*"))) == 1
        assert (job / "train.log").read_text().count("epoch 2/2 |") == 1
        assert (job / "checkpoints" / "last.pt").exists() and (job / "checkpoints" / "best.pt").exists()
        # Both ranks return the global metric; the launcher passes rank 0's (results()[0]) to the sweeper.
        assert task_returns(sweep, job) == [metrics["val/acc"]] * 2

    single = run_train("seed=0", "trainer.max_epochs=2")
    assert single.returncode == 0, single.output
    job0 = read_checkpoint(jobs[0] / "checkpoints" / "last.pt")
    assert max_param_diff(job0["model"], single.checkpoint()["model"]) < TOLERANCE
    assert job0["metrics"]["val/acc"] == single.metrics["val/acc"]


@pytest.mark.slow
def test_sweeper_receives_rank_0s_metric(run_train, tmp_path):
    """An Optuna study of one trial: the value it records is the one the job's rank 0 wrote to metrics.json."""
    study = ("hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", "hydra.sweeper.direction=maximize")
    run = run_train(*TWO_RANK_JOBS, *study, "trainer.max_epochs=1", "logger=none", f"hydra.sweep.dir={tmp_path}")
    assert run.returncode == 0, run.output
    metrics = json.loads((tmp_path / "0" / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())["best_value"] == metrics["val/acc"]


@pytest.mark.slow
def test_time_limit_signal_checkpoints_requeues_and_resumes(run_train, train_env, tmp_path):
    """SIGUSR2, submitit's warning before the time limit, reaches rank 0 mid-epoch. The ranks checkpoint at the next
    logging step, then submitit's own handler requeues the job, which resumes in the same directory and ends where an
    uninterrupted run ends; the sweeper receives that result."""
    recipe = ("trainer.max_epochs=2", "model.dropout=0.2", "trainer.log_every_n_steps=5", "logger=none")
    pause_file = tmp_path / "paused"
    fault = ("model._target_=tests.faults.PausingMLP", f"+model.pause_file={pause_file}", "+model.fail_rank=0")
    command = [sys.executable, str(TRAIN), *TWO_RANK_JOBS, f"hydra.sweep.dir={tmp_path}/sweep", *recipe, *fault]
    sweep = subprocess.Popen(
        [*command, "+model.fail_at_step=13"], env=train_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for(pause_file, sweep)  # rank 0 is inside step 13
    os.kill(int(pause_file.read_text()), signal.SIGUSR2)
    output = sweep.communicate(timeout=300)[0]
    assert sweep.returncode == 0, output

    job = tmp_path / "sweep" / "0"
    log = (job / "train.log").read_text()
    assert "stopping after step 15 (epoch 1, step 15 of 22)" in log
    assert f"loaded {job}/checkpoints/last.pt: epoch 0, step 15" in log  # the requeued job, in the same directory
    uninterrupted = run_train("parallel=ddp", *recipe)
    assert uninterrupted.returncode == 0, uninterrupted.output
    final = read_checkpoint(job / "checkpoints" / "last.pt")
    assert final["global_step"] == 44
    assert max_param_diff(final["model"], uninterrupted.checkpoint()["model"]) < 1e-6
    assert task_returns(tmp_path / "sweep", job) == [final["metrics"]["val/acc"]] * 2
