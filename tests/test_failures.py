"""A failing or hanging rank ends the whole job with a non-zero exit, its error in the log, and no hang."""

import math
import time

import pytest

from conftest import max_param_diff

pytestmark = pytest.mark.slow


def test_exception_in_one_rank_ends_the_job(run_train):
    run = run_train(
        "parallel=ddp",
        "model._target_=tests.faults.RaisingMLP",
        "+model.fail_rank=1",
        "+model.fail_at_step=3",
        "trainer.max_epochs=3",
        timeout=120,
    )
    assert run.returncode == 1
    # One line from the launcher naming the rank, and the rank's own traceback in the job log, prefixed.
    assert "rank 1 failed (exit code 1): RuntimeError: injected failure at step 3" in run.output
    assert "[rank 1]" in run.log and "RuntimeError: injected failure at step 3" in run.log
    assert "Traceback" in run.log  # the failing rank's stack is kept for the post-mortem
    # It failed in epoch 1: no epoch finished, so nothing was written.
    assert not (run.run_dir / "metrics.json").exists()
    assert not (run.run_dir / "checkpoints").exists()


def test_exception_in_rank_zero_after_a_checkpoint_keeps_it(run_train):
    run = run_train(
        "parallel=ddp",
        "model._target_=tests.faults.RaisingMLP",
        "+model.fail_rank=0",
        "+model.fail_at_step=30",
        "trainer.max_epochs=3",
        timeout=120,
    )
    assert run.returncode == 1
    assert "rank 0 failed" in run.output
    checkpoint = run.checkpoint("last.pt")  # the epoch-1 checkpoint (22 steps) is whole and loadable
    assert checkpoint["epoch"] == 1 and checkpoint["global_step"] == 22
    assert not list((run.run_dir / "checkpoints").glob("*.tmp"))


def test_hung_rank_is_cut_off_by_the_process_group_timeout(run_train):
    started = time.monotonic()
    run = run_train(
        "parallel=ddp",
        "parallel.timeout_s=5",
        "model._target_=tests.faults.HangingMLP",
        "+model.fail_rank=1",
        "+model.fail_at_step=2",
        "trainer.max_epochs=1",
        timeout=150,
    )
    elapsed = time.monotonic() - started
    assert run.returncode == 1
    assert "rank 0 failed" in run.output  # rank 0 waited in the all-reduce, timed out, and raised
    # Bounded, not a benchmark: the hang lasts an hour; the job must end long before the subprocess timeout.
    assert elapsed < 120


@pytest.mark.parametrize(
    "parallel, fail_rank, fail_at_step, message",
    [
        # Detected at the logging step (10), named at the step it happened; nothing saved yet.
        ("single", 0, 5, "train/loss is nan at step 5 (epoch 1, first on rank 0); the last checkpoint holds epoch 0"),
        # Epoch 1 is steps 1-22; rank 1's NaN at step 30 is seen by every rank through the reductions.
        ("ddp", 1, 30, "train/loss is nan at step 30 (epoch 2, first on rank 1); the last checkpoint holds epoch 1"),
    ],
)
def test_nonfinite_loss_stops_the_run_naming_the_step(run_train, parallel, fail_rank, fail_at_step, message):
    run = run_train(
        f"parallel={parallel}",
        "model._target_=tests.faults.NaNMLP",
        f"+model.fail_rank={fail_rank}",
        f"+model.fail_at_step={fail_at_step}",
        "trainer.max_epochs=3",
        "logger=none",
        timeout=120,
    )
    assert run.returncode == 1
    assert message in run.output
    assert "Traceback" not in run.output
    if fail_at_step > 22:
        assert run.checkpoint("last.pt")["epoch"] == 1  # the last good checkpoint is intact
    else:
        assert not (run.run_dir / "checkpoints").exists()
    assert not (run.run_dir / "metrics.json").exists()


def test_nonfinite_loss_can_skip_the_step_instead(run_train):
    """trainer.nonfinite_loss=skip: a NaN on rank 1 at step 5 makes every rank drop that update, and the run ends
    where a single-process run that dropped the same update ends."""
    common = (
        "model._target_=tests.faults.NaNMLP",
        "+model.fail_at_step=5",
        "trainer.max_epochs=2",
        "trainer.nonfinite_loss=skip",
        "logger=none",
    )
    ddp = run_train("parallel=ddp", "+model.fail_rank=1", *common, timeout=120)
    single = run_train("+model.fail_rank=0", *common)
    assert ddp.returncode == 0, ddp.output
    assert single.returncode == 0, single.output
    assert "non-finite loss on 1 rank(s): update skipped" in ddp.log
    assert ddp.metrics["skipped_steps"] == single.metrics["skipped_steps"] == 1
    assert ddp.metrics["global_step"] == 44  # a skipped step is still a step: the schedule does not shift
    assert math.isfinite(ddp.metrics["train/loss"])
    assert ddp.metrics["train/loss"] == pytest.approx(single.metrics["train/loss"], rel=1e-5)
    assert max_param_diff(ddp.checkpoint()["model"], single.checkpoint()["model"]) < 1e-5
