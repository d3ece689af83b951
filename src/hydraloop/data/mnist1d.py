import random

import numpy as np
import torch
from torch.utils.data import TensorDataset

from hydraloop.data.cache import cached_arrays
from hydraloop.data.folds import fold_split


def load_mnist1d(
    cache_dir: str | None = None, num_folds: int | None = None, fold: int = 0, split_seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """MNIST-1D with the package's default generation arguments: 4000 train / 1000 test, shape (1, 40).

    With `num_folds`, cross-validation over the 4000 training sequences: fold `fold` of them (chosen by
    `split_seed`) is the validation set, and the test set stays unused, held out for the model finally chosen."""
    arrays = cached_arrays("mnist1d_default", _generate, cache_dir)

    def tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.tensor(x, dtype=torch.float32).unsqueeze(1), torch.tensor(y, dtype=torch.long))

    train_set = tensors(arrays["x"], arrays["y"])
    if num_folds is None:
        return train_set, tensors(arrays["x_test"], arrays["y_test"])
    x, y = train_set.tensors
    train, val = fold_split(y, num_folds, fold, split_seed)
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def _generate() -> dict[str, np.ndarray]:
    from mnist1d.data import get_dataset_args, make_dataset

    # make_dataset reseeds numpy's and Python's global RNGs; keep the caller's streams untouched.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    return {key: data[key] for key in ("x", "y", "x_test", "y_test")}
