"""docs/make-it-yours.md's worked examples (a model and a data set, one .py and one .yaml each) run as printed.

The files are cut out of the page and written into a copy of src/ and conf/: nothing else is edited.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, max_param_diff, read_checkpoint

pytestmark = pytest.mark.slow

BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)
PATH = re.compile(r"`((?:src|conf)/[\w/]+\.(?:py|yaml))`")


def readme_files() -> dict[str, str]:
    """Each python or yaml block whose lead-in text (since the previous block) names a src/ or conf/ file."""
    text, files, previous_end = (REPO / "docs" / "make-it-yours.md").read_text(), {}, 0
    for block in BLOCK.finditer(text):
        named = PATH.findall(text[previous_end : block.start()])
        if block.group(1) in ("python", "yaml") and named:
            files[named[-1]] = block.group(2)
        previous_end = block.end()
    return files


def test_readme_names_its_files():
    assert set(readme_files()) == {
        "src/hydraloop/models/resmlp.py",
        "conf/model/resmlp.yaml",
        "src/hydraloop/data/spirals.py",
        "conf/data/spirals.yaml",
        "conf/optimizer/rmsprop.yaml",
        "src/hydraloop/tasks/multilabel.py",
        "conf/task/multilabel.yaml",
        "src/hydraloop/data/pairs.py",
        "conf/data/pairs.yaml",
        "src/hydraloop/models/siamese.py",
        "conf/model/siamese.yaml",
        "src/hydraloop/tasks/model_loss.py",
        "conf/task/model_loss.yaml",
        "src/hydraloop/tasks/diffusion.py",
        "conf/task/diffusion.yaml",
        "src/hydraloop/models/denoiser.py",
        "conf/model/denoiser.yaml",
        "src/hydraloop/models/vae.py",
        "conf/model/vae.yaml",
        "src/hydraloop/tasks/elbo.py",
        "conf/task/elbo.yaml",
    }


def readme_tree(tmp_path, train_env) -> dict:
    """A copy of src/ and conf/ (and scripts/check_exact.py) with README's files written in; the environment that
    runs it."""
    for folder in ("src", "conf"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "check_exact.py", tmp_path / "scripts")
    for path, text in readme_files().items():
        (tmp_path / path).write_text(text)
    return {**train_env, "PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), train_env["PYTHONPATH"]])}


@pytest.mark.parametrize("model, optimizer, min_acc", [("resmlp", "adamw", 0.95), ("cnn", "rmsprop", 0.85)])
def test_worked_example_trains(tmp_path, train_env, model, optimizer, min_acc):
    env = readme_tree(tmp_path, train_env)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "src" / "train.py"),
            f"model={model}",
            "data=spirals",
            f"optimizer={optimizer}",
            "logger=none",
            f"hydra.run.dir={run_dir}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((run_dir / "metrics.json").read_text())["val/acc"] >= min_acc


def test_the_objective_example_trains(tmp_path, train_env):
    """README's multi-label task on labels that follow from the inputs: 5 labels, label j on when x_j + x_j+5 > 0."""
    env = readme_tree(tmp_path, train_env)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 20, generator=generator)
    y = (x[:, :5] + x[:, 5:10] > 0).float()
    np.savez(tmp_path / "labels.npz", x=x.numpy(), y=y.numpy())
    run_dir = tmp_path / "run"
    command = [sys.executable, str(tmp_path / "src" / "train.py"), "task=multilabel", "data=tensors"]
    command += [f"data.dataset.path={tmp_path / 'labels.npz'}", "data.input_shape=[20]", "data.target_shape=[5]"]
    command += ["data.num_classes=5", "trainer.max_epochs=10", "logger=none", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["val/f1"] > 0.9 and metrics["val/exact"] > 0.6, metrics
    best = read_checkpoint(run_dir / "checkpoints" / "best.pt")
    assert best["config"]["optimized_metric"] == "val/f1" and best["config"]["optimized_metric_mode"] == "max"


@pytest.mark.parametrize(
    "example, rows",
    [
        ("data=spirals model=denoiser task=diffusion", "ddp fsdp accumulation resume"),
        # The same draws in the model's forward pass: the rows that hold the others (ddp's with accumulation, and
        # fsdp's stopped and resumed under single).
        ("data=digits model=vae task=elbo", "accumulation resume"),
    ],
)
def test_the_randomness_examples_pass_check_exact(tmp_path, train_env, example, rows):
    """The diffusion model and the VAE draw their noise with keyed_random: ddp, fsdp, accumulation over an uneven
    last batch and a resume under another strategy train what one process trains, as check_exact prints."""
    env = readme_tree(tmp_path, train_env)
    command = [sys.executable, str(tmp_path / "scripts" / "check_exact.py"), *example.split(), "--rows", *rows.split()]
    proc = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = [line for line in proc.stdout.splitlines() if line.endswith(" pass")]
    assert len(passed) == len(rows.split()), proc.stdout


# 257 pairs: 4 batches of 64 and one of 1, fewer rows than the ranks or the micro-batches.
PAIRS = ("data=pairs", "model=siamese", "data.dataset.num_train=257", "data.dataset.num_val=64")
PAIRS += ("data.drop_last=false", "trainer.max_epochs=2", "logger=none")


@pytest.fixture(scope="module")
def pairs_tree(tmp_path_factory, train_env):
    tmp_path = tmp_path_factory.mktemp("readme")
    env = readme_tree(tmp_path, train_env)

    def run(*overrides: str, name: str) -> Path:
        run_dir = tmp_path / name
        command = [sys.executable, str(tmp_path / "src" / "train.py"), *PAIRS, *overrides, f"hydra.run.dir={run_dir}"]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return run_dir

    run.tmp_path = tmp_path
    return run


def weights(run_dir: Path) -> dict:
    return read_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]


