import math

import torch
from torch.utils.data import TensorDataset


def make_synthetic(
    num_train: int, num_val: int, input_shape: list[int], num_classes: int, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Gaussian inputs labelled by a fixed random linear teacher, so a model has something to learn."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_train + num_val, *input_shape, generator=generator)
    teacher = torch.randn(math.prod(input_shape), num_classes, generator=generator)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    return TensorDataset(x[:num_train], y[:num_train]), TensorDataset(x[num_train:], y[num_train:])
