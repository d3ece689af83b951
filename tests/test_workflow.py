"""Debug modes, evaluation through the entrypoint, and the console."""

import json
import os
import pty
import subprocess
import sys

import pytest

from conftest import TRAIN, read_checkpoint


def test_debug_fast_runs_one_batch_and_keeps_nothing(run_train):
    run = run_train("debug=fast")
    assert run.returncode == 0, run.output
    assert run.metrics["global_step"] == 1 and run.metrics["epoch"] == 1
    assert not (run.run_dir / "checkpoints").exists()
    assert not (run.run_dir / "tensorboard").exists()


def test_debug_overfit_drives_the_loss_to_zero(train_in_process):
    metrics, _ = train_in_process("debug=overfit", "logger=none")
    assert metrics["global_step"] == 60 * 2
    assert metrics["train/loss"] < 0.05  # from ~2.3 at the start


def test_debug_profile_writes_a_trace_of_three_steps(train_in_process):
    _, run_dir = train_in_process("debug=profile")
    traces = list((run_dir / "tensorboard" / "profiler").glob("*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 3  # steps after 1 skipped and 1 warm-up
    assert any("aten::addmm" in event.get("name", "") for event in events)  # real operator events


@pytest.fixture(scope="module")
def trained(run_train):
    run = run_train("trainer.max_epochs=3", "logger=none")
    assert run.returncode == 0, run.output
    return run


@pytest.mark.parametrize("parallel", ["single", pytest.param("ddp", marks=pytest.mark.slow)])
def test_eval_mode_reproduces_the_checkpoints_metrics(run_train, trained, parallel):
    checkpoint_path = trained.run_dir / "checkpoints" / "best.pt"
    recorded = read_checkpoint(checkpoint_path)["metrics"]
    run = run_train("mode=eval", f"ckpt_path={checkpoint_path}", f"parallel={parallel}", "logger=none")
    assert run.returncode == 0, run.output
    assert run.metrics["val/acc"] == recorded["val/acc"]  # every sample counted once, on one rank
    assert run.metrics["val/loss"] == pytest.approx(recorded["val/loss"], rel=1e-6)
    assert run.metrics["epoch"] == read_checkpoint(checkpoint_path)["epoch"]
    assert not (run.run_dir / "checkpoints").exists()  # evaluation writes metrics, not checkpoints


def test_eval_mode_needs_a_checkpoint(run_train):
    run = run_train("mode=eval")
    assert run.returncode == 2
    assert "mode=eval: needs ckpt_path=<checkpoint to evaluate>" in run.output


def test_config_is_printed_at_start(trained):
    assert "run directory: " in trained.log
    assert "max_epochs: 3" in trained.log  # the resolved tree, in the console and the job log


def test_progress_bar_on_a_terminal_only(tmp_path, train_env, trained):
    assert "%|" not in trained.output  # captured output is not a terminal: interval log lines only
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), "trainer.max_epochs=2", "logger=none", f"hydra.run.dir={tmp_path}"],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=train_env,
        close_fds=True,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=120) == 0
    screen = b"".join(chunks).decode(errors="replace")
    assert "44/44" in screen and "step/s" in screen  # tqdm: steps done over all steps, rate (and ETA)
    assert "loss=" in screen and "samples_per_s=" in screen
