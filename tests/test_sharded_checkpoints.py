"""parallel=fsdp's sharded checkpoints (hydraloop.sharded_checkpoint): each rank writes and reads its own shards; a
checkpoint resumes on another number of ranks, and under single, equal to the uninterrupted run; one file for
plain torch.load on demand; nothing lost when a rank dies mid-write or a shard goes missing."""

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, TRAIN, max_param_diff, read_checkpoint, wait_for
from hydraloop.errors import STORAGE_EXIT_CODE
from test_bad_input import assert_rejected
from test_fsdp import TOLERANCE, moments
from test_storage import file_size_limit

pytestmark = pytest.mark.slow

ONE, TWO = ("trainer.max_epochs=1", "logger=none"), ("trainer.max_epochs=2", "logger=none")
ONE_RANK = ("parallel=fsdp", "parallel.nproc_per_node=1")


@pytest.fixture(scope="module")
def single_2_epochs(run_train):
    run = run_train(*TWO)
    assert run.returncode == 0, run.output
    return run


@pytest.fixture(scope="module")
def fsdp_1_epoch(run_train):
    run = run_train("parallel=fsdp", *ONE)
    assert run.returncode == 0, run.output
    return run


def assert_ends_like(run, uninterrupted) -> None:
    assert run.returncode == 0, run.output
    assert run.metrics["global_step"] == uninterrupted.metrics["global_step"]
    assert max_param_diff(run.checkpoint()["model"], uninterrupted.checkpoint()["model"]) < TOLERANCE
    assert max_param_diff(moments(run), moments(uninterrupted)) < 1e-6
    assert run.metrics["val/acc"] == uninterrupted.metrics["val/acc"]


def test_each_rank_writes_its_own_shards_into_a_directory_named_as_a_file_was(fsdp_1_epoch):
    checkpoints = fsdp_1_epoch.run_dir / "checkpoints"
    assert os.readlink(checkpoints / "last.pt") == os.readlink(checkpoints / "best.pt") == "step-00000022.pt"
    files = {path.name for path in (checkpoints / "step-00000022.pt").iterdir()}
    assert files == {".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"}
    assert not list(checkpoints.glob("*.tmp"))


def test_resumed_on_two_ranks_on_one_and_under_single_and_one_ranks_on_two_each_end_as_uninterrupted(
    run_train, fsdp_1_epoch, single_2_epochs
):
    two_ranks = fsdp_1_epoch.run_dir / "checkpoints" / "last.pt"
    one_rank = run_train(*ONE_RANK, *ONE)
    assert one_rank.returncode == 0, one_rank.output
    resumed = [
        run_train("parallel=fsdp", *TWO, f"ckpt_path={two_ranks}"),
        run_train(*ONE_RANK, *TWO, f"ckpt_path={two_ranks}"),
        run_train(*TWO, f"ckpt_path={two_ranks}"),
        run_train("parallel=fsdp", *TWO, f"ckpt_path={one_rank.run_dir}/checkpoints/last.pt"),
    ]
    for run in resumed:
        assert "epoch 1, step 22" in run.output
        assert_ends_like(run, single_2_epochs)


def test_consolidated_file_loads_with_plain_torch_load_and_evaluates_as_the_shards_do(
    run_train, fsdp_1_epoch, tmp_path
):
    sharded = fsdp_1_epoch.run_dir / "checkpoints" / "last.pt"
    whole = tmp_path / "whole.pt"
    command = [sys.executable, str(REPO / "scripts" / "consolidate.py"), str(sharded), str(whole)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plain = torch.load(whole, weights_only=True)  # no hydraloop in the loading
    shards = read_checkpoint(sharded)
    assert max_param_diff(plain["model"], shards["model"]) == 0.0
    assert plain["optimizer"]["param_groups"] == shards["optimizer"]["param_groups"]
    assert plain["global_step"] == 22
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)  # never over a file
    assert (
        again.returncode == 2
        and again.stderr == f"consolidate.py: {whole}: exists; name a new file (nothing is overwritten)\n"
    )

    evaluations = [
        run_train("mode=eval", f"ckpt_path={whole}", "logger=none"),
        run_train("mode=eval", f"ckpt_path={sharded}", "logger=none"),
        run_train("parallel=fsdp", "mode=eval", f"ckpt_path={sharded}", "logger=none"),
    ]
    for run in evaluations:
        assert run.returncode == 0, run.output
        assert run.metrics["val/acc"] == fsdp_1_epoch.metrics["val/acc"]
        assert run.metrics["val/loss"] == pytest.approx(fsdp_1_epoch.metrics["val/loss"], rel=1e-6)


