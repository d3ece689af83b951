import math

import torch
from torch.utils.data import TensorDataset

from hydraloop.data.folds import fold_split
from hydraloop.errors import require


def make_synthetic(
    num_train: int,
    num_val: int,
    input_shape: list[int],
    num_classes: int,
    seed: int = 0,
    num_folds: int | None = None,
    fold: int = 0,
    split_seed: int = 0,
) -> tuple[TensorDataset, TensorDataset]:
    """Gaussian inputs labelled by a fixed random linear teacher, so a model has something to learn.

    With `num_folds`, fold `fold` of all `num_train + num_val` samples (chosen by `split_seed`) is the validation
    set."""
    for key, count in (("num_train", num_train), ("num_val", num_val)):
        require(count > 0, f"data.dataset.{key}={count}: must be positive")
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_train + num_val, *input_shape, generator=generator)
    teacher = torch.randn(math.prod(input_shape), num_classes, generator=generator)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    if num_folds is not None:
        train, val = fold_split(y, num_folds, fold, split_seed)
        return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])
    return TensorDataset(x[:num_train], y[:num_train]), TensorDataset(x[num_train:], y[num_train:])
