import numpy as np
import torch
from torch.utils.data import TensorDataset

from hydraloop.data.cache import cached_arrays
from hydraloop.data.folds import train_val_split


def load_diabetes(
    val_fraction: float = 0.2,
    split_seed: int = 0,
    standardize: bool = True,
    cache_dir: str | None = None,
    num_folds: int | None = None,
    fold: int = 0,
) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's diabetes set (Efron et al. 2004): 442 patients, 10 baseline measurements, and a measure of the
    disease's progression one year later (25 to 346) as the regression target, one value per sample.

    `standardize`: inputs and target are shifted and scaled to mean 0 and standard deviation 1 by the training
    split's statistics (the raw target's variance is ~6000, far from what one learning rate suits alongside the
    inputs'); val/mse is then in units of the training target's variance, and val/r2 is the same either way.
    With `num_folds`, fold `fold` of all 442 patients is the validation set instead (`val_fraction` is unused).
    """
    arrays = cached_arrays("sklearn_diabetes", _from_sklearn, cache_dir)  # importing sklearn costs ~1 s per run
    x = torch.tensor(arrays["data"], dtype=torch.float64)
    y = torch.tensor(arrays["target"], dtype=torch.float64)
    train, val = train_val_split(y, val_fraction, split_seed, num_folds, fold)
    if standardize:
        x = (x - x[train].mean(dim=0)) / x[train].std(dim=0)
        y = (y - y[train].mean()) / y[train].std()
    x, y = x.float(), y.float()
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def _from_sklearn() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_diabetes as sklearn_diabetes

    diabetes = sklearn_diabetes(scaled=False)
    return {"data": diabetes.data, "target": diabetes.target}
