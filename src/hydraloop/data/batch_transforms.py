"""The elementwise end of an image folder's transforms (ToDtype, Normalize), run once per batch instead of per sample.

pytorch/examples' recipe ends each sample's transforms in ToImage, ToDtype and Normalize. The last two are
elementwise arithmetic on a tensor whose shape they keep, yet together they cost a sample as much time (Python,
mostly) as decoding a 32x32 PNG. Run on the collated batch instead (in the DataLoader worker, right after
collation), they do the same arithmetic on the same values: the batch is bitwise the one the per-sample list makes
(tests/test_images.py), and a worker spends about a quarter less time per image on the demo folder
(scripts/benchmark.py, (d)).

Only those two types exactly (a subclass may do anything), only after ToImage or PILToTensor (so that the samples are
tensors to stack), and ToDtype only to a single dtype (a per-type dict would treat the batch, a plain tensor, as
another type than the samples). The data set the caller holds keeps its whole list: the loader gets a copy with the
shorter one.
"""

import copy
import sys
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate


class CollateThenTransform:
    """default_collate, then `transform` on the batch's inputs (the first of each sample's fields). A module-level
    class, so that it pickles into the DataLoader's workers."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __call__(self, samples: list[Any]) -> list[Any]:
        inputs, *rest = default_collate(samples)
        # A plain tensor, as the per-sample list's batch is (stacking torchvision's Image tensors may keep the type).
        return [self.transform(inputs).as_subclass(torch.Tensor), *rest]


def split_elementwise_tail(dataset: Dataset) -> tuple[Dataset, CollateThenTransform | None]:
    """(A copy of `dataset` whose samples stop before the elementwise tail, a collate_fn that runs the tail on each
    batch), or (`dataset`, None) when it is not a torchvision DatasetFolder (ImageFolder) with such a tail."""
    if "torchvision" not in sys.modules:  # then no data set here is one of its folders; do not import it for nothing
        return dataset, None
    from torchvision.datasets import DatasetFolder
    from torchvision.datasets.vision import StandardTransform
    from torchvision.transforms import v2

    if not (isinstance(dataset, DatasetFolder) and type(dataset.transform) is v2.Compose):
        return dataset, None
    transforms = dataset.transform.transforms
    start = len(transforms)
    while start > 0 and _elementwise(transforms[start - 1], v2):
        start -= 1
    if start == len(transforms) or start == 0 or type(transforms[start - 1]) not in (v2.ToImage, v2.PILToTensor):
        return dataset, None
    head = copy.copy(dataset)
    head.transform = v2.Compose(transforms[:start])
    head.transforms = StandardTransform(head.transform, head.target_transform)
    return head, CollateThenTransform(v2.Compose(transforms[start:]))


def _elementwise(transform: Any, v2: Any) -> bool:
    if type(transform) is v2.ToDtype:
        return isinstance(transform.dtype, torch.dtype)
    return type(transform) is v2.Normalize
