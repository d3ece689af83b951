import numpy as np
import torch
from torch.utils.data import TensorDataset

from hydraloop.data.cache import cached_arrays
from hydraloop.data.folds import train_val_split


def load_digits(
    val_fraction: float = 0.2,
    split_seed: int = 0,
    cache_dir: str | None = None,
    num_folds: int | None = None,
    fold: int = 0,
) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8x8 handwritten digits as (1, 8, 8) float images in [0, 1], split into train / val.

    With `num_folds`, fold `fold` of all 1797 images is the validation set instead (`val_fraction` is unused)."""
    arrays = cached_arrays("sklearn_digits", _from_sklearn, cache_dir)  # importing sklearn costs ~1 s per run
    x = torch.tensor(arrays["images"] / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(arrays["target"], dtype=torch.long)
    train, val = train_val_split(y, val_fraction, split_seed, num_folds, fold)
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def _from_sklearn() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    return {"images": digits.images, "target": digits.target}
