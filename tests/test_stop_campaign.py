"""Stop signals at every moment of a run of spawned ranks end it within seconds, exactly resumable, and no run of
them leaves a file in the temporary folder or a process behind (scripts/stop_campaign.py; issue 48)."""

import json
import logging
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, TRAIN
from hydraloop.errors import Interrupted, exit_on_error
from hydraloop.preemption import StopRequest, interrupt_once, stop_at_once, stop_taken

sys.path.insert(0, str(REPO / "scripts"))
from run_leftovers import environment, left_behind  # noqa: E402


def test_a_stop_signal_while_omegaconf_reads_a_key_stays_a_stop():
    """OmegaConf rebuilds an exception raised inside it from its text alone (format_and_raise), as pickle does from
    its args: a stop that came as a rank read its config was a TypeError, and the rank a failed one (exit 1)."""
    cfg = OmegaConf.create({"trainer": {"max_epochs": 1}})
    sent = []

    def signal_inside_omegaconf(frame, event, arg):
        if event == "call" and not sent and "omegaconf" in frame.f_code.co_filename:
            sent.append(frame.f_code.co_name)
            signal.raise_signal(signal.SIGTERM)  # handled at the next instruction: inside OmegaConf
        return None

    with stop_at_once(), pytest.raises(Interrupted) as stop:
        sys.settrace(signal_inside_omegaconf)
        try:
            assert cfg.trainer.max_epochs == 1  # not reached: the stop comes first
        finally:
            sys.settrace(None)
    assert sent and stop.value.__traceback__ is not None
    assert (stop.value.signum, str(stop.value)) == (
        signal.SIGTERM,
        "stopped by SIGTERM outside the training loop, without a checkpoint",
    )
    unpickled = pickle.loads(pickle.dumps(stop.value))
    assert (unpickled.signum, str(unpickled)) == (stop.value.signum, str(stop.value))
    with pytest.raises(SystemExit) as exited, exit_on_error():
        raise unpickled
    assert exited.value.code == 128 + signal.SIGTERM


def test_a_stop_that_the_code_it_landed_in_raised_an_error_from_stays_a_stop():
    """A library that re-raises any Exception as its own (DTensor's sharding propagation: `RuntimeError(...) from`
    it) made a stop signal a failure: while fsdp built its parameters, a failed rank (exit 1), and a second SIGTERM
    then ended the launcher by the signal (-15). An error that carries no stop stays what it was."""
    with pytest.raises(Interrupted) as stop, stop_at_once():
        try:
            signal.raise_signal(signal.SIGTERM)  # handled at the next instruction, inside the try
            time.sleep(0.01)
        except Exception as error:
            raise RuntimeError(f"{error}\n\nSharding propagation failed") from error
    assert (stop.value.signum, type(stop.value.__cause__)) == (signal.SIGTERM, RuntimeError)
    stop_taken()
    with pytest.raises(ValueError), stop_at_once():
        raise ValueError("not a stop")


def test_a_stop_inside_a_library_while_the_model_is_built_ends_the_run_as_a_stop(run_train):
    """The same where a run builds its model (tests.faults.StopWrappedMLP): the rank logged `training failed` with
    the library's traceback, and the run ended as a failure (exit 1) where nothing else took the signal."""
    run = run_train("logger=none", "model._target_=tests.faults.StopWrappedMLP")
    assert run.returncode == 143, run.output
    assert "stopped by SIGTERM outside the training loop, without a checkpoint" in run.output
    assert "training failed" not in run.output and "Sharding propagation" not in run.output


@pytest.mark.slow
def test_a_stop_signal_to_one_rank_alone_before_its_training_stops_the_job(run_train):
    """`kill <a rank's pid>` (or a scheduler's signal to one task) while rank 1 builds its model: the rank stopped,
    and rank 0 waited in a collective until parallel.timeout_s (then failed: exit 1). Now the rank hands its signal
    to the launcher, which stops the job as on its own."""
    model = ("model._target_=tests.faults.StopWrappedMLP", "+model.fail_rank=1", "+model.alone=true")
    run = run_train("parallel=ddp", "parallel.timeout_s=60", "logger=none", *model, timeout=50)
    assert run.returncode == 143, run.output
    # Rank 0 hands in its own stop before training, or is ended a moment later: said either way.
    assert re.search(
        r"stopped by SIGTERM (outside the training loop|while the ranks were starting, before training), "
        "without a checkpoint",
        run.output,
    ), run.output


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_that_the_code_it_landed_in_swallowed_is_raised_where_the_loop_starts(sent, caplog):
    """A handler's Interrupted (or Ctrl-C's KeyboardInterrupt) raised inside code that catches it (a logging call's
    handler catches every Exception, and printed it as a logging error) was lost: the run trained to its end, exit 0,
    and took no further Ctrl-C. It is raised again where the loop starts; a second signal on the way out of it is
    dropped."""
    caplog.set_level(logging.INFO, logger="hydraloop.preemption")
    signal.signal(signal.SIGINT, interrupt_once)
    with stop_at_once():
        try:
            signal.raise_signal(sent)  # handled at the next instruction, inside the try
            time.sleep(0.01)
        except BaseException:  # noqa: BLE001  what a library's bare `except:` does
            pass
        with pytest.raises((Interrupted, KeyboardInterrupt)) as stop, StopRequest():
            pytest.fail("the loop started")
        with pytest.raises(type(stop.value)):
            try:
                raise stop.value
            finally:
                signal.raise_signal(signal.SIGINT)  # on the way out: dropped, not a second KeyboardInterrupt
                time.sleep(0.01)
    assert (stop.value.signum if sent == signal.SIGTERM else signal.SIGINT) == sent
    assert "got SIGINT: a stop is already under way" in caplog.text


