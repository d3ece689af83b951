"""A run's records are never lost or replaced by worse ones: a refusal writes nothing, a rerun of a finished run
touches nothing, an evaluation never writes over a training run, and a kill loses no row."""

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TRAIN, Run, bad_input_line

pytestmark = pytest.mark.slow

RECIPE = ("trainer.max_epochs=2", "trainer.log_every_n_steps=5", "model.dropout=0.2", "logger=[csv,tensorboard]")


@pytest.fixture(scope="module")
def finished(run_train):
    run = run_train(*RECIPE)
    assert run.returncode == 0, run.output
    return run


def snapshot(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `run_dir`, by relative path: its bytes and its modification time (ns)."""
    files = (path for path in run_dir.rglob("*") if path.is_file())
    return {str(path.relative_to(run_dir)): (path.read_bytes(), path.stat().st_mtime_ns) for path in files}


@pytest.fixture
def finished_copy(finished, tmp_path) -> Path:
    """A copy of the finished run's directory, its files' times included, for commands that might change it."""
    return Path(shutil.copytree(finished.run_dir, tmp_path / "finished"))


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
    before = snapshot(finished.run_dir)
    checkpoint = finished.run_dir / "checkpoints" / "step-00000022.pt"
    overrides = [item.replace("CHECKPOINT", str(checkpoint)) for item in overrides]
    refused = run_train(*RECIPE, *overrides, run_dir=finished.run_dir)
    assert expected.replace("RUN_DIR", str(finished.run_dir)) in bad_input_line(refused)
    assert snapshot(finished.run_dir) == before  # .hydra/ and train.log included


def test_a_rerun_of_a_finished_run_says_so_and_touches_nothing(run_train, finished):
    before = snapshot(finished.run_dir)
    rerun = run_train(*RECIPE, run_dir=finished.run_dir)
    assert rerun.returncode == 0, rerun.output
    assert f"run directory {finished.run_dir}: finished at step 44; its records are left as they are" in rerun.output
    assert snapshot(finished.run_dir) == before


WARM_UP = "scheduler.warmup_epochs=1.0: a warm-up of 22 steps passes the run's 4 steps (22 per epoch)"


@pytest.mark.parametrize("resume", ["resume=true", "resume=false"])
def test_a_warm_up_in_epochs_longer_than_the_run_is_refused_before_the_directory_is_touched(
    run_refused, finished_copy, resume
):
    """It was refused by the rank, once the run was accepted: .hydra/ rewritten with the refused config, train.log
    appended to (into a new directory: one made, with both)."""
    before = snapshot(finished_copy)
    refused = run_refused("logger=csv", "trainer.max_steps=4", "scheduler=cosine", resume, run_dir=finished_copy)
    assert WARM_UP in bad_input_line(refused)
    assert snapshot(finished_copy) == before


def test_an_environment_the_logger_refuses_is_one_line_before_the_directory_is_touched(
    train_env, finished_copy, tmp_path
):
    """W&B read WANDB_MODE in the rank: a pydantic traceback, exit 1, after the run had rewritten .hydra/."""
    before = snapshot(finished_copy)
    for run_dir in (finished_copy, tmp_path / "new"):
        command = [sys.executable, str(TRAIN), f"hydra.run.dir={run_dir}", *RECIPE, "logger=wandb"]
        proc = subprocess.run(
            command, env={**train_env, "WANDB_MODE": "offlne"}, capture_output=True, text=True, timeout=180
        )
        refused = Run(proc.returncode, proc.stdout + proc.stderr, run_dir)
        assert "logger.wandb: WANDB_MODE=offlne in the environment: W&B refuses it (Input should be 'online'" in (
            bad_input_line(refused)
        )
    assert snapshot(finished_copy) == before
    assert not (tmp_path / "new").exists()


def test_a_refusal_only_a_rank_meets_leaves_the_directory_as_it_was(run_train, finished_copy, image_folder, tmp_path):
    """An image folder's size is counted by the ranks only (data.check): its warm-up in epochs is refused there,
    after `.hydra/` was written and train.log appended to. Both are put back: bytes and times; a new directory goes."""
    images = ("data=image_folder", f"data.dataset.root={image_folder}", "data.image_size=8", "model=cnn")
    overrides = (*images, "scheduler=cosine", "trainer.max_steps=2", "logger=none", "resume=false")
    before = snapshot(finished_copy)
    for run_dir in (finished_copy, tmp_path / "new"):
        refused = run_train(*overrides, run_dir=run_dir)
        assert "scheduler.warmup_epochs=1.0: a warm-up of" in bad_input_line(refused)
        assert "run directory: " in refused.output  # accepted: the rank refused it
    assert snapshot(finished_copy) == before
    assert not (tmp_path / "new").exists()


def test_a_finished_run_without_checkpoints_is_left_as_it_is(run_train, run_refused, tmp_path):
    """trainer.save_checkpoints=false: a rerun under another config trained anew, replacing metrics.json (and, with
    logger=csv, metrics.csv); it is refused, as where the checkpoints are kept. The same config is the finished run."""
    recipe = ("trainer.max_epochs=1", "trainer.save_checkpoints=false", "logger=csv")
    first = run_train(*recipe, run_dir=tmp_path / "run")
    assert first.returncode == 0, first.output
    before = snapshot(first.run_dir)
    changed = run_refused(*recipe, "trainer.max_steps=2", run_dir=first.run_dir)
    assert bad_input_line(changed).endswith(
        f"trainer.max_steps=2 (was None): the run in {first.run_dir} finished at step 22 under another config, "
        "without a checkpoint of its own to continue from, and is left as it is: resume=false starts the directory "
        "over, or give this run a directory of its own"
    )
    rerun = run_refused(*recipe[:2], "logger=tensorboard", run_dir=first.run_dir)  # the logger is no part of the run
    assert rerun.returncode == 0, rerun.output
    assert f"run directory {first.run_dir}: finished at step 22; its records are left as they are" in rerun.output
    assert snapshot(first.run_dir) == before


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
