"""Resolvers that yaml files compute values with, registered by hydraloop.config.register_configs. The config is
resolved once, in the launcher: the ranks get plain values."""

from collections.abc import Callable
from typing import Any


def image_folder_classes(root: str) -> int:
    """`${image_folder_classes:${data.dataset.root}}`: data=image_folder's num_classes, the class folders in
    root/train (0 if there is none: the data set's launcher check then says what is wrong)."""
    from hydraloop.data.image_folder import count_class_folders  # imports no torchvision

    return count_class_folders(root)


def linear_scaling(base_lr: float, base_batch_size: int, global_batch_size: int) -> float:
    """`${linear_scaling:0.1,256,${data.batch_size}}`: the linear scaling rule (Goyal et al. 2017), `base_lr` per
    `base_batch_size` samples, scaled to the global batch."""
    return base_lr * global_batch_size / base_batch_size


def resize_for_center_crop(crop_size: int) -> int:
    """`${resize_for_center_crop:224}`: the shorter side to resize to before a centre crop, 256 for 224 as in
    ImageNet recipes (the crop keeps 87.5%)."""
    return round(crop_size * 256 / 224)


ARITHMETIC_AND_DATA: dict[str, Callable[..., Any]] = {
    "image_folder_classes": image_folder_classes,
    "linear_scaling": linear_scaling,
    "resize_for_center_crop": resize_for_center_crop,
}
