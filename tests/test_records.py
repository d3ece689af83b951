"""A run's records are never lost or replaced by worse ones: a refusal writes nothing, a rerun of a finished run
touches nothing, an evaluation never writes over a training run, and a kill loses no row."""

import csv
import json

import pytest

from conftest import bad_input_line
from test_storage import contents

pytestmark = pytest.mark.slow

RECIPE = ("trainer.max_epochs=2", "trainer.log_every_n_steps=5", "model.dropout=0.2", "logger=[csv,tensorboard]")


@pytest.fixture(scope="module")
def finished(run_train):
    run = run_train(*RECIPE)
    assert run.returncode == 0, run.output
    return run


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (("data.batch_size=0",), "data.batch_size=0: must be positive"),
        (("model=cnn",), "does not fit model hydraloop.models.cnn.CNN"),
        (("mode=eval", "ckpt_path=CHECKPOINT"), "mode=eval: the run directory RUN_DIR holds a training run's records"),
        # Finished under another config: not "finished", not trained on either.
        (("model.dropout=0.5",), "model.dropout=0.5 (was 0.2): the run in RUN_DIR finished at step 44 under another"),
        (("trainer.grad_clip_norm=0.01",), "trainer.grad_clip_norm=0.01 (was None): the run in RUN_DIR finished at"),
        (("callbacks=[ema]",), "callbacks.ema._target_=hydraloop.callbacks.ema.EMA (was None), and callbacks.ema"),
        (("optimized_metric=val/loss",), "optimized_metric=val/loss (was val/acc): the run in RUN_DIR finished at"),
    ],
)
def test_a_refusal_into_a_finished_runs_directory_changes_nothing(run_train, finished, overrides, expected):
    before = contents(finished.run_dir)
    checkpoint = finished.run_dir / "checkpoints" / "step-00000022.pt"
    overrides = [item.replace("CHECKPOINT", str(checkpoint)) for item in overrides]
    refused = run_train(*RECIPE, *overrides, run_dir=finished.run_dir)
    assert expected.replace("RUN_DIR", str(finished.run_dir)) in bad_input_line(refused)
    assert contents(finished.run_dir) == before  # .hydra/ and train.log included


def test_a_rerun_of_a_finished_run_says_so_and_touches_nothing(run_train, finished):
    before = contents(finished.run_dir)
    rerun = run_train(*RECIPE, run_dir=finished.run_dir)
    assert rerun.returncode == 0, rerun.output
    assert f"run directory {finished.run_dir}: finished at step 44; its records are left as they are" in rerun.output
    assert contents(finished.run_dir) == before


def test_a_refusal_writes_nothing_at_all(run_train, tmp_path):
    refused = run_train("data.batch_size=0", run_dir=tmp_path / "new")
    bad_input_line(refused)
    assert not (tmp_path / "new").exists()


def rows(run_dir) -> list[dict[str, str]]:
    """metrics.csv without the columns of time (they differ between any two runs)."""
    timed = ("samples_per_sec", "step_time_ms", "data_wait_frac")
    with (run_dir / "metrics.csv").open() as handle:
        return [{k: v for k, v in row.items() if not k.endswith(timed)} for row in csv.DictReader(handle)]


def test_a_kill_after_a_checkpoint_loses_no_row_and_the_rerun_logs_the_uninterrupted_runs(
    run_train, finished, tmp_path
):
    """Killed at step 25: epoch 1's checkpoint (step 22) is newer than step 22's row, which the CSV logger held until
    the next step's metrics. It is on disk before the checkpoint now, and the rerun logs the rest: the uninterrupted
    run's rows, no more, no fewer."""
    kill = ("model._target_=tests.faults.KilledMLP", "+model.fail_rank=0", "+model.fail_at_step=25")
    killed = run_train(*RECIPE, *kill, run_dir=tmp_path / "run")
    assert killed.returncode == -9, killed.output
    assert [row["step"] for row in rows(killed.run_dir)] == ["5", "10", "15", "20", "22"]
    rerun = run_train(*RECIPE, *kill, run_dir=killed.run_dir)  # the fault counts this process's steps: none now
    assert rerun.returncode == 0, rerun.output
    assert rows(rerun.run_dir) == rows(finished.run_dir)


def test_a_kill_after_the_last_checkpoint_is_finished_by_the_rerun_with_the_uninterrupted_records(
    run_train, finished, tmp_path
):
    """Killed after the last checkpoint, before metrics.json: the rerun trains nothing, validates nothing again, and
    writes the metrics.json the uninterrupted run wrote."""
    killed = run_train(*RECIPE, "+logger.killer._target_=tests.faults.KillingLogger", run_dir=tmp_path / "run")
    assert killed.returncode == -9, killed.output
    assert not (killed.run_dir / "metrics.json").exists()
    rerun = run_train(*RECIPE, run_dir=killed.run_dir)
    assert rerun.returncode == 0, rerun.output
    expected = {k: v for k, v in finished.metrics.items() if k != "wall_time_s"}
    assert {k: v for k, v in rerun.metrics.items() if k != "wall_time_s"} == expected
    assert rows(rerun.run_dir) == rows(finished.run_dir)
    assert json.loads((rerun.run_dir / "metrics.json").read_text())["train/loss"] is not None
