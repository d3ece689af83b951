"""What a run leaves behind: one run directory, written by rank 0 alone, with global metrics."""

import json
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import TRAIN, torchrun_train

pytestmark = pytest.mark.slow

METRICS_KEYS = {"val/acc", "val/loss", "train/loss", "epoch", "global_step", "world_size", "wall_time_s"}


def run_in(cwd, *overrides, env):
    """The plain command, with Hydra's default run directory (outputs/DATE/TIME under the working directory)."""
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *overrides], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sorted(p for p in (cwd / "outputs").glob("*/*") if p.is_dir())


def test_default_run_reaches_95_percent_in_one_run_directory(tmp_path, train_env):
    run_dirs = run_in(tmp_path, env=train_env)
    assert len(run_dirs) == 1
    metrics = json.loads((run_dirs[0] / "metrics.json").read_text())
    assert metrics["val/acc"] >= 0.95
    assert metrics["world_size"] == 1


def test_ddp_makes_exactly_one_run_directory(tmp_path, train_env):
    run_dirs = run_in(tmp_path, "parallel=ddp", "trainer.max_epochs=1", env=train_env)
    assert len(run_dirs) == 1  # the workers wrote into the launcher's directory and made none of their own
    assert json.loads((run_dirs[0] / "metrics.json").read_text())["world_size"] == 2


@pytest.fixture(scope="module")
def ddp_run(run_train):
    run = run_train("parallel=ddp", "trainer.max_epochs=3", "trainer.log_every_n_steps=5")
    assert run.returncode == 0, run.output
    return run


def test_run_directory_contents(ddp_run):
    names = {p.name for p in ddp_run.run_dir.iterdir()}
    assert names == {".hydra", "train.log", "tensorboard", "checkpoints", "metrics.json"}
    # The last two step-named checkpoints (trainer.keep_last_k=2); last.pt is another name of the newest.
    checkpoints = ddp_run.run_dir / "checkpoints"
    assert {p.name for p in checkpoints.iterdir()} == {"last.pt", "best.pt", "step-00000044.pt", "step-00000066.pt"}
    assert (checkpoints / "last.pt").samefile(checkpoints / "step-00000066.pt")
    # One event file: rank 1 got a null logger.
    assert len(list((ddp_run.run_dir / "tensorboard").iterdir())) == 1


def test_metrics_json(ddp_run):
    metrics = ddp_run.metrics
    assert metrics.keys() >= METRICS_KEYS
    assert metrics["epoch"] == 3 and metrics["global_step"] == 3 * (1438 // 64) and metrics["world_size"] == 2
    assert 0.5 < metrics["val/acc"] <= 1.0 and metrics["wall_time_s"] > 0


def test_console_lines_come_from_rank_zero_only(ddp_run):
    # Rank 1 logs warnings and errors only: each interval line appears once, not once per rank.
    assert ddp_run.log.count("epoch 1 step 5 |") == 1
    assert ddp_run.output.count("epoch 1 step 5 |") == 1
    assert "[rank 1]" not in ddp_run.log


def test_checkpoint_format(ddp_run):
    checkpoint = ddp_run.checkpoint("last.pt")  # weights_only=True
    assert {"model", "optimizer", "scheduler", "epoch", "global_step", "rng", "config", "metrics"} <= checkpoint.keys()
    assert not any(key.startswith("module.") for key in checkpoint["model"])  # the unwrapped model
    assert checkpoint["epoch"] == 3 and checkpoint["global_step"] == ddp_run.metrics["global_step"]
    assert checkpoint["config"]["parallel"]["_target_"].endswith("DDPStrategy")
    assert checkpoint["config"]["trainer"]["max_epochs"] == 3  # resolved, plain values
    assert {"torch", "numpy", "python", "cuda"} <= checkpoint["rng"].keys()
    assert checkpoint["metrics"]["val/acc"] == ddp_run.metrics["val/acc"]


def test_best_checkpoint_holds_the_best_epoch(ddp_run):
    accumulator = EventAccumulator(str(ddp_run.run_dir / "tensorboard")).Reload()
    per_epoch = [event.value for event in accumulator.Scalars("val/acc")]
    best = ddp_run.checkpoint("best.pt")
    assert best["best_metric"] == max(ddp_run.checkpoint("last.pt")["best_metric"], best["metrics"]["val/acc"])
    assert best["metrics"]["val/acc"] == pytest.approx(max(per_epoch), abs=1e-6)  # events store float32
    first_best_epoch = per_epoch.index(max(per_epoch)) + 1
    assert best["epoch"] == first_best_epoch


def test_tensorboard_events(ddp_run):
    accumulator = EventAccumulator(str(ddp_run.run_dir / "tensorboard")).Reload()
    scalars = set(accumulator.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_sec", "val/loss", "val/acc"} <= scalars
    assert len(accumulator.Scalars("val/acc")) >= 3  # one per epoch (and the final one with the hparams)
    assert accumulator.Scalars("val/acc")[-1].value == pytest.approx(ddp_run.metrics["val/acc"], abs=1e-6)
    assert accumulator.Scalars("train/lr")[0].value == pytest.approx(0.003)
    steps = [event.step for event in accumulator.Scalars("train/loss")]
    assert steps[:3] == [5, 10, 15]
    assert "config" in " ".join(accumulator.Tags()["tensors"])
    plugins = accumulator.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in plugins and "_hparams_/session_start_info" in plugins


def test_two_ddp_jobs_at_once_do_not_collide(tmp_path, train_env):
    """Each job's rendezvous binds a free port of its own."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(TRAIN),
                "parallel=ddp",
                "trainer.max_epochs=1",
                "logger=none",
                f"hydra.run.dir={tmp_path / name}",
            ],
            env=train_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("a", "b")
    ]
    outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    a, b = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("a", "b"))
    assert a["val/acc"] == b["val/acc"] and a["world_size"] == b["world_size"] == 2


def test_torchrun_makes_exactly_one_run_directory(tmp_path, train_env):
    """Under torchrun every rank runs Hydra; the ranks agree on the run folder's name through the agent's store."""
    proc = torchrun_train("trainer.max_epochs=1", "logger=none", env=train_env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1
    assert (run_dirs[0] / ".hydra" / "config.yaml").is_file()  # Hydra's own record, from rank 0
    assert (run_dirs[0] / "train.log").read_text().count("run directory:") == 1  # every rank ran main; one logged
    assert json.loads((run_dirs[0] / "metrics.json").read_text())["world_size"] == 2


def test_torchrun_with_a_one_process_strategy_is_refused(tmp_path, train_env):
    """Two processes running parallel=single would be two rank 0s writing one run directory."""
    proc = torchrun_train("trainer.max_epochs=1", env=train_env, cwd=tmp_path, parallel="single")
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "WORLD_SIZE=2: torchrun or hydra.launcher started 2 processes, one rank each, but SingleDevice" in output
    assert not list((tmp_path / "outputs").glob("*/*/checkpoints"))
    assert not list((tmp_path / "outputs").glob("*/*/metrics.json"))