def test_a_rank_killed_as_it_writes_its_shards_leaves_the_previous_checkpoint_and_the_rerun_resumes_from_it(
    run_train, single_2_epochs, tmp_path
):
    run_dir = tmp_path / "run"
    killed = ("model._target_=tests.faults.KilledWhileSavingMLP", "+model.fail_rank=1", "+model.fail_at_step=30")
    first = run_train("parallel=fsdp", *TWO, *killed, run_dir=run_dir)
    assert first.returncode != 0
    checkpoints = run_dir / "checkpoints"
    assert os.readlink(checkpoints / "last.pt") == "step-00000022.pt"
    assert read_checkpoint(checkpoints / "last.pt")["global_step"] == 22
    assert not (checkpoints / "step-00000044.pt").exists()  # at most its staging directory, never a checkpoint

    rerun = run_train("parallel=fsdp", *TWO, "+model.fail_at_step=10000", *killed[:2], run_dir=run_dir)
    assert "checkpoints/last.pt: epoch 1, step 22" in rerun.output
    assert not list(checkpoints.glob("*.tmp"))  # the dead write's leftovers are gone
    assert_ends_like(rerun, single_2_epochs)


def test_a_missing_or_short_shard_falls_back_to_the_previous_checkpoint(
    run_train, run_refused, single_2_epochs, tmp_path
):
    run_dir = tmp_path / "run"
    stopped = run_train("parallel=fsdp", *TWO, "trainer.ckpt_every_n_steps=30", "trainer.max_steps=40", run_dir=run_dir)
    assert stopped.returncode == 0, stopped.output
    checkpoints = run_dir / "checkpoints"
    assert os.readlink(checkpoints / "last.pt") == "step-00000040.pt"
    shard = checkpoints / "step-00000040.pt" / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    (run_dir / "metrics.json").unlink()  # as if the run had died after its checkpoint

    refused = run_refused("parallel=fsdp", *TWO, f"ckpt_path={checkpoints}/step-00000040.pt", "resume=false")
    assert_rejected(refused, f"ckpt_path={checkpoints}/step-00000040.pt: shard __1_0.distcp is truncated (")
    rerun = run_train("parallel=fsdp", *TWO, run_dir=run_dir)
    assert "last.pt, step-00000040.pt cannot be read" in rerun.output
    assert "continuing from step-00000030.pt" in rerun.output
    assert_ends_like(rerun, single_2_epochs)

    # Damaged bytes, the length intact: found as the shard is read, one line (a damaged file is not found at all).
    assert sorted(path.name for path in checkpoints.glob("step-*")) == ["step-00000030.pt", "step-00000044.pt"]
    with open(checkpoints / "step-00000044.pt" / "__1_0.distcp", "r+b") as shard:
        shard.write(b"\xff" * 500)
    damaged = run_train("mode=eval", f"ckpt_path={checkpoints}/step-00000044.pt")
    assert damaged.returncode == 2, damaged.output
    assert f"{checkpoints}/step-00000044.pt: not a readable checkpoint: its shards cannot be read (" in damaged.output
    assert "Traceback" not in damaged.output
    # The directory last.pt links to, removed: the link is an unreadable checkpoint, said so, and the rerun falls back.
    shutil.rmtree(checkpoints / "step-00000044.pt")
    (run_dir / "metrics.json").unlink()
    again = run_train("parallel=fsdp", *TWO, run_dir=run_dir)
    assert "last.pt cannot be read" in again.output and "continuing from step-00000030.pt" in again.output
    assert_ends_like(again, single_2_epochs)


def test_keep_last_k_removes_shard_directories_but_the_one_best_pt_names(run_train, tmp_path):
    run = run_train(
        "parallel=fsdp", "trainer.max_epochs=3", "logger=none", "trainer.keep_last_k=1", "optimized_metric_mode=min"
    )  # val/acc only rises: the first validation stays the best
    assert run.returncode == 0, run.output
    checkpoints = run.run_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.glob("step-*")) == ["step-00000022.pt", "step-00000066.pt"]
    assert os.readlink(checkpoints / "best.pt") == "step-00000022.pt"
    assert os.readlink(checkpoints / "last.pt") == "step-00000066.pt"
    assert read_checkpoint(checkpoints / "best.pt")["global_step"] == 22


