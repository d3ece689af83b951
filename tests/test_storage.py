"""A run owns its directory, and storage faults lose nothing. Each fault is made for real: a second run into a live
run's directory, a full disk (a file-size limit), a read-only or unwritable run directory, a truncated last.pt, a
killed run's leftover lock."""

import ctypes
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TRAIN, bad_input_line, max_param_diff, read_checkpoint, wait_for
from hydraloop.errors import STORAGE_EXIT_CODE
from hydraloop.run_lock import LOCK_FILE
from test_run_lock import may_own

pytestmark = pytest.mark.slow

RECIPE = ("trainer.max_epochs=2", "model.dropout=0.2", "trainer.log_every_n_steps=5", "logger=none")
CAPS_THAT_OVERRIDE_PERMISSIONS = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
PR_CAPBSET_DROP = 24


@pytest.fixture(scope="module")
def lone_run(run_train):
    """The recipe, alone in its directory: what every run below that finishes must end with."""
    run = run_train(*RECIPE)
    assert run.returncode == 0, run.output
    return run


def contents(run_dir: Path, leave_out: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under `run_dir`, by relative path, but those under `leave_out`."""
    files = {str(path.relative_to(run_dir)): path for path in run_dir.rglob("*") if path.is_file()}
    return {name: path.read_bytes() for name, path in files.items() if not name.startswith(leave_out)}


def waiting_run(run_dir: Path, tmp_path: Path, step: int, env: dict, preexec_fn=None) -> subprocess.Popen:
    """The recipe in `run_dir`, waiting inside `step` until tmp_path/resume exists (see tests.waits.WaitingMLP)."""
    model = ("model._target_=tests.waits.WaitingMLP", "+model.fail_rank=0", f"+model.fail_at_step={step}")
    files = (f"+model.pause_file={tmp_path / 'paused'}", f"+model.resume_file={tmp_path / 'resume'}")
    command = [sys.executable, str(TRAIN), f"hydra.run.dir={run_dir}", *RECIPE, *model, *files]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec_fn
    )


def test_a_second_run_into_a_live_runs_directory_is_refused_and_changes_nothing(
    run_train, train_env, tmp_path, lone_run
):
    run_dir = tmp_path / "run"
    first = waiting_run(run_dir, tmp_path, step=13, env=train_env)
    try:
        wait_for(tmp_path / "paused", first)  # the first run holds its directory, inside step 13
        before = contents(run_dir)
        since = json.loads((run_dir / LOCK_FILE).read_text())["since"]
        second = run_train(*RECIPE, run_dir=run_dir)
        assert bad_input_line(second).endswith(
            f"run directory {run_dir}: in use by another run (pid {first.pid} on {socket.gethostname()}, since "
            f"{since}); wait for it to end, or give this run another hydra.run.dir"
        )
        assert contents(run_dir) == before  # not a line in train.log, not a byte in .hydra/
    finally:
        (tmp_path / "resume").touch()
    output = first.communicate(timeout=120)[0]
    assert first.returncode == 0, output

    finished = read_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert finished["global_step"] == 44
    assert max_param_diff(finished["model"], lone_run.checkpoint()["model"]) < 1e-6
    assert json.loads((run_dir / "metrics.json").read_text())["val/acc"] == lone_run.metrics["val/acc"]
    assert not (run_dir / LOCK_FILE).exists()  # released at the end


def file_size_limit(limit: int):
    """For preexec_fn: no file of the run may grow past `limit` bytes, as on a disk that fills up."""

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write past the limit then fails (EFBIG), not the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_file_size


@pytest.mark.parametrize("parallel", ["single", "ddp"])
def test_a_full_disk_ends_the_run_in_one_line_and_keeps_the_checkpoints(run_train, parallel):
    first = run_train(f"parallel={parallel}", "trainer.max_epochs=1", "logger=none")
    assert first.returncode == 0, first.output
    run_dir = first.run_dir
    kept = contents(run_dir, leave_out=(".hydra", "train.log"))  # last.pt, best.pt, step-00000022.pt, metrics.json
    limit = len(kept["checkpoints/last.pt"]) // 2  # no checkpoint fits any more; the job log (a few kB) does
    assert (run_dir / "train.log").stat().st_size * 4 < limit

    overrides = (f"parallel={parallel}", "trainer.max_epochs=2", "logger=none")
    full = run_train(*overrides, run_dir=run_dir, preexec_fn=file_size_limit(limit))
    assert full.returncode == STORAGE_EXIT_CODE, full.output
    errors = [line for line in full.output.splitlines() if "[ERROR]" in line]
    assert errors[-1].endswith(
        f"cannot write {run_dir}/checkpoints/step-00000044.pt: File too large (EFBIG); the checkpoints saved before "
        "are intact"
    )
    if parallel == "single":  # under ddp, rank 1's collective fails too when rank 0 ends, and logs its traceback
        assert len(errors) == 1 and "Traceback" not in full.output, full.output
    # Nothing changed but the job log: no .tmp, no lock left, the checkpoints as they were and loadable.
    assert contents(run_dir, leave_out=(".hydra", "train.log")) == kept
    assert full.checkpoint("last.pt")["global_step"] == full.checkpoint("best.pt")["global_step"] == 22


def in_a_read_only_mount(run_dir: Path) -> tuple[str, ...]:
    """A command prefix: what follows runs in a private mount namespace where `run_dir` is mounted read-only (a real
    read-only file system); skips the test where no such namespace can be made."""
    unshare = ("unshare", "--mount", "--propagation", "private") + (() if os.geteuid() == 0 else ("--map-root-user",))
    remount = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    try:
        if subprocess.run([*unshare, "true"], capture_output=True).returncode != 0:
            raise OSError
    except OSError:
        pytest.skip("needs a private mount namespace: root, or unprivileged user namespaces (unshare -rm)")
    return (*unshare, "sh", "-c", remount, str(run_dir))


def without_permission_override():
    """For preexec_fn: file permissions hold for the run, also for root (which drops the capabilities that override
    them, for itself and what it starts); skips the test where they cannot be dropped."""

    def drop() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        for capability in CAPS_THAT_OVERRIDE_PERMISSIONS:
            if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    if os.geteuid() != 0:
        return None
    try:
        subprocess.run(["true"], preexec_fn=drop, check=True)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("running as root without CAP_SETPCAP: file permissions cannot be made to hold")
    return drop


@pytest.mark.parametrize("fault", ["read-only file system", "permission denied", "read-only checkpoints folder"])
def test_a_run_directory_that_cannot_be_written_is_refused_before_any_rank_starts(train_in_process, run_train, fault):
    _, run_dir = train_in_process("trainer.max_epochs=1", "logger=none")
    before = contents(run_dir)
    if fault == "read-only file system":
        wrapper = in_a_read_only_mount(run_dir)
        refused = run_train("parallel=ddp", "trainer.max_epochs=2", run_dir=run_dir, wrapper=wrapper)
        expected = f"hydra.run.dir={run_dir}: cannot be written: Read-only file system (EROFS)"  # before Hydra runs
    else:
        preexec_fn = without_permission_override()
        unwritable = run_dir if fault == "permission denied" else run_dir / "checkpoints"
        unwritable.chmod(0o555)
        try:
            refused = run_train("parallel=ddp", "trainer.max_epochs=2", run_dir=run_dir, preexec_fn=preexec_fn)
        finally:
            unwritable.chmod(0o755)
        where = f"hydra.run.dir={run_dir}" if unwritable == run_dir else f"run directory folder {unwritable}"
        expected = f"{where}: cannot be written: Permission denied (EACCES)"
    assert bad_input_line(refused).endswith(expected)
    assert "[rank 1]" not in refused.output  # refused by the launcher: no rank started
    assert contents(run_dir) == before  # Hydra's .hydra/ and train.log included


def test_a_permission_fault_mid_run_ends_it_in_one_line_without_metrics(train_env, tmp_path):
    """The run directory becomes unwritable during the last epoch (its checkpoints folder stays writable): the last
    checkpoint is saved, metrics.json cannot be, and the run says so."""
    run_dir = tmp_path / "run"
    preexec_fn = without_permission_override()
    run = waiting_run(run_dir, tmp_path, step=30, env=train_env, preexec_fn=preexec_fn)
    try:
        wait_for(tmp_path / "paused", run)
        run_dir.chmod(0o555)
    finally:
        (tmp_path / "resume").touch()
    output = run.communicate(timeout=120)[0]
    run_dir.chmod(0o755)

    assert run.returncode == STORAGE_EXIT_CODE, output
    errors = [line for line in output.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and "Traceback" not in output, output
    assert errors[0].endswith(f"cannot write {run_dir}/metrics.json: Permission denied (EACCES)")
    assert not (run_dir / "metrics.json").exists()
    assert not [path for path in run_dir.rglob("*.tmp")]
    assert read_checkpoint(run_dir / "checkpoints" / "last.pt")["global_step"] == 44
    assert may_own(run_dir)  # the lock it could not remove names a process that is gone: the next run takes it


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_an_unreadable_last_checkpoint_falls_back_to_the_newest_readable_one(train_in_process, caplog, damage):
    metrics, run_dir = train_in_process(*RECIPE)
    last = run_dir / "checkpoints" / "last.pt"
    uninterrupted = read_checkpoint(last)
    # In place, as a disk or a copy gone wrong would: step-00000044.pt, another name of the same file, too.
    os.truncate(last, last.stat().st_size // 2 if damage == "truncated" else 0)

    caplog.clear()
    with caplog.at_level(logging.INFO):
        resumed_metrics, _ = train_in_process(*RECIPE, run_dir=run_dir)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "hydraloop" in r.name]
    assert warnings == [
        "resume=true: last.pt, step-00000044.pt cannot be read (truncated, or not a checkpoint): continuing from "
        f"step-00000022.pt, the newest readable checkpoint in {run_dir}/checkpoints"
    ]
    assert f"loaded {run_dir}/checkpoints/step-00000022.pt: epoch 1, step 22" in caplog.text

    resumed = read_checkpoint(last)
    assert resumed["global_step"] == 44
    assert max_param_diff(resumed["model"], uninterrupted["model"]) < 1e-6
    assert resumed_metrics["val/acc"] == metrics["val/acc"]
    names = sorted(path.name for path in last.parent.iterdir())
    assert names == ["best.pt", "last.pt", "step-00000022.pt", "step-00000044.pt"]


def test_starting_over_removes_the_abandoned_runs_step_checkpoints(train_in_process):
    """resume=false in a directory whose checkpoints reach step 44: after this run's first checkpoint (step 22), the
    older run's step 44 is gone, so that the newest step-named checkpoint is this run's."""
    _, run_dir = train_in_process("trainer.max_epochs=2", "logger=none")
    train_in_process("trainer.max_epochs=1", "resume=false", "logger=none", run_dir=run_dir)
    checkpoints = run_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["best.pt", "last.pt", "step-00000022.pt"]
    assert (checkpoints / "last.pt").samefile(checkpoints / "step-00000022.pt")  # a hard link: no second copy
    assert read_checkpoint(checkpoints / "last.pt")["epoch"] == 1


def test_a_rerun_after_a_killed_run_takes_over_its_lock_and_ends_where_the_lone_run_ends(run_train, lone_run):
    killed = run_train(*RECIPE, "model._target_=tests.faults.KilledMLP", "+model.fail_rank=0", "+model.fail_at_step=30")
    assert killed.returncode == -signal.SIGKILL, killed.output
    left = json.loads((killed.run_dir / LOCK_FILE).read_text())  # a killed process releases nothing

    rerun = run_train(*RECIPE, run_dir=killed.run_dir)
    assert rerun.returncode == 0, rerun.output
    owner = f"pid {left['pid']} on {left['host']}, since {left['since']}"
    assert f"taking over the lock of {owner} (its process is gone)" in rerun.log
    assert "checkpoints/last.pt: epoch 1, step 22" in rerun.log
    assert max_param_diff(rerun.checkpoint()["model"], lone_run.checkpoint()["model"]) < 1e-6
    assert not (killed.run_dir / LOCK_FILE).exists()
