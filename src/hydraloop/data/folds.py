"""k-fold cross-validation: `data.num_folds=K data.fold=i` validates on fold i and trains on the other K - 1.

`python src/train.py -m data.num_folds=5 data.fold=0,1,2,3,4` is a 5-fold run: every sample of the pool is
validated exactly once over the five jobs. Each in-memory data set passes its pool to `fold_split` in place of its
usual train/val split; what the pool is (all samples, or only the training set when the data set has its own test
set) is said by the data set's function.
"""

from __future__ import annotations

import numpy as np
import torch

from hydraloop.errors import ConfigError


def train_val_split(
    labels: torch.Tensor, val_fraction: float, split_seed: int, num_folds: int | None = None, fold: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) indices: fold `fold` of `num_folds` when k-fold is on, else a random `val_fraction` of the
    samples; either way fixed by `split_seed` alone."""
    if num_folds is not None:
        return fold_split(labels, num_folds, fold, split_seed)
    if not 0 < val_fraction < 1:
        raise ConfigError(f"data.dataset.val_fraction={val_fraction}: must be between 0 and 1 (exclusive)")
    num_val = int(round(len(labels) * val_fraction))
    if not 0 < num_val < len(labels):
        raise ConfigError(
            f"data.dataset.val_fraction={val_fraction}: leaves {num_val} of {len(labels)} samples for validation "
            f"and {len(labels) - num_val} for training; both need at least one"
        )
    order = torch.from_numpy(np.random.default_rng(split_seed).permutation(len(labels)))
    return order[num_val:], order[:num_val]


def fold_split(labels: torch.Tensor, num_folds: int, fold: int, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) indices into `labels` for fold `fold` of `num_folds`, both in ascending order.

    Stratified for class labels: each class's samples, shuffled by `split_seed`, are dealt round the folds in turn,
    continuing where the previous class stopped, so every fold holds each class's share to within one sample and
    fold sizes differ by at most one. Floating-point targets (regression) are dealt the same way as one class.
    The folds depend on the labels and `split_seed` only: the same on every rank, for every world size and seed.
    """
    count = len(labels)
    if not 2 <= num_folds <= count:
        raise ConfigError(f"data.num_folds={num_folds}: must be between 2 and the {count} samples to split")
    if not 0 <= fold < num_folds:
        raise ConfigError(f"data.fold={fold}: must be in [0, data.num_folds={num_folds})")
    groups = np.zeros(count) if labels.is_floating_point() else labels.numpy()
    rng = np.random.default_rng(split_seed)
    assigned = np.empty(count, dtype=np.int64)
    dealt = 0
    for group in np.unique(groups):
        members = rng.permutation(np.flatnonzero(groups == group))
        assigned[members] = (dealt + np.arange(len(members))) % num_folds
        dealt += len(members)
    in_fold = torch.from_numpy(assigned == fold)
    return torch.nonzero(~in_fold).flatten(), torch.nonzero(in_fold).flatten()
