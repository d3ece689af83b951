"""data=tensors: a user's own .npz / .pt arrays, checked against data.input_shape and data.num_classes, each
problem one clear line."""

import numpy as np
import pytest
import torch

from conftest import bad_input_line
from hydraloop.data.tensors import load_tensors
from hydraloop.errors import ConfigError


def blobs(n: int = 600, dim: int = 20, classes: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Well separated Gaussian blobs: easy to learn, so a short run must reach a high accuracy."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, dim)) * 2
    y = rng.integers(0, classes, n)
    return (centers[y] + rng.normal(size=(n, dim))).astype(np.float32), y


@pytest.fixture
def npz(tmp_path):
    """npz(**arrays) -> path of a new .npz holding them."""
    count = iter(range(1000))

    def write(**arrays) -> str:
        path = tmp_path / f"data{next(count)}.npz"
        np.savez(path, **arrays)
        return str(path)

    return write


def rejected(path, *, input_shape=(20,), num_classes=3, **kwargs) -> str:
    with pytest.raises(ConfigError) as error:
        load_tensors(path, input_shape=list(input_shape), num_classes=num_classes, **kwargs)
    message = str(error.value)
    assert "\n" not in message
    return message


# --- what it loads -------------------------------------------------------------------------------------------


def test_npz_split_into_train_and_val(npz):
    x, y = blobs(n=100)
    path = npz(x=x.astype(np.float64), y=y.astype(np.uint8))
    train, val = load_tensors(path, input_shape=[20], num_classes=3, val_fraction=0.2, split_seed=0)
    assert (len(train), len(val)) == (80, 20)
    xs, ys = train.tensors
    assert xs.dtype == torch.float32 and ys.dtype == torch.int64 and xs.shape == (80, 20)
    # A partition of the file's samples: every row exactly once, with its own label.
    rows = torch.cat([train.tensors[0], val.tensors[0]])
    labels = torch.cat([train.tensors[1], val.tensors[1]])
    order = np.lexsort(rows.numpy().T[::-1])
    expected = np.lexsort(x.astype(np.float32).T[::-1])
    np.testing.assert_array_equal(rows.numpy()[order], x.astype(np.float32)[expected])
    np.testing.assert_array_equal(labels.numpy()[order], y[expected])
    # The split depends on split_seed only.
    again, _ = load_tensors(path, input_shape=[20], num_classes=3, split_seed=0)
    other, _ = load_tensors(path, input_shape=[20], num_classes=3, split_seed=1)
    assert torch.equal(again.tensors[0], xs) and not torch.equal(other.tensors[0], xs)


def test_pt_with_its_own_validation_set(tmp_path):
    x, y = blobs(n=50)
    path = tmp_path / "data.pt"
    images = torch.from_numpy(x).reshape(50, 1, 4, 5)
    torch.save(
        {
            "x": images[:40],
            "y": torch.from_numpy(y[:40]),
            "x_val": images[40:],
            "y_val": torch.from_numpy(y[40:]).int(),
        },
        path,
    )
    train, val = load_tensors(str(path), input_shape=[1, 4, 5], num_classes=3, val_fraction=0.5)
    assert torch.equal(train.tensors[0], images[:40]) and torch.equal(val.tensors[0], images[40:])
    assert torch.equal(val.tensors[1], torch.from_numpy(y[40:])) and val.tensors[1].dtype == torch.int64


def test_custom_keys(npz):
    x, y = blobs(n=30)
    path = npz(features=x[:20], labels=y[:20], features_val=x[20:], labels_val=y[20:])
    train, val = load_tensors(path, input_shape=[20], num_classes=3, x_key="features", y_key="labels")
    assert (len(train), len(val)) == (20, 10)


# --- what it rejects, and how it says so -----------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "nope.npz"
    assert rejected(str(path)) == f"data.dataset.path={path}: no such file"


def test_missing_relative_file_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert rejected("nope.npz") == f"data.dataset.path=nope.npz: no such file ({tmp_path / 'nope.npz'})"


def test_unsupported_extension(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("1,2,3\n")
    assert rejected(str(path)) == (
        f"data.dataset.path={path}: unsupported file type '.txt'; use .npz or .pt or .csv or .parquet"
    )


def test_unreadable_file(tmp_path):
    path = tmp_path / "broken.npz"
    path.write_bytes(b"not a zip file")
    # Not numpy's advice to allow pickles, which is what np.load says of any file that is not a zip or a .npy.
    assert rejected(str(path)) == (
        f"data.dataset.path={path}: not a .npz file (a zip of .npy arrays, as np.savez writes); it starts b'not '"
    )


def test_pt_that_is_not_a_dict(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(3)], path)
    assert rejected(str(path)) == f"data.dataset.path={path}: holds a list; a .pt file must hold a dict of tensors"


def test_missing_keys_named(npz):
    x, y = blobs(n=10)
    path = npz(inputs=x, y=y)
    assert rejected(path) == (
        f"data.dataset.path={path}: no 'x' in the file (data.dataset.x_key=x, data.dataset.y_key=y); "
        "it holds 'inputs', 'y'"
    )
    path = npz(a=x)
    assert rejected(path).startswith(f"data.dataset.path={path}: no 'x', 'y' in the file")


def test_half_a_validation_set(npz):
    x, y = blobs(n=10)
    path = npz(x=x, y=y, x_val=x)
    assert rejected(path) == (
        f"data.dataset.path={path}: has 'x_val' but no 'y_val'; give both for a validation set, or neither"
    )


def test_mismatched_lengths(npz):
    x, y = blobs(n=10)
    path = npz(x=x, y=y[:9])
    assert (
        rejected(path) == f"data.dataset.path={path}: 'x' has 10 samples but 'y' has 9; they must have the same length"
    )


def test_mismatched_lengths_in_the_validation_set(npz):
    x, y = blobs(n=10)
    path = npz(x=x, y=y, x_val=x[:5], y_val=y[:4])
    assert "'x_val' has 5 samples but 'y_val' has 4" in rejected(path)


def test_integer_inputs_need_the_switch_and_stay_integers(npz):
    x, y = blobs(n=10)
    path = npz(x=(x * 100).astype(np.int32), y=y)
    assert rejected(path) == (
        f"data.dataset.path={path}: 'x' has dtype int32; inputs must be floating point (e.g. float32), or, for token "
        "ids, integers with data.dataset.integer_inputs=true"
    )
    train, _ = load_tensors(path, input_shape=[20], num_classes=3, integer_inputs=True, val_fraction=0.5)
    assert train.tensors[0].dtype == torch.int64  # token ids, as an embedding takes them
    assert "integer_inputs=true: 'x' has dtype float32, not integers" in rejected(npz(x=x, y=y), integer_inputs=True)


def test_a_csv_or_parquet_table_by_column_names(tmp_path):
    x, y = blobs(n=50, dim=3)
    csv = tmp_path / "table.csv"
    csv.write_text("a,b,c,label\n" + "".join(f"{r[0]},{r[1]},{r[2]},{t}\n" for r, t in zip(x.tolist(), y)))
    train, val = load_tensors(str(csv), input_shape=[2], num_classes=3, y_key="label", feature_columns=["c", "a"])
    rows = torch.cat([train.tensors[0], val.tensors[0]])
    assert rows.shape == (50, 2) and len(val) == 10
    assert sorted(rows[:, 0].tolist()) == sorted(torch.tensor(x[:, 2]).tolist())  # column c first, as named
    pyarrow = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = pa.table({"ids": (x[:, 0] > 0).astype(np.int64), "other": x[:, 1], "label": y})
    pyarrow.write_table(table, tmp_path / "table.parquet")
    whole, _ = load_tensors(str(tmp_path / "table.parquet"), input_shape=[2], num_classes=3, y_key="label")
    assert whole.tensors[0].shape[1] == 2 and whole.tensors[1].dtype == torch.int64  # every column but the label
    assert "no column 'y' (data.dataset.y_key); it has 'a', 'b', 'c', 'label'" in rejected(str(csv), input_shape=(3,))
    unknown = rejected(str(csv), y_key="label", feature_columns=["a", "d"])
    assert unknown.startswith("data.dataset.feature_columns=['a', 'd']: no column 'd'; it has 'a', 'b', 'c', 'label'")
    (tmp_path / "words.csv").write_text("a,label\nhigh,0\nlow,1\n")
    assert "column 'a' holds values that are not numbers, e.g. 'high'" in rejected(
        str(tmp_path / "words.csv"), y_key="label"
    )
    (tmp_path / "counts.csv").write_text("a,b,label\n" + "".join(f"{i},{i % 3},{i % 2}\n" for i in range(10)))
    counts, counts_val = load_tensors(str(tmp_path / "counts.csv"), input_shape=[2], num_classes=2, y_key="label")
    assert counts.tensors[0].is_floating_point()  # whole numbers, yet features for a model of real inputs
    rows = sorted(map(tuple, torch.cat([counts.tensors[0], counts_val.tensors[0]]).tolist()))
    assert rows == [(float(i), float(i % 3)) for i in range(10)]  # the table's values, each once
    ids, _ = load_tensors(str(tmp_path / "counts.csv"), [2], 2, y_key="label", integer_inputs=True)
    assert ids.tensors[0].dtype == torch.int64


def test_float_labels(npz):
    x, y = blobs(n=10)
    path = npz(x=x, y=y.astype(np.float32))
    assert rejected(path) == (
        f"data.dataset.path={path}: 'y' has dtype float32; labels must be integer class indices (e.g. int64)"
    )


def test_one_hot_labels(npz):
    x, y = blobs(n=10)
    path = npz(x=x, y=np.eye(3, dtype=np.int64)[y])
    assert rejected(path) == (
        f"data.dataset.path={path}: 'y' has shape [10, 3]; labels must be one class index per sample, "
        "shape [N] (not one-hot)"
    )


@pytest.mark.parametrize("bad_label, shown", [(3, "from 0 to 3"), (-1, "from -1 to 2")])
def test_labels_outside_num_classes(npz, bad_label, shown):
    x, y = blobs(n=10)
    y[0] = bad_label
    y[1:4] = [0, 1, 2]
    path = npz(x=x, y=y)
    assert rejected(path) == f"data.dataset.path={path}: 'y' holds labels {shown}, outside [0, data.num_classes=3)"


def test_sample_shape_differs_from_input_shape(npz):
    x, y = blobs(n=10)
    path = npz(x=x, y=y)
    assert rejected(path, input_shape=[1, 20]) == (
        f"data.dataset.path={path}: 'x' samples have shape [20] ('x' is [10, 20]), but data.input_shape=[1, 20]"
    )


def test_non_finite_inputs(npz):
    x, y = blobs(n=10)
    x[2, 3], x[5, 0] = np.nan, np.inf
    path = npz(x=x, y=y)
    assert rejected(path) == f"data.dataset.path={path}: 'x' holds 2 NaN or infinite value(s) (as float32)"


@pytest.mark.parametrize("fraction", [0.0, 1.0, 0.001])
def test_val_fraction_that_leaves_a_split_empty(npz, fraction):
    x, y = blobs(n=10)
    message = rejected(npz(x=x, y=y), val_fraction=fraction)
    assert message.startswith(f"data.dataset.val_fraction={fraction}: ")


# --- through the real CLI --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_trains_on_a_users_npz(run_train, tmp_path):
    x, y = blobs(n=1200)
    np.savez(tmp_path / "blobs.npz", x=x, y=y)
    run = run_train(
        "data=tensors",
        f"data.dataset.path={tmp_path / 'blobs.npz'}",
        "data.input_shape=[20]",
        "data.num_classes=3",
        "trainer.max_epochs=3",
        "logger=none",
    )
    assert run.returncode == 0, run.output
    metrics = run.metrics
    assert metrics["val/acc"] >= 0.98, metrics
    assert metrics["global_step"] == 3 * (960 // 64)  # 240 val samples held out, batches of 64, drop_last


def test_missing_file_through_the_cli(run_train, tmp_path):
    path = tmp_path / "missing.npz"
    run = run_train("data=tensors", f"data.dataset.path={path}", "data.input_shape=[20]", "data.num_classes=3")
    error = bad_input_line(run)
    assert error.endswith(f"data.dataset.path={path}: no such file"), error
    assert "run directory:" not in run.output  # found by data.check in the launcher, which logs that first
    assert not (run.run_dir / "metrics.json").exists()


@pytest.mark.slow
def test_bad_labels_under_ddp(run_train, tmp_path):
    """Each rank loads the file itself; the rank's ConfigError still ends the job as bad input, in one line."""
    x, y = blobs(n=100)
    np.savez(tmp_path / "blobs.npz", x=x, y=y)
    run = run_train(
        "data=tensors",
        f"data.dataset.path={tmp_path / 'blobs.npz'}",
        "data.input_shape=[20]",
        "data.num_classes=2",
        "parallel=ddp",
    )
    error = bad_input_line(run)
    assert error.endswith("'y' holds labels from 0 to 2, outside [0, data.num_classes=2)"), error


def test_required_keys_through_the_cli(run_train):
    """conf/data/tensors.yaml leaves path, input_shape and num_classes as `???`: forgetting one is bad input too."""
    run = run_train("data=tensors", "data.dataset.path=my.npz", "data.num_classes=3")
    error = bad_input_line(run)
    assert "data.input_shape: required" in error, error
