"""Writes a small real image folder, with no download: scikit-learn's 8x8 handwritten digits as PNG files.

    python scripts/make_image_folder.py [ROOT] [--size 32]

ROOT (default: $XDG_CACHE_HOME/hydraloop/digits_images, where experiment=images_resnet looks) gets the layout
data=image_folder reads, ROOT/train/<digit>/<n>.png and ROOT/val/<digit>/<n>.png: 1438 training and 359 validation
images of 10 classes, the split data=digits uses (20% held out, split_seed 0). Each image is upscaled to SIZE x SIZE
grey pixels (bicubic), dark ink on white as on paper. A ROOT that already holds files is left as it is (an empty
one is written into); ROOT is written in a temporary folder and renamed, so it is complete whenever it has files.
"""

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from hydraloop.errors import ConfigError
from hydraloop.storage import check_makeable

DEFAULT_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydraloop" / "digits_images"


def write_digits(root: Path, size: int = 32, val_fraction: float = 0.2, split_seed: int = 0) -> Path:
    """Writes the folder (unless `root` already holds files); returns `root`."""
    if has_files(root):
        return root
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(split_seed).permutation(len(digits.target))
    num_val = int(round(len(order) * val_fraction))
    splits = {"val": order[:num_val], "train": order[num_val:]}
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        for split, indices in splits.items():
            for index in indices:
                label = int(digits.target[index])
                pixels = (255 - digits.images[index] * (255 / 16)).round().astype(np.uint8)  # 0-16 ink -> white paper
                image = Image.fromarray(pixels).resize((size, size), Image.Resampling.BICUBIC)
                folder = tmp / split / str(label)
                folder.mkdir(parents=True, exist_ok=True)
                image.save(folder / f"{index:04d}.png")
        os.replace(tmp, root)  # atomic: another process writing the same folder at once loses the race harmlessly
    except OSError:
        if not root.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def has_files(root: Path) -> bool:
    return root.is_dir() and any(root.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--size", type=int, default=32, help="side of the square PNGs, in pixels")
    args = parser.parse_args()
    if args.size < 1:
        parser.error(f"--size {args.size}: must be a positive number of pixels")
    if args.root.exists() and not args.root.is_dir():
        parser.error(f"{args.root}: a file, not a folder")
    existed = has_files(args.root)
    if not existed:
        try:
            check_makeable(args.root, "ROOT")
        except ConfigError as error:
            parser.error(str(error))
    write_digits(args.root, args.size)
    kept = "holds files already, left as it is (a missing or empty folder is written)"
    print(f"{args.root}: {kept if existed else 'written'}")


if __name__ == "__main__":
    main()
