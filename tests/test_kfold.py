"""k-fold cross-validation: `-m data.num_folds=K data.fold=0,...,K-1` validates every sample exactly once, each fold
holds each class's share, and scripts/summarize.py reports each configuration's mean and standard deviation over
its folds. The same multirun shows TensorBoard's HParams rows: one per job, in the job's own run."""

import json
import math
import statistics

import numpy as np
import pytest
import torch
import yaml
from hydra.utils import instantiate

from conftest import read_checkpoint
from hydraloop.data.digits import load_digits
from hydraloop.data.folds import fold_split
from hydraloop.data.mnist1d import load_mnist1d
from hydraloop.data.synthetic import make_synthetic
from hydraloop.data.tensors import load_tensors
from hydraloop.errors import ConfigError
from test_summarize import summarize, table_rows
from tracking_stores import event_files, events, hparams_row, rejected_in_process


@pytest.fixture(scope="module")
def digits_labels(tmp_path_factory):
    train, val = load_digits(cache_dir=str(tmp_path_factory.mktemp("digits")))
    return torch.cat([train.tensors[1], val.tensors[1]])


@pytest.mark.parametrize("num_folds", [2, 5, 7])
def test_folds_partition_the_samples_and_keep_class_shares(digits_labels, num_folds):
    labels = digits_labels
    folds = [fold_split(labels, num_folds, fold, split_seed=0) for fold in range(num_folds)]
    validated = torch.cat([val for _, val in folds])
    assert sorted(validated.tolist()) == list(range(len(labels)))  # each sample validated exactly once
    for train, val in folds:
        assert sorted(torch.cat([train, val]).tolist()) == list(range(len(labels)))  # trained on all the others
    sizes = [len(val) for _, val in folds]
    assert max(sizes) - min(sizes) <= 1
    for label in range(10):  # stratified: each class's count per fold within one of its share
        counts = [int((labels[val] == label).sum()) for _, val in folds]
        share = int((labels == label).sum()) / num_folds
        assert all(abs(count - share) < 1 for count in counts), (label, counts, share)


def test_folds_depend_on_split_seed_only(digits_labels):
    a = fold_split(digits_labels, 5, 2, split_seed=0)[1]
    assert torch.equal(a, fold_split(digits_labels.clone(), 5, 2, split_seed=0)[1])
    assert not torch.equal(a, fold_split(digits_labels, 5, 2, split_seed=1)[1])


def test_regression_targets_are_split_evenly():
    targets = torch.linspace(0, 1, 103)
    folds = [fold_split(targets, 4, fold, split_seed=0)[1] for fold in range(4)]
    assert sorted(torch.cat(folds).tolist()) == list(range(103)) and {len(fold) for fold in folds} == {25, 26}


def test_what_each_data_set_cross_validates(tmp_path, data_cache):
    """digits and synthetic: all their samples; mnist1d: its 4000 training sequences (the test set stays unused);
    tensors: the file's samples, or refused when the file holds its own validation set."""
    digits = [load_digits(cache_dir=str(data_cache), num_folds=3, fold=fold) for fold in range(3)]
    assert sum(len(val) for _, val in digits) == 1797 and all(len(t) + len(v) == 1797 for t, v in digits)
    synthetic = make_synthetic(100, 20, [4], 3, num_folds=4, fold=1)
    assert len(synthetic[0]) + len(synthetic[1]) == 120 and len(synthetic[1]) == 30
    mnist1d = load_mnist1d(cache_dir=str(data_cache), num_folds=5, fold=0)
    assert (len(mnist1d[0]), len(mnist1d[1])) == (3200, 800)
    x, y = np.random.default_rng(0).normal(size=(50, 3)).astype(np.float32), np.arange(50) % 2
    np.savez(tmp_path / "pool.npz", x=x, y=y)
    train, val = load_tensors(str(tmp_path / "pool.npz"), [3], 2, num_folds=5, fold=4)
    assert (len(train), len(val)) == (40, 10)
    np.savez(tmp_path / "own_val.npz", x=x, y=y, x_val=x[:5], y_val=y[:5])
    with pytest.raises(ConfigError, match=r"^data.num_folds=5: data.dataset.path=.*own_val.npz holds its own valid"):
        load_tensors(str(tmp_path / "own_val.npz"), [3], 2, num_folds=5, fold=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("data.num_folds=5", "data.fold=5"), "data.fold=5: must be in [0, data.num_folds=5)"),
        (("data.num_folds=5", "data.fold=-1"), "data.fold=-1: must be in [0, data.num_folds=5)"),
        (("data.num_folds=1",), "data.num_folds=1: must be at least 2, or null for no k-fold"),
        (("data.fold=2",), "data.fold=2: needs data.num_folds (k-fold cross-validation)"),
        (
            ("data.num_folds=3", "~data.dataset.num_folds", "~data.dataset.fold"),
            "data.num_folds=3: the data set hydraloop.data.digits.load_digits takes no num_folds",
        ),
    ],
)
def test_bad_folds(train_in_process, tmp_path, caplog, overrides, message):
    error = rejected_in_process(train_in_process, tmp_path, caplog, *overrides)
    assert error.startswith(message), error


