"""Images from disk, bad input: a folder, an image, a transform list or a torchvision model that cannot work ends the
run with one line naming the key and value, exit code 2, before any rank starts where it can be seen there; and the
demo folder's script refuses a size of no pixels."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

from conftest import REPO, bad_input_line, compose_train
from hydraloop.checks.config_values import check_config
from hydraloop.errors import ConfigError, unwrap_instantiation


def write_folder(root: Path, counts: dict[str, int], size: int = 12) -> Path:
    """root/<split>/<class>/<n>.png for {"train/a": 3, ...}: grey squares of `size` pixels."""
    for folder, count in counts.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for n in range(count):
            Image.new("L", (size, size), color=40 * n).save(root / folder / f"{n}.png")
    return root


TWO_CLASSES = {"train/a": 4, "train/b": 4, "val/a": 2, "val/b": 2}


def rejected(run) -> str:
    error = bad_input_line(run)
    assert not (run.run_dir / "checkpoints").exists() and not (run.run_dir / "metrics.json").exists()
    return error


def tiny(root: Path, *overrides: str) -> tuple[str, ...]:
    return ("data=image_folder", f"data.dataset.root={root}", "data.image_size=8", "data.batch_size=2", *overrides)


def launch_check(*overrides: str) -> str:
    """The one line of what data.check (run by the launcher before any rank starts) raises for this config."""
    cfg = compose_train(*overrides)
    try:
        check_config(cfg, world_size=1)
        instantiate(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)).data.check)
    except Exception as error:
        cause = unwrap_instantiation(error)  # as the launcher does
        assert isinstance(cause, ConfigError) and "\n" not in str(cause), error
        return str(cause)
    raise AssertionError("the check accepted it")


def test_missing_root_ends_the_run_in_the_launcher(run_train, tmp_path):
    run = run_train(*tiny(tmp_path / "nowhere", "parallel=ddp"))
    assert rejected(run).endswith(f"data.dataset.root={tmp_path / 'nowhere'}: no such folder")
    assert "[rank " not in run.output  # no rank started


@pytest.mark.parametrize(
    "counts, expected",
    [
        ({"train/a": 1}, "has no val/; it needs train/ and val/, each with one folder per class"),
        ({**TWO_CLASSES, "train/b": 0}, "train/b holds no image (each class folder needs at least one)"),
        ({**TWO_CLASSES, "train/c": 1}, "train/ and val/ have different classes (only in train/: c)"),
    ],
)
def test_bad_folder(tmp_path, counts, expected):
    root = write_folder(tmp_path / "images", counts)
    assert launch_check(*tiny(root)) == f"data.dataset.root={root}: {expected}"


def test_unreadable_image_seen_at_launch(run_train, tmp_path):
    root = write_folder(tmp_path / "images", TWO_CLASSES)
    (root / "train" / "a" / "0.png").write_bytes(b"not a png")
    error = rejected(run_train(*tiny(root)))
    assert error.endswith(
        f"data.dataset.root={root}: cannot read image {root}/train/a/0.png: cannot identify image file"
    )


@pytest.mark.slow
def test_unreadable_image_in_a_worker_ends_the_run_with_one_line(run_train, tmp_path):
    root = write_folder(tmp_path / "images", TWO_CLASSES)
    (root / "train" / "b" / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # a PNG signature, then nothing
    run = run_train(*tiny(root, "data.num_workers=1", "trainer.max_epochs=1"))
    expected = f"data.dataset.root={root}: cannot read image {root}/train/b/2.png: Truncated File Read"
    assert rejected(run).endswith(expected)
    assert "DataLoader worker" not in run.output  # the worker's traceback is not passed on


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "data.val_transforms=[{_target_:torchvision.transforms.v2.CenterCrop,size:8}]",
            "data.val_transforms: makes a PIL.Image of train/a/0.png; the list must end in a float tensor, e.g. with "
            "torchvision.transforms.v2.ToImage and ToDtype(dtype=torch.float32, scale=true)",
        ),
        (
            "data.val_transforms=[{_target_:torchvision.transforms.v2.PILToTensor}]",
            "data.val_transforms: makes a torch.uint8 tensor of train/a/0.png; the list must end in a float tensor, "
            "e.g. with torchvision.transforms.v2.ToImage and ToDtype(dtype=torch.float32, scale=true)",
        ),
        (
            "data.input_shape=[3,9,9]",
            "data.input_shape=[3, 9, 9]: data.train_transforms makes [3, 8, 8] of train/a/0.png; set "
            "data.input_shape (or data.image_size) to what the transforms make",
        ),
        (
            "data.train_transforms=[{_target_:torchvision.transforms.v2.Blur}]",
            "data.train_transforms[0]: cannot build it: No module named 'torchvision.transforms.v2.Blur'",
        ),
        (
            "data.train_transforms=[{_target_:torchvision.transforms.v2.RandomResizedCrop,sise:8}]",
            "data.train_transforms[0]: cannot build it: RandomResizedCrop.__init__() got an unexpected keyword "
            "argument 'sise'",
        ),
        ("data.num_workers=some", "data.num_workers=some: must be a number of worker processes (0 or more) or auto"),
    ],
)
def test_bad_transforms_or_workers(tmp_path, override, expected):
    root = write_folder(tmp_path / "images", TWO_CLASSES)
    assert launch_check(*tiny(root, override)) == expected


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.arch=resnet19", "model.arch=resnet19: not a torchvision classification model; closest: resnet18, "),
        ("model.weights=DEFAULT", "model.weights=DEFAULT: expected "),
        (  # the ValueError of torch.nn.Dropout inside torchvision's constructor, on the meta device
            "model.arch=efficientnet_b0 +model.dropout=1.5",
            "model.dropout=1.5: hydraloop.models.torchvision_model.torchvision_model says: dropout probability has "
            "to be between 0 and 1, but got 1.5",
        ),
    ],
)
def test_bad_torchvision_model_ends_the_run_in_the_launcher(run_train, tmp_path, override, expected):
    root = write_folder(tmp_path / "images", TWO_CLASSES)
    run = run_train(*tiny(root, "model=torchvision", "parallel=ddp", *override.split()))
    assert expected in rejected(run)
    assert "run directory:" not in run.output  # refused before the launch, which logs the config first


def test_make_image_folder_refuses_a_size_of_no_pixels(tmp_path, train_env):
    script = REPO / "scripts" / "make_image_folder.py"
    command = [sys.executable, str(script), str(tmp_path / "digits"), "--size", "0"]
    run = subprocess.run(command, env=train_env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.splitlines()[-1] == "make_image_folder.py: error: --size 0: must be a positive number of pixels"
    assert not (tmp_path / "digits").exists()
