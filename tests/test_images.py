"""Images from disk: data=image_folder with random crops and flips that depend on (seed, epoch, sample index) alone,
model=torchvision, the ImageNet recipe. (Bad input: test_images_bad_input.py.)"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from conftest import TRAIN, compose_train, max_param_diff, read_checkpoint, wait_for
from hydraloop.data.batch_transforms import CollateThenTransform, split_elementwise_tail
from hydraloop.data.loaders import auto_num_workers, build_loaders
from hydraloop.data.seeded_augmentation import SeededAugmentation
from hydraloop.errors import ConfigError
from hydraloop.models.torchvision_model import torchvision_model


def images(root: Path, *overrides: str) -> tuple[str, ...]:
    """A small, quick image recipe: 16x16 crops of the digits folder, the recipe's random crops and flips."""
    return ("data=image_folder", f"data.dataset.root={root}", "data.image_size=16", "logger=none", *overrides)


def loaders(root: Path, rank: int, world_size: int, num_workers: int):
    cfg = compose_train(*images(root))
    train_set, val_set = instantiate(cfg.data.dataset)
    return build_loaders(
        train_set,
        val_set,
        global_batch_size=8,
        global_val_batch_size=8,
        rank=rank,
        world_size=world_size,
        seed=0,
        num_workers=num_workers,
        drop_last=True,
        device=torch.device("cpu"),
    )


def train_loader(root: Path, rank: int, world_size: int, num_workers: int, epoch: int, start_batch: int = 0):
    loader, _ = loaders(root, rank, world_size, num_workers)
    loader.set_epoch(epoch, start_sample=start_batch * 8)
    return loader


def first_batches(loader, count: int) -> list[torch.Tensor]:
    batches = iter(loader)
    return [next(batches)[0] for _ in range(count)]


def test_a_samples_crop_and_flip_depend_on_seed_epoch_and_index_alone(image_folder):
    cfg = compose_train(*images(image_folder))
    train_set, _ = instantiate(cfg.data.dataset)
    assert isinstance(train_set, SeededAugmentation)
    torch.manual_seed(1234)
    stream = torch.get_rng_state()
    sample = train_set[(0, 5)][0]
    assert sample.shape == (3, 16, 16) and sample.dtype == torch.float32
    assert torch.equal(train_set[(0, 5)][0], sample)
    assert not torch.equal(train_set[(1, 5)][0], sample)  # another epoch, another crop
    assert torch.equal(torch.get_rng_state(), stream)  # the training process's own stream is left as it was

    # One process without workers, two ranks with two workers each, and a resume after one batch: the same images.
    single = first_batches(train_loader(image_folder, 0, 1, num_workers=0, epoch=1), 3)
    ranks = [first_batches(train_loader(image_folder, rank, 2, num_workers=2, epoch=1), 3) for rank in (0, 1)]
    for step, batch in enumerate(single):  # rank r takes positions r, r + 2, ... of the global batch
        assert torch.equal(ranks[0][step], batch[0::2]) and torch.equal(ranks[1][step], batch[1::2])
    resumed = first_batches(train_loader(image_folder, 0, 1, num_workers=2, epoch=1, start_batch=1), 2)
    assert torch.equal(resumed[0], single[1]) and torch.equal(resumed[1], single[2])


def test_closing_todtype_and_normalize_run_per_batch_and_make_the_per_sample_lists_batch(image_folder):
    """The loaders run the lists' elementwise end on whole batches (hydraloop.data.batch_transforms); the batches are
    bitwise those of each sample through its whole list, and the caller's data sets keep their whole lists."""
    cfg = compose_train(*images(image_folder))
    train_set, val_set = instantiate(cfg.data.dataset)
    for num_workers in (0, 1):
        train, val = loaders(image_folder, 0, 1, num_workers)
        assert isinstance(train.batches.collate_fn, CollateThenTransform)
        assert isinstance(val.collate_fn, CollateThenTransform)
        assert [type(t).__name__ for t in train.batches.dataset.dataset.transform.transforms][-1] == "ToImage"
        train.set_epoch(1)
        keys = next(iter(train.sampler))
        inputs, targets = next(iter(train))
        whole_lists = [train_set[key] for key in keys]
        assert type(inputs) is torch.Tensor and inputs.dtype == torch.float32
        assert torch.equal(inputs, torch.stack([sample for sample, _ in whole_lists]))
        assert targets.tolist() == [target for _, target in whole_lists]
        val_inputs, _ = next(iter(val))
        assert torch.equal(val_inputs, torch.stack([val_set[i][0] for i in range(0, 8)]))
    assert [type(t).__name__ for t in train_set.dataset.transform.transforms][-1] == "Normalize"


