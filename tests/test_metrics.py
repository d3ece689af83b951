"""The config's `metrics`: torchmetrics by name, reported beside the task's, equal to scikit-learn's on one process
and to single-process training's under ddp and fsdp; their better direction from the class; bad ones in one line."""

import pytest
import torch
from hydra.utils import instantiate

from conftest import bad_input_line, compose_train
from hydraloop.errors import ConfigError

pytest.importorskip("torchmetrics", reason="the metrics extra (in dev)")
sklearn_metrics = pytest.importorskip("sklearn.metrics")

from hydraloop.metrics import MetricSet  # noqa: E402

METRICS = [
    "+metrics.f1={_target_: torchmetrics.classification.MulticlassF1Score, num_classes: 10, average: macro}",
    "+metrics.auroc={_target_: torchmetrics.classification.MulticlassAUROC, num_classes: 10}",
    "+metrics.ap={_target_: torchmetrics.classification.MulticlassAveragePrecision, num_classes: 10}",
]
# 1797 digits, 360 for validation: with a batch of 64 the ranks' shards (180 each) end in uneven last batches.
RUN = ["trainer.max_steps=6", "logger=csv", "optimized_metric=val/f1", *METRICS]


@pytest.fixture(scope="module")
def single(run_train):
    run = run_train(*RUN)
    assert run.returncode == 0, run.output
    return run


def test_single_process_values_are_scikit_learns(single):
    checkpoint = single.checkpoint()
    model = instantiate(compose_train().model)
    model.load_state_dict(checkpoint["model"])
    _, val_set = instantiate(compose_train().data.dataset)
    inputs, targets = (torch.stack(column) for column in zip(*[val_set[i] for i in range(len(val_set))]))
    with torch.no_grad():
        probabilities = model.eval()(inputs).softmax(dim=1).numpy()
    labels, predicted = targets.numpy(), probabilities.argmax(axis=1)
    metrics = single.metrics
    assert metrics["val/f1"] == pytest.approx(sklearn_metrics.f1_score(labels, predicted, average="macro"), abs=1e-6)
    auroc = sklearn_metrics.roc_auc_score(labels, probabilities, multi_class="ovr", average="macro")
    assert metrics["val/auroc"] == pytest.approx(auroc, abs=1e-5)
    one_hot = torch.nn.functional.one_hot(targets, 10).numpy()
    ap = sklearn_metrics.average_precision_score(one_hot, probabilities, average="macro")
    assert metrics["val/ap"] == pytest.approx(ap, abs=1e-5)
    assert "val/f1" in (single.run_dir / "metrics.csv").read_text().splitlines()[0]  # logged beside the task's


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_under_ddp_and_fsdp_they_equal_single(run_train, single, parallel):
    split = run_train(*RUN, f"parallel={parallel}", "parallel.nproc_per_node=2")
    assert split.returncode == 0, split.output
    for name in ("val/f1", "val/auroc", "val/ap", "val/acc"):
        assert split.metrics[name] == pytest.approx(single.metrics[name], abs=1e-6), name


def test_the_better_direction_is_the_classs():
    mse = "+metrics.mse={_target_: torchmetrics.MeanSquaredError}"
    assert compose_train("data=diabetes", "task=regression", mse, "optimized_metric=val/mse").optimized_metric_mode == (
        "min"
    )
    assert compose_train(*METRICS, "optimized_metric=val/f1").optimized_metric_mode == "max"


@pytest.mark.parametrize(
    "node, expected",
    [
        (
            {"f1": {"_target_": "torchmetrics.F1Scor"}},
            "metrics.f1._target_=torchmetrics.F1Scor: no such class; closest",
        ),
        (
            {"f1": {"_target_": "torchmetrics.classification.MulticlasF1Score"}},
            "no such class; closest in torchmetrics: MulticlassF1Score",
        ),
        ({"f1": {"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1}}, "not a torchmetrics.Metric"),
        ({"f1": "F1Score"}, "metrics.f1=F1Score: must be a node with a _target_"),
    ],
)
def test_a_metric_that_cannot_be_is_one_line(node, expected):
    with pytest.raises(ConfigError, match=expected):
        MetricSet(node, torch.device("cpu"))


def test_a_constructors_refusal_is_one_line_through_the_command_line(run_train, tmp_path):
    run = run_train("+metrics.f1={_target_: torchmetrics.classification.MulticlassF1Score}", run_dir=tmp_path / "r")
    assert "metrics.f1: MulticlassF1Score says:" in bad_input_line(run) and not (tmp_path / "r").exists()


def test_a_regression_metric_is_given_the_outputs_in_the_targets_shape():
    """A regression model gives (N, 1) for one value per sample, torchmetrics' regression metrics want the targets'
    (N,): MeanSquaredError refused them at the first validation. They now equal the task's own val/mse and val/r2."""
    from hydraloop.tasks.regression import Regression

    task = Regression(target_shape=[])
    node = {"tm_mse": {"_target_": "torchmetrics.MeanSquaredError"}, "tm_r2": {"_target_": "torchmetrics.R2Score"}}
    task.extra_metrics = MetricSet(node, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    outputs, targets = torch.randn(16, 1, generator=generator), torch.randn(16, generator=generator)
    own = task.metrics_from(task.validation_statistics(lambda inputs: outputs, (torch.zeros(16, 3), targets)).tolist())
    theirs = task.extra_metrics.compute()
    assert theirs["val/tm_mse"] == pytest.approx(own["val/mse"], rel=1e-6)
    assert theirs["val/tm_r2"] == pytest.approx(own["val/r2"], rel=1e-5)
