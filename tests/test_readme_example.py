"""The README's worked example (a model and a data set, one .py and one .yaml each) runs as printed.

The files are cut out of README.md and written into a copy of src/ and conf/: nothing else is edited.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

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
    }


@pytest.mark.parametrize("model, optimizer, min_acc", [("resmlp", "adamw", 0.95), ("cnn", "rmsprop", 0.85)])
def test_worked_example_trains(tmp_path, train_env, model, optimizer, min_acc):
    for folder in ("src", "conf"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for path, text in readme_files().items():
        (tmp_path / path).write_text(text)
    env = {**train_env, "PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), train_env["PYTHONPATH"]])}
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
