"""A folder of images, read as pytorch/examples' ImageNet recipe reads it: `data=image_folder data.dataset.root=DIR`.

DIR holds `train/` and `val/`, each with one folder per class (the same classes in both) holding that class's
images, in any format PIL reads with one of torchvision's image extensions (.jpg, .png, ...). Each split is a
torchvision ImageFolder. Transforms are config, `data.train_transforms` and `data.val_transforms`: lists of
`_target_`s (torchvision.transforms.v2), applied in order; the last must make a float tensor shaped
`data.input_shape`. The training set's random transforms are seeded per sample (SeededAugmentation); the
loaders run a list's closing ToDtype and Normalize once per batch (batch_transforms).

`check_image_folder` runs in the launcher before any rank starts (`data.check`): the layout, and one image through
both transform lists. A file that cannot be decoded later, in a DataLoader worker, ends the run with one line
naming it (ConfigError, exit code 2). torchvision is imported only when an image folder is configured.
"""

import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from hydraloop.data.seeded_augmentation import SeededAugmentation
from hydraloop.errors import ConfigError, first_line

SPLITS = ("train", "val")
DEMO_FOLDER = "digits_images"  # scripts/make_image_folder.py's default, under $XDG_CACHE_HOME/hydraloop


def count_class_folders(root: str) -> int:
    """Class folders in `<root>/train`, 0 if there is no such folder: `data.num_classes`, counted where the config
    is resolved (the launcher), before any data is read. What is wrong with a folder, `check_image_folder` says."""
    train = Path(str(root)) / "train"
    return len(_class_names(train)) if train.is_dir() else 0


def check_image_folder(
    root: str, train_transforms: Any, val_transforms: Any, input_shape: Sequence[int], num_classes: int
) -> tuple[torch.Tensor, int]:
    """Raises ConfigError, in one line naming the key and value, on anything wrong with the folder or transforms.
    Returns a training sample as the loaders give it, (image, class): the first image of class 0, for the launcher's
    trial batch (hydraloop.trial)."""
    root = Path(str(root))
    classes = _check_layout(root, num_classes)
    first = _first_image(root / "train" / classes[0])
    image = _load_rgb(str(first), root=str(root))
    sizes = [int(size) for size in input_shape]
    if min(sizes) < 1:
        raise ConfigError(f"data.input_shape={sizes}: must be positive sizes (data.image_size sets the last two)")
    for key, configs in (("data.train_transforms", train_transforms), ("data.val_transforms", val_transforms)):
        try:
            sample = _compose(configs, key)(image)
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001  a transform that refuses its values, or this image
            raise ConfigError(f"{key}: fails on {first.relative_to(root)}: {first_line(error)}") from None
        if not (isinstance(sample, torch.Tensor) and sample.is_floating_point()):
            raise ConfigError(
                f"{key}: makes {_kind(sample)} of {first.relative_to(root)}; the list must end in a float tensor, "
                "e.g. with torchvision.transforms.v2.ToImage and ToDtype(dtype=torch.float32, scale=true)"
            )
        if list(sample.shape) != [int(size) for size in input_shape]:
            raise ConfigError(
                f"data.input_shape={list(input_shape)}: {key} makes {list(sample.shape)} of {first.relative_to(root)}; "
                "set data.input_shape (or data.image_size) to what the transforms make"
            )
        if key == "data.train_transforms":
            train_sample = sample
    return train_sample, 0


def load_image_folder(
    root: str, train_transforms: Any, val_transforms: Any, num_classes: int, augmentation_seed: int
) -> tuple[Dataset, Dataset]:
    """(train, val) ImageFolders over `<root>/train` and `<root>/val`; the training set seeded per sample."""
    from torchvision.datasets import ImageFolder

    _check_layout(Path(str(root)), num_classes)  # cheap, and here too: num_classes may have been set by hand
    load = partial(_load_rgb, root=str(root))  # a module-level function: workers get it pickled
    train, val = (
        ImageFolder(
            os.path.join(str(root), split), transform=_compose(configs, f"data.{split}_transforms"), loader=load
        )
        for split, configs in zip(SPLITS, (train_transforms, val_transforms))
    )
    return SeededAugmentation(train, augmentation_seed), val


