"""A resume into a changed config: what the checkpoint restores gives way to what the new config says, or is
refused; never one value recorded and another used."""

import csv
import logging

import pytest
import torch

from conftest import max_param_diff, read_checkpoint
from hydraloop.data.samplers import GlobalBatchSampler


def checkpoint(run_dir, name: str = "last.pt") -> dict:
    return read_checkpoint(run_dir / "checkpoints" / name)


def test_an_epoch_resumed_under_another_batch_size_takes_each_remaining_sample_once():
    """30 batches of 16, then batches of 64 from sample 480: together one pass over the epoch's permutation."""
    before = GlobalBatchSampler(1438, 16, 0, 1, seed=0)
    before.set_epoch(0)
    seen = [index for batch in list(before)[:30] for index in batch]
    after = GlobalBatchSampler(1438, 64, 0, 1, seed=0)
    after.set_epoch(0, start_sample=len(seen))
    seen += [index for batch in after for index in batch]
    order = torch.randperm(1438, generator=torch.Generator().manual_seed(0)).tolist()
    assert seen == order[: 480 + (1438 - 480) // 64 * 64]  # drop_last: the rest's incomplete batch


def test_a_mid_epoch_resume_under_another_batch_size_continues_at_the_sample_it_stopped_at(train_in_process):
    _, run_dir = train_in_process("data.batch_size=16", "trainer.max_steps=30", "logger=none")
    assert checkpoint(run_dir)["epoch_samples"] == 480
    metrics, _ = train_in_process("data.batch_size=64", "trainer.max_epochs=1", "logger=none", run_dir=run_dir)
    assert metrics["epoch"] == 1
    assert metrics["global_step"] == 30 + (1438 - 480) // 64  # the rest of epoch 1, in batches of 64


def test_a_schedule_in_epochs_keeps_to_its_epochs_after_a_resume_under_another_batch_size(train_in_process):
    decay = ("scheduler=step", "scheduler.step_epochs=1", "logger=csv", "trainer.log_every_n_steps=1")
    _, run_dir = train_in_process(*decay, "data.batch_size=32", "trainer.max_epochs=1")  # 44 steps
    train_in_process(*decay, "data.batch_size=64", "trainer.max_epochs=3", run_dir=run_dir)  # 22 steps an epoch
    lr = {int(row["step"]): float(row["train/lr"]) for row in csv.DictReader((run_dir / "metrics.csv").open())}
    # The lr logged at a step is the next step's: epoch 2 (steps 45-66) trains at a tenth, epoch 3 at a hundredth.
    assert (lr[43], lr[44], lr[65], lr[66], lr[87]) == pytest.approx((3e-3, 3e-4, 3e-4, 3e-5, 3e-5))


def test_a_resume_past_a_lowered_limit_ends_that_epoch_and_trains_the_next(train_in_process):
    _, run_dir = train_in_process("trainer.limit_train_batches=20", "trainer.max_steps=15", "logger=none")
    metrics, _ = train_in_process(
        "trainer.limit_train_batches=10", "trainer.max_epochs=3", "logger=none", run_dir=run_dir
    )
    assert (metrics["epoch"], metrics["global_step"]) == (3, 15 + 10 + 10)


def test_a_resume_with_another_learning_rate_trains_with_it_and_says_so(train_in_process, caplog):
    """Said once, though both groups (with and without weight decay) changed their lr."""
    caplog.set_level(logging.INFO)
    groups = ("logger=none", "optimizer.no_weight_decay=true")
    _, run_dir = train_in_process("trainer.max_epochs=1", *groups)
    before = checkpoint(run_dir)
    train_in_process("trainer.max_epochs=2", *groups, "optimizer.lr=1e-12", "optimizer.weight_decay=0", run_dir=run_dir)
    after = checkpoint(run_dir)
    said = "from step 22 on: optimizer.weight_decay 0.01 -> 0, optimizer.lr 0.003 -> 1e-12"
    assert caplog.text.count(said) == 1 and caplog.text.count("optimizer.lr 0.003 -> 1e-12") == 1, caplog.text
    assert after["global_step"] == 44
    assert max_param_diff(after["model"], before["model"]) < 1e-8  # an epoch at lr 1e-12 moves nothing
    assert [
        (group["lr"], group["initial_lr"], group["weight_decay"]) for group in after["optimizer"]["param_groups"]
    ] == [
        (1e-12, 1e-12, 0),
        (1e-12, 1e-12, 0),
    ]
    assert after["scheduler"]["base_lrs"] == [1e-12, 1e-12]


def test_a_run_from_another_directorys_checkpoint_keeps_a_best_of_its_own(train_in_process):
    """Started from another run's checkpoint, at an lr that cannot improve on its best: this directory's first
    validation is its best.pt, and trainer.eval_best evaluates it (it used to find no best.pt, and no metrics.json
    was written)."""
    _, first = train_in_process("trainer.max_epochs=2", "logger=none")
    metrics, second = train_in_process(
        "trainer.max_epochs=3",
        "optimizer.lr=1e-12",
        f"ckpt_path={first / 'checkpoints' / 'last.pt'}",
        "trainer.eval_best=true",
        "logger=none",
    )
    assert checkpoint(second, "best.pt")["global_step"] == 66
    assert metrics["best/global_step"] == 66 and metrics["best/val/acc"] == metrics["val/acc"]


def test_a_checkpoint_chosen_by_another_metric_starts_its_best_over(train_in_process, caplog):
    """best_metric is a val/acc; resumed with optimized_metric=val/loss, it would be a loss to beat: a loss below
    0.97 would never come. It starts over, and best.pt is chosen by val/loss from then on."""
    caplog.set_level(logging.INFO)
    _, run_dir = train_in_process("trainer.max_epochs=1", "logger=none")
    assert checkpoint(run_dir)["best_metric"] == checkpoint(run_dir)["metrics"]["val/acc"]
    train_in_process("trainer.max_epochs=2", "optimized_metric=val/loss", "logger=none", run_dir=run_dir)
    assert "best.pt and early stopping start over in this run directory, by val/loss (min)" in caplog.text
    last = checkpoint(run_dir)
    assert last["best_metric"] == last["metrics"]["val/loss"]
    assert checkpoint(run_dir, "best.pt")["global_step"] == 44


def logged_losses(run_dir) -> dict[int, float]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return {int(row["step"]): float(row["train/loss"]) for row in rows if row["train/loss"]}


@pytest.mark.parametrize("stop_at", [8, 12])
def test_a_run_resumed_between_logging_steps_logs_the_uninterrupted_runs_losses(train_in_process, stop_at):
    """Stopped at step 8 (mid-interval: logging every 5), or mid-epoch at 12, and resumed: every logged train/loss
    is the uninterrupted run's, the first after the resume included."""
    common = ("trainer.log_every_n_steps=5", "trainer.ckpt_every_n_steps=3", "model.dropout=0.2", "logger=csv")
    _, uninterrupted = train_in_process(*common, "trainer.max_steps=30")
    _, resumed = train_in_process(*common, f"trainer.max_steps={stop_at}")
    train_in_process(*common, "trainer.max_steps=30", run_dir=resumed)
    expected, got = logged_losses(uninterrupted), logged_losses(resumed)
    assert got.keys() == expected.keys() == {5, 10, 15, 20, 25, 30}
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("changed", ["seed=1", "data.shuffle=false"])
def test_a_mid_epoch_resume_under_another_sample_order_is_refused(train_in_process, tmp_path, caplog, changed):
    _, run_dir = train_in_process("trainer.max_steps=10", "logger=none")
    before = checkpoint(run_dir)
    with pytest.raises(SystemExit) as refused:
        train_in_process("trainer.max_epochs=1", changed, "logger=none", run_dir=run_dir)
    assert refused.value.code == 2
    key, value = changed.split("=")
    expected = f"{changed}: resume=true: {run_dir / 'checkpoints' / 'last.pt'} is mid-epoch (step 10 of epoch 1)"
    assert expected in caplog.text
    assert checkpoint(run_dir)["global_step"] == before["global_step"]