def test_sigterm_with_an_asynchronous_checkpoint_in_flight_then_rerun_equals_uninterrupted(
    run_train, train_env, single_2_epochs, tmp_path
):
    """Every 5 steps a checkpoint is written in the background while training goes on; the stop signal's own
    checkpoint is one too, and the stop waits for it before the job ends."""
    pause_file = tmp_path / "paused"
    overrides = [
        "parallel=fsdp",
        "parallel.async_checkpoint=true",
        "trainer.ckpt_every_n_steps=5",
        "trainer.log_every_n_steps=5",
        *TWO,
    ]
    pausing = ["model._target_=tests.faults.PausingMLP", f"+model.pause_file={pause_file}", "+model.fail_rank=0"]
    command = [
        sys.executable,
        str(TRAIN),
        f"hydra.run.dir={tmp_path / 'run'}",
        *overrides,
        *pausing,
        "+model.fail_at_step=13",
    ]
    job = subprocess.Popen(command, env=train_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(pause_file, job)  # rank 0 is inside step 13 (of 22 in epoch 1)
    job.send_signal(signal.SIGTERM)
    output = job.communicate(timeout=120)[0]
    assert job.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in output, output
    checkpoints = tmp_path / "run" / "checkpoints"
    assert os.readlink(checkpoints / "last.pt") == "step-00000015.pt"
    assert read_checkpoint(checkpoints / "last.pt")["epoch_step"] == 15
    assert not list(checkpoints.glob("*.tmp"))

    rerun = run_train(*overrides, *pausing, run_dir=tmp_path / "run")
    assert "checkpoints/last.pt: epoch 0, step 15" in rerun.output
    assert_ends_like(rerun, single_2_epochs)


def test_a_sharded_checkpoint_of_another_model_is_one_line_naming_a_key_and_its_shapes(run_refused, fsdp_1_epoch):
    path = fsdp_1_epoch.run_dir / "checkpoints" / "last.pt"
    run = run_refused("parallel=fsdp", "model.hidden_sizes=[32]", f"ckpt_path={path}")
    assert_rejected(run, f"ckpt_path={path}: does not fit model", "has shape [128, 64], model needs [32, 64]")
    assert "[rank 1]" not in run.output


def test_async_checkpoint_needs_sharded_checkpoints(run_refused):
    run = run_refused("parallel=fsdp", "parallel.checkpoint=full", "parallel.async_checkpoint=true")
    assert_rejected(run, "parallel.async_checkpoint=true: needs parallel.checkpoint=sharded")


@pytest.mark.parametrize("background", [False, True])
def test_a_full_disk_ends_the_run_in_one_line_and_keeps_the_sharded_checkpoints(run_train, fsdp_1_epoch, background):
    """Every file may grow to half a shard only: the step-44 checkpoint cannot be written, now or in the background."""
    run_dir = fsdp_1_epoch.run_dir.with_name(f"{fsdp_1_epoch.run_dir.name}-full-{background}")
    shutil.copytree(fsdp_1_epoch.run_dir, run_dir, symlinks=True)
    (run_dir / "metrics.json").unlink()
    checkpoints = run_dir / "checkpoints"
    limit = (checkpoints / "step-00000022.pt" / "__0_0.distcp").stat().st_size // 2
    overrides = ("parallel=fsdp", f"parallel.async_checkpoint={str(background).lower()}", *TWO)
    full = run_train(*overrides, run_dir=run_dir, preexec_fn=file_size_limit(limit))
    assert full.returncode == STORAGE_EXIT_CODE, full.output
    errors = [line for line in full.output.splitlines() if "[ERROR]" in line]
    # torch.save, writing a shard, keeps only its own error of the write the limit cut short (the OSError is lost).
    error = errors[-1].split(" - ", 1)[1]
    assert error.startswith(f"cannot write {checkpoints}/step-00000044.pt: "), error
    assert error.endswith("; the checkpoints saved before are intact") and "\n" not in error
    assert sorted(path.name for path in checkpoints.iterdir()) == ["best.pt", "last.pt", "step-00000022.pt"]
    assert read_checkpoint(checkpoints / "last.pt")["global_step"] == 22


def test_predict_and_sample_read_a_sharded_checkpoint_as_its_consolidated_file(run_train, fsdp_1_epoch, tmp_path):
    sharded = fsdp_1_epoch.run_dir / "checkpoints" / "last.pt"
    whole = tmp_path / "whole.pt"
    consolidate = [sys.executable, str(REPO / "scripts" / "consolidate.py"), str(sharded), str(whole)]
    subprocess.run(consolidate, check=True, capture_output=True, timeout=120)
    inputs = tmp_path / "new.npz"
    np.savez(inputs, x=np.random.default_rng(0).random((37, 1, 8, 8), dtype=np.float32))
    runs = [
        run_train("mode=predict", f"ckpt_path={whole}", f"data.predict_path={inputs}"),
        run_train("mode=predict", f"ckpt_path={sharded}", f"data.predict_path={inputs}", "parallel=fsdp"),
    ]
    for run in runs:
        assert run.returncode == 0, run.output
    expected, found = (np.load(run.run_dir / "predictions.npz") for run in runs)
    assert np.array_equal(found["class"], expected["class"])
    np.testing.assert_allclose(found["probabilities"], expected["probabilities"], rtol=1e-6)

    gpt = ("experiment=text_gpt", "model.n_layer=1", "model.n_embd=32", "trainer.max_steps=2", "logger=none")
    lm = run_train(*gpt, "parallel=fsdp", "scheduler.warmup_steps=0", "trainer.val_every_n_steps=null")
    assert lm.returncode == 0, lm.output
    lm_whole = tmp_path / "lm.pt"
    lm_sharded = lm.run_dir / "checkpoints" / "last.pt"
    subprocess.run([*consolidate[:2], str(lm_sharded), str(lm_whole)], check=True, capture_output=True, timeout=120)
    sample = [sys.executable, str(REPO / "scripts" / "sample.py"), "--prompt", "ROMEO:", "--max-new-tokens", "30"]
    texts = [
        subprocess.run([*sample, str(path)], capture_output=True, text=True, timeout=120)
        for path in (lm_sharded, lm_whole)
    ]
    assert texts[0].returncode == 0, texts[0].stderr
    assert texts[0].stdout == texts[1].stdout and texts[0].stdout.startswith("ROMEO:")
