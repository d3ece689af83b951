"""Hydra multirun: each job its own subfolder, logs and metrics; the task returns the optimized metric."""

import json
import sys

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO

pytestmark = pytest.mark.slow


def jobs(sweep_dir):
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def test_lr_sweep_under_ddp(run_train, tmp_path):
    run = run_train(
        "-m", "optimizer.lr=0.01,0.1", "parallel=ddp", "trainer.max_epochs=1", f"hydra.sweep.dir={tmp_path}"
    )
    assert run.returncode == 0, run.output
    dirs = jobs(tmp_path)
    assert [d.name for d in dirs] == ["0", "1"]
    lrs = []
    for job in dirs:
        metrics = json.loads((job / "metrics.json").read_text())
        assert metrics["world_size"] == 2
        assert (job / "checkpoints" / "last.pt").exists() and (job / "train.log").read_text()
        lrs.append((job / ".hydra" / "overrides.yaml").read_text())
    assert "optimizer.lr=0.01" in lrs[0] and "optimizer.lr=0.1" in lrs[1]
    assert not list(tmp_path.glob("*/*/*/.hydra"))  # no nested run dirs from the workers


def test_single_and_ddp_in_one_sweep_agree(run_train, tmp_path):
    run = run_train("-m", "parallel=single,ddp", "trainer.max_epochs=2", f"hydra.sweep.dir={tmp_path}")
    assert run.returncode == 0, run.output
    single, ddp = (json.loads((job / "metrics.json").read_text()) for job in jobs(tmp_path))
    assert (single["world_size"], ddp["world_size"]) == (1, 2)
    assert single["val/acc"] == ddp["val/acc"]


def test_task_returns_the_optimized_metric(tmp_path, monkeypatch, data_cache):
    """What a sweeper receives: main's return value is metrics.json's value of `optimized_metric`."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(data_cache))
    monkeypatch.syspath_prepend(str(REPO / "src"))
    import train  # src/train.py; importing registers the schemas

    returned = {}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for metric in ("val/acc", "val/loss"):
            run_dir = tmp_path / metric.replace("/", "_")
            # Outside a Hydra run there is no hydra:runtime.output_dir to interpolate: name the paths.
            cfg = compose(
                "train",
                overrides=[
                    "trainer.max_epochs=1",
                    "logger=none",
                    f"optimized_metric={metric}",
                    f"output_dir={run_dir}",
                    f"log_file={run_dir}/train.log",
                ],
            )
            run_dir.mkdir()
            returned[metric] = train.main.__wrapped__(cfg)
            assert returned[metric] == json.loads((run_dir / "metrics.json").read_text())[metric]
    assert returned["val/acc"] > 0.5 and 0 < returned["val/loss"] < 2.5
    sys.modules.pop("train", None)
