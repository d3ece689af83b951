"""Stopping and starting again: a stop signal checkpoints mid-epoch and a rerun continues to the uninterrupted
run's result; a dead rank ends the job quickly with its last good checkpoint intact; a restarted job resumes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TRAIN, free_port, max_param_diff, read_checkpoint, torchrun_command, wait_for

pytestmark = pytest.mark.slow

RECIPE = ("trainer.max_epochs=2", "model.dropout=0.2", "trainer.log_every_n_steps=5", "logger=none")


@pytest.mark.parametrize(
    "parallel, launcher", [("single", "python"), ("ddp", "python"), ("fsdp", "python"), ("ddp", "torchrun")]
)
def test_stop_signal_mid_epoch_then_rerun_ends_where_the_uninterrupted_run_ends(
    run_train, train_env, tmp_path, parallel, launcher
):
    pause_file = tmp_path / "paused"
    overrides = [
        f"hydra.run.dir={tmp_path / 'run'}",
        *RECIPE,
        "model._target_=tests.faults.PausingMLP",
        f"+model.pause_file={pause_file}",
        "+model.fail_rank=0",
        "+model.fail_at_step=13",
    ]
    if launcher == "torchrun":
        command = torchrun_command(*overrides, parallel=parallel)
    else:
        command = [sys.executable, str(TRAIN), f"parallel={parallel}", *overrides]
    job = subprocess.Popen(command, env=train_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(pause_file, job)  # rank 0 is inside step 13 (of 22 in epoch 1)
    job.send_signal(signal.SIGTERM)  # to the launcher: torch.distributed.elastic's agent passes it on to the ranks
    output = job.communicate(timeout=120)[0]

    # torchrun's own exit status after a signal is torchrun's; each rank's is ours, 143, after one line.
    assert job.returncode == 128 + signal.SIGTERM or launcher == "torchrun" and job.returncode != 0, output
    assert "stopped by SIGTERM" in output
    checkpoint = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    # The next logging step after the signal: step 15, mid-epoch.
    assert (checkpoint["epoch"], checkpoint["global_step"], checkpoint["epoch_step"]) == (0, 15, 15)
    assert not (tmp_path / "run" / "metrics.json").exists()  # the run did not finish

    rerun = subprocess.run(command, env=train_env, capture_output=True, text=True, timeout=180)  # the same command
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "checkpoints/last.pt: epoch 0, step 15" in rerun.stdout + rerun.stderr
    uninterrupted = run_train(f"parallel={parallel}", *RECIPE)
    assert uninterrupted.returncode == 0, uninterrupted.output

    resumed = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    expected = uninterrupted.checkpoint()
    assert resumed["global_step"] == expected["global_step"] == 44
    assert max_param_diff(resumed["model"], expected["model"]) < 1e-6  # dropout masks included: per-step seeds
    assert resumed["metrics"]["val/acc"] == expected["metrics"]["val/acc"]


def test_ctrl_c_ends_a_single_process_run_in_one_line(train_env, tmp_path):
    """SIGINT in one process: Python's KeyboardInterrupt, wherever it came (here inside a step), ends the run as the
    launcher of ranks ends it, in one line and exit 130, without a checkpoint; it printed a traceback of torch's
    internals before. The run directory's lock is released."""
    pause_file = tmp_path / "paused"
    command = [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / 'run'}", *RECIPE]
    command += ["model._target_=tests.faults.PausingMLP", f"+model.pause_file={pause_file}", "+model.fail_rank=0"]
    job = subprocess.Popen(command, env=train_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(pause_file, job)
    job.send_signal(signal.SIGINT)
    output = job.communicate(timeout=60)[0]
    assert job.returncode == 128 + signal.SIGINT, output
    assert "stopped by SIGINT (Ctrl-C: ended at once, without a checkpoint)" in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()
    assert not (tmp_path / "run" / "run.lock").exists()


def test_killed_rank_ends_the_job_within_seconds_and_keeps_the_last_checkpoint(run_train):
    started = time.monotonic()
    run = run_train(
        "parallel=ddp",
        "trainer.max_epochs=3",
        "logger=none",
        "model._target_=tests.faults.KilledMLP",
        "+model.fail_rank=1",
        "+model.fail_at_step=30",  # in epoch 2, after epoch 1's checkpoint (22 steps)
        timeout=150,
    )
    elapsed = time.monotonic() - started
    assert run.returncode == 1, run.output
    assert "rank 1 failed (exit code -9)" in run.output
    # The agent sees the dead process at once and stops the others; not a benchmark, a bound.
    assert elapsed < 60
    checkpoint = run.checkpoint("last.pt")
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (1, 22)
    assert not list((run.run_dir / "checkpoints").glob("*.tmp"))


FAIL_ONCE = ("model._target_=tests.faults.FailingOnceMLP", "+model.fail_rank=1", "+model.fail_at_step=30")


@pytest.mark.parametrize("parallel, sent", [("single", "SIGTERM"), ("ddp", "SIGUSR1")])
def test_a_stop_signal_to_every_process_of_the_job_stops_it_with_a_checkpoint(run_train, parallel, sent):
    """As SLURM signals each process of a job step (scancel, its time limit, submitit's --signal) and `pkill` does:
    the loaders' workers, their fork server and the resource tracker get it too (hydraloop.data.workers). A worker it
    ended failed the rank where it would have written its checkpoint (exit 1: `DataLoader worker (pid(s) ...) exited
    unexpectedly`); SIGUSR1 ended the resource tracker, whose successor printed a KeyError traceback per
    shared-memory segment the first had registered."""
    stop = ("+callbacks.stop._target_=tests.faults.StopSignalAt", "+callbacks.stop.at_step=3")
    stop += (f"+callbacks.stop.signal_name={sent}", "+callbacks.stop.every_process=true")
    run = run_train(f"parallel={parallel}", "data.num_workers=1", "trainer.max_epochs=1", "logger=none", *stop)
    assert run.returncode == 128 + signal.Signals[sent], run.output
    assert f"stopped by {sent} after step 10" in run.output and "Traceback" not in run.output, run.output
    assert run.checkpoint()["global_step"] == 10


@pytest.fixture(scope="module")
def uninterrupted_3_epochs(run_train):
    run = run_train("parallel=ddp", "trainer.max_epochs=3", "model.dropout=0.2", "logger=none")
    assert run.returncode == 0, run.output
    return run


def test_restarted_ranks_resume_from_the_last_checkpoint(run_train, uninterrupted_3_epochs):
    run = run_train(
        "parallel=ddp",
        "parallel.max_restarts=1",
        "trainer.max_epochs=3",
        "model.dropout=0.2",
        "logger=none",
        *FAIL_ONCE,
    )
    assert run.returncode == 0, run.output
    assert "injected failure at step 30" in run.log  # the first attempt did fail
    assert "checkpoints/last.pt: epoch 1, step 22" in run.log  # and the second started from epoch 1's checkpoint
    assert run.metrics["global_step"] == 66
    assert max_param_diff(run.checkpoint()["model"], uninterrupted_3_epochs.checkpoint()["model"]) < 1e-6


def test_torchrun_max_restarts_resumes_in_the_same_run_directory(tmp_path, train_env, uninterrupted_3_epochs):
    command = torchrun_command(
        "trainer.max_epochs=3",
        "model.dropout=0.2",
        "logger=none",
        *FAIL_ONCE,
        launcher_args=("--standalone", "--nproc_per_node=2", "--max-restarts=1"),
    )
    proc = subprocess.run(command, cwd=tmp_path, env=train_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1  # the restarted ranks found the first attempt's directory, and its checkpoint
    assert "checkpoints/last.pt: epoch 1, step 22" in (run_dirs[0] / "train.log").read_text()
    model = read_checkpoint(run_dirs[0] / "checkpoints" / "last.pt")["model"]
    assert max_param_diff(model, uninterrupted_3_epochs.checkpoint()["model"]) < 1e-6


@pytest.fixture(scope="module")
def uninterrupted_1_epoch(run_train):
    run = run_train("trainer.max_epochs=1", "logger=none")
    assert run.returncode == 0, run.output
    return run


@pytest.mark.parametrize(
    "strategy, during, at_step",
    [
        (("parallel=single",), "step", 21),  # the ranks agree on it at the last step: it ended the run with 143
        (("parallel=ddp",), "validation", 22),  # in the final validation: metrics.json written, and 143
        (("parallel=fsdp", "callbacks=[ema]"), "step", 21),  # 143, and no metrics.json
    ],
    ids=["single", "ddp", "fsdp-ema"],
)
def test_a_stop_signal_in_the_last_logging_interval_lets_every_strategy_finish(
    run_train, uninterrupted_1_epoch, strategy, during, at_step
):
    """SIGTERM to the launcher (tests.faults.StopSignalAt) in the last of 22 steps' logging intervals (21-22), or
    after it: nothing is left to stop for, so every strategy ends the run as it would have ended, exit 0 with
    metrics.json, and a rerun of the command finds it finished."""
    command = (
        *strategy,
        "trainer.max_epochs=1",
        "logger=none",
        "+callbacks.stop._target_=tests.faults.StopSignalAt",
        f"+callbacks.stop.at_step={at_step}",
        f"+callbacks.stop.during={during}",
    )
    run = run_train(*command, timeout=150)
    assert run.returncode == 0, run.output
    assert "got SIGTERM" in run.log and "SIGTERM came at or after the run's last step" in run.log
    assert run.metrics["global_step"] == run.checkpoint()["global_step"] == 22
    expected = uninterrupted_1_epoch.checkpoint()
    assert max_param_diff(run.checkpoint()["model"], expected["model"]) < 1e-5  # per-rank means against one mean
    assert run.metrics["val/acc"] == pytest.approx(expected["metrics"]["val/acc"])

    rerun = run_train(*command, run_dir=run.run_dir)
    assert rerun.returncode == 0, rerun.output
    assert "finished at step 22; its records are left as they are" in rerun.output


def test_elastic_torchrun_loses_a_node_and_finishes_alone_as_single_does(tmp_path, train_env, uninterrupted_1_epoch):
    """Two torchrun agents on this machine, one rank each, in an elastic job (--nnodes=1:2, c10d rendezvous,
    --max-restarts=1). The second node is lost at step 15 (its agent and its rank killed); the first one's rank then
    fails its collective, its agent meets the rendezvous again alone and restarts it, and it resumes from the step-10
    checkpoint at world size 1: the run ends with single-process training's weights. The first node hosts the
    rendezvous store (is_host): losing that node would end the job."""
    pids, resume_file, run_dir = tmp_path / "pids", tmp_path / "resume", tmp_path / "run"
    pids.mkdir()
    rendezvous = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d", "--rdzv-id=elastic", "--max-restarts=1"]
    rendezvous.append(f"--rdzv-endpoint=localhost:{free_port()}")
    overrides = (
        f"hydra.run.dir={run_dir}",
        "trainer.max_epochs=1",
        "trainer.ckpt_every_n_steps=10",
        "logger=none",
        "parallel.timeout_s=60",
        "model._target_=tests.waits.WaitingInFirstAttemptMLP",
        "+model.wait_at_step=15",
        f"+model.pid_dir={pids}",
        f"+model.resume_file={resume_file}",
    )
    env = {**train_env, "OMP_NUM_THREADS": "1"}  # a core each, as two nodes would have

    def node(is_host: int) -> subprocess.Popen:
        # The survivor's second rendezvous waits last_call_timeout for other nodes before it starts alone.
        conf = f"--rdzv-conf=is_host={is_host},last_call_timeout=5"
        command = torchrun_command(*overrides, launcher_args=(*rendezvous, conf))
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    lost = node(is_host=0)  # a client first: it waits for the store, so the rendezvous fills at once
    survivor = node(is_host=1)
    try:
        for rank in ("0", "1"):
            wait_for(pids / rank, survivor)
        ranks = {int((pids / rank).read_text()) for rank in ("0", "1")}
        lost_rank = next(pid for pid in ranks if _parent(pid) == lost.pid)
        os.kill(lost_rank, signal.SIGKILL)  # the node is gone: its agent and its rank
        lost.kill()
        resume_file.touch()
        output = survivor.communicate(timeout=240)[0]
    finally:
        resume_file.touch()
        for process in (lost, survivor):
            process.kill()
            process.wait()
    assert survivor.returncode == 0, output
    # The lost peer, said once by the survivor's rank: no second line claiming a traceback it never printed.
    assert output.count("a collective failed: another rank is gone") == 1 and "training failed" not in output, output
    log = (run_dir / "train.log").read_text()
    assert "checkpoints/last.pt: epoch 0, step 10" in log  # the restarted rank resumed from the last checkpoint
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["global_step"]) == (1, 22)
    final = read_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert max_param_diff(final["model"], uninterrupted_1_epoch.checkpoint()["model"]) < 1e-5


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])
