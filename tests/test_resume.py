"""Resuming from a checkpoint ends where the uninterrupted run ends."""

import pytest

from conftest import max_param_diff

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("parallel", ["single", "ddp"])
def test_resume_after_two_epochs_matches_uninterrupted_four(run_train, parallel):
    first = run_train(f"parallel={parallel}", "trainer.max_epochs=2", "model.dropout=0.2")
    assert first.returncode == 0, first.output
    assert first.checkpoint()["epoch"] == 2

    resumed = run_train(
        f"parallel={parallel}", "trainer.max_epochs=4", "model.dropout=0.2",
        f"ckpt_path={first.run_dir}/checkpoints/last.pt",
    )
    uninterrupted = run_train(f"parallel={parallel}", "trainer.max_epochs=4", "model.dropout=0.2")
    assert resumed.returncode == 0, resumed.output
    assert uninterrupted.returncode == 0, uninterrupted.output
    assert "resumed from" in resumed.output

    assert resumed.metrics["epoch"] == uninterrupted.metrics["epoch"] == 4
    assert resumed.metrics["global_step"] == uninterrupted.metrics["global_step"]
    assert max_param_diff(resumed.checkpoint()["model"], uninterrupted.checkpoint()["model"]) < 1e-6
    assert resumed.metrics["val/acc"] == uninterrupted.metrics["val/acc"]
    # The optimizer state (AdamW moments) came back too, not just the weights.
    resumed_moments = resumed.checkpoint()["optimizer"]["state"]
    uninterrupted_moments = uninterrupted.checkpoint()["optimizer"]["state"]
    assert max_param_diff(
        {k: v["exp_avg_sq"] for k, v in resumed_moments.items()},
        {k: v["exp_avg_sq"] for k, v in uninterrupted_moments.items()},
    ) < 1e-6


def test_resume_across_strategies(run_train):
    """A DDP checkpoint resumes under single and continues as an uninterrupted single run would."""
    ddp = run_train("parallel=ddp", "trainer.max_epochs=1")
    assert ddp.returncode == 0, ddp.output
    resumed = run_train("trainer.max_epochs=2", f"ckpt_path={ddp.run_dir}/checkpoints/last.pt")
    single = run_train("trainer.max_epochs=2")
    assert resumed.returncode == 0, resumed.output
    assert max_param_diff(resumed.checkpoint()["model"], single.checkpoint()["model"]) < 1e-5