def _check_layout(root: Path, num_classes: int) -> list[str]:
    where = f"data.dataset.root={root}"
    if not root.is_dir():
        problem = "not a folder" if root.exists() else "no such folder"
        if root.name == DEMO_FOLDER:
            problem += " (python scripts/make_image_folder.py writes the demo folder there)"
        raise ConfigError(f"{where}: {problem}")
    missing = [f"{split}/" for split in SPLITS if not (root / split).is_dir()]
    if missing:
        raise ConfigError(
            f"{where}: has no {' and no '.join(missing)}; it needs train/ and val/, each with one folder per class"
        )
    classes = {split: _class_names(root / split) for split in SPLITS}
    if not classes["train"]:
        raise ConfigError(f"{where}: train/ holds no class folders")
    if classes["train"] != classes["val"]:
        differences = [
            f"only in {split}/: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
            for split, other in (("train", "val"), ("val", "train"))
            if (names := sorted(set(classes[split]) - set(classes[other])))
        ]
        raise ConfigError(f"{where}: train/ and val/ have different classes ({'; '.join(differences)})")
    for split in SPLITS:
        for name in classes[split]:
            if not _has_image(root / split / name):
                raise ConfigError(f"{where}: {split}/{name} holds no image (each class folder needs at least one)")
    if len(classes["train"]) != num_classes:
        raise ConfigError(f"data.num_classes={num_classes}: {where} has {len(classes['train'])} classes")
    return classes["train"]


def _class_names(split: Path) -> list[str]:
    """ImageFolder's classes: the sorted names of the folders directly inside `split`."""
    return sorted(entry.name for entry in os.scandir(split) if entry.is_dir())


def _has_image(folder: Path) -> bool:
    """Whether ImageFolder finds a file in `folder` (it walks subfolders too). Stops at the first, so it reads a
    few entries of each of ImageNet's 2000 folders, not 1.3 million."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir() and _has_image(Path(entry.path)):
                return True
            if entry.name.lower().endswith(IMG_EXTENSIONS) and entry.is_file():
                return True
    return False


def _first_image(folder: Path) -> Path:
    """The first file ImageFolder takes from `folder`, a class folder that has one (see _has_image)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    for directory, _, files in sorted(os.walk(folder, followlinks=True)):
        for name in sorted(files):
            if name.lower().endswith(IMG_EXTENSIONS):
                return Path(directory) / name
    raise AssertionError(f"{folder} holds no image")  # unreachable after _check_layout


def _load_rgb(path: str, root: str) -> Any:
    """ImageFolder's own loader (PIL, converted to RGB), saying in one line which file failed and why."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as file:
            return Image.open(file).convert("RGB")
    except UnidentifiedImageError:
        reason = "cannot identify image file"  # PIL's own message adds the file object's repr
    except Exception as error:  # truncated or corrupt data, an unreadable file: PIL's errors vary by format
        reason = first_line(error)
    raise ConfigError(f"data.dataset.root={root}: cannot read image {path}: {reason}")


def _compose(configs: Any, key: str) -> Any:
    """The transforms of `configs` (a list of `_target_` nodes) in one v2.Compose; one line for a bad entry."""
    from torchvision.transforms import v2

    if not (isinstance(configs, list) or OmegaConf.is_list(configs)):
        raise ConfigError(f"{key}={configs}: must be a list of transforms, each with a _target_")
    transforms = []
    for position, config in enumerate(configs):
        try:
            transforms.append(instantiate(config))
        except Exception as error:
            cause = error
            while cause.__cause__ is not None:  # Hydra's wrappers, down to what the import or the constructor said
                cause = cause.__cause__
            reason = first_line(cause)
            raise ConfigError(f"{key}[{position}]: cannot build it: {reason}") from None
    return v2.Compose(transforms)


def _kind(sample: Any) -> str:
    if isinstance(sample, torch.Tensor):
        return f"a {sample.dtype} tensor"
    return f"a {type(sample).__module__.split('.')[0]}.{type(sample).__name__}"  # e.g. a PIL.Image
