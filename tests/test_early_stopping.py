"""Early stopping on optimized_metric, and evaluating best.pt at the end (trainer.eval_best)."""

import csv

import pytest

from conftest import bad_input_line, max_param_diff

# A [128, 128] MLP overfits the diabetes set's 354 training patients within a few epochs: val/mse turns up.
OVERFITTING = ("data=diabetes", "task=regression", "trainer.max_epochs=40", "trainer.early_stopping.patience=3")


def validations(run_dir) -> list[float]:
    return [float(row["val/mse"]) for row in csv.DictReader((run_dir / "metrics.csv").open()) if row["val/mse"]]


def expected_stop(values: list[float], patience: int, min_delta: float) -> int:
    """The validation (1-based) after which `patience` in a row have not improved on the best by > min_delta."""
    best, stale = None, 0
    for number, value in enumerate(values, start=1):
        if best is None or best - value > min_delta:
            best, stale = value, 0
        else:
            stale += 1
            if stale == patience:
                return number
    return len(values)


@pytest.mark.parametrize("min_delta", [0.0, 0.05])
def test_training_stops_after_patience_validations_without_improvement(train_in_process, min_delta):
    metrics, run_dir = train_in_process(*OVERFITTING, f"trainer.early_stopping.min_delta={min_delta}", "logger=csv")
    values = validations(run_dir)
    stop = metrics["stopped_early"]
    assert stop["epoch"] == expected_stop(values, 3, min_delta) == len(values) < 40
    assert stop["global_step"] == metrics["global_step"] == 11 * stop["epoch"]
    assert stop["reason"].startswith(f"val/mse did not improve by more than {min_delta} in 3 validations")
    assert metrics["val/mse"] == values[-1]


def test_resuming_a_run_that_stopped_early_does_not_train_on(train_in_process, tmp_path):
    first, run_dir = train_in_process(*OVERFITTING, "logger=none")
    again, _ = train_in_process(*OVERFITTING, "logger=none", "trainer.max_epochs=60", run_dir=run_dir)
    assert again["global_step"] == first["global_step"] and again["stopped_early"] == first["stopped_early"]
    assert again["val/mse"] == first["val/mse"]


def test_eval_best_adds_the_best_checkpoints_metrics(train_in_process):
    metrics, run_dir = train_in_process(*OVERFITTING, "trainer.eval_best=true", "logger=csv")
    values = validations(run_dir)
    assert metrics["best/val/mse"] == pytest.approx(min(values), rel=1e-12)
    assert (
        metrics["best/epoch"] == values.index(min(values)) + 1
        and metrics["best/global_step"] == 11 * metrics["best/epoch"]
    )
    assert metrics["val/mse"] == values[-1] != metrics["best/val/mse"]  # the last weights are not the best


def test_a_stop_at_a_validation_mid_epoch_ends_the_run_with_its_records(train_in_process):
    """Validation every 2 steps of 11-step epochs: the stop falls mid-epoch, where the loop has no epoch's metrics."""
    metrics, run_dir = train_in_process(
        *OVERFITTING, "trainer.val_every_n_steps=2", "trainer.early_stopping.min_delta=1e9", "trainer.eval_best=true",
        "logger=csv",
    )  # fmt: skip
    values = validations(run_dir)
    # The first validation sets the best; patience 3 more, none better by 1e9, end the run at step 8.
    assert metrics["stopped_early"]["global_step"] == metrics["global_step"] == 2 * len(values) == 8
    assert metrics["val/mse"] == values[-1] and metrics["best/val/mse"] == pytest.approx(min(values), rel=1e-12)
    assert (run_dir / "metrics.json").is_file()


@pytest.fixture(scope="module")
def single_eval_best(run_train):
    run = run_train(*OVERFITTING, "logger=none", "trainer.eval_best=true")
    assert run.returncode == 0, run.output
    return run


@pytest.mark.slow
def test_every_rank_stops_after_the_same_epoch(run_train, single_eval_best):
    single = single_eval_best
    ddp = run_train(*OVERFITTING, "logger=none", "trainer.eval_best=true", "parallel=ddp")
    assert ddp.returncode == 0, ddp.output
    assert ddp.metrics["stopped_early"] == single.metrics["stopped_early"]
    assert max_param_diff(ddp.checkpoint("best.pt")["model"], single.checkpoint("best.pt")["model"]) < 1e-5
    assert ddp.metrics["best/val/mse"] == pytest.approx(single.metrics["best/val/mse"], rel=1e-5)


@pytest.mark.slow
def test_fsdp_evaluates_its_sharded_best_checkpoint_as_single_does(run_train, single_eval_best):
    """parallel=fsdp's best.pt is a link to a step's folder of shards: eval_best took it for missing, and metrics.json
    had no best/* (so a rerun did not find the run finished, and wrote metrics.json again)."""
    fsdp = run_train(*OVERFITTING, "logger=none", "trainer.eval_best=true", "parallel=fsdp")
    assert fsdp.returncode == 0, fsdp.output
    assert (fsdp.run_dir / "checkpoints" / "best.pt").is_dir()
    best = {key: value for key, value in single_eval_best.metrics.items() if key.startswith("best/")}
    assert {key for key in fsdp.metrics if key.startswith("best/")} == best.keys() >= {"best/val/mse", "best/epoch"}
    for key, value in best.items():  # best/epoch and best/global_step: the same checkpoint
        assert fsdp.metrics[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.early_stopping.patience=0", "trainer.early_stopping.patience=0: must be positive, or null"),
        ("trainer.early_stopping.min_delta=-1", "trainer.early_stopping.min_delta=-1.0: must be at least 0"),
        (
            "trainer.save_checkpoints=false",
            "trainer.eval_best=true: needs trainer.save_checkpoints=true, for checkpoints/best.pt",
        ),
    ],
)
def test_bad_early_stopping_and_eval_best_settings(run_train, override, message):
    assert message in bad_input_line(run_train("trainer.eval_best=true", override))