def test_dict_batches_with_the_models_own_loss_train_alike_under_every_strategy_and_accumulation(pairs_tree):
    """Dict batches, two inputs, the model's own loss; an uneven last batch: single with 1 and 4 micro-batches,
    ddp and fsdp with 4, and (first, second, labels) tuples with the shipped classification task, all alike."""
    single = pairs_tree("task=model_loss", name="single")
    reference = weights(single)
    for name, overrides in {
        "accumulated": ("task=model_loss", "trainer.grad_accum_steps=4"),
        "ddp": ("task=model_loss", "parallel=ddp", "trainer.grad_accum_steps=4"),
        "fsdp": ("task=model_loss", "parallel=fsdp", "trainer.grad_accum_steps=4"),
        "tuples": ("data.dataset.as_tuples=true", "parallel=ddp"),  # model(first, second), the logits' loss
    }.items():
        assert max_param_diff(weights(pairs_tree(*overrides, name=name)), reference) < 1e-5, name


def test_a_dict_batch_run_stopped_mid_epoch_continues_as_the_uninterrupted_one(pairs_tree):
    uninterrupted = pairs_tree("task=model_loss", "trainer.grad_accum_steps=2", name="whole")
    resumed = pairs_tree("task=model_loss", "trainer.grad_accum_steps=2", "trainer.max_steps=7", name="resumed")
    pairs_tree("task=model_loss", "trainer.grad_accum_steps=2", name="resumed")  # into the same directory: resumes
    assert max_param_diff(weights(resumed), weights(uninterrupted)) < 1e-6


def test_predictions_of_two_inputs_come_in_the_files_order_under_every_strategy(pairs_tree):
    trained = pairs_tree(name="trained")
    points = torch.randn(37, 2, 8, generator=torch.Generator().manual_seed(1))
    path = pairs_tree.tmp_path / "pairs.npz"
    np.savez(path, **{"x.first": points[:, 0].numpy(), "x.second": points[:, 1].numpy()})
    spec = importlib.util.spec_from_file_location("siamese", pairs_tree.tmp_path / "src/hydraloop/models/siamese.py")
    siamese = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(siamese)
    model = siamese.Siamese(8, 2)
    model.load_state_dict(weights(trained))
    expected = model(points[:, 0], points[:, 1])["logits"].argmax(dim=1).numpy()
    checkpoint = trained / "checkpoints" / "last.pt"
    for parallel in ("single", "ddp", "fsdp"):
        predicted = pairs_tree(
            "mode=predict",
            f"ckpt_path={checkpoint}",
            f"data.predict_path={path}",
            f"parallel={parallel}",
            name=parallel + "-p",
        )
        assert (np.load(predicted / "predictions.npz")["class"] == expected).all(), parallel
