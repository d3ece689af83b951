"""The README's worked example (a model and a data set, one .py and one .yaml each) runs as printed.

The files are cut out of README.md and written into a copy of src/ and conf/: nothing else is edited.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO

pytestmark = pytest.mark.slow

BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)
PATH = re.compile(r"`((?:src|conf)/[\w/]+\.(?:py|yaml))`")


def readme_files() -> dict[str, str]:
    """Each python or yaml block whose lead-in text (since the previous block) names a src/ or conf/ file."""
    text, files, previous_end = (REPO / "README.md").read_text(), {}, 0
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
    }


def readme_tree(tmp_path, train_env) -> dict:
    """A copy of src/ and conf/ with README's files written in; the environment that runs it."""
    for folder in ("src", "conf"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
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
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["config"]["optimized_metric"] == "val/f1" and best["config"]["optimized_metric_mode"] == "max"