def test_kfold_on_a_file_with_its_own_validation_set(train_in_process, tmp_path, caplog):
    x, y = np.zeros((8, 3), np.float32), np.arange(8) % 2
    path = tmp_path / "own_val.npz"
    np.savez(path, x=x, y=y, x_val=x, y_val=y)
    overrides = ("data=tensors", f"data.dataset.path={path}", "data.input_shape=[3]", "data.num_classes=2")
    error = rejected_in_process(train_in_process, tmp_path, caplog, *overrides, "data.num_folds=2")
    assert error.startswith(f"data.num_folds=2: data.dataset.path={path} holds its own validation set"), error


# --- a real 3-fold multirun of two configurations ----------------------------------------------------------------

FOLDS, LRS = 3, ("0.003", "0.03")


@pytest.fixture(scope="module")
def kfold_sweep(run_train, tmp_path_factory):
    sweep_dir = tmp_path_factory.mktemp("kfold")
    run = run_train(
        "-m",
        f"data.num_folds={FOLDS}",
        "data.fold=0,1,2",
        f"optimizer.lr={','.join(LRS)}",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=8",
        f"hydra.sweep.dir={sweep_dir}",
        timeout=300,
    )
    assert run.returncode == 0, run.output
    jobs = sorted((path for path in sweep_dir.iterdir() if path.name.isdigit()), key=lambda path: int(path.name))
    assert len(jobs) == FOLDS * len(LRS)
    return sweep_dir, jobs


def job_config(job) -> dict:
    return yaml.safe_load((job / ".hydra" / "config.yaml").read_text())


def job_metrics(job) -> dict:
    return json.loads((job / "metrics.json").read_text())


@pytest.mark.slow
def test_every_sample_is_validated_once_per_configuration(kfold_sweep, data_cache):
    """Each job's final weights, evaluated here on its fold, score exactly the job's val/acc; the folds of one
    configuration partition all 1797 digits."""
    _, jobs = kfold_sweep
    validated = {lr: [] for lr in LRS}
    for job in jobs:
        config = job_config(job)
        fold = config["data"]["fold"]
        _, val = load_digits(cache_dir=str(data_cache), num_folds=FOLDS, fold=fold)
        checkpoint = read_checkpoint(job / "checkpoints" / "last.pt")
        model = instantiate(checkpoint["config"]["model"])  # resolved, unlike .hydra/config.yaml
        model.load_state_dict(checkpoint["model"])
        with torch.no_grad():
            logits = model(val.tensors[0])
        correct = int((logits.argmax(dim=1) == val.tensors[1]).sum())
        assert correct / len(val) == job_metrics(job)["val/acc"], job
        validated[str(config["optimizer"]["lr"])].append(fold)
    assert validated == {lr: [0, 1, 2] for lr in LRS}  # with the partition test above: each digit once per lr


@pytest.mark.slow
def test_summary_reports_mean_and_std_over_folds(kfold_sweep):
    sweep_dir, jobs = kfold_sweep
    result = summarize(sweep_dir)
    assert result.returncode == 0, result.stderr
    markdown = (sweep_dir / "summary.md").read_text()
    folds_table = markdown.split("## Cross-validation: mean ± standard deviation over folds")[1]
    rows = table_rows(folds_table)
    by_lr = {lr: [job_metrics(job) for job in jobs if str(job_config(job)["optimizer"]["lr"]) == lr] for lr in LRS}
    means = {lr: statistics.fmean(m["val/acc"] for m in metrics) for lr, metrics in by_lr.items()}
    expected = [f"`optimizer.lr={lr}`" for lr in sorted(LRS, key=lambda lr: -means[lr])]
    assert [row["configuration"] for row in rows] == expected
    for row in rows:
        metrics = by_lr[row["configuration"].strip("`").split("=")[1]]
        assert row["folds"] == str(FOLDS)
        for key in ("val/acc", "val/loss", "train/loss"):
            values = [m[key] for m in metrics]
            mean, std = (float(part) for part in row[key].split(" ± "))
            assert mean == pytest.approx(statistics.fmean(values), abs=5e-5)
            assert std == pytest.approx(statistics.stdev(values), abs=5e-5) and std > 0
    from matplotlib.image import imread

    image = imread(sweep_dir / "val_curves.png")
    assert image.shape[0] >= 400 and image[..., :3].std() > 0.05


@pytest.mark.slow
def test_each_job_is_one_hparams_row_in_its_own_run(kfold_sweep):
    """TensorBoard takes a sweep's columns from one run's declaration: every job declares the same."""
    _, jobs = kfold_sweep
    rows = [hparams_row(job) for job in jobs]
    assert {(tuple(names), tuple(metrics)) for names, metrics, _ in rows} == {
        (
            ("data.num_folds", "data.fold", "optimizer.lr", "trainer.max_epochs", "trainer.limit_train_batches"),
            ("val/loss", "val/acc", "val/acc_top5", "train/epoch_loss"),
        )
    }
    for job, (_, _, values) in zip(jobs, rows):
        config = job_config(job)
        assert values["data.fold"] == config["data"]["fold"] and values["data.num_folds"] == FOLDS
        assert values["optimizer.lr"] == config["optimizer"]["lr"]
        assert event_files(job) == [event_files(job)[0]] and "/" not in event_files(job)[0]  # no sub-run
        final = events(job).Scalars("val/acc")[-1].value  # the row's val/acc column: the run's last value
        assert math.isclose(final, job_metrics(job)["val/acc"], rel_tol=1e-6)
