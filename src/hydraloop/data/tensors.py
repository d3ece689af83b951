"""Your own arrays as a data set, without code: `data=tensors data.dataset.path=my.npz data.input_shape=[20]
data.num_classes=3`.

The file is a numpy `.npz` (`np.savez("my.npz", x=x, y=y)`) or a torch `.pt` holding a dict of tensors
(`torch.save({"x": x, "y": y}, "my.pt")`, read with `weights_only=True`, so loading it runs no code). `x` holds the
inputs, floating point, shaped `(N, *input_shape)`; `y` the labels, integer class indices in `[0, num_classes)`,
shaped `(N,)`, or, with `target_shape` (task=regression), real values shaped `(N, *target_shape)`. If the file also
holds `x_val` and `y_val` (`<x_key>_val`, `<y_key>_val`), they are the validation set; otherwise a fixed
`val_fraction` of the samples is held out, chosen by `split_seed`, or, with `num_folds`, fold `fold` of them (k-fold
cross-validation, which a file with its own validation set refuses).

A table works too: a `.csv` (a header row, then numbers) or a `.parquet` file, whose column `y_key` holds the
targets and `feature_columns` (null: every other column) the inputs, one value each (input_shape [number of
features]); a validation set is held out as above. A table's inputs are read as real values, whole numbers too, or,
with `integer_inputs=true`, as integers (token ids, say, for a model that embeds them), kept as int64.

Anything wrong with the file is a ConfigError: one line naming the config key, the value and what was found.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from hydraloop.data.array_files import TABLES, quoted, read_arrays, read_table
from hydraloop.data.folds import train_val_split
from hydraloop.errors import ConfigError


def load_tensors(
    path: str,
    input_shape: Sequence[int],
    num_classes: int,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    x_key: str = "x",
    y_key: str = "y",
    num_folds: int | None = None,
    fold: int = 0,
    target_shape: Sequence[int] | None = None,
    feature_columns: Sequence[str] | None = None,
    integer_inputs: bool = False,
) -> tuple[TensorDataset, TensorDataset]:
    """(train, val) TensorDatasets of float32 inputs (int64 with `integer_inputs`) and int64 labels (float32 targets
    with `target_shape`) read from `path` (.npz, .pt, or a .csv or .parquet table)."""
    where = f"data.dataset.path={path}"
    if Path(str(path)).suffix.lower() in TABLES:
        arrays = read_table(Path(str(path)), where, x_key, y_key, feature_columns)
        if target_shape is not None:  # a table's "3" is a real value here, not a class label
            arrays[y_key] = arrays[y_key].double()
        if not integer_inputs:  # nor is a feature of 3 (a count, a year) an id, unless integer_inputs says so
            arrays[x_key] = arrays[x_key].double()
    else:
        arrays = read_arrays(Path(str(path)), where)
    x_val_key, y_val_key = f"{x_key}_val", f"{y_key}_val"
    missing = [key for key in (x_key, y_key) if key not in arrays]
    if missing:
        raise ConfigError(
            f"{where}: no {quoted(missing)} in the file (data.dataset.x_key={x_key}, data.dataset.y_key={y_key}); "
            f"it holds {quoted(sorted(arrays)) or 'nothing'}"
        )
    has_val = [key in arrays for key in (x_val_key, y_val_key)]
    if any(has_val) and not all(has_val):
        present, absent = (x_val_key, y_val_key) if has_val[0] else (y_val_key, x_val_key)
        raise ConfigError(f"{where}: has '{present}' but no '{absent}'; give both for a validation set, or neither")

    input_shape = [int(size) for size in input_shape]
    targets = None if target_shape is None else [int(size) for size in target_shape]
    x, y = _checked(arrays, x_key, y_key, input_shape, num_classes, targets, where, integer_inputs)
    if all(has_val):
        if num_folds is not None:
            raise ConfigError(
                f"data.num_folds={num_folds}: {where} holds its own validation set ('{x_val_key}', '{y_val_key}'); "
                "k-fold splits one pool of samples: leave them out of the file, or set data.num_folds=null"
            )
        x_val, y_val = _checked(arrays, x_val_key, y_val_key, input_shape, num_classes, targets, where, integer_inputs)
        return TensorDataset(x, y), TensorDataset(x_val, y_val)
    if num_folds is None and not 0 < val_fraction < 1:
        raise ConfigError(
            f"data.dataset.val_fraction={val_fraction}: must be between 0 and 1 (exclusive), "
            f"or give '{x_val_key}' and '{y_val_key}' in the file"
        )
    train, val = train_val_split(y, val_fraction, split_seed, num_folds, fold)
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def _checked(
    arrays: dict[str, Any],
    x_key: str,
    y_key: str,
    input_shape: list[int],
    num_classes: int,
    target_shape: list[int] | None,
    where: str,
    integer_inputs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = arrays[x_key], arrays[y_key]
    for key, value in ((x_key, x), (y_key, y)):
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"{where}: '{key}' holds a {type(value).__name__}, not a tensor")
    integers = not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
    if integer_inputs and not integers:
        raise ConfigError(f"data.dataset.integer_inputs=true: '{x_key}' has dtype {_dtype(x)}, not integers")
    if not integer_inputs and not x.is_floating_point():
        raise ConfigError(
            f"{where}: '{x_key}' has dtype {_dtype(x)}; inputs must be floating point (e.g. float32), or, for token "
            "ids, integers with data.dataset.integer_inputs=true"
        )
    if target_shape is not None:
        return _with_real_targets(x, y, x_key, y_key, input_shape, target_shape, where, integer_inputs)
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ConfigError(
            f"{where}: '{y_key}' has dtype {_dtype(y)}; labels must be integer class indices (e.g. int64)"
        )
    if y.dim() != 1:
        raise ConfigError(
            f"{where}: '{y_key}' has shape {list(y.shape)}; labels must be one class index per sample, "
            "shape [N] (not one-hot)"
        )
    if x.dim() == 0 or len(x) != len(y):
        raise ConfigError(
            f"{where}: '{x_key}' has {len(x) if x.dim() else 0} samples but '{y_key}' has {len(y)}; "
            "they must have the same length"
        )
    if len(y) == 0:
        raise ConfigError(f"{where}: '{x_key}' and '{y_key}' hold no samples")
    if not input_shape or min(input_shape) <= 0:
        raise ConfigError(f"data.input_shape={input_shape}: must be a list of positive sizes, e.g. [20] or [1, 28, 28]")
    if list(x.shape[1:]) != input_shape:
        raise ConfigError(
            f"{where}: '{x_key}' samples have shape {list(x.shape[1:])} ('{x_key}' is {list(x.shape)}), "
            f"but data.input_shape={input_shape}"
        )
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= num_classes:
        raise ConfigError(
            f"{where}: '{y_key}' holds labels from {low} to {high}, outside [0, data.num_classes={num_classes})"
        )
    return (x.to(torch.int64) if integer_inputs else _finite(x, x_key, where)), y.to(torch.int64)


def _with_real_targets(
    x: torch.Tensor,
    y: torch.Tensor,
    x_key: str,
    y_key: str,
    input_shape: list[int],
    target_shape: list[int],
    where: str,
    integer_inputs: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`data.target_shape` set (task=regression): `y` holds real values shaped `(N, *target_shape)`."""
    if not y.is_floating_point():
        raise ConfigError(
            f"{where}: '{y_key}' has dtype {_dtype(y)}, integer labels; data.target_shape={target_shape} asks for "
            "real-valued targets (floating point; or data.target_shape=null for class labels)"
        )
    if y.dim() == 0 or len(x) != len(y):
        raise ConfigError(f"{where}: '{x_key}' has {len(x)} samples but '{y_key}' has {len(y) if y.dim() else 0}")
    if list(y.shape[1:]) != target_shape:
        raise ConfigError(
            f"{where}: '{y_key}' samples have shape {list(y.shape[1:])} ('{y_key}' is {list(y.shape)}), "
            f"but data.target_shape={target_shape}"
        )
    if list(x.shape[1:]) != input_shape:
        raise ConfigError(
            f"{where}: '{x_key}' samples have shape {list(x.shape[1:])} ('{x_key}' is {list(x.shape)}), "
            f"but data.input_shape={input_shape}"
        )
    return (x.to(torch.int64) if integer_inputs else _finite(x, x_key, where)), _finite(y, y_key, where)


def _finite(values: torch.Tensor, key: str, where: str) -> torch.Tensor:
    values = values.to(torch.float32)
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise ConfigError(f"{where}: '{key}' holds {bad} NaN or infinite value(s) (as float32)")
    return values.contiguous()


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