@pytest.mark.parametrize(
    ("names", "tail"),
    [
        (["RandomResizedCrop", "ToImage", "ToDtype", "Normalize"], ["ToDtype", "Normalize"]),
        (["Resize", "PILToTensor", "ToDtype"], ["ToDtype"]),
        (["ToImage", "ToDtype", "Normalize", "RandomErasing"], None),  # random: per sample
        (["ToImage", "ToDtype:dict", "Normalize"], None),  # a per-type dtype would see the batch as another type
        (["RandomResizedCrop", "ToDtype", "Normalize"], None),  # a PIL image until ToDtype: nothing to stack
    ],
)
def test_only_an_elementwise_tail_after_a_tensor_moves_to_the_batch(image_folder, names, tail):
    from torchvision import tv_tensors
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    special = {
        "RandomResizedCrop": lambda: v2.RandomResizedCrop(8),
        "Resize": lambda: v2.Resize(8),
        "ToDtype": lambda: v2.ToDtype(torch.float32, scale=True),
        "ToDtype:dict": lambda: v2.ToDtype({tv_tensors.Image: torch.float32}, scale=True),
        "Normalize": lambda: v2.Normalize([0.5] * 3, [0.2] * 3),
    }
    transforms = [special[name]() if name in special else getattr(v2, name)() for name in names]
    dataset = ImageFolder(str(image_folder / "val"), transform=v2.Compose(transforms))
    head, collate = split_elementwise_tail(dataset)
    if tail is None:
        assert head is dataset and collate is None
    else:
        assert [type(t).__name__ for t in collate.transform.transforms] == tail
        assert head.transform.transforms == transforms[: -len(tail)] and dataset.transform.transforms == transforms


