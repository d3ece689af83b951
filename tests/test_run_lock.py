"""run.lock's rules, against real processes: who holds a run directory, and who may take it over (a process that is
gone, an earlier attempt of the same job), and who may not (a live run, one on another host)."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from conftest import TRAIN, wait_for
from hydraloop.errors import ConfigError
from hydraloop.run_lock import LOCK_FILE, Owner, release, take

JOB_ENV = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture(autouse=True)
def no_job(monkeypatch):
    """As a plain `python src/train.py` outside any job, unless a test says otherwise."""
    for key in JOB_ENV:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def live_process():
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait()


def holder(pid: int, host: str | None = None, **fields) -> Owner:
    """A lock record for process `pid`, on this host unless `host` (its start time unknown unless given)."""
    fields = {"process_start": 0, **fields}
    return replace(Owner.this_process(), pid=pid, host=host or socket.gethostname(), **fields)


def write_lock(run_dir, owner: Owner) -> None:
    (run_dir / LOCK_FILE).write_text(json.dumps(asdict(owner)))


def may_own(run_dir) -> bool:
    """Whether a new run could take the directory's lock now: there is none, or its holder's is stale. Only looks."""
    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return True
    holder = Owner(**json.loads(path.read_text() or "{}")) if path.read_text() else None
    return holder is None or holder.stale_for(Owner.this_process()) is not None


def test_taken_then_released(tmp_path):
    me = take(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == asdict(me)
    assert (me.host, me.pid, me.job) == (socket.gethostname(), os.getpid(), "")
    assert not may_own(tmp_path)  # this process holds it: a second run in it, e.g. Hydra's next job, may not
    release(tmp_path, me)
    assert not (tmp_path / LOCK_FILE).exists()
    assert may_own(tmp_path)


def test_a_live_run_keeps_its_directory(tmp_path, live_process):
    owner = holder(live_process.pid)
    write_lock(tmp_path, owner)
    with pytest.raises(ConfigError) as refused:
        take(tmp_path)
    assert str(refused.value) == (
        f"run directory {tmp_path}: in use by another run (pid {live_process.pid} on {owner.host}, since "
        f"{owner.since}); wait for it to end, or give this run another hydra.run.dir"
    )
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == asdict(owner)  # untouched
    assert not may_own(tmp_path)


def test_the_lock_of_a_process_that_is_gone_is_taken_over(tmp_path, caplog):
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_lock(tmp_path, holder(gone.pid))
    assert may_own(tmp_path)
    with caplog.at_level(logging.INFO, logger="hydraloop.run_lock"):
        me = take(tmp_path)
    assert me.pid == os.getpid()
    assert (
        f"taking over the lock of pid {gone.pid} on {me.host}" in caplog.text and "(its process is gone)" in caplog.text
    )


def test_a_reused_pid_is_not_its_owner(tmp_path, live_process):
    """The pid is alive, but the process that holds it started at another time: the owner is gone."""
    write_lock(tmp_path, holder(live_process.pid, process_start=1))
    assert take(tmp_path).pid == os.getpid()


def test_a_run_on_another_host_cannot_be_checked_and_keeps_its_directory(tmp_path):
    owner = holder(4242, host="gpu-node-7", job="slurm:41")
    write_lock(tmp_path, owner)
    with pytest.raises(ConfigError) as refused:
        take(tmp_path)
    assert str(refused.value) == (
        f"run directory {tmp_path}: in use by another run (pid 4242 on gpu-node-7, job slurm:41, since "
        f"{owner.since}); if that run is gone, delete {tmp_path / LOCK_FILE}"
    )


@pytest.mark.parametrize(
    "env, held_by, taken",
    [
        # SLURM requeues the job, on another node, while the old allocation is still ending.
        ({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "1"}, dict(job="slurm:41", attempt=[0, 0]), True),
        # torchrun restarts its workers (rank 0 may land on another node of the job).
        (
            {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"},
            dict(job="torchrun:abc", attempt=[0, 1]),
            True,
        ),
        # Two runs of one attempt: twice `python src/train.py` in one salloc shell.
        ({"SLURM_JOB_ID": "41"}, dict(job="slurm:41", attempt=[0, 0]), False),
        # An earlier attempt, still ending, does not take the lock back from a later one.
        ({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "1"}, dict(job="slurm:41", attempt=[2, 0]), False),
        # torchrun's default --rdzv-id is no job identity: unrelated jobs share it.
        ({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "1"}, dict(job="", attempt=[0, 0]), False),
        ({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}, dict(job="slurm:41", attempt=[0, 0]), False),
    ],
)
def test_a_later_attempt_of_the_same_job_takes_over(tmp_path, monkeypatch, env, held_by, taken):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    write_lock(tmp_path, holder(4242, host="gpu-node-7", **held_by))
    if taken:
        assert take(tmp_path).pid == os.getpid()
    else:
        with pytest.raises(ConfigError, match="in use by another run"):
            take(tmp_path)


def test_release_leaves_a_lock_taken_over_since(tmp_path, monkeypatch):
    """A requeued job took the lock over while this, its old attempt, was ending: the old one's exit keeps it."""
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    old = take(tmp_path)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    new = take(tmp_path)
    release(tmp_path, old)
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == asdict(new)
    release(tmp_path, new)
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.parametrize("content", ["", '{"host": "vm", "pi'])
def test_an_empty_or_torn_lock_file_holds_nothing(tmp_path, content):
    (tmp_path / LOCK_FILE).write_text(content)
    assert take(tmp_path).pid == os.getpid()


RACER = """
import sys, time
from pathlib import Path
from hydraloop.errors import ConfigError
from hydraloop.run_lock import take

run_dir, start = Path(sys.argv[1]), float(sys.argv[2])
while time.time() < start:
    pass
try:
    take(run_dir)
except ConfigError:
    sys.exit(3)
while not (run_dir / "done").exists():  # hold it until every other racer has tried
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_runs_starting_at_once_cannot_both_take_it(tmp_path):
    start = time.time() + 2  # every racer imported and spinning by then
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(start)]) for _ in range(6)]
    deadline = time.monotonic() + 60
    while sum(racer.poll() is not None for racer in racers) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    (tmp_path / "done").touch()
    assert sorted(racer.wait(timeout=60) for racer in racers) == [0, 3, 3, 3, 3, 3]


@pytest.mark.slow
def test_a_stop_signal_while_the_run_starts_releases_the_lock_and_leaves_nothing(train_env, tmp_path):
    """SIGTERM once the run directory is taken and the run accepted (.hydra/ and train.log written), before the
    training loop's stop handler exists. The signal's default ended the process there (exit -15), leaving run.lock
    and what the run had written; now it ends it in one line, exit 143, the lock released and the directory as it
    was before the command: here, none."""
    run_dir = tmp_path / "run"
    model = ("model._target_=tests.faults.SlowStartMLP", f"+model.pause_file={tmp_path / 'paused'}")
    command = [sys.executable, str(TRAIN), f"hydra.run.dir={run_dir}", "logger=none", *model]
    command.append(f"+model.resume_file={tmp_path / 'resume'}")
    process = subprocess.Popen(command, env=train_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(tmp_path / "paused", process)  # the rank builds its model: the loop has not started
        assert (run_dir / LOCK_FILE).is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
        os.kill(process.pid, signal.SIGTERM)  # single: the launcher is the rank
        output = process.communicate(timeout=120)[0]
    finally:
        (tmp_path / "resume").touch()
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "stopped by SIGTERM outside the training loop, without a checkpoint" in output
    assert not run_dir.exists()
