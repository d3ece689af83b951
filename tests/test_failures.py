"""A failing or hanging rank ends the whole job with a non-zero exit, its error in the log, and no hang."""

import csv
import math
import time

import pytest
import torch

from conftest import max_param_diff, read_checkpoint

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
        (
            "single",
            0,
            5,
            "train/loss is nan at step 5 (epoch 1, first on rank 0, at lr 0.003); no checkpoint was saved in this "
            "run: a rerun starts from scratch",
        ),
        # Epoch 1 is steps 1-22; rank 1's NaN at step 30 is seen by every rank through the reductions.
        (
            "ddp",
            1,
            30,
            "train/loss is nan at step 30 (epoch 2, first on rank 1, at lr 0.003); checkpoints/last.pt holds step 22, "
            "where a rerun continues",
        ),
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


def checkpoints_are_finite(run) -> dict[str, int]:
    """{file name: global step} of every checkpoint in the run directory, each checked to hold finite weights."""
    steps = {}
    for path in sorted((run.run_dir / "checkpoints").glob("*.pt")):
        checkpoint = read_checkpoint(path)
        assert all(torch.isfinite(tensor).all() for tensor in checkpoint["model"].values()), path.name
        steps[path.name] = checkpoint["global_step"]
    return steps


@pytest.mark.parametrize(
    "fault, checkpoint_every, expected",
    [
        # A NaN loss at step 3, with a checkpoint at every step: found before step 3's checkpoint, not at step 10.
        (
            "NaNMLP",
            1,
            "train/loss is nan at step 3 (epoch 1, first on rank 0, at lr 0.003); checkpoints/last.pt holds step 2",
        ),
        # The same found at step 5's checkpoint, the first: none is made.
        (
            "NaNMLP",
            5,
            "train/loss is nan at step 3 (epoch 1, first on rank 0, at lr 0.003); no checkpoint was saved in this run",
        ),
        # A finite loss whose gradient overflows at step 3: the weights are not finite, so step 3 is not saved.
        ("InfGradMLP", 1, "the weights are NaN or infinite after step 3, from a finite loss; checkpoints/last.pt "),
    ],
)
def test_no_checkpoint_is_made_of_a_nonfinite_loss_or_weights_and_the_good_ones_stay(
    run_train, fault, checkpoint_every, expected
):
    run = run_train(
        f"model._target_=tests.faults.{fault}",
        "+model.fail_rank=0",
        "+model.fail_at_step=3",
        f"trainer.ckpt_every_n_steps={checkpoint_every}",
        "trainer.max_epochs=1",
        "logger=none",
    )
    assert run.returncode == 1, run.output
    assert expected in run.output
    assert "Traceback" not in run.output
    found = checkpoints_are_finite(run)
    if checkpoint_every == 1:  # keep_last_k=2: steps 1 and 2, and last.pt naming step 2
        assert found == {"last.pt": 2, "step-00000001.pt": 1, "step-00000002.pt": 2}
    else:
        assert found == {}


def test_a_skipped_step_alone_in_its_logging_interval_is_skipped_like_any_other(run_train):
    """With a logging step at every step, each interval holds one step: a skipped one must not end the run."""
    run = run_train(
        "model._target_=tests.faults.NaNMLP",
        "+model.fail_rank=0",
        "+model.fail_at_step=11",
        "trainer.log_every_n_steps=1",
        "trainer.nonfinite_loss=skip",
        "trainer.max_epochs=1",
        "logger=none",
    )
    assert run.returncode == 0, run.output
    assert run.metrics["skipped_steps"] == 1 and run.metrics["global_step"] == 22


def test_consecutive_skipped_steps_end_the_run_wherever_the_logging_steps_fall(run_train):
    """NaN from step 7 on: trainer.max_consecutive_skips=3 skipped steps in a row (7, 8, 9; the logging step is 10)
    end the run in one line naming them and the checkpoint a rerun starts from."""
    run = run_train(
        "model._target_=tests.faults.NaNFromMLP",
        "+model.fail_rank=0",
        "+model.fail_at_step=7",
        "trainer.nonfinite_loss=skip",
        "trainer.max_consecutive_skips=3",
        "trainer.ckpt_every_n_steps=5",
        "trainer.max_epochs=1",
        "logger=none",
    )
    assert run.returncode == 1, run.output
    assert "Traceback" not in run.output
    assert (
        "train/loss was non-finite at every step from 7 to 9, all skipped (trainer.nonfinite_loss=skip ends the run "
        "after trainer.max_consecutive_skips=3 in a row); checkpoints/last.pt holds step 5, where a rerun continues"
    ) in run.output
    assert checkpoints_are_finite(run)["last.pt"] == 5


def test_finite_losses_near_float32s_largest_value_do_not_overflow_their_interval_sum(run_train):
    """Every step's loss is finite, and twenty of them would sum to infinity in float32. The interval's mean is
    computed in float64 and logged as the finite number it is (the float32 sum was a traceback)."""
    run = run_train(
        "model._target_=tests.faults.HugeLossMLP",
        "data.batch_size=2",
        "trainer.log_every_n_steps=20",
        "trainer.limit_train_batches=40",
        "trainer.max_epochs=1",
        "trainer.save_checkpoints=false",
        "logger=csv",
    )
    assert run.returncode == 0 and "Traceback" not in run.output, run.output
    rows = list(csv.DictReader((run.run_dir / "metrics.csv").open()))
    losses = [float(row["train/loss"]) for row in rows if row["train/loss"]]
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 3.4e38 / 20 for loss in losses), losses


def test_a_skipped_step_leaves_batch_norms_statistics_as_they_were(run_train):
    """The NaN step's forward pass moved the running statistics; skipping its update puts them back, so every
    checkpoint is finite, buffers included, and the metrics are numbers."""
    run = run_train(
        "model._target_=tests.faults.BatchNormNaNMLP",
        "+model.fail_rank=0",
        "+model.fail_at_step=3",
        "trainer.nonfinite_loss=skip",
        "trainer.max_epochs=1",
        "logger=none",
    )
    assert run.returncode == 0, run.output
    assert run.metrics["skipped_steps"] == 1 and math.isfinite(run.metrics["val/loss"])
    for name in ("last.pt", "best.pt"):
        assert all(torch.isfinite(tensor.float()).all() for tensor in run.checkpoint(name)["model"].values()), name