def test_auto_num_workers_is_this_ranks_share_of_the_cores(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    for key in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(key, raising=False)
    assert auto_num_workers() == max(1, cores - 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # set, but no elastic agent: one rank per task (SLURM)
    assert auto_num_workers() == max(1, cores - 1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun / spawned ranks share the cores
    assert auto_num_workers() == max(1, cores // 2 - 1)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert auto_num_workers() == 1


def test_named_weights_load_from_the_hub_cache_and_a_new_head_starts_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="model.weights=IMAGENET1K_V1: expected .*/hub/checkpoints/resnet18-"):
        torchvision_model("resnet18", num_classes=10, weights="IMAGENET1K_V1")
    # Any file of the right name and keys is what an offline machine would have copied there.
    torch.manual_seed(0)
    imagenet = torchvision_model("resnet18", num_classes=1000).state_dict()
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(imagenet, tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth")
    same_head = torchvision_model("resnet18", num_classes=1000, weights="ResNet18_Weights.IMAGENET1K_V1")
    assert max_param_diff(same_head.state_dict(), imagenet) == 0.0
    ten = torchvision_model("resnet18", num_classes=10, weights="DEFAULT").state_dict()
    assert ten["fc.weight"].shape == (10, 512)
    assert (
        max_param_diff(
            {k: v for k, v in ten.items() if not k.startswith("fc.")},
            {k: v for k, v in imagenet.items() if not k.startswith("fc.")},
        )
        == 0.0
    )
    with torch.device("meta"):  # the launcher's check (arguments.check_model): the file is found, nothing is read
        assert torchvision_model("resnet18", num_classes=10, weights="DEFAULT").fc.weight.is_meta


def test_step_schedule_and_the_imagenet_recipe_compose():
    cfg = compose_train("experiment=imagenet_resnet50", "data.dataset.root=/data/imagenet")
    assert (cfg.model.arch, cfg.data.batch_size, cfg.trainer.max_epochs) == ("resnet50", 256, 90)
    assert (cfg.optimizer.lr, cfg.optimizer.momentum, cfg.optimizer.weight_decay) == (0.1, 0.9, 1e-4)
    assert compose_train("experiment=imagenet_resnet50", "data.batch_size=1024").optimizer.lr == pytest.approx(0.4)
    assert cfg.data.num_workers == "auto"
    assert [t._target_.rsplit(".", 1)[1] for t in cfg.data.val_transforms][:2] == ["Resize", "CenterCrop"]
    assert (cfg.data.val_transforms[0].size, cfg.data.val_transforms[1].size) == (256, 224)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=900, steps_per_epoch=10)
    lrs = []
    for _ in range(901):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[299] == 1.0 and lrs[300] == pytest.approx(0.1) and lrs[600] == pytest.approx(0.01)


# --- whole runs --------------------------------------------------------------------------------------------------

EXACT = ("model=cnn", "model.channels=[8,16]", "optimizer=sgd", "data.batch_size=32", "trainer.max_epochs=2")


WORKER_ENDED_BY_ITS_LOADER = """
import multiprocessing, torch
from torch.utils.data import TensorDataset
from hydraloop.data.loaders import build_loaders
from hydraloop.data.workers import LoaderWorker

if __name__ == "__main__":
    data = TensorDataset(torch.arange(64.0).reshape(32, 2))
    common = dict(global_batch_size=4, global_val_batch_size=4, rank=0, world_size=1, seed=0, drop_last=True)
    train, _ = build_loaders(data, data, num_workers=1, device=torch.device("cpu"), **common)
    next(iter(train))
    (worker,) = [child for child in multiprocessing.active_children() if isinstance(child, LoaderWorker)]
    worker.terminate()
    worker.join(10)
    print(worker.exitcode)
"""


def test_a_loader_worker_that_ignores_stop_signals_is_still_ended_by_its_loader(tmp_path, train_env):
    """Loader workers ignore SIGTERM (a scheduler's to every process: hydraloop.data.workers), and torch's loader ends
    one that has not ended 5 s after its shutdown request with Process.terminate: a SIGKILL for a LoaderWorker. A
    SIGTERM left it running, with its fork server, in a process that outlives its runs (a joblib sweep's worker)."""
    script = tmp_path / "end_a_worker.py"
    script.write_text(WORKER_ENDED_BY_ITS_LOADER)
    done = subprocess.run([sys.executable, str(script)], env=train_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == [str(-signal.SIGKILL)], done.stdout + done.stderr


@pytest.mark.slow
def test_ddp_with_workers_ends_with_the_parameters_of_single_without(run_train, image_folder):
    """Random crops and flips on, a model without batch norm (whose statistics are per rank)."""
    common = images(image_folder, *EXACT, "trainer.limit_train_batches=8")
    single = run_train(*common, "data.num_workers=0")
    ddp = run_train(*common, "parallel=ddp", "parallel.nproc_per_node=2", "data.num_workers=2")
    assert single.returncode == 0, single.output
    assert ddp.returncode == 0, ddp.output
    assert ddp.metrics["world_size"] == 2 and ddp.metrics["global_step"] == single.metrics["global_step"] == 16
    assert max_param_diff(ddp.checkpoint()["model"], single.checkpoint()["model"]) < 1e-5
    assert ddp.metrics["val/acc"] == single.metrics["val/acc"]
    # The crops matter: other crops of the same samples (another augmentation seed) end elsewhere.
    other = run_train(*common, "data.num_workers=0", "data.dataset.augmentation_seed=1")
    assert max_param_diff(other.checkpoint()["model"], single.checkpoint()["model"]) > 1e-3


RECOVERY = ("data.batch_size=64", "trainer.max_epochs=2", "model.dropout=0.2", "trainer.log_every_n_steps=5")


@pytest.mark.slow
def test_stop_mid_epoch_then_rerun_with_workers_ends_where_the_uninterrupted_run_ends(
    run_train, train_env, tmp_path, image_folder
):
    pause_file = tmp_path / "paused"
    overrides = [
        f"hydra.run.dir={tmp_path / 'run'}",
        *images(image_folder, *RECOVERY, "data.num_workers=2"),
        "model._target_=tests.faults.PausingMLP",
        f"+model.pause_file={pause_file}",
        "+model.fail_rank=0",
        "+model.fail_at_step=13",
    ]
    command = [sys.executable, str(TRAIN), *overrides]
    job = subprocess.Popen(command, env=train_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(pause_file, job)  # inside step 13 of 22 in epoch 1
    job.send_signal(signal.SIGTERM)
    output = job.communicate(timeout=120)[0]
    assert job.returncode == 128 + signal.SIGTERM, output
    checkpoint = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert (checkpoint["epoch"], checkpoint["global_step"], checkpoint["epoch_step"]) == (0, 15, 15)

    rerun = subprocess.run(command, env=train_env, capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    uninterrupted = run_train(*images(image_folder, *RECOVERY, "data.num_workers=0"))
    assert uninterrupted.returncode == 0, uninterrupted.output
    resumed = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert resumed["global_step"] == uninterrupted.checkpoint()["global_step"] == 44
    assert max_param_diff(resumed["model"], uninterrupted.checkpoint()["model"]) < 1e-6


@pytest.mark.slow
def test_imagenet_recipe_runs_its_first_steps_on_a_tiny_folder(run_train, image_folder):
    run = run_train(
        "experiment=imagenet_resnet50",
        *images(image_folder, "data.batch_size=32", "trainer.max_epochs=1"),
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
    )
    assert run.returncode == 0, run.output
    assert run.metrics["global_step"] == 2
    groups = run.checkpoint()["optimizer"]["param_groups"]
    assert groups[0]["lr"] == pytest.approx(0.1 * 32 / 256) and groups[0]["momentum"] == 0.9
