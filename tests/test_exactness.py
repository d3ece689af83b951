"""Distributed training computes what single-process training computes: parameters compared after 2 epochs."""

import json
import subprocess

import pytest

from conftest import free_port, max_param_diff, read_checkpoint, torchrun_command, torchrun_train

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5  # float round-off: DDP averages per-rank mean gradients, single takes one mean


@pytest.fixture(scope="module")
def single_2_epochs(run_train):
    run = run_train("trainer.max_epochs=2")
    assert run.returncode == 0, run.output
    return run


# The fast tier's one ddp-equals-single, with ranks forked (auto on the CPU); the whole suite spawns them too.
@pytest.mark.parametrize("start_method", [pytest.param("auto", marks=pytest.mark.fast), "spawn"])
def test_ddp_two_ranks_matches_single(run_train, single_2_epochs, start_method):
    ddp = run_train("parallel=ddp", f"parallel.start_method={start_method}", "trainer.max_epochs=2")
    assert ddp.returncode == 0, ddp.output
    assert ddp.metrics["world_size"] == 2
    assert ddp.metrics["global_step"] == single_2_epochs.metrics["global_step"]
    diff = max_param_diff(ddp.checkpoint()["model"], single_2_epochs.checkpoint()["model"])
    assert diff < TOLERANCE
    # Validation shards the set without padding, so every sample is counted once: the same accuracy.
    assert ddp.metrics["val/acc"] == single_2_epochs.metrics["val/acc"]
    assert ddp.metrics["train/loss"] == pytest.approx(single_2_epochs.metrics["train/loss"], rel=1e-5)


@pytest.mark.fast
def test_dataparallel_on_cpu_is_single(run_train, single_2_epochs):
    dp = run_train("parallel=dataparallel", "trainer.max_epochs=2")
    assert dp.returncode == 0, dp.output
    assert "parallel=dataparallel needs at least 2 GPUs, found 0: training like parallel=single" in dp.output
    assert max_param_diff(dp.checkpoint()["model"], single_2_epochs.checkpoint()["model"]) == 0.0


def test_ddp_matches_single_with_cnn_sgd_cosine_and_clipping(run_train):
    """A second recipe: conv net on MNIST-1D, Nesterov SGD, warm-up + cosine, gradient clipping, an odd-sized
    last global batch that drop_last removes, and DataLoader worker processes.

    A recipe that lingers on the initial loss plateau (say, a full epoch of warm-up here) amplifies round-off:
    then even single-process runs with 1 and 2 CPU threads end ~1e-3 apart, and so does DDP. This one does not.
    """
    overrides = [
        "data=mnist1d",
        "model=cnn",
        "model.channels=[8,16]",
        "optimizer=sgd",
        "optimizer.nesterov=true",
        "scheduler=cosine",
        "scheduler.warmup_epochs=0.25",
        "trainer.grad_clip_norm=1.0",
        "trainer.max_epochs=2",
        "data.batch_size=96",
        "data.num_workers=1",
    ]
    single = run_train(*overrides)
    ddp = run_train(*overrides, "parallel=ddp")
    assert single.returncode == 0, single.output
    assert ddp.returncode == 0, ddp.output
    assert ddp.metrics["global_step"] == single.metrics["global_step"] == 2 * (4000 // 96)
    assert max_param_diff(ddp.checkpoint()["model"], single.checkpoint()["model"]) < TOLERANCE
    assert ddp.metrics["val/acc"] == single.metrics["val/acc"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_joining_an_outside_launchers_group(tmp_path, train_env, single_2_epochs, parallel):
    """Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set) each process is a rank: nothing is spawned."""
    run_dir = tmp_path / "run"
    proc = torchrun_train("trainer.max_epochs=2", f"hydra.run.dir={run_dir}", env=train_env, parallel=parallel)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    joined = read_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]
    assert max_param_diff(joined, single_2_epochs.checkpoint()["model"]) < TOLERANCE


def test_two_nodes_train_together_into_one_run_directory(tmp_path, train_env, single_2_epochs):
    """Two torchrun agents on one machine, one rank each, meeting at a c10d rendezvous: the multi-node command."""
    rendezvous = ("--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}")
    # Each simulated node would take every core of this one machine; give each one core, as two real nodes have
    # their own. A rank that stalls fails its collective after 60 s, with the error in the output.
    env = {**train_env, "OMP_NUM_THREADS": "1"}
    overrides = ("trainer.max_epochs=2", "parallel.timeout_s=60")
    nodes = [
        subprocess.Popen(
            torchrun_command(*overrides, launcher_args=(*rendezvous, f"--node_rank={node}")),
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    metrics = json.loads((run_dirs[0] / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    joined = read_checkpoint(run_dirs[0] / "checkpoints" / "last.pt")["model"]
    assert max_param_diff(joined, single_2_epochs.checkpoint()["model"]) < TOLERANCE
