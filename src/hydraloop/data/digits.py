import numpy as np
import torch
from torch.utils.data import TensorDataset

from hydraloop.data.cache import cached_arrays


def load_digits(
    val_fraction: float = 0.2, split_seed: int = 0, cache_dir: str | None = None
) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8x8 handwritten digits as (1, 8, 8) float images in [0, 1], split into train / val."""
    arrays = cached_arrays("sklearn_digits", _from_sklearn, cache_dir)  # importing sklearn costs ~1 s per run
    x = torch.tensor(arrays["images"] / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(arrays["target"], dtype=torch.long)
    order = torch.from_numpy(np.random.default_rng(split_seed).permutation(len(y)))
    num_val = int(round(len(y) * val_fraction))
    val, train = order[:num_val], order[num_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def _from_sklearn() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    return {"images": digits.images, "target": digits.target}
