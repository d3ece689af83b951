"""Data sets and models of structured batches that the launcher must refuse, for the bad-input tests:
`data.dataset._target_=tests.structured.with_text`, `model._target_=tests.structured.TupleOut`."""

import torch
from torch import nn
from torch.utils.data import Dataset

from hydraloop.models.mlp import MLP


class Samples(Dataset):
    def __init__(self, make) -> None:
        self.make = make

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        return self.make(index)


def with_text(**_):
    """Dict samples that hold a string beside the tensors."""
    sample = lambda i: {"x": torch.randn(8), "text": f"sample {i}", "labels": torch.tensor(i % 2)}  # noqa: E731
    return Samples(sample), Samples(sample)


def without_labels(**_):
    """Dict samples whose targets are under another key than the task reads."""
    sample = lambda i: {"x": torch.randn(8), "target": torch.tensor(i % 2)}  # noqa: E731
    return Samples(sample), Samples(sample)


class TupleOut(MLP):
    """An MLP that returns a tuple (logits, features): no task can know which is which."""

    def forward(self, x):
        return super().forward(x), x


class Keyword(nn.Module):
    """A model called by keyword, for dict batches of `x`."""

    def __init__(self, num_classes: int = 2) -> None:
        super().__init__()
        self.linear = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.linear(x)


class WithComputedBuffer(MLP):
    """An MLP whose constructor draws a buffer that no checkpoint holds (`persistent=False`), added to its inputs:
    under parallel=fsdp only rank 0 builds the model for real, and every rank must compute with rank 0's draw."""

    def __init__(self, input_shape, num_classes: int, **options) -> None:
        super().__init__(input_shape, num_classes, **options)
        self.register_buffer("offset", torch.randn(*input_shape), persistent=False)

    def forward(self, x):
        return super().forward(x + self.offset)


class TwoRows(MLP):
    """An MLP whose forward assumes batches of two rows, as the launcher's trial batch has: only a rank's first step
    (of data.batch_size rows) finds it."""

    def forward(self, x):
        return super().forward(x.reshape(2, -1))
