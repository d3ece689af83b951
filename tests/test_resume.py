"""Resuming from a checkpoint ends where the uninterrupted run ends."""

import pytest
import torch

from conftest import max_param_diff
from hydraloop.schedulers import apply_current_step, cosine_with_warmup

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("parallel", ["single", "ddp"])
def test_resume_after_two_epochs_matches_uninterrupted_four(run_train, parallel):
    first = run_train(f"parallel={parallel}", "trainer.max_epochs=2", "model.dropout=0.2")
    assert first.returncode == 0, first.output
    assert first.checkpoint()["epoch"] == 2

    resumed = run_train(
        f"parallel={parallel}",
        "trainer.max_epochs=4",
        "model.dropout=0.2",
        f"ckpt_path={first.run_dir}/checkpoints/last.pt",
    )
    uninterrupted = run_train(f"parallel={parallel}", "trainer.max_epochs=4", "model.dropout=0.2")
    assert resumed.returncode == 0, resumed.output
    assert uninterrupted.returncode == 0, uninterrupted.output
    assert "loaded " in resumed.output and "epoch 2, step 44" in resumed.output

    assert resumed.metrics["epoch"] == uninterrupted.metrics["epoch"] == 4
    assert resumed.metrics["global_step"] == uninterrupted.metrics["global_step"]
    assert max_param_diff(resumed.checkpoint()["model"], uninterrupted.checkpoint()["model"]) < 1e-6
    assert resumed.metrics["val/acc"] == uninterrupted.metrics["val/acc"]
    # The optimizer state (AdamW moments) came back too, not just the weights.
    resumed_moments = resumed.checkpoint()["optimizer"]["state"]
    uninterrupted_moments = uninterrupted.checkpoint()["optimizer"]["state"]
    assert (
        max_param_diff(
            {k: v["exp_avg_sq"] for k, v in resumed_moments.items()},
            {k: v["exp_avg_sq"] for k, v in uninterrupted_moments.items()},
        )
        < 1e-6
    )


def test_resume_across_strategies(run_train):
    """A DDP checkpoint resumes under single and continues as an uninterrupted single run would."""
    ddp = run_train("parallel=ddp", "trainer.max_epochs=1")
    assert ddp.returncode == 0, ddp.output
    resumed = run_train("trainer.max_epochs=2", f"ckpt_path={ddp.run_dir}/checkpoints/last.pt")
    single = run_train("trainer.max_epochs=2")
    assert resumed.returncode == 0, resumed.output
    assert max_param_diff(resumed.checkpoint()["model"], single.checkpoint()["model"]) < 1e-5


def test_resume_with_more_epochs_follows_the_new_schedule_from_the_first_step():
    """A finished 2-epoch cosine run ends at lr 0; resumed to 4 epochs, its next step uses the 4-epoch plan."""
    steps_per_epoch = 10

    def build(max_epochs):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = cosine_with_warmup(
            optimizer, total_steps=max_epochs * steps_per_epoch, steps_per_epoch=steps_per_epoch, warmup_epochs=0.0
        )
        return optimizer, scheduler

    optimizer, scheduler = build(2)
    for _ in range(2 * steps_per_epoch):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0)

    resumed_optimizer, resumed_scheduler = build(4)
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    resumed_scheduler.load_state_dict(scheduler.state_dict())
    apply_current_step(resumed_scheduler)
    planned_factor = build(4)[1].lr_lambdas[0](2 * steps_per_epoch)  # half-way down the 4-epoch cosine
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * planned_factor) == pytest.approx(0.05)