@pytest.mark.slow
def test_stops_at_each_moment_end_within_seconds_resumable_and_leave_nothing(tmp_path, train_env):
    """A try of the campaign at each moment, the three signals in turn, each to the command's whole process group as a
    terminal sends it (scripts/stop_campaign.py --tries 48 for more): SIGINT while the ranks start (forked: 60 s before,
    the agent's shutdown timeout, for a rank stuck in gloo's connect), two SIGTERMs in step 1 (spawned ranks: the second
    ended the launcher by the signal), SIGTERM during a validation (forked), SIGINT mid-epoch (spawned) and two SIGTERMs
    during a checkpoint write (forked), each rank with a loader worker. Each ends within 5 s with 128 + the first
    signal's number, leaves its checkpoints whole, nothing in its own TMPDIR and no process, and its rerun ends at the
    uninterrupted run's parameters (whose run leaves nothing either)."""
    out = tmp_path / "tries.json"
    command = [sys.executable, str(REPO / "scripts" / "stop_campaign.py"), "--tries", "5", "--out", str(out)]
    command += ["--moments", "start", "first-step", "validation", "mid-epoch", "checkpoint"]  # not `launch`: no rank
    command += ["--signals", "SIGINT", "SIGTERM-twice", "SIGTERM", "--to", "group"]  # as a terminal sends them
    command += ["--no-shared-memory"]  # the machine's, which the suite's other tests share meanwhile
    command += ["--workers", "1"]  # a signal to the group ended a rank's loader workers, and the rank failed
    done = subprocess.run(command, env=train_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 tries, 0 failed" in done.stdout, done.stdout
    tries = json.loads(out.read_text())
    moments = [(one["moment"], one["start_method"], one["exit"]) for one in tries]
    assert moments == [
        ("start", "fork", 130),
        ("first-step", "spawn", 143),
        ("validation", "fork", 143),
        ("mid-epoch", "spawn", 130),
        ("checkpoint", "fork", 143),
    ]
    # Where each stop left last.pt. SIGINT: none (no checkpoint before step 22). In step 1, while the other spawned
    # rank may still be setting up: none, or at the logging step after step 1 (5) where every rank was training (a
    # machine quicker than the campaign's window). During the validation and the checkpoint write of step 22: at
    # that checkpoint (the validation's all-reduce carries the stop, and one follows each checkpoint).
    assert tries[1]["last_pt_step"] in (None, 5)
    assert [tries[i]["last_pt_step"] for i in (0, 2, 3, 4)] == [None, 22, None, 22]


@pytest.mark.slow
def test_no_run_of_spawned_ranks_leaves_a_file_in_tmpdir_or_a_process(tmp_path, train_env):
    """In a TMPDIR of its own, listed after each: a failed rank, a killed rank with loader workers (its fork server,
    workers and resource tracker outlived it for good), a killed rank 0 logging to W&B, a refused config, a sweep of
    two ddp jobs. The agent wrote torchelastic_* folders and pytorch-errorfile-* files there and never removed them.
    And loader workers under a TMPDIR of 72 characters, which a single process takes: the fork server's socket in the
    launcher's folder was past a socket path's 107 (`AF_UNIX path too long`). (/dev/shm is the machine's, which the
    suite's other tests share meanwhile: scripts/stop_campaign.py, run alone, checks it.)"""
    short = Path(tempfile.mkdtemp(dir="/tmp"))  # the fork server's socket fits in the launcher's folder
    long = Path(tempfile.mkdtemp(dir="/tmp"))
    long = long / ("t" * (72 - len(f"{long}/")))
    long.mkdir()
    common = ("parallel=ddp", "logger=none", "trainer.max_epochs=1")
    killed = "(exit code -9)"  # not a rank that failed as its loader workers started
    cases = {
        "failed rank": (1, short, "", *common, "model._target_=tests.faults.RaisingMLP", "+model.fail_rank=1"),
        "killed rank with workers": (
            1,
            short,
            killed,
            *common,
            "data.num_workers=1",
            "model._target_=tests.faults.KilledMLP",
            "+model.fail_rank=1",
            "+model.fail_at_step=3",
        ),
        # W&B's media and artifact folders, which its exit handlers remove, outlived a killed rank 0.
        "killed rank 0 logging to wandb": (
            1,
            short,
            killed,
            *common[:1],
            "logger=wandb",
            "logger.wandb.mode=offline",
            *common[2:],
            "model._target_=tests.faults.KilledMLP",
            "+model.fail_rank=0",
        ),
        "refused config": (2, short, "", *common, "parallel.nproc_per_node=0"),
        "sweep": (
            0,
            short,
            "",
            "-m",
            *common,
            "trainer.max_steps=3",
            "seed=0,1",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ),
        "workers under a long TMPDIR": (0, long, "", *common, "trainer.max_steps=3", "data.num_workers=1"),
    }
    try:
        for case, (expected, tmpdir, said, *overrides) in cases.items():
            marker = uuid.uuid4().hex
            run_dir = f"hydra.run.dir={tmp_path / case.replace(' ', '-')}"
            command = [sys.executable, str(TRAIN), *overrides, run_dir]
            done = subprocess.run(
                command, env=environment(tmpdir, marker, train_env), capture_output=True, text=True, timeout=300
            )
            assert done.returncode == expected and said in done.stdout + done.stderr, (case, done.stdout + done.stderr)
            assert left_behind(tmpdir, marker) == [], case
    finally:
        shutil.rmtree(short)
        shutil.rmtree(long.parent)
