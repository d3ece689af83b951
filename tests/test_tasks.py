"""Tasks own the loss and the metrics: each task's metrics from summed statistics equal the metrics computed on the
whole set at once, however it is split into batches and ranks; regression trains and resumes exactly."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

from conftest import bad_input_line, max_param_diff, read_checkpoint
from hydraloop.tasks.classification import Classification
from hydraloop.tasks.language_model import LanguageModel
from hydraloop.tasks.regression import Regression
from test_config import compose_train


def summed(task, outputs, targets, pieces: int) -> dict[str, float]:
    """The metrics from statistics added over `pieces` unequal batches, as batches and ranks add them."""
    cuts = sorted(np.random.default_rng(0).choice(range(1, len(targets)), pieces - 1, replace=False))
    totals = sum(
        task.statistics(o, t) for o, t in zip(torch.tensor_split(outputs, cuts), torch.tensor_split(targets, cuts))
    )
    assert len(totals) == task.num_statistics
    return task.metrics_from(totals.tolist())


def test_classification_metrics_are_exact_over_batches():
    logits, labels = torch.randn(301, 10, generator=torch.Generator().manual_seed(0)), torch.randint(0, 10, (301,))
    metrics = summed(Classification(num_classes=10), logits, labels, pieces=7)
    top5 = (logits.topk(5, dim=1).indices == labels[:, None]).any(dim=1).float().mean().item()
    assert metrics == pytest.approx(
        {
            "val/loss": F.cross_entropy(logits, labels).item(),
            "val/acc": (logits.argmax(dim=1) == labels).float().mean().item(),
            "val/acc_top5": top5,
        },
        rel=1e-6,
    )
    assert list(summed(Classification(num_classes=3), logits[:, :3], labels % 3, pieces=3)) == ["val/loss", "val/acc"]


def test_label_smoothing_changes_the_training_loss_only():
    logits, labels = torch.randn(64, 10), torch.randint(0, 10, (64,))
    smooth = Classification(num_classes=10, label_smoothing=0.1)
    assert smooth.loss(logits, labels) == pytest.approx(F.cross_entropy(logits, labels, label_smoothing=0.1).item())
    assert summed(smooth, logits, labels, 2)["val/loss"] == pytest.approx(F.cross_entropy(logits, labels).item())


@pytest.mark.parametrize("target_shape", [[], [3]])
def test_regression_metrics_equal_scikit_learns(target_shape):
    generator = torch.Generator().manual_seed(0)
    scale = torch.tensor([1.0, 5.0, 0.1])[: math.prod(target_shape)].reshape(target_shape)  # unequal variances
    targets = torch.randn(257, *target_shape, generator=generator) * scale
    outputs = targets.reshape(257, -1) + 0.5 * torch.randn(257, math.prod(target_shape), generator=generator)
    metrics = summed(Regression(target_shape), outputs, targets, pieces=5)
    y, predicted = targets.reshape(257, -1).double().numpy(), outputs.double().numpy()
    assert metrics == pytest.approx(
        {
            "val/mse": mean_squared_error(y, predicted),
            "val/mae": mean_absolute_error(y, predicted),
            "val/r2": r2_score(y, predicted),  # per output, then averaged
        },
        rel=1e-9,
    )


def test_language_model_metrics_are_per_token():
    logits, tokens = torch.randn(6, 9, 20), torch.randint(0, 20, (6, 9))
    metrics = summed(LanguageModel(vocab_size=20, block_size=9), logits, tokens, pieces=3)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).item()
    accuracy = (logits.argmax(dim=2) == tokens).float().mean().item()
    assert metrics == pytest.approx({"val/loss": loss, "val/ppl": math.exp(loss), "val/acc": accuracy}, rel=1e-6)


@pytest.mark.parametrize(
    ("overrides", "metric", "mode"),
    [
        ((), "val/acc", "max"),
        (("task=regression", "data=diabetes"), "val/mse", "min"),
        (("task=regression", "data=diabetes", "optimized_metric=val/r2"), "val/r2", "max"),
        (("task=language_model",), "val/loss", "min"),
        (("optimized_metric=val/loss",), "val/loss", "min"),
        (("optimized_metric=val/loss", "optimized_metric_mode=max"), "val/loss", "max"),
    ],
)
def test_the_optimized_metric_and_its_direction_default_from_the_task(overrides, metric, mode):
    cfg = compose_train(*overrides)
    assert (cfg.optimized_metric, cfg.optimized_metric_mode) == (metric, mode)


REGRESSION = ("experiment=diabetes_mlp", "trainer.max_epochs=2", "logger=none")


@pytest.fixture(scope="module")
def regression_single(run_train):
    run = run_train(*REGRESSION)
    assert run.returncode == 0, run.output
    return run


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_regression_under_ddp_and_fsdp_equals_single(run_train, regression_single, parallel):
    run = run_train(*REGRESSION, f"parallel={parallel}")
    assert run.returncode == 0, run.output
    assert max_param_diff(run.checkpoint()["model"], regression_single.checkpoint()["model"]) < 1e-5
    for name in ("val/mse", "val/mae", "val/r2"):
        assert run.metrics[name] == pytest.approx(regression_single.metrics[name], rel=1e-5)


def test_regression_trains_and_its_metrics_are_those_of_its_predictions(train_in_process):
    metrics, run_dir = train_in_process("experiment=diabetes_mlp", "logger=none")
    assert metrics["val/r2"] > 0.45  # least squares on this split: 0.523
    # mode=eval recomputes the checkpoint's metrics from its weights.
    evaluated, _ = train_in_process(
        "experiment=diabetes_mlp", "logger=none", "mode=eval", f"ckpt_path={run_dir}/checkpoints/best.pt"
    )
    saved = read_checkpoint(run_dir / "checkpoints" / "best.pt")["metrics"]
    assert {name: evaluated[name] for name in saved} == pytest.approx(saved, rel=1e-9)
    last = read_checkpoint(run_dir / "checkpoints" / "last.pt")["metrics"]
    assert saved["val/mse"] <= last["val/mse"]  # best.pt is chosen by val/mse, minimised


def test_gradient_accumulation_for_regression_matches_one_batch(train_in_process):
    plain, plain_dir = train_in_process(*REGRESSION)
    accumulated, accumulated_dir = train_in_process(*REGRESSION, "trainer.grad_accum_steps=4")
    weights = [read_checkpoint(d / "checkpoints" / "last.pt")["model"] for d in (plain_dir, accumulated_dir)]
    assert max_param_diff(*weights) < 1e-5
    assert accumulated["val/mse"] == pytest.approx(plain["val/mse"], rel=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("data=diabetes",),
            "task=classification: needs integer class labels, but data.target_shape=[] says the targets are real "
            "values (task=regression fits them)",
        ),
        (
            ("task=regression",),
            "task=regression: needs real-valued targets, but data.target_shape=null says the data has class labels",
        ),
        (("task=language_model",), "task=language_model: needs token sequences (data.vocab_size and data.block_size"),
        (
            ("task=regression", "data=diabetes", "data.num_classes=3"),
            "data.num_classes=3: the model's output width, must be 1 for data.target_shape=[] under task=regression",
        ),
        (
            ("task=regression", "data=diabetes", "optimized_metric=val/acc"),
            "optimized_metric=val/acc: the task reports val/mse, val/mae, val/r2",
        ),
        (("task.label_smoothing=1.5",), "task.label_smoothing=1.5: must be at least 0 and below 1"),
    ],
)
def test_a_task_that_does_not_fit_is_refused_in_one_line(run_train, overrides, message):
    run = run_train(*overrides)
    assert message in bad_input_line(run)
    assert not (run.run_dir / "checkpoints").exists()
